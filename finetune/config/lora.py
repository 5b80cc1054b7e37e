"""The LoRA section: training adapters (peft) instead of every weight, and the merged copy (TRL's
``ModelConfig`` names)."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.config.flags import flag
from finetune.errors import FinetuneError


@dataclass
class LoraArguments:
    """``--use_peft`` and LoRA's rank, alpha, dropout and target modules; ``--merge_adapter``."""

    use_peft: bool = flag(
        False,
        "Train LoRA adapters (peft) instead of every weight: the base model stays "
        "frozen (no gradients, no optimizer state); a classifier head stays trainable.",
        step=True, trainer=None,
    )
    lora_r: int = flag(
        16, "LoRA rank (TRL's default).",
        step=True, trainer=None,
    )
    lora_alpha: int = flag(
        32, "LoRA alpha: the update is scaled by alpha / r.",
        step=True, trainer=None,
    )
    lora_dropout: float = flag(
        0.05, "Dropout on the LoRA branch.",
        step=True, trainer=None, verify=0.0,
    )
    lora_target_modules: str | None = flag(
        None,
        "Comma-separated module names to adapt, or 'all-linear' (default: peft's "
        "choice for the architecture, e.g. the attention projections).",
        step=True, trainer=None,
    )
    merge_adapter: bool = flag(
        False,
        "With --use_peft: also write the base model with the adapter merged in, to "
        "<output_dir>/merged (a plain model directory).",
        step=False, trainer=None,
    )

    def _check_peft(self) -> None:
        """LoRA's settings and the merged copy."""
        if self.use_peft and (self.lora_r < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1):
            raise FinetuneError(f"LoRA needs --lora_r >= 1, --lora_alpha > 0 and --lora_dropout in [0, 1), got r="
                                f"{self.lora_r}, alpha={self.lora_alpha}, dropout={self.lora_dropout}.")
        if self.merge_adapter and not self.use_peft:
            raise FinetuneError("--merge_adapter needs --use_peft (there is no adapter to merge otherwise).")
