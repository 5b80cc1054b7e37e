"""Model FLOPs utilisation: training FLOPs per token = 6 x parameters (Kaplan et al. 2020, "Scaling Laws for
Neural Language Models", 2.1; attention's term left out) over dense bf16/fp16 peaks from NVIDIA datasheets."""

from __future__ import annotations

import re

# Dense (no structured sparsity) bf16/fp16 tensor-core peaks, FLOP/s, from NVIDIA's product datasheets
# (they print the 2:4-sparsity figure, twice these; "dense" = that figure / 2). Matched against
# torch.cuda.get_device_name() in order: the first pattern that matches wins.
PEAK_FLOPS: list[tuple[str, float, str]] = [
    (r"H200.*NVL", 835.5e12, "NVIDIA H200 datasheet: H200 NVL BF16/FP16 1,671 TFLOPS with sparsity"),
    (r"H200", 989.4e12, "NVIDIA H200 datasheet: H200 SXM BF16/FP16 1,979 TFLOPS with sparsity"),
    (r"H100.*NVL", 835.5e12, "NVIDIA H100 datasheet: H100 NVL BF16/FP16 1,671 TFLOPS with sparsity"),
    (r"H100.*PCIe", 756.0e12, "NVIDIA H100 datasheet: H100 PCIe BF16/FP16 1,513 TFLOPS with sparsity"),
    (r"H100", 989.4e12, "NVIDIA H100 datasheet: H100 SXM BF16/FP16 1,979 TFLOPS with sparsity"),
    (r"A100", 312.0e12, "NVIDIA A100 datasheet: BF16/FP16 Tensor Core 312 TFLOPS (624 with sparsity)"),
    (r"L40S", 362.05e12, "NVIDIA L40S datasheet: BF16/FP16 Tensor Core 362.05 TFLOPS (733 with sparsity)"),
    (r"\bL4\b", 121.0e12, "NVIDIA L4 datasheet: BF16/FP16 Tensor Core 242 TFLOPS with sparsity"),
    (r"\bA10\b", 125.0e12, "NVIDIA A10 datasheet: BF16/FP16 Tensor Core 125 TFLOPS (250 with sparsity)"),
    (r"V100.*PCIe", 112.0e12, "NVIDIA V100 datasheet: PCIe Tensor Performance (FP16) 112 TFLOPS; no bf16"),
    (r"V100", 125.0e12, "NVIDIA V100 datasheet: SXM2 Tensor Performance (FP16) 125 TFLOPS; no bf16"),
    (r"\bT4\b", 65.0e12, "NVIDIA T4 datasheet: Mixed Precision (FP16/FP32) 65 TFLOPS; no bf16"),
]


def peak_flops(device_name: str | None, override_tflops: float | None = None) -> tuple[float, str] | None:
    """(peak dense bf16/fp16 FLOP/s, its source) for a GPU named as ``torch.cuda.get_device_name`` does;
    ``override_tflops`` (TFLOP/s) wins. None for no device or an unknown one."""
    if override_tflops:
        return override_tflops * 1e12, "--peak_tflops"
    if not device_name:
        return None
    for pattern, flops, source in PEAK_FLOPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return flops, source
    return None


def model_flops_utilization(num_parameters: int, tokens_per_second: float, device_name: str | None,
                            override_tflops: float | None = None) -> tuple[float, str] | None:
    """(MFU as a fraction of peak, the peak's source) = 6 x ``num_parameters`` x ``tokens_per_second``
    / peak FLOP/s of ``device_name``; None when the device's peak is unknown (e.g. a CPU)."""
    peak = peak_flops(device_name, override_tflops)
    if peak is None:
        return None
    return 6 * num_parameters * tokens_per_second / peak[0], peak[1]
