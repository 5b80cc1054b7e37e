"""The planner's count of what a model and its optimizer hold, in bytes, by layout: full-precision weights, a
bitsandbytes 4-bit (NF4/FP4) or 8-bit (LLM.int8()) base with its quantization constants, and AdamW's state in 32 or
8 bits. Formulas from bitsandbytes 0.50.2's own allocations (cited per function); ``tests/test_plan_memory.py``
checks each against the bytes of a real bitsandbytes layer and optimizer.

A quantized base keeps in full precision what transformers' bitsandbytes integration does not convert (only
``nn.Linear`` layers are, less the output embeddings, tied weights and the last module:
``transformers.quantizers.base.get_keys_to_not_convert``): embeddings, ``lm_head``, norms stay as they were loaded,
and are counted as such here.
"""

from __future__ import annotations

import torch

FOUR_BIT_BLOCK = 64  # Params4bit's default blocksize (nn/modules.py, Params4bit.__new__: blocksize None -> 64)
NESTED_BLOCK = 256  # double quantization: quantize_blockwise(absmax - offset, blocksize=256) (functional.py, quantize_4bit)
FOUR_BIT_CODE = 16  # get_4bit_type: the 16 fp32 values of NF4 or FP4, one tensor per layer's QuantState
DYNAMIC_CODE = 256  # create_dynamic_map: 256 fp32 values (a nested state's code, copied per layer; the 8-bit optimizer's
# qmap1/qmap2, shared by every parameter of one optimizer)
OPTIMIZER_BLOCK = 256  # Optimizer2State.init_state: absmax1/absmax2, one fp32 per 256 elements (optim/optimizer.py)
MIN_8BIT_SIZE = 4096  # Optimizer2State's min_8bit_size: a smaller tensor keeps its two moments in fp32
FP32 = 4


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def four_bit_bytes(numel: int, nested: bool, blocksize: int = FOUR_BIT_BLOCK) -> int:
    """Bytes of one bitsandbytes 4-bit weight of ``numel`` elements (``Params4bit`` and its ``QuantState``),
    bitsandbytes 0.50.2 ``functional.quantize_4bit`` with the default op (``backends/default/ops.py``):

    - the packed weight, two 4-bit codes a byte: ceil(numel / 2) (the same bytes in any ``quant_storage``);
    - ``absmax``, one scale per block of ``blocksize`` (64): fp32, or with ``nested`` (``--use_bnb_nested_quant``,
      ``compress_statistics``) one uint8 each, quantized in blocks of 256 whose own fp32 ``absmax``, a 256-value
      fp32 code and the fp32 ``offset`` are kept beside (``quantize_blockwise``, ``backends/cpu/ops.py``);
    - the 16-value fp32 code of NF4/FP4 (``get_4bit_type``).
    So about 0.5 + 4/64 = 0.5625 bytes per weight, 0.5 + 1/64 + 4/(64*256) = 0.516 nested."""
    blocks = _blocks(numel, blocksize)
    packed = _blocks(numel, 2)
    if nested:
        constants = blocks + _blocks(blocks, NESTED_BLOCK) * FP32 + DYNAMIC_CODE * FP32 + FP32
    else:
        constants = blocks * FP32
    return packed + constants + FOUR_BIT_CODE * FP32


def int8_bytes(out_features: int, in_features: int) -> int:
    """Bytes of one LLM.int8() weight (bitsandbytes 0.50.2 ``Int8Params._quantize``: ``int8_vectorwise_quant``):
    the int8 matrix (``CB``, the parameter's own data), one byte a weight, and ``SCB``, one fp32 scale per output
    row."""
    return out_features * in_features + out_features * FP32


def _is_int8(param) -> bool:
    """Whether ``param`` is a quantized ``Int8Params`` (an int8 matrix; its class checked by name, so the planner
    does not import bitsandbytes)."""
    return type(param).__name__ == "Int8Params" and param.dtype == torch.int8 and param.dim() == 2


def parameter_bytes(param) -> int:
    """Bytes ``param`` holds as loaded: a ``Params4bit`` by ``four_bit_bytes`` of its original shape
    (``quant_state.shape``), an ``Int8Params`` by ``int8_bytes``, any other tensor its elements x element size."""
    state = getattr(param, "quant_state", None)
    if state is not None:  # Params4bit, quantized
        numel = 1
        for size in state.shape:
            numel *= size
        return four_bit_bytes(numel, bool(state.nested), state.blocksize)
    if _is_int8(param):
        return int8_bytes(*param.shape)
    return param.numel() * param.element_size()


def weight_bytes(model) -> dict:
    """The weights of ``model`` in bytes by layout: {"quantized": the 4-bit/8-bit layers' (weights and constants),
    "full": every other parameter (embeddings, ``lm_head``, norms, adapters), "total"}; a tied parameter once."""
    quantized = full = 0
    for param in model.parameters():  # parameters() yields a tied weight once
        counted = parameter_bytes(param)
        if getattr(param, "quant_state", None) is not None or _is_int8(param):
            quantized += counted
        else:
            full += counted
    return {"quantized": quantized, "full": full, "total": quantized + full}


def optimizer_state_bytes(params, optim: str) -> int:
    """Bytes of AdamW's two moments over ``params`` (the trainable tensors) under ``--optim`` ``optim``:

    - ``adamw_torch``/``adamw_torch_fused``: two tensors like each parameter (``torch.optim.AdamW``);
    - ``adamw_bnb_8bit``/``paged_adamw_8bit``: bitsandbytes 0.50.2 ``Optimizer2State.init_state``: per tensor of at
      least ``MIN_8BIT_SIZE`` (4096) elements, two uint8 moments (one byte an element each) and two fp32 ``absmax``
      per block of 256; a smaller tensor keeps two fp32 moments; plus the two 256-value fp32 quantile maps
      (``qmap1``/``qmap2``) the optimizer's tensors share;
    - ``paged_adamw_32bit``: two fp32 moments (paged memory only on CUDA: ``get_state_buffer``).
    The step counters (a scalar each) are left out."""
    params = list(params)
    if optim in ("adamw_torch", "adamw_torch_fused"):
        return sum(2 * p.numel() * p.element_size() for p in params)
    if not optim.endswith("8bit"):
        return sum(2 * p.numel() * FP32 for p in params)
    total, any_8bit = 0, False
    for p in params:
        n = p.numel()
        if n < MIN_8BIT_SIZE:
            total += 2 * n * FP32
        else:
            any_8bit = True
            total += 2 * n + 2 * _blocks(n, OPTIMIZER_BLOCK) * FP32
    return total + (2 * DYNAMIC_CODE * FP32 if any_8bit else 0)


def optimizer_step_bytes(params, optim: str) -> int:
    """The transient of one optimizer step over ``params`` (the trainable tensors): the tensors it makes for its
    largest parameter of n elements, freed before the next. bitsandbytes 0.50.2's 8-bit AdamW on a CPU
    (``backends/cpu/ops.py``, ``_optimizer_update_8bit_blockwise_cpu``) de-quantizes both moments to fp32, copies the
    gradient to fp32, and builds its denominator from two more fp32 tensors (``state2_fp32.sqrt() / correction2``):
    5 x 4n bytes (a tensor under 4096 elements takes the 32-bit path); ``torch.optim.AdamW`` (one tensor at a time on
    a CPU) and the 32-bit ones, that denominator's two tensors: 2 x n x the element size."""
    largest = max(list(params), key=lambda p: p.numel(), default=None)
    if largest is None:
        return 0
    n = largest.numel()
    if optim.endswith("8bit") and n >= MIN_8BIT_SIZE:
        return 5 * FP32 * n
    return 2 * n * (largest.element_size() if optim in ("adamw_torch", "adamw_torch_fused") else FP32)


def dequantized_layer_bytes(model) -> int:
    """The transient of a 4-bit forward: its largest layer de-quantized, which the CPU kernel builds as int32 codes,
    their fp32 values, then the scaled fp32 weight (bitsandbytes 0.50.2 ``_dequantize_4bit_compute``): 3 x 4 bytes a
    weight of the largest 4-bit layer; 0 without one. Freed after the layer's matmul, so held once."""
    largest = 0
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        if state is not None:
            numel = 1
            for size in state.shape:
                numel *= size
            largest = max(largest, numel)
    return 3 * FP32 * largest


def describe_optimizer(optim: str) -> str:
    """The optimizer's state as the table names it: "AdamW", "AdamW 8-bit", "AdamW 32-bit, bitsandbytes"."""
    if optim in ("adamw_torch", "adamw_torch_fused"):
        return "AdamW"
    return "AdamW 8-bit, bitsandbytes" if optim.endswith("8bit") else "AdamW 32-bit, bitsandbytes"


def model_memory(model, optim: str) -> dict:
    """What training ``model`` under ``--optim`` ``optim`` holds beside its activations, in bytes: "weights"
    (``weight_bytes``), "gradients" (one like each trainable parameter), "optimizer_state"
    (``optimizer_state_bytes``), "dequantized" (``dequantized_layer_bytes``), "optimizer_step"
    (``optimizer_step_bytes``), and "optimizer" (its name,
    ``describe_optimizer``)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"weights": weight_bytes(model), "gradients": sum(p.numel() * p.element_size() for p in trainable),
            "optimizer_state": optimizer_state_bytes(trainable, optim), "dequantized": dequantized_layer_bytes(model),
            "optimizer_step": optimizer_step_bytes(trainable, optim),
            "optimizer": describe_optimizer(optim)}


def kv_cache_bytes(model_config, sequences: int, positions: int, element_size: int) -> int:
    """Bytes of the key/value cache ``generate`` holds for ``sequences`` rows of ``positions`` tokens each: 2 (keys
    and values) x layers x key/value heads x head size x positions x sequences x ``element_size`` (the model's
    activation dtype). transformers 5.24's ``DynamicCache`` keeps one (batch, kv heads, positions, head size) key and
    value tensor per layer (``cache_utils.py``, ``DynamicLayer.update``: ``torch.cat`` along the positions); after
    ``max_new_tokens`` new tokens it holds prompt + new - 1 positions (the last token sampled is never fed back)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return 2 * model_config.num_hidden_layers * kv_heads * head_dim * positions * sequences * element_size


def sampling_logits_bytes(vocab: int, sequences: int, element_size: int) -> int:
    """Bytes of one sampling step's logits over the vocabulary, ``sequences`` rows (transformers 5.24
    ``GenerationMixin._sample``, with ``logits_to_keep`` 1): the model's last-position logits (``element_size``), their
    fp32 copy (``next_token_logits``) and the fp32 probabilities (``softmax``); a temperature or top-p processor adds
    a copy more each. Freed at the next step, so held once."""
    return sequences * vocab * (element_size + 2 * FP32)


def generation_memory(model, sequences: int, prompt_tokens: int, new_tokens: int) -> dict:
    """What sampling ``new_tokens`` tokens after ``prompt_tokens`` for ``sequences`` rows with ``model`` holds beside
    its weights, in bytes: {"kv_cache": ``kv_cache_bytes`` at prompt + new - 1 positions, "logits":
    ``sampling_logits_bytes``, "sequences"}; the activation dtype is the input embeddings' (a 4-bit base computes
    in it)."""
    element = model.get_input_embeddings().weight.element_size()
    config = model.config
    return {"kv_cache": kv_cache_bytes(config, sequences, prompt_tokens + new_tokens - 1, element),
            "logits": sampling_logits_bytes(config.vocab_size, sequences, element), "sequences": sequences}
