"""Checkpoints that survive: written to ``.tmp-step_...`` and renamed, ``COMPLETE`` marker last, pruned only
after the new one is complete, refused when resuming would change what a step means. Layout:
``<output_dir>/checkpoints/step_00000012/`` = ``accelerator.save_state`` output, ``trainer_state.json`` and
``COMPLETE`` (see docs/design-notes.md#checkpoint)."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from accelerate.utils import gather_object
from safetensors import SafetensorError

from finetune.errors import FinetuneError

MARKER = "COMPLETE"
# What the writers raise on a full or failing disk: OSError (open/write/fsync/rename), safetensors' SafetensorError
# (not an OSError: safetensors/__init__.pyi), RuntimeError (torch.save's "PytorchStreamWriter failed writing file")
WRITE_ERRORS = (OSError, SafetensorError, RuntimeError)
STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^step_(\d{8})$")

# Settings that change what one optimizer step means, or which samples it sees: resuming under a change
# of any of them would not continue the same run.
STEP_MEANING = ("recipe", "train_file", "max_train_samples", "max_length", "block_size", "model_name_or_path",
                "per_device_train_batch_size", "gradient_accumulation_steps", "seed", "train_sampling_strategy",
                "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


@dataclass
class RunProgress:
    """The loop's own state at an optimizer-step boundary (units: optimizer steps, micro-batches per
    process, samples and label tokens over all processes, seconds)."""

    step: int = 0
    epoch: int = 0  # the epoch in progress (0-based)
    micro_batches_done: int = 0  # micro-batches of that epoch already consumed, per process
    samples_seen: int = 0
    tokens_seen: int = 0
    input_tokens_seen: int = 0
    padded_tokens_seen: int = 0  # input positions incl. padding (what the model computed on)
    skipped_steps: int = 0
    consecutive_skipped: int = 0
    step_loss_total: float = 0.0  # sum over optimizer steps of each step's mean loss (train_loss: / step)
    last_loss: float | None = None
    best_metric: float | None = None  # --metric_for_best_model's best value so far, and where
    best_step: int | None = None
    evals_without_improvement: int = 0  # for --early_stopping_patience
    patience_best: float | None = None  # the best value of every evaluation (best_metric: of those kept)
    train_runtime: float = 0.0
    num_processes: int = 1
    step_meaning: dict = field(default_factory=dict)

    def record_step(self, loss: float, skipped: bool) -> None:
        """Count one optimizer step whose mean loss per item was ``loss``."""
        self.step += 1
        self.step_loss_total += loss
        self.last_loss = loss
        self.skipped_steps += int(skipped)
        self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0

    def record_evaluation(self, value: float | None, greater_is_better: bool, checkpointed: bool = True) -> bool:
        """Track ``--metric_for_best_model`` after an evaluation at ``self.step``. Early stopping counts
        evaluations without a strict improvement over every evaluation so far (Trainer's
        ``EarlyStoppingCallback``, threshold 0); the best model is the best evaluation whose model is kept
        (``checkpointed``: a checkpoint follows it, or it is the final model). Returns whether this
        evaluation is the new best model."""
        if value is None:
            return False

        def better(than):
            return than is None or (value > than if greater_is_better else value < than)

        if better(self.patience_best):
            self.patience_best, self.evals_without_improvement = value, 0
        else:
            self.evals_without_improvement += 1
        if checkpointed and better(self.best_metric):
            self.best_metric, self.best_step = value, self.step
            return True
        return False


def checkpoints_dir(output_dir) -> Path:
    """``<output_dir>/checkpoints``."""
    return Path(output_dir) / "checkpoints"


def step_meaning(config, num_processes: int) -> dict:
    """The settings that define a step (``STEP_MEANING``) plus the number of processes."""
    meaning = {name: getattr(config, name) for name in STEP_MEANING}
    meaning["num_processes"] = num_processes
    return meaning


def list_checkpoints(output_dir) -> list[Path]:
    """Checkpoint directories with a real name, oldest first (complete or not)."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds its completion marker (written last)."""
    return (path / MARKER).is_file()


def find_resume_checkpoint(output_dir, spec: str) -> Path | None:
    """``spec`` "latest": the newest complete checkpoint under ``output_dir`` (incomplete ones skipped with a
    warning); "auto": the same, or None where there is none (a fresh start); otherwise the path ``spec``.
    Raises ``FinetuneError`` if there is none ("latest") or it is incomplete."""
    if spec == "auto":
        return newest_complete_checkpoint(output_dir)
    if spec == "latest":
        candidates = list_checkpoints(output_dir)
        for path in reversed(candidates):
            if is_complete(path):
                return path
            print(f"warning: skipping incomplete checkpoint {path} (no {MARKER} marker: its write was interrupted)")
        raise FinetuneError(f"--resume_from_checkpoint latest: no complete checkpoint under "
                            f"{checkpoints_dir(output_dir)}. Start without --resume_from_checkpoint.")
    path = Path(spec)
    if not path.is_dir():
        raise FinetuneError(f"--resume_from_checkpoint {spec!r} is not a directory. Pass a checkpoint directory "
                            f"(e.g. {checkpoints_dir(output_dir)}/step_00000010) or 'latest'.")
    if not is_complete(path):
        raise FinetuneError(f"--resume_from_checkpoint {spec!r} is incomplete (no {MARKER} marker): its write was "
                            "interrupted. Use an earlier checkpoint, or 'latest' to pick the newest complete one.")
    return path


def newest_complete_checkpoint(output_dir) -> Path | None:
    """The newest checkpoint under ``output_dir`` with its completion marker, or None."""
    return next((p for p in reversed(list_checkpoints(output_dir)) if is_complete(p)), None)


def read_state(path: Path) -> RunProgress:
    """The ``RunProgress`` saved in checkpoint ``path``. Raises ``FinetuneError`` if it is unreadable."""
    try:
        saved = json.loads((path / STATE_FILE).read_text())
        if "loss_sum" in saved:  # the names before round 3
            saved["step_loss_total"] = saved.pop("loss_sum")
            saved.setdefault("patience_best", saved.get("best_metric"))
        return RunProgress(**saved)
    except (OSError, ValueError, TypeError) as err:
        raise FinetuneError(f"checkpoint {path} is corrupt ({STATE_FILE}: {err}). Resume from another checkpoint "
                            "(--resume_from_checkpoint PATH) or start again.") from None


def check_compatible(state: RunProgress, meaning: dict, path: Path, allow: bool) -> None:
    """Refuse to resume when a setting of ``STEP_MEANING`` or the process count differs from the
    checkpoint's, naming each difference; ``allow`` (``--ignore_checkpoint_mismatch``) overrides."""
    differences = [f"{k}: checkpoint {state.step_meaning.get(k)!r}, now {v!r}"
                   for k, v in meaning.items() if state.step_meaning.get(k) != v]
    if differences and not allow:
        raise FinetuneError(
            f"cannot resume from {path}: these settings change what a step means: {'; '.join(differences)}. "
            "Resume with the checkpoint's settings, or pass --ignore_checkpoint_mismatch to continue anyway.")


def checkpoint_path(output_dir, step: int) -> Path:
    """``<output_dir>/checkpoints/step_<8 digits>``."""
    return checkpoints_dir(output_dir) / f"step_{step:08d}"


def save_checkpoint(accelerator, output_dir, state: RunProgress, save_total_limit: int | None,
                    model=None, tokenizer=None, layout=None) -> Path:
    """Write ``state.step``'s checkpoint atomically, then prune to ``save_total_limit`` (oldest complete first,
    never the new or the best one); returns its path. Collective: every process calls it. With ``model`` and
    ``tokenizer`` it is also a ``from_pretrained`` directory. ``layout`` (``distributed.StorageLayout``; None: global
    rank 0 writes): ``per_machine`` gives each machine a complete copy (docs/design-notes.md#checkpoint).
    Raises ``FinetuneError`` on every process if the write fails on any (e.g. disk full): the partial write is
    removed, the previous checkpoints untouched."""
    writes = accelerator.is_main_process if layout is None else layout.writes
    per_machine = layout is not None and layout.per_machine
    root = checkpoints_dir(output_dir)
    final = checkpoint_path(output_dir, state.step)
    tmp = root / f".tmp-{final.name}"
    error = None
    if writes:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp), safe_serialization=True)
    except WRITE_ERRORS as err:
        error = err
    if per_machine:  # collective: every process, also one whose write failed
        name = f"random_states_{accelerator.process_index}.pkl"
        try:
            own = (tmp / name).read_bytes() if error is None else None
        except WRITE_ERRORS as err:
            own, error = None, err
        rng_states = gather_object([(name, own)])
    try:
        if writes and error is None:
            if per_machine:
                for name, data in rng_states:
                    if data is not None and not (tmp / name).exists():
                        (tmp / name).write_bytes(data)
            if model is not None and hasattr(accelerator.unwrap_model(model), "peft_config"):
                accelerator.unwrap_model(model).save_pretrained(tmp)  # a PEFT adapter dir (adapter weights are small)
            elif model is not None:
                unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
                unwrapped.config.architectures = [type(unwrapped).__name__]  # as save_pretrained records it
                unwrapped.config.save_pretrained(tmp)
                if getattr(unwrapped, "generation_config", None) is not None and unwrapped.can_generate():
                    unwrapped.generation_config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            (tmp / STATE_FILE).write_text(json.dumps(asdict(state)) + "\n")
            _fsync_tree(tmp)
            (tmp / MARKER).write_text(f"step {state.step}\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    except WRITE_ERRORS as err:
        error = err
    message = None if error is None else f"{type(error).__name__}: {error}"
    errors = gather_object([message]) if accelerator.num_processes > 1 else [message]
    failed = [e for e in errors if e is not None]
    if failed:
        if writes:
            shutil.rmtree(tmp, ignore_errors=True)
        raise FinetuneError(f"writing checkpoint {final.name} failed ({failed[0]}); the previous checkpoints are "
                            "intact. Free disk space (or choose another --output_dir) and resume with "
                            "--resume_from_checkpoint latest.") from None
    if writes and save_total_limit:
        keep = {final, checkpoint_path(output_dir, state.best_step) if state.best_step is not None else final}
        complete = [p for p in list_checkpoints(output_dir) if is_complete(p) and p not in keep]
        for old in complete[: max(len(complete) + 1 - save_total_limit, 0)]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_tree(path: Path) -> None:
    # the marker must not reach the disk before the files it vouches for
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
