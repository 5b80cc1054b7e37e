"""What precision runs (Accelerate's "no", "fp16", "bf16") and its name: see docs/precision.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from finetune.errors import FinetuneError

if TYPE_CHECKING:
    from accelerate import Accelerator

# mixed_precision value -> how a person names it (banner, model card, summaries)
PRECISION_NAMES = {"no": "fp32", "fp16": "fp16 (autocast + GradScaler loss scaling)", "bf16": "bf16 (autocast)"}


def effective_mixed_precision(accelerator) -> str:
    """The precision autocast really runs on ``accelerator.device``, measured: "fp16", "bf16" or "no"."""
    a = torch.ones(2, 2, device=accelerator.device)
    with accelerator.autocast():
        dtype = (a @ a).dtype  # on a CPU Accelerate accepts fp16 but runs fp32: this says "no" there
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "no")


def precision_that_runs(mixed_precision: str, device_type: str) -> str:
    """The precision Accelerate will run for ``mixed_precision`` ("no", "fp16", "bf16") on a device of
    ``device_type`` ("cpu", "cuda", ...), for code that runs before the Accelerator exists (the planner's probes):
    "no" for fp16 on a CPU, where Accelerate turns neither autocast nor a GradScaler on (accelerate 1.15
    ``accelerator.py`` lines 565-570: ``native_amp`` only where ``device.type != "cpu"``); bf16 runs on a CPU
    (lines 585-590). A run measures it instead: ``effective_mixed_precision``."""
    if mixed_precision == "fp16" and device_type == "cpu":
        return "no"
    return mixed_precision


def check_precision_supported(mixed_precision: str) -> None:
    """Raise ``FinetuneError`` for bf16 on a CUDA device without bf16 (before Ampere); CPUs pass."""
    if mixed_precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise FinetuneError(f"--mixed_precision bf16: this GPU ({torch.cuda.get_device_name()}) has no bf16 support. "
                            "Use --mixed_precision fp16 or no.")


def loss_scale(accelerator: Accelerator) -> float | None:
    """The fp16 GradScaler's loss scale (a float; a device sync), or None without loss scaling."""
    return accelerator.scaler.get_scale() if accelerator.scaler is not None else None


def optimizer_step_skipped(accelerator: Accelerator, scale_before: float | None) -> bool:
    """Whether the step just taken skipped for fp16 overflow; ``scale_before``: ``loss_scale`` before the step."""
    if accelerator.optimizer_step_was_skipped:
        return True
    # scaler.update() lowers the scale only after inf/NaN gradients; catches fused-optimizer skips (accelerate #4242)
    return scale_before is not None and loss_scale(accelerator) < scale_before
