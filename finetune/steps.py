"""How long a run is, in optimizer steps: from micro-batches per process per epoch and the flags."""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.errors import FinetuneError


@dataclass(frozen=True)
class StepPlan:
    """How long a run is, in optimizer steps (micro-batches per process)."""

    micro_batches_per_epoch: int  # per process
    steps_per_epoch: int  # ceil(micro-batches / N): an epoch's last window may be partial
    max_steps: int  # --max_steps if > 0, else ceil(epochs x steps per epoch)
    num_epochs: int  # epochs started: ceil(max_steps / steps per epoch)

    def steps(self, value: float | None) -> int | None:
        """A step value in optimizer steps: >= 1 as is, a ratio of ``max_steps`` rounded up; None stays None."""
        if value is None:
            return None
        return int(value) if value >= 1 else math.ceil(self.max_steps * value)  # TrainingArguments.get_warmup_steps

    def epoch_fraction(self, step: int) -> float:
        """Epochs completed after ``step`` optimizer steps (e.g. 1.5)."""
        return step / self.steps_per_epoch


def plan_steps(micro_batches_per_epoch: int, config) -> StepPlan:
    """The ``StepPlan`` for micro-batches per process per epoch; ``FinetuneError`` if there are none."""
    if micro_batches_per_epoch == 0:
        raise FinetuneError("the training set is empty after --max_train_samples; use more samples.")
    steps_per_epoch = math.ceil(micro_batches_per_epoch / config.gradient_accumulation_steps)
    max_steps = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * steps_per_epoch)
    return StepPlan(micro_batches_per_epoch, steps_per_epoch, max_steps, math.ceil(max_steps / steps_per_epoch))


def micro_batches_per_process(num_samples: int, micro_batch: int, num_processes: int) -> int:
    """ceil(ceil(samples / micro-batch) / processes), as Accelerate's sharded dataloader yields them."""
    return math.ceil(math.ceil(num_samples / micro_batch) / num_processes)
