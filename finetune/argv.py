"""The one reader of a command's own flags in an argv list, before the training flags are parsed (``config.parse_config``
takes what is left). Plain lists of strings, no imports: ``finetune --help`` uses it before torch is imported.

A flag is given as ``--name VALUE`` or ``--name=VALUE``; a switch as ``--name`` alone.
"""

from __future__ import annotations

HELP = ("-h", "--help")


def wants_help(argv: list[str]) -> bool:
    """Whether ``-h`` or ``--help`` is among ``argv``."""
    return any(arg in HELP for arg in argv)


def given(argv: list[str], flag: str) -> bool:
    """Whether ``flag`` (``--name``) is among ``argv``, as ``--name`` or ``--name=VALUE``."""
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def take_switch(argv: list[str], flag: str) -> tuple[bool, list[str]]:
    """(whether the switch ``flag`` was given, ``argv`` without it)."""
    rest = [arg for arg in argv if arg != flag]
    return len(rest) != len(argv), rest


def take_values(argv: list[str], flag: str, joined: bool = True) -> tuple[list[str | None], list[str]]:
    """(the values of ``flag`` in the order given, ``argv`` without them): ``--name VALUE``, and ``--name=VALUE``
    where ``joined``. A ``--name`` last, with no value after it, gives None (taken out too)."""
    values, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag:
            values.append(argv[i + 1] if i + 1 < len(argv) else None)
            i += 2
        elif joined and arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
            i += 1
        else:
            rest.append(arg)
            i += 1
    return values, rest
