"""The batch section: the micro-batch, the accumulation, and the effective batch the planner keeps exact (samples,
micro-batches)."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.config.flags import check_positive_int, flag
from finetune.errors import FinetuneError


@dataclass
class BatchArguments:
    """Micro-batch sizes, accumulation steps, ``--total_batch_size`` and the planner's memory budget."""

    per_device_train_batch_size: int = flag(
        8, "Micro-batch size in samples, per process, per forward/backward.",
        # a split of the effective batch B: B is part of a step's meaning (elastic.batch_meaning), its split is not
        step=False, trainer="per_device_train_batch_size",
    )
    per_device_eval_batch_size: int = flag(
        32, "Evaluation batch size per process.",
        step=False, trainer="per_device_eval_batch_size",
    )
    total_batch_size: int | None = flag(
        None,
        "Global effective batch per optimizer step (samples). Sets the accumulation steps so "
        "micro-batch x accumulation x processes equals it exactly.",
        step=False, trainer=None, compare_passes=False, verify=None,
    )
    auto_find_batch_size: bool = flag(
        False, "With --total_batch_size: use the largest micro-batch that fits in memory (probe steps).",
        step=False, trainer=None, compare_passes=False, verify=False,
    )
    max_memory_mb: int | None = flag(
        None,
        "CPU memory budget for --auto_find_batch_size (MiB; default: available RAM). "
        "The estimate leaves out transient buffers (0.2-0.4 GiB under the real peak "
        "at bbc-news, 256 tokens): leave a margin.",
        step=False, trainer=None, compare_passes=False,
    )
    gradient_accumulation_steps: int = flag(
        1, "Micro-batches per optimizer step (N). Effective batch = micro x N x processes.",
        step=False, trainer="gradient_accumulation_steps",  # a split of B, as per_device_train_batch_size
    )

    def _check_batch(self) -> None:
        """Batch sizes and accumulation (samples, micro-batches), and the planner's flags."""
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            check_positive_int(name, getattr(self, name))
        if self.auto_find_batch_size and not self.total_batch_size:
            raise FinetuneError("--auto_find_batch_size needs --total_batch_size (the effective batch it must keep).")
        if self.total_batch_size is not None and self.total_batch_size < 1:
            raise FinetuneError(f"--total_batch_size must be a positive integer, got {self.total_batch_size}.")
