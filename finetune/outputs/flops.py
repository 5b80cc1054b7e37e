"""Training FLOPs per token and their utilisation of a GPU's peak: 6 N + 12 L d T per token (Chowdhery et al.
2022, "PaLM", appendix B: N the parameters that multiply activations, L layers, d the attention width (heads x
head_dim), T the sequence length), over dense bf16/fp16 peaks from NVIDIA datasheets; a run's utilisation is over
the peaks of all its GPUs (processes x one GPU's)."""

from __future__ import annotations

import re

import torch

from finetune.engine import parameter_numel, parameter_sizes

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
    / peak FLOP/s of ``device_name``; None when the device's peak is unknown (e.g. a CPU). The benchmarks'
    simple form; a run's own figures come from ``training_flops_per_token``."""
    peak = peak_flops(device_name, override_tflops)
    if peak is None:
        return None
    return 6 * num_parameters * tokens_per_second / peak[0], peak[1]


def _unwrapped(model):
    while hasattr(model, "module"):  # DDP, accelerate's wrappers
        model = model.module
    return model


def matmul_parameters(model) -> tuple[int, int]:
    """(all, trainable) parameters that multiply activations once per token, in elements: every parameter but
    the embedding tables (a lookup, no multiply); an output embedding tied to the input one counts (its matmul
    runs: ``in_features x out_features`` of the head). Sizes are the whole parameters whatever the engine
    sharded (``engine.parameter_sizes``: partitioned placeholders, flat shards), not this rank's part."""
    sizes = parameter_sizes(model)  # the wrapped model: the sharding wrappers know their flat parameters
    model = _unwrapped(model)
    total = sum(n for module, n, _ in sizes if not isinstance(module, torch.nn.Embedding))
    trainable = sum(n for module, n, grad in sizes if grad and not isinstance(module, torch.nn.Embedding))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and not any(module is head for module, _, _ in sizes):
        # tied: the shared table is listed under the input embedding, and is also the head's matmul
        weight = head.weight
        size = (head.in_features * head.out_features if isinstance(head, torch.nn.Linear) else parameter_numel(weight))
        total += size
        trainable += size if weight.requires_grad else 0
    return total, trainable


def attention_width(config) -> int | None:
    """PaLM's d in 12 L d T: the width of the attention's queries, keys and values, ``num_attention_heads x
    head_dim`` where the config sets ``head_dim`` (it differs from ``hidden_size`` in Qwen3, Gemma-7B:
    16 x 256 = 4096 against 3072), else ``hidden_size``. None without either."""
    heads, head_dim = getattr(config, "num_attention_heads", None), getattr(config, "head_dim", None)
    if heads and head_dim:
        return heads * head_dim
    return getattr(config, "hidden_size", None)


def training_flops_per_token(model, context: float, recompute: bool = False) -> tuple[float, str] | None:
    """(training FLOPs per token, the formula with its numbers) for a token in a sequence of ``context`` tokens:
    6 N + 12 L d T (PaLM, appendix B; d: ``attention_width``, heads x head_dim); where only some weights train (LoRA), 4 N + 2 N_trainable (a frozen
    weight needs no weight gradient); ``recompute`` (activation checkpointing) adds the forward again, 2 N + 4 L d T.
    None for a model whose config has no ``num_hidden_layers`` or width."""
    config = getattr(_unwrapped(model), "config", None)
    layers, width = getattr(config, "num_hidden_layers", None), attention_width(config)
    if not layers or not width:
        return None
    total, trainable = matmul_parameters(model)
    dense = 6 * total if trainable >= total else 4 * total + 2 * trainable
    attention = 12 * layers * width * context
    formula = (f"{'6 N' if trainable >= total else '4 N + 2 N_trainable'} + 12 L d T, N = {total:,}"
               + ("" if trainable >= total else f", N_trainable = {trainable:,}")
               + f", L = {layers}, d = {width}, T = {context:.1f}")
    if recompute:
        dense += 2 * total
        attention += 4 * layers * width * context
        formula += ", + 2 N + 4 L d T recomputed (activation checkpointing)"
    return dense + attention, formula
