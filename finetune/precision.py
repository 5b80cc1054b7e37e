"""Precision: the one table of precision names, and the precision that really runs.

``mixed_precision`` values are Accelerate's ("no", "fp16", "bf16"). What runs can differ from what was
asked: on a CPU Accelerate accepts fp16 and silently runs fp32, so every report uses the measured value
(under DeepSpeed, the value its config enables: DeepSpeed, not autocast, runs the precision there).
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


def running_precision(accelerator) -> str:
    """The precision a run with ``accelerator`` trains in: "fp16", "bf16" or "no". Under DeepSpeed, the one
    its config enables (``sharded.deepspeed_precision``: DeepSpeed casts the model itself and Accelerate's
    autocast is off, so a measurement would say fp32); everywhere else, measured
    (``effective_mixed_precision``)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        from finetune.sharded import deepspeed_precision

        return deepspeed_precision(accelerator.state.deepspeed_plugin.deepspeed_config)
    return effective_mixed_precision(accelerator)


def check_precision_supported(mixed_precision: str) -> None:
    """Raise ``FinetuneError`` for bf16 on a CUDA device without bf16 (before Ampere). CPUs run bf16
    autocast (fast with AVX512-BF16/AMX); fp16 on a CPU is not refused but reported as fp32."""
    if mixed_precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise FinetuneError(f"--mixed_precision bf16: this GPU ({torch.cuda.get_device_name()}) has no bf16 support. "
                            "Use --mixed_precision fp16 or no.")
