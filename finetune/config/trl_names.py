"""TRL's and TrainingArguments' names that ``finetune train`` takes beside its own: the ``--bf16``/``--fp16`` switches
(flags or config keys) as ``--mixed_precision``, and a config file's ``datasets:`` section (TRL 1.16's
``DatasetMixtureConfig``) as ``--dataset_mixture``. Used by ``config.parsing``."""

from __future__ import annotations

from finetune.argv import given, take_values
from finetune.errors import FinetuneError

# TrainingArguments' (and TRL's) precision switches, as ``--mixed_precision`` values
_PRECISION_SWITCHES = ("bf16", "fp16")


_TRUE, _FALSE = ("true", "yes", "1", "t", "y"), ("false", "no", "0", "f", "n")


def _switch_value(name: str, value, where: str) -> bool:
    """A ``--bf16``/``--fp16`` value (a bool, or true/false text; None: the bare switch) as a bool. Raises
    ``FinetuneError`` for anything else."""
    if value is None or isinstance(value, bool):
        return value is not False
    if str(value).lower() in _TRUE + _FALSE:
        return str(value).lower() in _TRUE
    raise FinetuneError(f"{where}{name}: expected true or false, got {value!r} (or use --mixed_precision no|fp16|bf16).")


def precision_from_switches(switches: dict[str, bool], where: str) -> str | None:
    """TrainingArguments' ``bf16``/``fp16`` booleans (``switches``: the ones given) as a ``--mixed_precision`` value:
    ``bf16``/``fp16`` for the one set true, ``no`` when those given are all false (TRL's configs default to bf16, so
    ``bf16: false`` alone means fp32), None when none is given. Raises ``FinetuneError`` when both are true."""
    if not switches:
        return None
    on = [name for name in _PRECISION_SWITCHES if switches.get(name)]
    if len(on) > 1:
        raise FinetuneError(f"{where}bf16 and fp16 are both true: set one of them (or --mixed_precision bf16|fp16).")
    return on[0] if on else "no"


def take_precision_switches(argv: list[str]) -> list[str]:
    """``argv`` with ``--bf16``/``--fp16`` (bare, ``--bf16 true``, ``--bf16=false``) turned into
    ``--mixed_precision``. Raises ``FinetuneError`` where they disagree with a ``--mixed_precision`` also given."""
    switches = {}
    for name in _PRECISION_SWITCHES:
        flag_ = f"--{name}"
        if not given(argv, flag_):
            continue
        rest, i, values = [], 0, []
        while i < len(argv):  # the bare switch takes no value unless a boolean word follows it
            arg = argv[i]
            if arg == flag_:
                following = argv[i + 1] if i + 1 < len(argv) else None
                takes = following is not None and following.lower() in _TRUE + _FALSE
                values.append(following if takes else None)
                i += 2 if takes else 1
            elif arg.startswith(flag_ + "="):
                values.append(arg.split("=", 1)[1])
                i += 1
            else:
                rest.append(arg)
                i += 1
        argv = rest
        switches[name] = _switch_value(flag_, values[-1], "")
    mixed = precision_from_switches(switches, "--")
    if mixed is None:
        return argv
    explicit, _ = take_values(argv, "--mixed_precision")
    if explicit and explicit[-1] != mixed:
        raise FinetuneError(f"--mixed_precision {explicit[-1]} and --{'/--'.join(switches)} disagree: pass one of them.")
    return argv if explicit else [*argv, "--mixed_precision", mixed]


def file_precision_switches(values: dict, path: str) -> dict:
    """A config file's ``bf16``/``fp16`` keys (a TRL or TrainingArguments YAML) as its ``mixed_precision``.
    Raises ``FinetuneError`` where they disagree with a ``mixed_precision`` key of the same file."""
    switches = {name: _switch_value(name, values.pop(name), f"--config {path}: ")
                for name in _PRECISION_SWITCHES if name in values}
    mixed = precision_from_switches(switches, f"--config {path}: ")
    if mixed is not None:
        if values.get("mixed_precision", mixed) != mixed:
            raise FinetuneError(f"--config {path}: mixed_precision {values['mixed_precision']} and "
                                f"{'/'.join(switches)} disagree: keep one of them.")
        values["mixed_precision"] = mixed
    return values


def file_mixture(values: dict, path: str) -> dict:
    """A config file's TRL ``datasets:`` section (with its ``streaming``/``test_split_size`` keys), or a
    ``dataset_mixture:`` mapping of them, as the file's ``dataset_mixture`` (``data.canonical_mixture`` checks it).
    Raises ``FinetuneError`` for both at once."""
    from finetune.config.data import MIXTURE_KEYS, canonical_mixture

    section = {k: values.pop(k) for k in MIXTURE_KEYS if k in values}
    if not section:
        return values
    if isinstance(values.get("dataset_mixture"), (dict, list)):
        raise FinetuneError(f"--config {path}: both `datasets:` and `dataset_mixture:`; keep one of them.")
    values["dataset_mixture"] = canonical_mixture(section)
    return values
