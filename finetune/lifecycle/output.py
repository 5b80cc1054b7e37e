"""Output-directory checks, done before any work so a bad ``--output_dir`` loses nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from finetune.config import fields_with
from finetune.distributed import WRITE_PROBE
from finetune.errors import FinetuneError
from finetune.lifecycle.checkpoint import is_complete, list_checkpoints, newest_complete_checkpoint, refuse_unverified

# Settings whose change does not make a run "different" (where it goes, whether it may overwrite), and the
# values a run derives (the new config is compared before they are derived): each field's ``same_run=False``.
_IGNORED = frozenset(fields_with(same_run=False))


def _planned_split(old: dict, new: dict) -> set[str]:
    """The fields the batch planner chooses on every launch (the split of ``--total_batch_size`` B and, under
    ``--auto_find_batch_size``, the memory levers: ``planner.Lever``), where both runs ask for the same B: a
    requeued job plans B again on the processes it gets, and ``run_config.json`` holds the planned values, the new
    config the flags before planning. Empty where B is not planned (then the split is the user's own)."""
    if old.get("total_batch_size") is None or old.get("total_batch_size") != new.get("total_batch_size"):
        return set()
    from finetune.planner.plans import Lever  # the lever's fields are TrainConfig's of those names

    return {"per_device_train_batch_size", "gradient_accumulation_steps",
            *(f.name for f in dataclasses.fields(Lever))}


def check_output_dir(config) -> None:  # noqa: C901 - over the budget; to split
    """Refuse an ``--output_dir`` that holds a different run (unless ``--overwrite_output_dir``) or
    cannot be written. A directory holding the same run's config may be reused (a rerun).

    Raises ``FinetuneError`` naming the differing settings and the flags that fix it, or, for
    ``--resume_from_checkpoint auto``, the checkpoints there that cannot be resumed when none can
    (``checkpoint.refuse_unverified``).
    """
    out = Path(config.output_dir)
    resuming = bool(config.resume_from_checkpoint)
    if config.resume_from_checkpoint == "auto":  # a fresh start passes the new-run checks
        resuming = newest_complete_checkpoint(out) is not None
        if not resuming:  # never a fresh start over checkpoints that do not verify (it would delete them)
            refuse_unverified(out)
    if config.overwrite_output_dir and not resuming:
        resolved, cwd = out.expanduser().resolve(), Path.cwd().resolve()
        if resolved in (cwd, *cwd.parents, Path.home().resolve()):
            raise FinetuneError(f"--output_dir {str(out)!r} with --overwrite_output_dir would delete the current "
                                "directory, one of its parents or your home directory. Choose a directory of its own.")
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"--output_dir {str(out)!r} is a file, not a directory. Choose another --output_dir.")
    previous = out / "run_config.json"
    # On resume the checkpoint's own check names what changed (finetune.lifecycle.checkpoint.check_compatible).
    if previous.is_file() and not config.overwrite_output_dir and not resuming:
        try:
            old = json.loads(previous.read_text())
        except (OSError, ValueError):
            old = {}
        new = config.to_dict()
        ignored = _IGNORED | _planned_split(old, new)
        differences = sorted(k for k in set(old) | set(new) if k not in ignored and old.get(k) != new.get(k))
        if differences:
            raise FinetuneError(
                f"--output_dir {str(out)!r} holds a different run (settings that differ: {', '.join(differences)}). "
                "Choose another --output_dir, or pass --overwrite_output_dir to replace it."
            )
    if previous.is_file() and not config.overwrite_output_dir and not resuming:
        if any(is_complete(p) for p in list_checkpoints(out)):
            raise FinetuneError(
                f"--output_dir {str(out)!r} holds checkpoints of this run. Continue it with "
                "--resume_from_checkpoint latest, or pass --overwrite_output_dir to start over (the checkpoints "
                "are then deleted).")
    # every process of a launch runs this check at once: another rank's write probe is not "content"
    content = [p for p in out.iterdir() if not p.name.startswith(WRITE_PROBE)] if out.is_dir() else []
    if content and not previous.is_file() and not config.overwrite_output_dir:
        raise FinetuneError(
            f"--output_dir {str(out)!r} is not empty and does not hold a finetune run. "
            "Choose another --output_dir, or pass --overwrite_output_dir."
        )
    # a real write, not os.access: root passes access checks, and file systems can be read-only. A directory
    # that does not exist yet is not created here (a refused run must leave nothing behind): its nearest
    # existing parent is probed instead.
    where = out
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        probe = where / f"{WRITE_PROBE}-{os.getpid()}"  # each process probes with its own file
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise FinetuneError(f"--output_dir {str(out)!r} cannot be written ({err.strerror or err}). "
                            "Choose a directory you can write to.") from None


def clear_output_dir(out: Path) -> None:
    """``--overwrite_output_dir``: remove everything in ``out`` (the previous run's model, metrics, model
    card, log, checkpoints, TensorBoard runs), so that after the new run only its own files are there.
    Called when training starts, never before: a run refused on bad input touches nothing."""
    if not out.is_dir():
        return
    for entry in out.iterdir():
        if entry.name.startswith(WRITE_PROBE):
            continue  # another rank's write probe, gone in an instant
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


def finished_metrics(output_dir) -> dict | None:
    """The metrics of a finished run in ``output_dir`` (``metrics.json`` is written last, after the final
    model), or None."""
    try:
        return json.loads((Path(output_dir) / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
