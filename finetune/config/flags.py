"""How a flag is declared: ``flag(...)`` and ``derived(...)``, each field's ``Roles`` in its metadata.

Each flag says what it is for where it is defined: ``flag(default, help, *, step, trainer, ...)`` keeps its roles
in the field's metadata (a ``Roles``), and every list of flags the code needs is a query over them
(``fields_with``). The roles:

- ``step`` (required): part of what one optimizer step means (which samples, in which batch, through which
  model). A checkpoint resumes only under the same values (``checkpoint.step_meaning``, ``check_compatible``).
- ``trainer`` (required): the ``TrainingArguments`` argument the Trainer backend passes it as (the installed
  transformers' name), a tuple of names that all get its value, or None (not one of Trainer's arguments: the
  Trainer backend reads it from the config, or it has no counterpart). ``to_trainer``: the conversion, where
  Trainer's value differs from ours (``backends.trainer.training_arguments``).
- ``replay`` (default True): a replayed ``run_config.json`` (``--config``) sets it. False for where this run
  writes and whether it resumes: the new command line decides those (``read_config_file``).
- ``same_run`` (default True): compared when a new run finds a previous run's config in its ``--output_dir``
  (``output.check_output_dir``). False where a change leaves it the same run: where it goes, checkpoints,
  logging, the Hub.
- ``compare_passes`` (default True): ``finetune compare`` passes it to both backends' runs
  (``compare.child_argv``). False where compare decides itself: the backend, the output directories, the batch
  plan it resolved once.
- ``verify`` (default ``KEPT``): the value ``finetune verify`` fixes for its check (``verify.CHECK_SETTINGS``);
  ``KEPT``: the run's own value.
- ``derived``: set while the run is resolved, never by a flag (``derived(default, replay=...)``): the parser has
  no flag for it, ``config_argv`` never emits it, a rerun does not compare it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from finetune.errors import FinetuneError

ROLES = "roles"  # the metadata key of a field's Roles (HfArgumentParser gets the other keys: "help")


class _Kept:
    """``KEPT``: ``verify`` leaves the field at the run's own value (None is a value verify may fix)."""

    def __repr__(self) -> str:
        return "KEPT"


KEPT = _Kept()


@dataclass(frozen=True)
class Roles:
    """What a ``TrainConfig`` field is for; the module docstring defines each role."""

    step: bool
    trainer: str | tuple[str, ...] | None
    to_trainer: Callable | None = None
    replay: bool = True
    same_run: bool = True
    compare_passes: bool = True
    verify: object = KEPT
    derived: bool = False

    @property
    def trainer_arguments(self) -> tuple[str, ...]:
        """The ``TrainingArguments`` names the field is passed as (none, one or several)."""
        if self.trainer is None:
            return ()
        return (self.trainer,) if isinstance(self.trainer, str) else tuple(self.trainer)


def flag(default, help: str, *, step: bool, trainer: str | tuple[str, ...] | None, to_trainer: Callable | None = None,
         replay: bool = True, same_run: bool = True, compare_passes: bool = True, verify=KEPT):
    """A ``TrainConfig`` flag: ``dataclasses.field`` with its ``help`` for the parser and its ``Roles``.
    ``step`` and ``trainer`` have no default: every flag says whether it is part of what a step means and
    what Trainer calls it. Raises ``TypeError`` (at import) when either is missing."""
    declared = Roles(step=step, trainer=trainer, to_trainer=to_trainer, replay=replay, same_run=same_run,
                     compare_passes=compare_passes, verify=verify)
    return field(default=default, metadata={"help": help, ROLES: declared})


def derived(default, *, replay: bool):
    """A value the run derives while it is resolved, never a flag: not part of a step's meaning, not a Trainer
    argument, not compared by a rerun, not passed by ``compare``, kept by ``verify``; ``replay``: whether a
    replayed ``run_config.json`` sets it. Left out of ``==`` (``compare=False``), so the config that
    ``config_argv``'s flags rebuild equals the one they came from."""
    declared = Roles(step=False, trainer=None, same_run=False, compare_passes=False, replay=replay, derived=True)
    return field(default=default, compare=False, metadata={ROLES: declared})


def check_positive_int(name: str, value) -> None:
    """Raise ``FinetuneError`` unless ``value`` (of flag ``--name``) is an int >= 1 (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise FinetuneError(f"--{name} must be a positive integer, got {value!r}.")
