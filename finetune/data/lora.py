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
    """The ``peft.LoraConfig`` of the LoRA flags for peft's ``TaskType`` named ``task_type`` (the task's
    ``peft_task_type``: ``SEQ_CLS``, ``CAUSAL_LM``)."""
    from peft import LoraConfig, TaskType  # lazy: see the top

    targets = config.lora_target_modules
    if targets and targets != "all-linear":
        targets = [name.strip() for name in targets.split(",") if name.strip()]
    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=targets or None,
                      task_type=TaskType[task_type])


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
    ``output_dir``; a ``.gguf`` base is de-quantized once into ``output_dir/base_model``, ``merge`` also writes
    ``output_dir/merged``. ``state_dict``: the gathered full state dict, or None (see docs/design-notes.md#lora)."""
    from peft import TaskType  # lazy: see the top

    model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=is_main_process)
    if not is_main_process:
        return
    tokenizer.save_pretrained(output_dir)
    if model.peft_config["default"].task_type == TaskType.SEQ_CLS:
        # the labels (num_labels, id2label) live in the trained config, not the base model's
        model.get_base_model().config.save_pretrained(output_dir)
    if base_name_or_path.endswith(".gguf"):
        from finetune.data.gguf import load_gguf_causal_lm  # lazy: see the top

        base, _ = load_gguf_causal_lm(base_name_or_path)
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


def load_adapter_model(path) -> PeftModel:
    """The base model of ``path``'s ``adapter_config.json`` with the adapter applied (``PeftModel.from_pretrained``).
    Raises ``OSError``/``ValueError`` (transformers', peft's) when either cannot be loaded."""
    from peft import PeftModel, TaskType  # lazy: see the top
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    path = Path(path)
    adapter = json.loads((path / ADAPTER_CONFIG).read_text())
    base_path = adapter["base_model_name_or_path"]
    if adapter.get("task_type") == TaskType.SEQ_CLS:
        config = AutoConfig.from_pretrained(path) if (path / "config.json").is_file() else None
        base = AutoModelForSequenceClassification.from_pretrained(base_path, config=config)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_path)
    return PeftModel.from_pretrained(base, str(path))
