"""LoRA through ``peft``: wrap the model, count what trains, and save a PEFT adapter directory.

The flags are TRL's (``--use_peft``, ``--lora_r``, ``--lora_alpha``, ``--lora_dropout``,
``--lora_target_modules``). The base model is frozen, so it keeps no gradients and no optimizer state;
for classification peft keeps the new head (``classifier``/``score``) trainable (``modules_to_save``).
"""

from __future__ import annotations

import json
from pathlib import Path

from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from finetune.gguf_model import load_gguf_causal_lm

ADAPTER_CONFIG = "adapter_config.json"
BASE_DIR = "base_model"  # a GGUF base, de-quantized once, where the adapter config can point to it


def lora_config(config, task_name: str) -> LoraConfig:
    """The ``peft.LoraConfig`` for ``config``'s LoRA flags: ``SEQ_CLS`` for classification (peft then keeps
    the classifier head trainable and saves it with the adapter), ``CAUSAL_LM`` otherwise."""
    targets = config.lora_target_modules
    if targets and targets != "all-linear":
        targets = [name.strip() for name in targets.split(",") if name.strip()]
    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=targets or None,
                      task_type=TaskType.SEQ_CLS if task_name == "sequence-classification" else TaskType.CAUSAL_LM)


def apply_lora(model, config, task_name: str) -> PeftModel:
    """``peft.get_peft_model`` with ``lora_config``. Raises ``ValueError`` (peft's) for target modules the
    model does not have; the caller turns it into a clear error."""
    return get_peft_model(model, lora_config(config, task_name))


def save_adapter(model: PeftModel, state_dict: dict | None, tokenizer, output_dir: Path, base_name_or_path: str,
                 is_main_process: bool, merge: bool) -> None:
    """Write a PEFT adapter directory into ``output_dir``: ``adapter_config.json``,
    ``adapter_model.safetensors`` (the LoRA weights and any trainable head) and the tokenizer, loadable with
    ``load_adapter_model(output_dir)`` (or peft's ``AutoPeftModelForCausalLM``; a classification adapter's
    ``config.json`` holds the trained labels, which the base model's config lacks). A ``.gguf`` base cannot be reloaded by name, so
    it is de-quantized once into ``output_dir/base_model`` and the adapter config points there. ``merge``:
    also write the model with the adapter merged in to ``output_dir/merged`` (a plain model directory).
    ``state_dict``: the full (gathered) state dict, or None for the model's own."""
    model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=is_main_process)
    if not is_main_process:
        return
    tokenizer.save_pretrained(output_dir)
    if model.peft_config["default"].task_type == TaskType.SEQ_CLS:
        # the labels (num_labels, id2label) live in the trained config, not the base model's
        model.get_base_model().config.save_pretrained(output_dir)
    if base_name_or_path.endswith(".gguf"):
        base, _ = load_gguf_causal_lm(base_name_or_path)
        base.save_pretrained(output_dir / BASE_DIR)
        tokenizer.save_pretrained(output_dir / BASE_DIR)
        path = output_dir / ADAPTER_CONFIG
        adapter = json.loads(path.read_text())
        adapter["base_model_name_or_path"] = str((output_dir / BASE_DIR).resolve())
        path.write_text(json.dumps(adapter, indent=2) + "\n")
    if merge:
        merged = model.merge_and_unload()  # the adapter was saved above; this ends the PeftModel
        merged.save_pretrained(output_dir / "merged")
        tokenizer.save_pretrained(output_dir / "merged")


def load_adapter_model(path) -> PeftModel:
    """The base model named in ``path``'s ``adapter_config.json`` with the adapter of ``path`` applied
    (``peft.PeftModel.from_pretrained``). A classification adapter's base is built with the labels of its
    ``config.json``. Raises ``OSError``/``ValueError`` (transformers', peft's) when either cannot be loaded."""
    path = Path(path)
    adapter = json.loads((path / ADAPTER_CONFIG).read_text())
    base_path = adapter["base_model_name_or_path"]
    if adapter.get("task_type") == TaskType.SEQ_CLS:
        config = AutoConfig.from_pretrained(path) if (path / "config.json").is_file() else None
        base = AutoModelForSequenceClassification.from_pretrained(base_path, config=config)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_path)
    return PeftModel.from_pretrained(base, str(path))
