"""Precision: the one table of precision names, and the precision that really runs.

``mixed_precision`` values are Accelerate's ("no", "fp16", "bf16"). What runs can differ from what was
asked: on a CPU Accelerate accepts fp16 and silently runs fp32, so every report uses the value the engine
reports (``engine.precision()``: measured under autocast, or what a sharded engine's config enables).
"""

from __future__ import annotations

import torch

from finetune.errors import FinetuneError

# mixed_precision value -> how a person names it (banner, model card, summaries)
PRECISION_NAMES = {"no": "fp32", "fp16": "fp16 (autocast + GradScaler loss scaling)", "bf16": "bf16 (autocast)"}


def effective_mixed_precision(accelerator) -> str:
    """The precision that autocast really runs on ``accelerator.device``: "fp16", "bf16" or "no".

    Measured, not assumed: a 2x2 matmul inside ``accelerator.autocast()`` reports its dtype. On a CPU,
    Accelerate accepts ``mixed_precision="fp16"`` but runs fp32; this returns "no" there.
    """
    a = torch.ones(2, 2, device=accelerator.device)
    with accelerator.autocast():
        dtype = (a @ a).dtype
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "no")


def check_precision_supported(mixed_precision: str) -> None:
    """Raise ``FinetuneError`` for bf16 on a CUDA device without bf16 (before Ampere). CPUs run bf16
    autocast (fast with AVX512-BF16/AMX); fp16 on a CPU is not refused but reported as fp32."""
    if mixed_precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise FinetuneError(f"--mixed_precision bf16: this GPU ({torch.cuda.get_device_name()}) has no bf16 support. "
                            "Use --mixed_precision fp16 or no.")


def loss_scale(accelerator: Accelerator) -> float | None:
    """The fp16 GradScaler's current loss scale (a Python float; a device sync), or None when the run has
    no loss scaling (fp32, bf16)."""
    return accelerator.scaler.get_scale() if accelerator.scaler is not None else None


def optimizer_step_skipped(accelerator: Accelerator, scale_before: float | None) -> bool:
    """Whether the optimizer step just taken (on a sync micro-batch) was skipped for an fp16 overflow.
    ``scale_before``: ``loss_scale(accelerator)`` read just before ``optimizer.step()``.

    Two signals, either suffices: Accelerate's ``optimizer_step_was_skipped``, and a drop of the loss scale
    across the step (``AcceleratedOptimizer.step`` calls ``scaler.update()``, which lowers the scale only
    after inf/NaN gradients, i.e. only when ``scaler.step`` skipped the update). Accelerate's flag alone
    misses skips with a fused optimizer (``--optim adamw_torch_fused``): GradScaler then always calls the
    optimizer's ``step``, whose kernel skips the update itself, so the flag stays False (accelerate issue
    4242). Always False without loss scaling.
    """
    if accelerator.optimizer_step_was_skipped:
        return True
    return scale_before is not None and loss_scale(accelerator) < scale_before
