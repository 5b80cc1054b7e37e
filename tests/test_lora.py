"""LoRA through peft in both engines: only the adapter and the classifier head train (the base weights
stay bitwise), the output is a PEFT adapter directory, the Trainer backend takes the same steps, and a
resume continues the same adapter (and refuses other LoRA settings)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import run_in_process, train_steps
from safetensors.torch import load_file

from finetune.errors import FinetuneError

LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, max_train_samples=32, max_eval_samples=8,
            per_device_train_batch_size=4, gradient_accumulation_steps=2, max_length=32, disable_dropout=True,
            learning_rate=5e-3, warmup_steps=0, seed=3, eval_strategy="no")


def test_only_the_adapter_and_head_train_and_the_output_is_an_adapter(tmp_path, tiny_bert):
    metrics, out = run_in_process(tmp_path, "lora", model_name_or_path=tiny_bert, max_steps=3, save_steps=2, **LORA)
    assert 0 < metrics["trainable_parameters"] < metrics["num_parameters"] / 10
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny_bert

    base = load_file(f"{tiny_bert}/model.safetensors")
    state = load_file(str(out / "checkpoints" / "step_00000002" / "model.safetensors"))  # the full PeftModel state
    frozen = {k: v for k, v in state.items() if "lora_" not in k and "classifier" not in k}
    assert frozen
    for key, tensor in frozen.items():
        name = key.removeprefix("base_model.model.").replace(".base_layer", "").removeprefix("bert.")
        assert torch.equal(tensor, base[name]), key  # bitwise: no gradient, no optimizer state, no update
    lora_b = [v for k, v in state.items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)  # initialised to zero, now trained

    from finetune.models.lora import load_adapter_model

    model = load_adapter_model(out)
    assert model.config.id2label[0] == "business"  # the trained labels, not the base model's
    from peft import get_peft_model_state_dict

    adapter, loaded = load_file(str(out / "adapter_model.safetensors")), get_peft_model_state_dict(model)
    assert adapter.keys() == loaded.keys() and any("classifier" in k for k in adapter)  # the head is saved
    for key, tensor in adapter.items():
        assert torch.equal(loaded[key], tensor), key


def test_trainer_backend_takes_the_same_lora_steps(tmp_path, tiny_bert):
    kw = dict(model_name_or_path=tiny_bert, max_steps=4, **LORA)
    _, ours = run_in_process(tmp_path, "ours", **kw)
    _, theirs = run_in_process(tmp_path, "theirs", backend="trainer", **kw)
    assert [r["loss"] for r in train_steps(theirs)] == pytest.approx([r["loss"] for r in train_steps(ours)], rel=1e-4)


def test_resume_with_lora_gives_the_uninterrupted_adapter(tmp_path, tiny_bert):
    kw = dict(model_name_or_path=tiny_bert, max_steps=4, save_steps=2, **LORA)
    _, full = run_in_process(tmp_path, "full", **kw)
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    for name in ("adapter_model.safetensors", "adapter_config.json", "metrics.json"):
        (resumed / name).unlink()
    run_in_process(tmp_path, "resumed", resume_from_checkpoint="latest", **kw)
    a, b = load_file(str(full / "adapter_model.safetensors")), load_file(str(resumed / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-8)
    assert [r["loss"] for r in train_steps(resumed)] == [r["loss"] for r in train_steps(full)]
    with pytest.raises(FinetuneError, match="lora_r: checkpoint 4, now 8"):
        run_in_process(tmp_path, "resumed", resume_from_checkpoint="latest", **{**kw, "lora_r": 8})
