"""The Accelerate config files finetune ships (``accelerate_configs/``: ``multi_gpu``, ``fsdp2``,
``deepspeed_zero3``, ...), found by name as TRL finds its own: ``--config_file NAME`` takes a file of that path when
there is one, else the shipped config of that name (``multi_gpu``, ``multi_gpu.yaml`` or
``accelerate_configs/multi_gpu.yaml``), from any directory. Light: ``finetune recipes`` lists them without torch."""

from __future__ import annotations

from pathlib import Path

import yaml

from finetune.errors import FinetuneError

FOLDER = "accelerate_configs"
SUFFIXES = (".yaml", ".yml")


def shipped_dir() -> Path:
    """The folder of the shipped configs: ``finetune/accelerate_configs`` in an installed copy (pyproject's
    ``package-dir``), the repository's top-level ``accelerate_configs/`` in a source checkout or editable install."""
    package = Path(__file__).resolve().parents[1]  # finetune/ (this module is finetune/commands/launch_configs.py)
    installed = package / FOLDER
    return installed if installed.is_dir() else package.parent / FOLDER


def shipped_configs() -> dict[str, Path]:
    """Name (the file's stem) -> path of every shipped config, sorted by name; {} if the folder is missing."""
    folder = shipped_dir()
    if not folder.is_dir():
        return {}
    return {p.stem: p for p in sorted(folder.iterdir()) if p.suffix in SUFFIXES and p.is_file()}


def resolve_config_file(value: str) -> str:
    """``--config_file``'s ``value`` as Accelerate's launcher gets it: unchanged when it names a file; else the
    shipped config it names (a bare name with or without ``.yaml``, or ``accelerate_configs/<name>.yaml``, the
    spelling of the README's commands, from another directory). Raises ``FinetuneError`` naming the shipped ones
    when it is neither."""
    path = Path(value).expanduser()
    if path.is_file():
        return value
    shipped = shipped_configs()
    bare = len(path.parts) == 1 or (len(path.parts) == 2 and path.parts[0] == FOLDER)
    name = path.stem if path.suffix in SUFFIXES else path.name
    if bare and name in shipped:
        return str(shipped[name])
    raise FinetuneError(f"--config_file {value}: no such file, and finetune ships no Accelerate config of that name "
                        f"(shipped: {', '.join(shipped) or 'none found'}; finetune recipes lists them). Pass a shipped "
                        "name, or the path of your own file (`accelerate config` writes one).")


def summary(path: Path, width: int = 90) -> str:
    """What a shipped config is for: its comment after the first line (the launch command), up to the first ':'
    or '.' outside parentheses, cut at a word to ``width`` characters."""
    comments = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")]
    text = " ".join(comments[1:])
    depth = 0
    for i, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if depth == 0 and char in ":." and (i + 1 == len(text) or text[i + 1] == " "):
            text = text[:i]
            break
    return text if len(text) <= width else text[:width - 3].rsplit(" ", 1)[0] + " ..."


def list_configs() -> str:
    """A table of the shipped configs: name, distributed type, processes, machines, what it is for."""
    rows = [("config", "distributed_type", "processes", "machines", "what")]
    for name, path in shipped_configs().items():
        settings = yaml.safe_load(path.read_text()) or {}
        rows.append((name, str(settings.get("distributed_type", "?")), str(settings.get("num_processes", "?")),
                     str(settings.get("num_machines", 1)), summary(path)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def resolve_config_flag(launcher: list[str]) -> list[str]:
    """Accelerate launcher flags with each ``--config_file VALUE`` (or ``--config_file=VALUE``) resolved by
    ``resolve_config_file``; the other flags unchanged. Raises ``FinetuneError`` as that does."""
    resolved, i = [], 0
    while i < len(launcher):
        arg = launcher[i]
        if arg == "--config_file" and i + 1 < len(launcher):
            resolved += [arg, resolve_config_file(launcher[i + 1])]
            i += 2
            continue
        if arg.startswith("--config_file="):
            arg = "--config_file=" + resolve_config_file(arg.split("=", 1)[1])
        resolved.append(arg)
        i += 1
    return resolved
