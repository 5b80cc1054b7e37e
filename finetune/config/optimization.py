"""The optimization section: AdamW, the learning-rate schedule (sized in optimizer steps), the length of training,
clipping, and how many fp16 steps in a row may be skipped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from finetune.config.flags import flag
from finetune.config.lora import require_bitsandbytes
from finetune.errors import FinetuneError

LR_SCHEDULER_CHOICES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)

# TrainingArguments' names (transformers 5.24 training_args.py OptimizerNames): torch's AdamW, bitsandbytes' AdamW
OPTIM_CHOICES = ("adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit")
BNB_OPTIMIZERS = OPTIM_CHOICES[2:]


@dataclass
class OptimizationArguments:
    """AdamW and its schedule, epochs or steps, gradient clipping, fp16's skipped-step limit."""

    learning_rate: float = flag(
        5e-5, "Peak AdamW learning rate.",
        step=False, trainer="learning_rate",
    )
    weight_decay: float = flag(
        0.0, "AdamW weight decay (not on biases and LayerNorm).",
        step=False, trainer="weight_decay",
    )
    optim: Literal[OPTIM_CHOICES] = flag(
        "adamw_torch", "AdamW implementation (TrainingArguments names): fused is one kernel per step; "
        "adamw_bnb_8bit keeps the moments in 8 bits (bitsandbytes, block-wise), paged_* in memory that pages to "
        "the host under pressure (CUDA; on a CPU they run unpaged). The bitsandbytes ones need the qlora extra.",
        step=False, trainer="optim",
    )
    adam_beta1: float = flag(
        0.9, "AdamW beta1.",
        step=False, trainer="adam_beta1",
    )
    adam_beta2: float = flag(
        0.999, "AdamW beta2.",
        step=False, trainer="adam_beta2",
    )
    adam_epsilon: float = flag(
        1e-8, "AdamW epsilon.",
        step=False, trainer="adam_epsilon",
    )
    num_train_epochs: float = flag(
        3.0, "Epochs (fractions allowed). Ignored if max_steps > 0.",
        step=False, trainer="num_train_epochs",
    )
    max_steps: int = flag(
        -1, "Total optimizer steps; overrides num_train_epochs if > 0.",
        step=False, trainer="max_steps",
    )
    lr_scheduler_type: Literal[LR_SCHEDULER_CHOICES] = flag(
        "linear", "LR schedule, sized in optimizer steps.",
        step=False, trainer="lr_scheduler_type",
    )
    warmup_steps: float = flag(
        0,
        "Linear warmup: a count of optimizer steps, or a float in [0, 1): that ratio of "
        "the total optimizer steps (as TrainingArguments; there is no warmup_ratio).",
        step=False, trainer="warmup_steps",
    )
    max_grad_norm: float = flag(
        1.0, "Clip the global grad norm to this (0 disables).",
        step=False, trainer="max_grad_norm",
    )
    max_skipped_steps: int = flag(
        10, "fp16: stop after this many optimizer steps in a row skipped by the GradScaler.",
        step=False, trainer=None,
    )

    def _check_optimization(self) -> None:
        """Learning rate, length of training, clipping, fp16's skipped steps."""
        if self.learning_rate <= 0:
            raise FinetuneError(f"--learning_rate must be > 0, got {self.learning_rate}.")
        if self.num_train_epochs <= 0 and self.max_steps <= 0:
            raise FinetuneError("--num_train_epochs must be > 0 (or set --max_steps to a positive number).")
        if self.max_grad_norm < 0:
            raise FinetuneError(f"--max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}.")
        if self.optim in BNB_OPTIMIZERS:
            require_bitsandbytes(f"--optim {self.optim}")
        if self.max_skipped_steps < 1:
            raise FinetuneError(f"--max_skipped_steps must be >= 1, got {self.max_skipped_steps}.")
