"""What a preference (DPO) run leaves behind loads as it trained (issue 50): from an SFT LoRA run with ``--use_peft``,
``finetune predict``, ``finetune eval`` and ``finetune export`` load the model the run trained (the SFT model merged,
under the DPO adapter), not the SFT run's untuned base under the DPO adapter; and ``finetune export`` verifies a
preference run on its own validation pairs (both sides, as training encodes them)."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from helpers import run_in_process
from tiny_models import build_tiny_chat_llama

from finetune.commands.export import main as export_main
from finetune.export.report import INCOMPLETE, REPORT

WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()
IDS = [1, 57, 203, 9, 311, 44, 120, 2, 88, 17, 240, 5, 399, 64]  # token ids the logits are compared on


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """Preference pairs (train 8, validation 4) and SFT rows of their prompts and chosen sides."""
    rng, root = random.Random(1), tmp_path_factory.mktemp("dpo-outputs-data")

    def words(choices):
        return " ".join(rng.choice(WORDS) for _ in range(rng.choice(choices)))

    files = {}
    for name, n in (("train", 8), ("valid", 4)):
        pairs = [{"prompt": words([3, 8, 15]), "chosen": words([1, 2, 6]), "rejected": words([1, 3, 5])}
                 for _ in range(n)]
        files[name] = root / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(p) + "\n" for p in pairs))
        files[f"sft-{name}"] = root / f"sft-{name}.jsonl"
        files[f"sft-{name}"].write_text("".join(json.dumps({"prompt": p["prompt"], "completion": p["chosen"]}) + "\n"
                                                for p in pairs))
    return {k: str(v) for k, v in files.items()}


def dpo_flags(model: str, data: dict, **extra) -> dict:
    return {**dict(recipe="bbc-headlines-dpo", model_name_or_path=model, train_file=data["train"],
                   validation_file=data["valid"], max_length=96, learning_rate=3e-2, warmup_steps=0, max_steps=2,
                   per_device_train_batch_size=2, gradient_accumulation_steps=2, eval_strategy="no",
                   eval_on_start=False, mixed_precision="no", seed=5, disable_dropout=True), **extra}


@torch.no_grad()
def logits(model) -> torch.Tensor:
    """``model``'s fp32 logits on ``IDS`` (eval mode)."""
    model = model.float().eval()
    return model(input_ids=torch.tensor([IDS])).logits[0].float()


@pytest.fixture(scope="module")
def sft_adapter_run(tmp_path_factory, chat_llama, data) -> Path:
    """A LoRA SFT run on the tiny chat Llama (4 steps at lr 3e-2: an adapter that moves the logits)."""
    _, out = run_in_process(tmp_path_factory.mktemp("sft"), "sft", recipe="bbc-headlines", model_name_or_path=chat_llama,
                            train_file=data["sft-train"], validation_file=data["sft-valid"], use_peft=True,
                            lora_r=4, lora_alpha=8, lora_dropout=0.0, max_length=96, learning_rate=3e-2,
                            warmup_steps=0, max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                            eval_strategy="no", eval_on_start=False, mixed_precision="no", disable_dropout=True)
    assert (out / "adapter_config.json").is_file()
    return out


@pytest.fixture(scope="module")
def dpo_from_sft_adapter(tmp_path_factory, sft_adapter_run, data) -> tuple[Path, torch.Tensor]:
    """(the run directory, the logits of the model as it was in memory at the end of training) of a DPO run with
    ``--use_peft`` from ``sft_adapter_run``'s directory. The model is copied where the run saves its adapter."""
    import finetune.engine.plain as plain

    trained = {}
    original = plain.save_adapter

    def keep_a_copy(model, *args, **kwargs):
        trained["logits"] = logits(copy.deepcopy(model))
        return original(model, *args, **kwargs)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(plain, "save_adapter", keep_a_copy)
    try:
        _, out = run_in_process(tmp_path_factory.mktemp("dpo"), "dpo", **dpo_flags(
            str(sft_adapter_run), data, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, save_strategy="steps", save_steps=1))
    finally:
        monkeypatch.undo()
    return out, trained["logits"]


def independent_rebuild(sft_run: Path, dpo_run: Path):
    """SFT base + SFT adapter, merged; then a LoRA of the DPO run's config on it, its weights from the DPO run's
    ``adapter_model.safetensors`` (not through any base the adapter config records)."""
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sft_base = json.loads((sft_run / "adapter_config.json").read_text())["base_model_name_or_path"]
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft_base, dtype=torch.float32),
                                       str(sft_run)).merge_and_unload()
    config = LoraConfig.from_pretrained(str(dpo_run))
    config.inference_mode = True
    model = get_peft_model(merged, config)
    loaded = set_peft_model_state_dict(model, load_file(str(dpo_run / "adapter_model.safetensors")))
    assert not loaded.unexpected_keys
    return model


def test_dpo_from_an_sft_adapter_loads_as_trained_in_predict_eval_and_export(tmp_path, capsys, sft_adapter_run,
                                                                             dpo_from_sft_adapter):
    """DPO with --use_peft from an SFT LoRA run: the adapter's recorded base is the merged SFT model the run wrote
    beside it (``base_model/``), and predict, eval, export (its loader and its merged folder) and peft's own
    ``AutoPeftModelForCausalLM`` each load a model whose logits equal the model as it was in memory at the end of
    training within 1e-5 (fp32), as does an independent rebuild (SFT base + SFT adapter merged, the DPO adapter's
    saved weights on it); DPO moved the logits by far more than that, and so does the untuned base under the DPO
    adapter (what the adapter's recorded base loaded before). A checkpoint's adapter records the SFT adapter's
    directory as its base: export's loader merges it again (equal to the independent rebuild of that step)."""
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.commands.eval import load_for_eval
    from finetune.commands.predict import Predictor
    from finetune.export.source import load_source, resolve_source

    dpo, trained = dpo_from_sft_adapter
    sft_base = json.loads((sft_adapter_run / "adapter_config.json").read_text())["base_model_name_or_path"]
    rebuilt = logits(independent_rebuild(sft_adapter_run, dpo))
    assert (rebuilt - trained).abs().max() <= 1e-5
    sft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft_base), str(sft_adapter_run))
    assert (logits(sft_model) - trained).abs().max() > 1e-2  # DPO moved the model
    untuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft_base), str(dpo))
    assert (logits(untuned) - trained).abs().max() > 1e-2  # the wrong base is visible at this tolerance

    loaded = {"predict": Predictor(str(dpo)).pipe.model, "eval": load_for_eval(str(dpo))[0],
              "export source": load_source(resolve_source(str(dpo))),
              "peft's AutoPeftModelForCausalLM": AutoPeftModelForCausalLM.from_pretrained(str(dpo))}
    differences = {name: float((logits(model) - trained).abs().max()) for name, model in loaded.items()}
    assert all(d <= 1e-5 for d in differences.values()), differences
    recorded = json.loads((dpo / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str((dpo / "base_model").resolve())  # the merged SFT model, saved beside the adapter
    # the step-1 checkpoint's adapter records the SFT adapter's directory: export's loader merges it again
    step_1 = resolve_source(str(dpo), "step_1")
    rebuilt_step_1 = logits(independent_rebuild(sft_adapter_run, step_1.model_dir))
    assert (logits(load_source(step_1)) - rebuilt_step_1).abs().max() <= 1e-5
    code = export_main(["--model", str(dpo), "--to", "merged", "--output_dir", str(tmp_path / "export")])
    assert code == 0, capsys.readouterr().err
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export" / "merged"))
    assert (logits(merged) - trained).abs().max() <= 1e-5
    report = json.loads((tmp_path / "export" / REPORT).read_text())
    assert report["verification"][0]["relative_logit_diff"] <= 1e-5


def test_a_preference_run_exports_verified_on_both_sides_of_its_validation_pairs(tmp_path, capsys, chat_llama, data):
    """``finetune export --to merged`` of a full DPO run exits 0, verified on the run's own validation pairs encoded
    as training encodes them (the preference task's tokenization: both sides of each pair, so the positions are the
    sum of both sides' tokens), merged equal to the run's model (logit difference 0, greedy identical on the 4
    prompts); no EXPORT_INCOMPLETE is left."""
    from datasets import load_dataset

    from finetune.data.preference import pairs_to_features
    from finetune.models.loading import load_tokenizer

    _, run = run_in_process(tmp_path, "dpo-full", **dpo_flags(chat_llama, data))
    folder = tmp_path / "export"
    code = export_main(["--model", str(run), "--to", "merged", "--output_dir", str(folder)])
    assert code == 0, capsys.readouterr().err
    assert not (folder / INCOMPLETE).exists()
    report = json.loads((folder / REPORT).read_text())
    features = pairs_to_features(load_dataset("json", data_files=data["valid"], split="train"),
                                 load_tokenizer(str(run)), 96)
    sides = [len(row[f"{side}_input_ids"]) for row in features for side in ("chosen", "rejected")]
    assert report["verify_samples"] == 8 and report["positions"] == sum(sides)
    (merged_vs_run,) = report["verification"]
    assert merged_vs_run["max_abs_logit_diff"] == 0.0
    assert (merged_vs_run["greedy_identical"], merged_vs_run["greedy_total"]) == (4, 4)


def test_the_export_check_rebuilds_the_run_so_a_wrong_base_fails_it(tmp_path, capsys, monkeypatch, chat_llama,
                                                                    sft_adapter_run):
    """The merge loads the adapter's base through ``export.source.base_path``; made to return another model (the
    tiny Llama with one weight moved by 1.0), the merge is wrong, and the check, which rebuilds the run from its
    run_config.json instead of reloading through that loader, fails it: exit 1, EXPORT_INCOMPLETE left."""
    from transformers import AutoModelForCausalLM

    import finetune.export.source as source

    wrong = AutoModelForCausalLM.from_pretrained(chat_llama)
    with torch.no_grad():
        wrong.model.layers[0].mlp.down_proj.weight[0] += 1.0
    wrong.save_pretrained(tmp_path / "wrong-base")
    monkeypatch.setattr(source, "base_path", lambda src: str(tmp_path / "wrong-base"))
    folder = tmp_path / "export"
    code = export_main(["--model", str(sft_adapter_run), "--to", "merged", "--output_dir", str(folder)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "export verification failed, merged vs run: largest logit difference" in err
    assert (folder / INCOMPLETE).is_file()
    (merged_vs_run,) = json.loads((folder / REPORT).read_text())["verification"]
    assert merged_vs_run["max_abs_logit_diff"] > 1e-2
