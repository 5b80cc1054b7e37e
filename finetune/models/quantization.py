"""A quantized base under LoRA adapters (QLoRA): bitsandbytes' 4-bit (NF4, FP4) or 8-bit (LLM.int8()) weights,
loaded as TRL does it (``trl.get_quantization_config``: transformers' ``BitsAndBytesConfig`` from the
``ModelConfig`` flags) and prepared for training by peft's ``prepare_model_for_kbit_training``; what the base is
(for the banner and the card) and the hash of its quantized weights (part of a step's meaning: a resume never
continues on a base quantized otherwise). See docs/recipes.md, "QLoRA"."""

from __future__ import annotations

import gc
import hashlib
import os
import tempfile

import torch

PRECISION_DTYPES = {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}


def is_quantized(config) -> bool:
    """Whether ``config`` asks for a quantized base (``--load_in_4bit`` or ``--load_in_8bit``)."""
    return bool(getattr(config, "load_in_4bit", False) or getattr(config, "load_in_8bit", False))


def uses_bitsandbytes(config) -> bool:
    """Whether a run of ``config`` imports bitsandbytes: a quantized base, or one of its optimizers (``--optim``
    ``adamw_bnb_8bit``, ``paged_adamw_8bit``, ``paged_adamw_32bit``)."""
    return is_quantized(config) or getattr(config, "optim", "adamw_torch") not in ("adamw_torch", "adamw_torch_fused")


def compute_dtype(config, precision: str | None = None) -> str:
    """The 4-bit layers' compute dtype: ``--bnb_4bit_compute_dtype``, else the run's precision's
    (``PRECISION_DTYPES``: fp32 -> float32, bf16 -> bfloat16, fp16 -> float16), as TRL takes its ``dtype``:
    ``precision``, the one that runs ("no", "bf16", "fp16"), where known (a CPU runs an fp16 request in fp32),
    else the requested ``--mixed_precision``."""
    return config.bnb_4bit_compute_dtype or PRECISION_DTYPES.get(precision or config.mixed_precision, "float32")


def with_compute_dtype(config, precision: str):
    """``config`` with ``--bnb_4bit_compute_dtype`` set to ``compute_dtype(config, precision)`` for a 4-bit base
    (the model is loaded in the precision that runs, not the one requested); ``config`` itself otherwise."""
    if not getattr(config, "load_in_4bit", False) or config.bnb_4bit_compute_dtype:
        return config
    import dataclasses

    return dataclasses.replace(config, bnb_4bit_compute_dtype=compute_dtype(config, precision))


def bnb_config(config):
    """transformers' ``BitsAndBytesConfig`` for the quantization flags of ``config``, or None for a full-precision
    base (TRL 1.16 ``get_quantization_config``, with the compute dtype of ``compute_dtype``)."""
    if not is_quantized(config):
        return None
    from transformers import BitsAndBytesConfig  # lazy: only a quantized run pays for bitsandbytes' import

    if config.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=config.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=config.use_bnb_nested_quant,
                              bnb_4bit_compute_dtype=getattr(torch, compute_dtype(config)),
                              bnb_4bit_quant_storage=getattr(torch, config.bnb_4bit_quant_storage or "uint8"))


def load_kwargs(quantization) -> dict:
    """``from_pretrained``'s arguments for ``quantization`` (a ``BitsAndBytesConfig`` or None): the config and, on
    CUDA, every weight on this process's own device (``LOCAL_RANK``), as TRL's ``get_kbit_device_map`` did (a
    quantized model is placed when it is loaded, not moved by ``prepare``); {} for None."""
    if quantization is None:
        return {}
    kwargs = {"quantization_config": quantization}
    if torch.cuda.is_available():
        kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", 0))}
    return kwargs


def quantize_built(build, quantization):
    """The model ``build()`` returns (a full-precision model: a de-quantized GGUF) quantized by ``quantization`` (a
    ``BitsAndBytesConfig``): written to a temporary directory, freed, and loaded back through ``from_pretrained``, the
    one path on which transformers quantizes. The full-precision model is built here and let go before the quantized
    one loads, so the two are never held together (the peak of a QLoRA run from a GGUF file is its training's, not
    its loading's: docs/plan.md). Returns the quantized model."""
    with tempfile.TemporaryDirectory(prefix="finetune-quantize-") as folder:
        model = build()
        model.save_pretrained(folder)
        kind = type(model)
        del model
        gc.collect()
        return off_the_checkpoint(kind.from_pretrained(folder, **load_kwargs(quantization)), quantization)


def off_the_checkpoint(model, quantization):
    """``model``, loaded by ``from_pretrained`` with ``quantization`` (a ``BitsAndBytesConfig``; None: returned as it
    is), with every full-precision parameter and buffer on the CPU copied into its own memory. transformers 5.24 reads
    a ``.safetensors`` checkpoint through one memory map of the file (``modeling_utils.py``, ``safe_open(file, ...,
    backend="mmap")`` and ``get_slice``), and a tensor it does not convert (the embeddings, norms, a tied ``lm_head``)
    stays a view of that map, which then lives as long as the model: with it, every page of the file that quantizing
    the linear layers read stays in the process's resident memory (a checkpoint's full size, beside the quantized
    base: SmolLM2-135M's 405 MiB, docs/plan.md), which no count of the model's tensors sees. A copy lets the map go;
    the 4-bit and 8-bit weights are the quantizer's own tensors already. Ties are kept (a shared ``Parameter`` gets
    its new data once)."""
    if quantization is None:
        return model
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    for tensor in tensors.values():
        if tensor.device.type == "cpu" and type(tensor).__name__ not in ("Params4bit", "Int8Params"):
            tensor.data = tensor.data.clone()
    gc.collect()
    return model


def prepare_for_training(model):
    """A quantized ``model`` made ready for adapters (peft 0.21 ``prepare_model_for_kbit_training``: every base
    weight frozen, the non-quantized ones in fp32; activation checkpointing is left to ``--activation_checkpointing``).
    bitsandbytes' 4-bit layers on a CPU with AVX512-BF16 would, in eval mode, repack their weights for a CPU kernel
    with the scales rounded to bf16 (bitsandbytes 0.50.2 ``nn/modules.py`` ``Linear4bit.forward``): an evaluation
    would then change the base the next steps train on, so the repacking is turned off and evaluation computes as
    training does."""
    from peft import prepare_model_for_kbit_training  # lazy: see bnb_config

    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            module.register_load_state_dict_pre_hook(_take_quant_state)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _take_quant_state(module, state_dict, prefix, *_):
    """A 4-bit layer's load-state-dict pre-hook: its state dict holds the quantization constants beside the packed
    weight (bitsandbytes 0.50.2 ``Linear4bit._save_to_state_dict``), which its load does not take back, so a strict
    load of a checkpoint (``accelerator.load_state``) would fail on them. They are taken out here and checked equal
    to the layer's own (the step meaning's hash has already checked the base). Raises ``ValueError`` where they
    differ."""
    for key, own in module.weight.quant_state.as_dict(packed=True).items():
        saved = state_dict.pop(f"{prefix}weight.{key}", None)
        if saved is not None and not torch.equal(saved.to(own.device), own):
            raise ValueError(f"{prefix}weight.{key}: the checkpoint's quantization constants are not this base's")


def quantized_modules(model):
    """(name, module) of every bitsandbytes 4-bit or 8-bit linear layer of ``model``, in ``named_modules`` order."""
    import sys

    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return []
    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return [(name, module) for name, module in model.named_modules() if isinstance(module, kinds)]


def describe_base(model) -> str | None:
    """What the quantized base of ``model`` is, for the banner and the card: "NF4 (4-bit, bitsandbytes; nested
    constants; compute float32)" or "int8 (8-bit, bitsandbytes LLM.int8())"; None for a full-precision one."""
    layers = quantized_modules(model)
    if not layers:
        return None
    module = layers[0][1]
    state = getattr(module.weight, "quant_state", None)
    if state is None:
        return f"int8 (8-bit, bitsandbytes LLM.int8(); {len(layers)} linear layers)"
    nested = "; nested constants" if state.nested else ""
    compute = str(module.compute_dtype).removeprefix("torch.") if module.compute_dtype is not None else "float32"
    return f"{state.quant_type.upper()} (4-bit, bitsandbytes{nested}; compute {compute}; {len(layers)} linear layers)"


def base_identity(model) -> dict | None:
    """The quantized base of ``model`` as a step's meaning records it: {"quantization": ``describe_base``,
    "sha256": the hash of every quantized layer's stored bytes (packed weights, scales, nested constants, in
    module order)}; None for a full-precision base. Two loads that quantize alike hash alike; another quant type,
    nesting or bitsandbytes' rounding does not."""
    layers = quantized_modules(model)
    if not layers:
        return None
    digest = hashlib.sha256()
    for name, module in layers:
        for key, tensor in sorted(module.state_dict().items()):
            if isinstance(tensor, torch.Tensor):
                digest.update(f"{name}.{key}".encode())
                digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"quantization": describe_base(model), "sha256": digest.hexdigest()}
