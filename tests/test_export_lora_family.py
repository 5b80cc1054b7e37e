"""``finetune export`` of the LoRA family (issue 53): DoRA and rsLoRA runs merge within the LoRA export's float32
tolerance of the run's adapter model, with 100% top-1 and identical greedy continuations; a QLoRA run (NF4) merges
into its base de-quantized, and reports its departure from the run on its 4-bit base and the tolerance it is judged
at, from the measured quantization floor. Broken merges, installed here by monkeypatching (a DoRA merge without its
magnitude vector, an rsLoRA merge scaled alpha / r, a QLoRA adapter merged into the original full-precision
weights, into the 4-bit base (peft re-quantizes), or into a base de-quantized without its block scales), exit 1
with the verification's ``error:`` line, the folder marked incomplete. Tiny chat Llamas (2 layers, 32 wide)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import run_in_process
from tiny_models import build_tiny_chat_llama

from finetune.commands.export import main as export_main
from finetune.export.report import INCOMPLETE, REPORT

pytest.importorskip("bitsandbytes")

WORDS = ("the market rose as shares in the bank fell after the match ended with a late goal from the striker while "
         "ministers said the election would be held in spring and the film won awards").split()
LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)
RUNS = {"dora": dict(use_dora=True), "rslora": dict(use_rslora=True), "qlora": dict(load_in_4bit=True),
        "qlora-dora-rslora": dict(load_in_4bit=True, use_dora=True, use_rslora=True),
        "qlora-bf16": dict(load_in_4bit=True, bnb_4bit_compute_dtype="bfloat16"), "qlora-int8": dict(load_in_8bit=True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One SFT run per entry of ``RUNS`` on the same tiny chat Llama and rows (LoRA r 4, alpha 8 on q_proj and v_proj,
    lr 3e-2, 4 steps of 4 rows): DoRA, rsLoRA (scaling alpha / sqrt(r) = 4, twice alpha / r), QLoRA NF4 computing in
    float32 (the run's precision) or in bfloat16, DoRA with rsLoRA on NF4, and LoRA on an int8 base (LLM.int8())."""
    rng, root = random.Random(0), tmp_path_factory.mktemp("lora-family")
    files = []
    for name, n in (("train", 16), ("valid", 4)):
        rows = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 8, 21, 40]))),
                 "completion": " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 6])))} for _ in range(n)]
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(str(path))
    llama = str(build_tiny_chat_llama(root / "llama"))
    flags = dict(recipe="bbc-headlines", model_name_or_path=llama, train_file=files[0], validation_file=files[1],
                 max_length=96, learning_rate=3e-2, warmup_steps=0, disable_dropout=True, max_steps=4,
                 save_steps=100, per_device_train_batch_size=4, gradient_accumulation_steps=1, eval_on_start=False,
                 eval_strategy="no", mixed_precision="no", seed=5, **LORA)
    return {name: run_in_process(root, name, **flags, **extra)[1] for name, extra in RUNS.items()}


def _export(capsys, run: Path, folder: Path, *flags) -> tuple[int, str, str, dict]:
    """``finetune export --to merged`` in process: (exit code, stdout, the one ``error:`` line or "", the report)."""
    code = export_main(["--model", str(run), "--to", "merged", "--output_dir", str(folder), *flags])
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == (code != 0), captured.err[-2000:]
    return code, captured.out, "".join(errors), json.loads((folder / REPORT).read_text())


def _figures(report: dict) -> str:
    merged = report["verification"][0]
    return (f"largest {merged['max_abs_logit_diff']:.3g} ({merged['relative_logit_diff']:.3g} relative; bound "
            f"{merged['tolerance']['max_logit_diff']:.3g}), top-1 {merged['top1_agreement']:.4%}, KL "
            f"{merged['mean_kl']:.3g} (bound {merged['tolerance']['max_kl']}), greedy {merged['greedy_identical']}/"
            f"{merged['greedy_total']}")


# ------------------------------------------------------------------------------------------ the broken merges
def _dora_magnitude_dropped(model):
    """A DoRA merge without its magnitude vector: each layer's DoRA variant removed, so peft 0.21 merges it as plain
    LoRA, W + s BA (``tuners/lora/layer.py`` ``Linear.merge``: ``if active_adapter not in self.lora_variant``),
    instead of m / ||W + s BA|| (W + s BA) (``variants.py`` ``DoraLinearVariant.merge_safe``)."""
    for module in model.modules():
        if isinstance(getattr(module, "lora_variant", None), dict):
            module.lora_variant.clear()
    return model.merge_and_unload()


def _rslora_plain_scaling(model):
    """An rsLoRA merge scaled as plain LoRA, alpha / r instead of alpha / sqrt(r) (peft 0.21 ``tuners/lora/layer.py``
    ``update_layer``: ``scaling = lora_alpha / math.sqrt(r)`` under ``use_rslora``)."""
    for module in model.modules():
        if isinstance(getattr(module, "scaling", None), dict):
            module.scaling = {name: module.lora_alpha[name] / module.r[name] for name in module.scaling}
    return model.merge_and_unload()


def _adapter_dropped(model):
    return model.unload()


def _scaling_doubled(model):
    for module in model.modules():
        if isinstance(getattr(module, "scaling", None), dict):
            module.scaling = {name: 2 * value for name, value in module.scaling.items()}
    return model.merge_and_unload()


def _unscaled(dequantized):
    """A de-quantization that drops each 4-bit block's scale (absmax 1): the NF4 code values, not the weights."""
    from finetune.models.quantization import quantized_modules

    def broken(model):
        for _, module in quantized_modules(model):
            module.weight.quant_state.absmax = torch.ones_like(module.weight.quant_state.absmax)
        return dequantized(model)

    return broken


def _assert_refused(code: int, error: str, report: dict, folder: Path) -> dict:
    """Exit 1, the verification's one ``error:`` line (merged vs run), the folder marked incomplete."""
    assert code == 1, error
    assert error.startswith("error: export verification failed, merged vs run: largest logit difference"), error
    assert (folder / INCOMPLETE).is_file() and not report["passed"]
    assert "NOT verified" in (folder / "README.md").read_text()
    return report["verification"][0]


# ------------------------------------------------------------------------------------------ DoRA and rsLoRA
@pytest.mark.parametrize("name, broken", [("dora", _dora_magnitude_dropped), ("rslora", _rslora_plain_scaling)])
def test_dora_and_rslora_export_within_the_lora_tolerance_and_their_broken_merges_exit_1(
        tmp_path, capsys, monkeypatch, runs, name, broken):
    """The run's adapter is DoRA (a magnitude vector per layer) or rsLoRA (scaling 8 / sqrt(4) = 4); merged within
    float32 LoRA's tolerance (1e-5 relative), 100% top-1, every greedy continuation identical. The mutant merge
    (magnitude dropped; scaling alpha / r = 2) exits 1, beyond the bound by orders of magnitude."""
    from safetensors.torch import load_file

    config = json.loads((runs[name] / "adapter_config.json").read_text())
    assert (config["use_dora"], config["use_rslora"]) == (name == "dora", name == "rslora")
    weights = load_file(str(runs[name] / "adapter_model.safetensors"))
    assert sum("lora_magnitude_vector" in k for k in weights) == (4 if name == "dora" else 0)

    code, out, error, report = _export(capsys, runs[name], tmp_path / "correct")
    merged = report["verification"][0]
    with capsys.disabled():  # the next export reads the captured output
        print("\n" + name, "correct:", _figures(report))
    assert code == 0, error
    assert merged["tolerance"]["max_logit_diff"] == 1e-5 and merged["relative_logit_diff"] <= 1e-5
    assert merged["top1_agreement"] == 1.0 and merged["greedy_identical"] == merged["greedy_total"] == 4
    assert merged["positions"] > 200 and report["quantized_base"] is None

    monkeypatch.setattr("finetune.export.merge.unmerged", broken)
    code, out, error, report = _export(capsys, runs[name], tmp_path / "broken")
    print("\n" + name, broken.__name__, _figures(report))
    mutant = _assert_refused(code, error, report, tmp_path / "broken")
    assert mutant["relative_logit_diff"] > 100 * 1e-5


# ------------------------------------------------------------------------------------------ QLoRA
def test_qlora_merges_into_its_dequantized_base_and_reports_its_departure(tmp_path, capsys, runs):
    """NF4 computing in float32: the merged weights are the run's de-quantized base weights plus s BA (equal to fp32
    rounding), not the original ones; the quantization floor (the run on its de-quantized base vs the run) is 0, so
    the merge is judged as a float32 LoRA merge (1e-5 relative, 100% top-1, greedy identical) and passes; stdout,
    export_report.json and the card say what was exported, the departure and the tolerance's source."""
    import bitsandbytes.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    run = runs["qlora"]
    code, out, error, report = _export(capsys, run, tmp_path / "x")
    print("qlora correct:", _figures(report))
    assert code == 0, error
    merged, quantized = report["verification"][0], report["quantized_base"]
    floor = report["merge_calibration"]["floor"]
    assert floor["name"] == "quantization floor: run on its base de-quantized vs run"
    assert floor["max_abs_logit_diff"] == 0.0 and floor["mean_kl"] == 0.0  # the 4-bit layer computes on these weights
    assert merged["tolerance"] == {"max_logit_diff": 1e-5, "min_top1": 1.0, "max_kl": None, "greedy_identical": True}
    assert merged["relative_logit_diff"] <= 1e-5 and merged["top1_agreement"] == 1.0 and merged["greedy_identical"] == 4
    assert quantized["quantization"].startswith("NF4 (4-bit, bitsandbytes; compute float32")
    assert quantized["departure"]["max_abs_logit_diff"] == merged["max_abs_logit_diff"]
    line = next(line for line in out.splitlines() if line.startswith("QLoRA export: NF4"))
    assert "Departure from the run as trained (its quantized base" in line and "Tolerance: relative logit" in line
    assert "QLoRA adapter merged" in (tmp_path / "x" / "README.md").read_text()

    # the weights: W de-quantized from the run's own NF4 bytes, plus scaling x B A (alpha / r = 2)
    config = json.loads((tmp_path / "x" / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    exported = load_file(str(tmp_path / "x" / "merged" / "model.safetensors"))
    adapter = load_file(str(run / "adapter_model.safetensors"))
    base = json.loads((run / "run_config.json").read_text())["model_name_or_path"]
    nf4 = AutoModelForCausalLM.from_pretrained(base, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    layer = nf4.model.layers[1].self_attn.q_proj
    w = F.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    a, b = (adapter[f"base_model.model.model.layers.1.self_attn.q_proj.lora_{x}.weight"] for x in "AB")
    assert torch.allclose(exported["model.layers.1.self_attn.q_proj.weight"], w + 2 * b @ a, rtol=0, atol=1e-6)
    original = load_file(str(Path(base) / "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"]
    assert (original + 2 * b @ a - exported["model.layers.1.self_attn.q_proj.weight"]).abs().max() > 1e-3


def test_qlora_with_dora_and_rslora_exports(tmp_path, capsys, runs):
    """DoRA with rsLoRA on NF4: merged into the de-quantized base within 1e-5 relative, 100% top-1."""
    code, out, error, report = _export(capsys, runs["qlora-dora-rslora"], tmp_path / "x")
    print("qlora-dora-rslora correct:", _figures(report))
    merged = report["verification"][0]
    assert code == 0, error
    assert merged["relative_logit_diff"] <= 1e-5 and merged["top1_agreement"] == 1.0


@pytest.mark.parametrize("run, dtype", [("qlora-bf16", "float32"), ("qlora-int8", "float32"), ("qlora", "bfloat16")])
def test_a_qlora_export_passes_at_its_measured_floor(tmp_path, capsys, runs, run, dtype):
    """NF4 computing in bfloat16, LLM.int8() (which quantizes the activations too), and NF4 computing in float32
    exported in bfloat16: the merged model departs from the run by the run's own compute or by the export's
    rounding, which the quantization floor measures (the run on its de-quantized base, rounded to the dtype); the
    tolerance is 1e-5 + 2 x the floor's relative logit difference and 1.5 x its mean KL (top-1 and greedy reported),
    and the merge passes, departing by about the floor."""
    code, out, error, report = _export(capsys, runs[run], tmp_path / "x", "--dtype", dtype)
    print("\n" + run, dtype, "correct:", _figures(report))
    assert code == 0, error
    merged, floor = report["verification"][0], report["merge_calibration"]["floor"]
    tolerance = merged["tolerance"]
    assert floor["relative_logit_diff"] > 1e-4 and floor["mean_kl"] > 0  # the run's compute, not fp32's rounding
    assert tolerance["max_logit_diff"] == pytest.approx(1e-5 + 2 * floor["relative_logit_diff"])
    assert tolerance["max_kl"] == pytest.approx(1.5 * floor["mean_kl"])
    assert tolerance["min_top1"] is None and not tolerance["greedy_identical"]
    assert 0.5 * floor["mean_kl"] < merged["mean_kl"] < 1.2 * floor["mean_kl"]
    assert "mean KL <=" in report["quantized_base"]["tolerance_from"]


def _requantized_merge(unmerged):
    """peft's merge on the 4-bit base (``dequantized`` skipped below): it re-quantizes each merged weight; the result
    then de-quantized to be saved, as a 4-bit merge is turned into a plain model."""
    return lambda model: unmerged(model).dequantize(dtype=torch.float32)


QLORA_MUTANTS = {  # name: (the function of finetune.export replaced, what replaces it, given the real one), ...
    "original-base": [("source.run_quantization", lambda real: lambda source: None)],
    "requantized": [("source.dequantized", lambda real: lambda model: model), ("merge.unmerged", _requantized_merge)],
    "unscaled": [("source.dequantized", _unscaled)],
    "adapter-dropped": [("merge.unmerged", lambda real: _adapter_dropped)],
    "scaling-doubled": [("merge.unmerged", lambda real: _scaling_doubled)],
}


@pytest.mark.parametrize("run, mutant", [("qlora", name) for name in QLORA_MUTANTS]
                         + [("qlora-bf16", "original-base"), ("qlora-bf16", "requantized")])
def test_a_broken_qlora_merge_exits_1(tmp_path, capsys, monkeypatch, runs, run, mutant):
    """The adapter merged into the original full-precision base (the quantization skipped), into the 4-bit base
    (peft 0.21 ``tuners/lora/bnb.py`` ``Linear4bit.merge`` de-quantizes, adds and re-quantizes, lines 384-402), or
    into a base de-quantized without its block scales; the adapter dropped; its scaling doubled: each exits 1 with
    the verification's line, beyond the tolerance the quantization floor gives (float32 compute: a floor of 0, the
    float32 bound; bfloat16 compute: a measured floor; the wrong bases only, on the first 2 validation rows)."""
    from finetune.export import merge, source

    for target, make in QLORA_MUTANTS[mutant]:
        module, attribute = target.split(".")
        real = getattr({"source": source, "merge": merge}[module], attribute)
        monkeypatch.setattr(f"finetune.export.{target}", make(real))
    samples = ["--verify_samples", "2"] if run == "qlora-bf16" else []
    code, out, error, report = _export(capsys, runs[run], tmp_path / "x", *samples)
    print(run, mutant, _figures(report))
    merged = _assert_refused(code, error, report, tmp_path / "x")
    assert merged["relative_logit_diff"] > 10 * merged["tolerance"]["max_logit_diff"]
    assert "Departure from the run as trained" in out  # the departure is said before the error line


def test_a_qlora_export_without_bitsandbytes_is_one_error_line(tmp_path, capsys, monkeypatch, runs):
    """Without bitsandbytes (as ``importlib.util.find_spec`` says it), a QLoRA run's export ends with one ``error:``
    line naming the extra, exit 2, before any work: no folder written."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    folder = tmp_path / "x"
    code = export_main(["--model", str(runs["qlora"]), "--to", "merged", "--output_dir", str(folder)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "--load_in_4bit needs the bitsandbytes package" in lines[0], lines
    assert ".[qlora]" in lines[0] and not folder.exists()
