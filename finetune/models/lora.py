"""LoRA through ``peft`` with TRL's flags (``--use_peft``, ``--lora_r``, ...): wrap the model, count what trains,
save an adapter directory. The base is frozen; a classifier's new head trains and is saved (``modules_to_save``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

# peft, transformers' auto classes and the GGUF loader are imported where they are used: peft takes ~1 s that a run
# without --use_peft should not pay, and `finetune train`'s launcher process imports this module through the engine
# seam (engine/plain.py) without building a model.
ADAPTER_CONFIG = "adapter_config.json"
BASE_DIR = "base_model"  # a GGUF base, de-quantized once, where the adapter config can point to it


def lora_config(config, task_type: str) -> LoraConfig:
    """The ``peft.LoraConfig`` of the LoRA flags (rank, alpha, dropout, targets, DoRA, rsLoRA, modules trained in
    full, the initialisation) for peft's ``TaskType`` named ``task_type`` (the task's ``peft_task_type``:
    ``SEQ_CLS``, ``CAUSAL_LM``)."""
    from peft import LoraConfig, TaskType  # lazy: see the top

    from finetune.config.lora import init_lora_value  # the flag's value as peft takes it

    targets = config.lora_target_modules
    if targets and targets != "all-linear":
        targets = names(targets)
    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=targets or None, use_dora=config.use_dora, use_rslora=config.use_rslora,
                      modules_to_save=names(config.lora_modules_to_save) or None,
                      init_lora_weights=init_lora_value(config.init_lora_weights),
                      task_type=TaskType[task_type])


def names(listed: str | None) -> list[str]:
    """The module names of a comma-separated flag value (``--lora_target_modules``, ``--lora_modules_to_save``)."""
    return [name.strip() for name in (listed or "").split(",") if name.strip()]


def apply_lora(model, config, task_type: str) -> PeftModel:
    """``peft.get_peft_model`` with ``lora_config``; peft's ``ValueError`` for target modules the model lacks."""
    from peft import get_peft_model  # lazy: see the top

    return get_peft_model(model, lora_config(config, task_type))


def is_peft_model(model) -> bool:
    """``isinstance(model, peft.PeftModel)``, without importing peft: a model can only be one once peft is
    imported (``apply_lora`` or ``load_adapter_model`` did it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def save_pretrained_here(model, path, **kwargs) -> None:
    """``model.save_pretrained(path, **kwargs)`` written by this process, whatever its global rank: transformers 5
    writes on global rank 0 only once torch.distributed is up (``distributed/mixin.py``
    ``should_save_on_this_rank``), which would leave a machine's own copy without the file."""
    if hasattr(model, "should_save_on_this_rank"):
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
        try:
            model.save_pretrained(path, is_main_process=True, **kwargs)
        finally:
            del model.should_save_on_this_rank
    else:
        model.save_pretrained(path, **kwargs)


def save_adapter(model: PeftModel, state_dict: dict | None, tokenizer, output_dir: Path, base_name_or_path: str,
                 is_main_process: bool, merge: bool) -> None:
    """Write a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``, tokenizer) into
    ``output_dir``; a base that is no plain model (``is_derived_base``: a ``.gguf`` file, de-quantized; an earlier
    run's adapter directory, merged) is written once into ``output_dir/base_model`` and the adapter config points
    there, so any loader (peft's own too) loads the model the adapter was trained on; ``merge`` also writes
    ``output_dir/merged``. ``state_dict``: the gathered full state dict, or None (see docs/recipes.md#lora)."""
    from peft import TaskType  # lazy: see the top

    model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=is_main_process)
    if not is_main_process:
        return
    tokenizer.save_pretrained(output_dir)
    if model.peft_config["default"].task_type == TaskType.SEQ_CLS:
        # the labels (num_labels, id2label) live in the trained config, not the base model's
        model.get_base_model().config.save_pretrained(output_dir)
    if is_derived_base(base_name_or_path):
        base = load_base_model(base_name_or_path)  # built again as the run's task built it
        save_pretrained_here(base, output_dir / BASE_DIR)
        tokenizer.save_pretrained(output_dir / BASE_DIR)
        path = output_dir / ADAPTER_CONFIG
        adapter = json.loads(path.read_text())
        adapter["base_model_name_or_path"] = str((output_dir / BASE_DIR).resolve())
        path.write_text(json.dumps(adapter, indent=2) + "\n")
    if merge:
        merged = model.merge_and_unload()  # the adapter was saved above; this ends the PeftModel
        save_pretrained_here(merged, output_dir / "merged")
        tokenizer.save_pretrained(output_dir / "merged")


def load_adapter_model(path, dtype=None) -> PeftModel:
    """The base model of ``path``'s ``adapter_config.json`` (``load_base_model``) with the adapter applied
    (``PeftModel.from_pretrained``), in ``dtype`` (a ``torch.dtype``; None: transformers' default). Raises
    ``OSError``/``ValueError`` (transformers', peft's) when either cannot be loaded."""
    from peft import PeftModel, TaskType  # lazy: see the top
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = Path(path)
    adapter = json.loads((path / ADAPTER_CONFIG).read_text())
    base_path = adapter["base_model_name_or_path"]
    if adapter.get("task_type") == TaskType.SEQ_CLS:
        config = AutoConfig.from_pretrained(path) if (path / "config.json").is_file() else None
        base = AutoModelForSequenceClassification.from_pretrained(base_path, config=config,
                                                                  **({"dtype": dtype} if dtype else {}))
    else:
        base = load_base_model(base_path, dtype)
    return PeftModel.from_pretrained(base, str(path))


def is_derived_base(name_or_path: str) -> bool:
    """Whether the model at ``name_or_path`` is built rather than loaded by ``from_pretrained``: a ``.gguf`` file
    (de-quantized) or an adapter directory (merged into its base: ``load_merged_adapter``)."""
    return str(name_or_path).endswith(".gguf") or (Path(name_or_path) / ADAPTER_CONFIG).is_file()


def load_base_model(name_or_path: str, dtype=None):
    """The causal LM an adapter's ``base_model_name_or_path`` names, in ``dtype`` (None: as transformers loads it):
    a hub id or model directory, a ``.gguf`` file (de-quantized, ``gguf.load_gguf_causal_lm``), or an adapter
    directory (``load_merged_adapter``: an adapter trained on an earlier run's adapter, such as DPO's on an SFT
    run's, records that run's adapter directory). Raises ``OSError``/``ValueError`` when it cannot be loaded."""
    from transformers import AutoModelForCausalLM  # lazy: see the top

    if (Path(name_or_path) / ADAPTER_CONFIG).is_file():
        return load_merged_adapter(name_or_path, dtype)
    if str(name_or_path).endswith(".gguf"):
        from finetune.models.gguf import load_gguf_causal_lm  # lazy: see the top

        model, _ = load_gguf_causal_lm(name_or_path)
        return model.to(dtype) if dtype else model
    return AutoModelForCausalLM.from_pretrained(name_or_path, **({"dtype": dtype} if dtype else {}))


def load_merged_adapter(path, dtype=None):
    """The model a causal-LM adapter directory ``path`` stands for: its base with the adapter merged in (peft's
    ``merge_and_unload``; ``load_adapter_model``), every parameter trainable, and named after ``path`` (absolute:
    ``name_or_path``, which peft's ``get_peft_model`` records as a new adapter's ``base_model_name_or_path``), so
    that an adapter trained on it names what it was trained on and ``load_base_model`` rebuilds it the same way.
    Raises ``OSError``/``ValueError`` when the adapter or its base cannot be loaded."""
    model = load_adapter_model(path, dtype).merge_and_unload()
    model.requires_grad_(True)  # peft froze the base for its adapter; merged, it is all one model
    model.name_or_path = str(Path(path).resolve())
    return model


_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing's and torch.compile's


def plain_weights(model):
    """(name, tensor) of each weight of ``model`` as the plain model names and holds it (what an inference engine
    loads by name, TRL 1.16 ``generation/vllm_generation.py`` ``_iter_named_params``): a peft model's names without
    ``base_model.model.``, ``.base_layer`` and ``modules_to_save.<adapter>.``, its LoRA layers merged *out of place*
    (peft 0.21 ``tuners/lora/layer.py`` ``Linear.merge``'s safe path, lines 974-985: the base weight plus
    ``get_delta_weight``, or the variant's ``merge_safe`` for DoRA; a ``lora_bias`` added to the bias), the
    adapters' own tensors and a saved module's original left out; the model untouched, so the frozen base never
    drifts by a merge and unmerge. Tied weights come once (``named_parameters``); a sharded ``DTensor`` whole
    (``full_tensor``, collective)."""
    layers = {}
    if is_peft_model(model):
        from peft.tuners.lora import LoraLayer  # lazy: see the top

        layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, param in model.named_parameters():
        parts = name.split(".")
        if layers and (any(p.startswith("lora_") for p in parts) or "original_module" in parts):
            continue
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param.data
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer") and owner.removesuffix(".base_layer") in layers:
            tensor = _merged(layers[owner.removesuffix(".base_layer")], leaf, tensor)
        yield _plain_name(name, layers), tensor


def _merged(layer, leaf: str, tensor):
    """A LoRA layer's base ``weight`` or ``bias`` with its active adapters merged into a copy (none where peft has
    merged them already)."""
    if layer.merged or layer.disable_adapters:
        return tensor
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if leaf == "weight":
            if adapter in getattr(layer, "lora_variant", {}):
                tensor = layer.lora_variant[adapter].merge_safe(layer, adapter, tensor.clone())
            else:
                tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
        elif leaf == "bias" and layer.lora_bias[adapter]:
            tensor = tensor + (layer.lora_B[adapter].bias * layer.scaling[adapter]).to(tensor.dtype)
    return tensor


def _plain_name(name: str, layers: dict) -> str:
    """A parameter's name in the plain model (``plain_weights``)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    if not layers:
        return name
    parts = name.removeprefix("base_model.model.").replace(".base_layer", "").split(".")
    while "modules_to_save" in parts:  # <module>.modules_to_save.<adapter>.<leaf> -> <module>.<leaf>
        i = parts.index("modules_to_save")
        del parts[i:i + 2]
    return ".".join(parts)
