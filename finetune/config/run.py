"""The run section: which recipe, where the run writes, which backend runs it, resuming, and how long its processes
wait for each other and for the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from finetune.config.flags import flag
from finetune.errors import FinetuneError


@dataclass
class RunArguments:
    """The recipe, the output directory, the backend, resuming, the processes' timeouts."""

    recipe: str = flag(
        "bbc-news", "Recipe name (see --list_recipes) or path/to/recipe.py. Default: with --train_file or "
        "--dataset_name, the one for the data's columns (sft, dpo, clm, classify; grpo for prompt-only rows with "
        "--reward_funcs), else bbc-news.",
        step=True, trainer=None,
    )
    task: Literal["sft", "preference", "causal-lm", "sequence-classification", "grpo"] | None = flag(
        None, "Your data without --recipe: the training style, where the columns leave it open (text + label). "
        "Default: from the columns, as TRL's formats define them.",
        step=False, trainer=None,
    )
    list_recipes: bool = flag(
        False, "Print the known recipes and exit.",
        step=False, trainer=None, replay=False, same_run=False, compare_passes=False,
    )
    output_dir: str | None = flag(
        None, "Where the model, metrics.json and log.jsonl go. Default: outputs/<recipe>.",
        step=False, trainer=None, replay=False, same_run=False, compare_passes=False,
    )
    overwrite_output_dir: bool = flag(
        False, "Allow writing into an output_dir that already holds another run.",
        step=False, trainer=None, replay=False, same_run=False, compare_passes=False, verify=True,
    )
    backend: Literal["accelerate", "trainer"] = flag(
        "accelerate", "Training engine: our accelerator.accumulate() loop, or transformers' Trainer.",
        step=False, trainer=None, compare_passes=False, verify="accelerate",
    )
    compare: bool = flag(
        False, "Set by `finetune compare` (both backends with the same settings, comparison.md/json/png); a "
        "training run refuses it, naming `finetune compare`.",
        step=False, trainer=None, compare_passes=False, verify=False,
    )
    resume_from_checkpoint: str | None = flag(
        None,
        "'latest' (newest complete checkpoint in output_dir), 'auto' (latest if there "
        "is one, else a fresh start; a finished run exits 0: one command for a "
        "requeued job) or a checkpoint path.",
        step=False, trainer=None, replay=False, same_run=False, verify=None,
    )
    ignore_checkpoint_mismatch: bool = flag(
        False, "Resume even if the effective batch or the data differ (another split of the same batch needs no "
        "flag; samples are never replayed or skipped).",
        step=False, trainer=None, same_run=False,
    )
    ddp_timeout: int = flag(
        1800,
        "Seconds a collective waits for a peer process before the run fails (torch's "
        "process-group timeout; TrainingArguments' name and default).",
        step=False, trainer="ddp_timeout",
    )
    preemption_grace_seconds: float | None = flag(
        None,
        "Seconds the scheduler allows between its stop signal and SIGKILL (SLURM: the "
        "partition's GraceTime, or N of --signal=B:USR1@N). finetune train sets "
        "torchrun's shutdown timeout to it (default 30 s), and the run warns when an "
        "optimizer step plus a checkpoint will not fit in it.",
        step=False, trainer=None, same_run=False,
    )

    def _check_processes(self) -> None:
        """What the processes wait for: each other (collectives), the scheduler's grace."""
        if self.ddp_timeout < 1:
            raise FinetuneError(f"--ddp_timeout must be a positive number of seconds, got {self.ddp_timeout}.")
        check_grace_seconds(self.preemption_grace_seconds)


def check_grace_seconds(value) -> float | None:
    """``--preemption_grace_seconds``: None, or a positive, finite number of seconds (returned as a float). Raises
    ``FinetuneError`` otherwise."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not 0 < seconds < float("inf"):
        raise FinetuneError(f"--preemption_grace_seconds must be a positive number of seconds (the scheduler's grace "
                            f"between its stop signal and SIGKILL, e.g. 120), got {value!r}.")
    return seconds
