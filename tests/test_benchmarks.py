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
