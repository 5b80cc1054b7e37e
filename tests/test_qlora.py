"""QLoRA and the LoRA family: a 4-bit (NF4) or 8-bit base under LoRA adapters, DoRA, rsLoRA, peft's
initialisations and bitsandbytes' optimizers. Accumulation exact on a quantized base, a QLoRA run equal to a LoRA run
on the de-quantized base (within float error, far inside the quantization error), SIGTERM and resume bit-identical,
a resume onto a base quantized otherwise refused by name, and one ``error:`` line for every bad value."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import signal

import pytest
import torch
from helpers import launch, run_in_process, stop_during_window, train_steps
from tiny_models import build_tiny_chat_llama

pytest.importorskip("bitsandbytes")

WORDS = ("the market rose as shares in the bank fell after the match ended with a late goal from the striker while "
         "ministers said the election would be held in spring and the film won awards").split()


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory) -> tuple[str, str]:
    """prompt/completion rows of uneven lengths (where a per-micro-batch mean would go wrong)."""
    rng, root = random.Random(0), tmp_path_factory.mktemp("sft-data")

    def rows(n):
        return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 8, 21, 40]))),
                 "completion": " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 6])))} for _ in range(n)]

    paths = []
    for name, n in (("train", 16), ("valid", 4)):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(n)))
        paths.append(str(path))
    return paths[0], paths[1]


def qlora(model, sft_files, **extra) -> dict:
    """A QLoRA SFT run's flags: NF4, fp32 compute, no dropout, 2 optimizer steps of B = 8 per epoch."""
    train, valid = sft_files
    flags = dict(recipe="bbc-headlines", model_name_or_path=model, train_file=train, validation_file=valid,
                 max_length=96, learning_rate=3e-3, warmup_steps=0, disable_dropout=True, num_train_epochs=1,
                 eval_on_start=False, eval_strategy="no", mixed_precision="no", seed=5, use_peft=True,
                 lora_target_modules="all-linear", load_in_4bit=True, per_device_train_batch_size=8,
                 gradient_accumulation_steps=1)
    flags.update(extra)
    return {k: v for k, v in flags.items() if v is not None}


def adapter(output_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(output_dir / "adapter_model.safetensors"))


def relative_difference(a: dict, b: dict) -> float:
    """|a - b| / |a| over every tensor together (Adam turns float noise on near-zero gradients into lr-sized
    element updates, so no single element is the measure)."""
    assert a.keys() == b.keys()
    return float(torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)) / torch.sqrt(sum((a[k] ** 2).sum() for k in a)))


# ------------------------------------------------------------------------------------------ bad values
def _bad(tmp_path, capsys, model, flags, monkeypatch=None, missing=False):
    from finetune.run import main

    if missing:  # bitsandbytes not installed, as find_spec would say it
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    out = tmp_path / "out"
    try:
        code = main(["--recipe", "bbc-news", "--model_name_or_path", model, "--output_dir", str(out), *flags])
    except SystemExit as exit_info:  # argparse's own
        code = exit_info.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error: " in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert not out.exists()  # a refused run writes nothing
    return lines[0]


@pytest.mark.parametrize("flags, fragments", [
    (["--load_in_4bit"], ["--load_in_4bit is a LoRA setting", "--use_peft"]),
    (["--load_in_8bit"], ["--load_in_8bit is a LoRA setting"]),
    (["--use_dora"], ["--use_dora is a LoRA setting"]),
    (["--use_peft", "--load_in_4bit", "--load_in_8bit"], ["--load_in_4bit and --load_in_8bit together"]),
    (["--use_peft", "--bnb_4bit_compute_dtype", "bfloat16"], ["--bnb_4bit_compute_dtype applies to a 4-bit base"]),
    (["--use_peft", "--load_in_8bit", "--bnb_4bit_quant_type", "fp4"], ["--bnb_4bit_quant_type applies to a 4-bit"]),
    (["--use_peft", "--use_bnb_nested_quant"], ["--use_bnb_nested_quant applies to a 4-bit base"]),
    (["--use_peft", "--load_in_4bit", "--bnb_4bit_quant_type", "int3"], ["--bnb_4bit_quant_type", "invalid choice"]),
    (["--use_peft", "--load_in_4bit", "--bnb_4bit_quant_storage", "int4"], ["--bnb_4bit_quant_storage", "invalid"]),
    (["--use_peft", "--init_lora_weights", "bogus"], ["--init_lora_weights 'bogus' is not one of peft's", "pissa"]),
    (["--use_peft", "--init_lora_weights", "pissa_niter_0"], ["--init_lora_weights 'pissa_niter_0'"]),
    (["--use_peft", "--init_lora_weights", "loftq"], ["--init_lora_weights loftq", "loftq_config"]),
    (["--optim", "adamw_4bit"], ["--optim", "invalid choice"]),
    (["--use_peft", "--load_in_4bit", "--torch_compile"], ["--torch_compile with --load_in_4bit"]),
    (["--use_peft", "--load_in_4bit", "--merge_adapter"], ["--merge_adapter with a quantized base"]),
    (["--use_peft", "--load_in_8bit", "--use_dora"], ["--use_dora on an 8-bit base", "--load_in_4bit"]),
])
def test_bad_quantization_and_lora_flags_are_one_error_line(tmp_path, capsys, tiny_bert, flags, fragments):
    line = _bad(tmp_path, capsys, tiny_bert, flags)
    for fragment in fragments:
        assert fragment in line, (fragment, line)


@pytest.mark.parametrize("flags, named", [(["--use_peft", "--load_in_4bit"], "--load_in_4bit"),
                                          (["--optim", "paged_adamw_8bit"], "--optim paged_adamw_8bit")])
def test_missing_bitsandbytes_names_the_extra(tmp_path, capsys, monkeypatch, tiny_bert, flags, named):
    line = _bad(tmp_path, capsys, tiny_bert, flags, monkeypatch, missing=True)
    assert f"{named} needs the bitsandbytes package" in line and ".[qlora]" in line, line


def test_sharding_engines_refuse_a_quantized_base():
    from finetune.config import parse_config
    from finetune.engine import DeepSpeedEngine, FsdpEngine, PlainEngine, check_quantized_base
    from finetune.errors import FinetuneError

    config = parse_config(["--recipe", "bbc-news", "--use_peft", "--load_in_4bit"])
    check_quantized_base(config, PlainEngine)  # one process or DDP: each holds the whole quantized base
    for engine in (FsdpEngine, DeepSpeedEngine):
        with pytest.raises(FinetuneError, match=f"{engine.name} with a quantized base is not supported yet"):
            check_quantized_base(config, engine)


# ------------------------------------------------------------------------------------------ optimizers
@pytest.mark.parametrize("optim, bits, paged", [("adamw_bnb_8bit", 8, False), ("paged_adamw_8bit", 8, True),
                                                ("paged_adamw_32bit", 32, True)])
def test_bitsandbytes_optimizers_by_trainers_names(optim, bits, paged):
    """The accelerate backend builds what Trainer builds for the name (bitsandbytes' AdamW, optim_bits, is_paged),
    with the flags' hyperparameters; an 8-bit one keeps a large tensor's moments in 8 bits."""
    from transformers import Trainer, TrainingArguments

    from finetune.config import parse_config, trainer_arguments
    from finetune.engine import build_optimizer

    config = parse_config(["--recipe", "bbc-news", "--optim", optim, "--learning_rate", "0.01", "--adam_beta2", "0.99"])
    model = torch.nn.Linear(128, 64)  # 8192 weights: above bitsandbytes' min_8bit_size of 4096
    optimizer = build_optimizer(model, config)
    assert type(optimizer).__module__.startswith("bitsandbytes")
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], optimizer.args.optim_bits, optimizer.is_paged) == (0.01, (0.9, 0.99), bits, paged)
    model(torch.randn(4, 128)).sum().backward()
    optimizer.step()
    state = optimizer.state[model.weight]
    assert state["state1"].dtype == (torch.uint8 if bits == 8 else torch.float32)

    arguments = trainer_arguments(config)
    assert arguments["optim"] == optim  # the Trainer backend: TrainingArguments builds the same optimizer
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir="unused", optim=optim))
    assert cls.__module__.startswith("bitsandbytes") and kwargs["optim_bits"] == bits and kwargs["is_paged"] == paged


# ------------------------------------------------------------------------------------------ exactness
SPLITS = ((8, 1), (4, 2), (1, 8))  # B = 8 on one process: B x 1, B/2 x 2, 1 x B


@pytest.fixture(scope="module")
def accumulation_runs(tmp_path_factory, chat_llama, sft_files) -> tuple[dict, str]:
    """The one-process QLoRA runs of ``SPLITS`` on 12 samples (m x n -> output dir; the second window half full),
    trained once for the tests that compare with them, and the banner they printed."""
    import contextlib
    import io

    root, runs, printed = tmp_path_factory.mktemp("qlora-accumulation"), {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        for m, n in SPLITS:
            _, runs[m, n] = run_in_process(root, f"{m}x{n}", **qlora(chat_llama, sft_files, max_train_samples=12,
                                                                     per_device_train_batch_size=m,
                                                                     gradient_accumulation_steps=n))
    return runs, printed.getvalue()


def test_qlora_accumulation_is_exact(accumulation_runs):
    """NF4 base, fp32 compute: B x 1 = B/2 x 2 = 1 x B on the adapter weights (rtol 1e-5) and the losses, a short
    last window included; the banner and the card say the base is NF4."""
    runs, banner = accumulation_runs
    assert "on a frozen NF4 (4-bit, bitsandbytes; compute float32; 14 linear layers) base" in banner
    reference = adapter(runs[8, 1])
    assert any("lora_A" in k for k in reference) and len(reference) == 2 * 14
    for split in ((4, 2), (1, 8)):
        difference = relative_difference(reference, adapter(runs[split]))
        print(f"{split[0]} x {split[1]} against 8 x 1: {difference:.2e}")  # docs/recipes.md#qlora
        assert difference < 1e-5, split
        assert [r["loss"] for r in train_steps(runs[split])] == pytest.approx(
            [r["loss"] for r in train_steps(runs[8, 1])], rel=1e-5)
    card = (runs[8, 1] / "README.md").read_text()
    assert "| base model weights | NF4 4-bit (bitsandbytes), compute float32, frozen |" in card
    assert "| adapters | LoRA r=16, alpha=32; targets all-linear |" in card


def test_a_4bit_base_computes_in_the_precision_that_runs(tmp_path, chat_llama, sft_files, accumulation_runs, capsys):
    """An fp16 request runs fp32 on a CPU (bbc-headlines' default): the 4-bit layers compute in float32, as the run
    does, not in the float16 requested (they did: 2 steps of the bbc-headlines recipe on its SmolLM2 printed
    "compute float16"); the first step's loss is the fp32 run's, to the bit; the banner and the card say float32."""
    runs, _ = accumulation_runs
    _, out = run_in_process(tmp_path, "fp16-requested", **qlora(chat_llama, sft_files, max_train_samples=12,
                                                                 mixed_precision="fp16", max_steps=1))
    assert "on a frozen NF4 (4-bit, bitsandbytes; compute float32; 14 linear layers) base" in capsys.readouterr().out
    assert train_steps(out)[0]["loss"] == train_steps(runs[8, 1])[0]["loss"]
    assert "| base model weights | NF4 4-bit (bitsandbytes), compute float32, frozen |" in (out / "README.md").read_text()


def verify_args(flags: dict) -> list[str]:
    """``finetune verify``'s command line for a QLoRA run's ``flags``: 2 optimizer steps, the data cut to 1.5 B
    samples, the last window half full (with B = 8: 12 samples, as ``accumulation_runs`` trains them)."""
    return [*(f"--{k}={v}" for k, v in flags.items()), "--verify_steps", "2"]


def assert_verified_exact(report: dict, processes: int, batch: int) -> None:
    """verify's verdict on QLoRA: exact, on the NF4 base (the same in every way, unchanged by its run), every split
    and both Trainer rows exact, the positive control and the small controls caught."""
    from finetune.commands import verify

    assert report["verdict"] == "exact" and report["processes"] == processes, report["causes"]
    assert report["effective_batch"] == batch and report["last_window_samples"] == batch // 2
    assert report["quantized_base"].startswith("NF4 (4-bit") and len(report["quantized_base_sha256"]) == 64
    judged = [r for r in report["rows"] if r["role"] in ("split", "engine")]
    assert len(judged) == 4 and all(r["verdict"] == "exact" for r in judged), judged
    assert report["control_margin"] >= verify.CONTROL_FACTOR
    assert [(d["claimed"], d["threshold"]) for d in report["detects"]] == [(0.01, 0.01), (0.015, 0.015)]
    print(f"{processes} process(es): {report['detects_line']}; control {report['control_margin']:.3g} x the "
          f"gradient tolerance {report['tolerance']['gradients']:.2e}; small controls "
          + ", ".join(f"{t['margin']:.3g}" for d in report["detects"] for t in d["tried"]))


def assert_ways_equal_the_runs(root, ways: list[str], runs: dict) -> None:
    """Each of verify's ``ways`` (its output directory under ``root``) trained the adapter and the losses of the
    one-process B x 1 run (rtol 1e-5)."""
    reference = adapter(runs[8, 1])
    for way in ways:
        difference = relative_difference(reference, adapter(root / way))
        print(f"{way} against 8 x 1 on one process: {difference:.2e}")
        assert difference < 1e-5, way
        assert [r["loss"] for r in train_steps(root / way)] == pytest.approx(
            [r["loss"] for r in train_steps(runs[8, 1])], rel=1e-5), way


def test_verify_says_exact_on_qlora(tmp_path, chat_llama, sft_files):
    """``finetune verify --use_peft --load_in_4bit`` on one process (B = 4: 4 x 1, 2 x 2, 1 x 4): exact, its
    controls caught."""
    from finetune.commands import verify

    out = tmp_path / "verify"
    flags = qlora(chat_llama, sft_files, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert verify.main([*verify_args(flags), "--output_dir", str(out)]) == 0
    assert_verified_exact(json.loads((out / "verify.json").read_text()), processes=1, batch=4)


def test_qlora_on_two_processes_verifies_exact_and_equals_one_process(tmp_path, chat_llama, sft_files,
                                                                       accumulation_runs):
    """Two gloo processes (DDP), B/2 = 4 samples per process in a window: verify's ways B/2 x 1, B/4 x 2 and 1 x B/2
    per process (accelerate) and the Trainer's trained the adapter and the losses of the one-process B x 1 run
    (rtol 1e-5), each process on its own NF4 base quantized alike; verify says exact, its controls caught."""
    runs, _ = accumulation_runs
    out = tmp_path / "verify"
    flags = qlora(chat_llama, sft_files, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    result = launch([*verify_args(flags), "--output_dir", str(out)], num_processes=2,
                    module="finetune.commands.verify", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "verify.json").read_text())
    assert_verified_exact(report, processes=2, batch=8)
    assert report["engine"] == "DDP"
    assert_ways_equal_the_runs(out, ["reference-4x1", "split-2x2", "split-1x4", "engine-4x1", "engine-1x4"], runs)


def test_verify_catches_a_wrong_engine_on_qlora(tmp_path, monkeypatch, chat_llama, sft_files):
    """A short last window weighted by its share of N (Accelerate's default: ``tests/faults/mutants.py``
    ``partial-under``) on the NF4 base: not exact, every split named, the Trainer's reference row exact."""
    from faults.mutants import install_mutant

    from finetune.commands import verify

    install_mutant("partial-under", monkeypatch.setattr)
    out = tmp_path / "verify"
    flags = qlora(chat_llama, sft_files, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert verify.main([*verify_args(flags), "--output_dir", str(out)]) == 1
    report = json.loads((out / "verify.json").read_text())
    assert report["verdict"] == "not exact" and set(report["not_exact"]) >= {"2 x 2", "1 x 4"}, report["not_exact"]
    split = next(r for r in report["rows"] if r["way"] == "1 x 4")
    assert "step 2's gradients differ" in split["verdict"]  # the full first window is right
    assert next(r for r in report["rows"] if r["way"] == "4 x 1, Trainer")["verdict"] == "exact"


def test_verify_sees_the_quantized_base_change_during_a_way(tmp_path, chat_llama, sft_files):
    """bitsandbytes repacks a 4-bit layer's weight for its CPU kernel, its scales rounded to bf16, at its first
    eval-mode forward without gradients where ``support_avx512bf16_for_cpu`` is on (bitsandbytes 0.50.2
    ``nn/modules.py`` ``Linear4bit.forward``; ``prepare_for_training`` turns it off). Turned back on (on the layers
    whose width is a multiple of the block size, as the repacking needs), the way's loss after the last update (an
    eval-mode forward) changes the base: verify's hash after the run is not the hash as built. The same way without
    it keeps the base as built, the base every way starts from."""
    from finetune.commands import verify
    from finetune.commands.verify import phases

    flags = qlora(chat_llama, sft_files, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    session = phases.start(*verify.parse([*verify_args(flags), "--output_dir", str(tmp_path / "verify")]))

    def repacking(built):
        for module in built.model.modules():
            if getattr(module, "support_avx512bf16_for_cpu", None) is False and (
                    module.in_features % module.weight.quant_state.blocksize == 0):
                module.support_avx512bf16_for_cpu = True
        return built

    def run(way, vary=None):
        return verify.run_way(way, session.base, session.recipe, session.root, session.steps, True, vary)

    changed, clean = run(verify.Way("control", 1, 4), repacking), run(verify.Way("split", 1, 4))
    assert changed.error is None and clean.error is None, (changed.error, clean.error)
    assert changed.base[0] == clean.base[0] == clean.base[1] and changed.base[1] != changed.base[0]
    row = verify.compare([clean, changed], session.steps, {})["rows"][1]
    assert row["base_changed"] == [changed.base[0][:12], changed.base[1][:12]]


def dequantized_copy(model_dir: str, to) -> str:
    """The NF4 weights of ``model_dir`` de-quantized (bitsandbytes' ``dequantize_4bit``) into a plain fp32 copy of the
    model, saved to ``to``: the base a LoRA run must match a QLoRA run on."""
    import bitsandbytes.functional as F
    from bitsandbytes.nn import Linear4bit
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    quantized = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layers = dict(plain.named_modules())
    for name, module in quantized.named_modules():
        if isinstance(module, Linear4bit):
            with torch.no_grad():
                layers[name].weight.copy_(F.dequantize_4bit(module.weight.data, module.weight.quant_state))
    plain.save_pretrained(to)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(to)
    return str(to)


def test_qlora_equals_lora_on_the_dequantized_base(tmp_path, chat_llama, sft_files):
    """A QLoRA run and a LoRA run on the de-quantized base of the same weights: first-step losses equal to float
    error (the 4-bit layer de-quantizes and multiplies in fp32), far inside the quantization error (the LoRA run on
    the original fp32 base)."""
    dequantized = dequantized_copy(chat_llama, tmp_path / "dequantized")
    _, q = run_in_process(tmp_path, "qlora", **qlora(chat_llama, sft_files))
    _, d = run_in_process(tmp_path, "lora-dequantized", **qlora(dequantized, sft_files, load_in_4bit=False))
    _, o = run_in_process(tmp_path, "lora-original", **qlora(chat_llama, sft_files, load_in_4bit=False))
    first = {name: train_steps(out)[0]["loss"] for name, out in (("q", q), ("d", d), ("o", o))}
    quantization_error = abs(first["o"] - first["d"])
    print("first-step losses", first)  # reported in docs/recipes.md#qlora-lora-on-a-4-bit-or-8-bit-base
    assert quantization_error > 1e-5, first  # NF4 moved the loss
    assert abs(first["q"] - first["d"]) <= 1e-6 * first["d"], first
    assert abs(first["q"] - first["d"]) < quantization_error / 100, first
    assert relative_difference(adapter(d), adapter(q)) < 1e-5


# ------------------------------------------------------------------------------------------ resume
def digest(path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_qlora_sigterm_and_resume_is_bit_identical_and_another_base_is_refused(tmp_path, chat_llama, sft_files,
                                                                                 monkeypatch):
    """SIGTERM during step 3 of 4 (epoch 2's first window): resuming gives exactly the uninterrupted losses and
    adapter. The checkpoint records the quantized base's hash; a resume onto FP4, or with the same flags onto a
    base whose weights changed under the same path, is refused by name (exit 2) and writes nothing."""
    import shutil

    from transformers import AutoModelForCausalLM

    import finetune.backends.accelerate as engine
    from finetune.errors import FinetuneError, TrainingStopped

    base = tmp_path / "base"
    shutil.copytree(chat_llama, base)
    flags = qlora(str(base), sft_files, num_train_epochs=2, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    _, full = run_in_process(tmp_path, "full", **flags)
    original = stop_during_window(monkeypatch, index=2)
    with pytest.raises(TrainingStopped) as stopped:
        run_in_process(tmp_path, "killed", **flags)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    killed = tmp_path / "killed"
    state = json.loads((killed / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    recorded = state["step_meaning"]["quantized_base"]
    assert recorded["quantization"].startswith("NF4 (4-bit") and len(recorded["sha256"]) == 64

    monkeypatch.setattr(engine, "iter_windows", original)
    before = digest(killed)
    with pytest.raises(FinetuneError, match=r"bnb_4bit_quant_type: checkpoint 'nf4', now 'fp4'.*quantized_base"):
        run_in_process(tmp_path, "killed", resume_from_checkpoint="latest", **{**flags, "bnb_4bit_quant_type": "fp4"})
    assert digest(killed) == before

    weights = (base / "model.safetensors").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    model.save_pretrained(base)  # the same flags and path, other weights: only the hash tells
    with pytest.raises(FinetuneError, match=r"change what a step means: quantized_base: checkpoint \{"):
        run_in_process(tmp_path, "killed", resume_from_checkpoint="latest", **flags)
    assert digest(killed) == before
    (base / "model.safetensors").write_bytes(weights)

    run_in_process(tmp_path, "killed", resume_from_checkpoint="latest", **flags)
    assert [r["loss"] for r in train_steps(killed)] == [r["loss"] for r in train_steps(full)]  # exactly
    assert [r["step"] for r in train_steps(killed)] == [1, 2, 3, 4]
    a, b = adapter(full), adapter(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------ the LoRA family
def test_lora_family_on_a_4bit_base_in_both_backends_and_resume(tmp_path, chat_llama, sft_files, monkeypatch, capsys):
    """DoRA + rsLoRA + gaussian initialisation + lm_head trained in full, on a nested NF4 base, with bitsandbytes'
    8-bit AdamW: the adapter holds DoRA's magnitudes and the full lm_head, its config peft's settings, the card
    says so; the Trainer backend takes the same steps; SIGTERM and resume ends bit-identical; a resume without DoRA
    is refused by name."""
    import finetune.backends.accelerate as engine
    from finetune.errors import FinetuneError, TrainingStopped

    flags = qlora(chat_llama, sft_files, use_bnb_nested_quant=True, use_dora=True, use_rslora=True,
                  init_lora_weights="gaussian", lora_modules_to_save="lm_head", optim="adamw_bnb_8bit",
                  num_train_epochs=2, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    _, full = run_in_process(tmp_path, "full", **flags)
    banner = capsys.readouterr().out
    assert ("(DoRA r=16, alpha=32; rsLoRA scaling alpha/sqrt(r); init gaussian; targets all-linear; trained in full: "
            "lm_head), on a frozen NF4 (4-bit, bitsandbytes; nested constants; compute float32; 14 linear layers) "
            "base") in banner
    weights, config = adapter(full), json.loads((full / "adapter_config.json").read_text())
    assert sum("lora_magnitude_vector" in k for k in weights) == 14
    assert any(k.endswith("lm_head.weight") for k in weights)
    assert (config["use_dora"], config["use_rslora"], config["init_lora_weights"], config["modules_to_save"]) == (
        True, True, "gaussian", ["lm_head"])
    card = (full / "README.md").read_text()
    assert "| base model weights | NF4 4-bit (bitsandbytes), nested constants, compute float32, frozen |" in card
    assert "| optimizer | AdamW, `adamw_bnb_8bit`" in card

    _, trainer = run_in_process(tmp_path, "trainer", backend="trainer", **flags)
    assert [r["loss"] for r in train_steps(trainer)] == pytest.approx([r["loss"] for r in train_steps(full)], rel=1e-5)

    original = stop_during_window(monkeypatch, index=2)
    with pytest.raises(TrainingStopped):
        run_in_process(tmp_path, "killed", **flags)
    monkeypatch.setattr(engine, "iter_windows", original)
    killed = tmp_path / "killed"
    with pytest.raises(FinetuneError, match="use_dora: checkpoint True, now False"):
        run_in_process(tmp_path, "killed", resume_from_checkpoint="latest", **{**flags, "use_dora": False})
    run_in_process(tmp_path, "killed", resume_from_checkpoint="latest", **flags)
    assert [r["loss"] for r in train_steps(killed)] == [r["loss"] for r in train_steps(full)]
    resumed = adapter(killed)
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)


def test_an_8bit_base_trains_alike_in_both_backends(tmp_path, chat_llama, sft_files, capsys):
    """LoRA on an int8 base with paged 32-bit AdamW: the banner says int8; both backends take the same steps."""
    flags = qlora(chat_llama, sft_files, load_in_4bit=False, load_in_8bit=True, optim="paged_adamw_32bit")
    _, accelerate = run_in_process(tmp_path, "accelerate", **flags)
    assert "on a frozen int8 (8-bit, bitsandbytes LLM.int8(); 14 linear layers) base" in capsys.readouterr().out
    _, trainer = run_in_process(tmp_path, "trainer", backend="trainer", **flags)
    losses = [r["loss"] for r in train_steps(accelerate)]
    assert len(losses) == 2 and [r["loss"] for r in train_steps(trainer)] == pytest.approx(losses, rel=1e-5)
    assert "| base model weights | int8 8-bit (bitsandbytes LLM.int8()), frozen |" in (accelerate / "README.md").read_text()
