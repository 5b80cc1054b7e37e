"""Replay: the flags that rebuild a config (``config_argv``) and the shell command that reruns a run
(``reproduce_command``)."""

from __future__ import annotations

import dataclasses
import shlex

from finetune.config.train_config import DERIVED_FIELDS, TrainConfig


def config_argv(config: TrainConfig, recipe=None, exclude=frozenset()) -> list[str]:
    """Flags that rebuild ``config`` with ``parse_config``: ``--recipe`` plus every field whose value
    differs from its default (the recipe's ``DEFAULTS`` over the dataclass defaults), leaving out the
    fields named in ``exclude`` and the ``DERIVED_FIELDS`` (no flag sets them).

    Used when the original command line is not at hand (e.g. inside ``train()``). Fields set to ``None``
    against a non-``None`` default cannot be expressed as a flag and are left out.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    if recipe is not None:
        defaults.update(getattr(recipe, "DEFAULTS", {}))
    argv = ["--recipe", str(config.recipe)]
    for f in dataclasses.fields(config):
        if f.name in ("recipe", "list_recipes", *DERIVED_FIELDS) or f.name in exclude:
            continue
        value = getattr(config, f.name)
        if value is None or (f.name in defaults and value == defaults[f.name]):
            continue
        if isinstance(value, bool):
            argv += [f"--{f.name}"] if value else [f"--{f.name}", "False"]
        else:
            argv += [f"--{f.name}", repr(value) if isinstance(value, float) else str(value)]
    return argv


def reproduce_command(argv: list[str], num_processes: int = 1, device: str | None = None,
                      machine_flags: list[str] | None = None) -> str:
    """The command line that reruns a training run from any directory: ``finetune train ARGS``, every
    argument quoted with ``shlex.quote`` (copy-pasteable into a POSIX shell).

    ``argv``: the run's training flags (a leading ``.../run.py`` is dropped, so ``sys.argv`` works too).
    ``num_processes`` > 1 adds ``--multi_gpu --num_processes N`` (Accelerate's launcher flags, which
    ``finetune train`` takes), and on ``device="cpu"`` the ``ACCELERATE_USE_CPU=1`` prefix that gives N gloo
    processes on a CPU. ``machine_flags``: launcher flags of a run over several machines (``--num_machines M
    --machine_rank R --main_process_ip IP --main_process_port P``), added after those.
    """
    args = list(argv)
    if args and args[0].endswith("run.py"):
        args = args[1:]
    prefix, launch = [], ["finetune", "train"]
    if num_processes > 1:
        launch += ["--multi_gpu", "--num_processes", str(num_processes)]
        if device == "cpu":
            prefix = ["ACCELERATE_USE_CPU=1"]
    launch += machine_flags or []
    return " ".join([*prefix, *(shlex.quote(a) for a in [*launch, *args])])
