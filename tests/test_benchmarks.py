"""``finetune eval`` (issue 39): lm-evaluation-harness in process on a trained run, a LoRA adapter directory and
the GGUF base, equal to the ``lm-eval`` command line on the same model and documents: its metrics and every
document's per-choice log-likelihoods within 1e-6 (fp32)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_in_process
from lm_eval_helpers import LIMIT, loglikelihoods, ours, paired_se, sft_rows
from tiny_models import build_tiny_chat_llama

pytest.importorskip("lm_eval", reason="finetune eval needs lm-eval (the [eval] extra, installed by [test])")

@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


def command_line(model_args: str, out: Path) -> tuple[dict, dict]:
    """The ``lm-eval run`` command line on the same task config (the shipped one), documents and seed."""
    from finetune.outputs.lm_eval import write_shipped_tasks

    result = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"{model_args},dtype=float32",
         "--tasks", "bbc_topic", "--include_path", str(write_shipped_tasks()), "--limit", str(LIMIT), "--log_samples",
         "--output_path", str(out), "--device", "cpu", "--batch_size", "1", "--seed", "0"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    return results["results"]["bbc_topic"], loglikelihoods(next(out.rglob("samples_bbc_topic_*.jsonl")))


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

    # into the run's eval/ folder with --baseline: the card gets base, tuned and the difference with its stderr,
    # paired over the per-document records
    ours(str(run), run / "eval", "--baseline", chat_llama)
    tuned, base = (json.loads((run / "eval" / f).read_text())["results"]["bbc_topic"]
                   for f in ("eval_results.json", "baseline/eval_results.json"))
    card = (run / "README.md").read_text()
    section = card[card.index("## Benchmarks (lm-evaluation-harness)"):]
    section = section[:section.index("<!-- end of benchmarks -->")]
    assert f"base `{chat_llama}`" in section
    for metric in ("acc", "acc_norm"):
        t, b = tuned[f"{metric},none"], base[f"{metric},none"]
        ts, bs = tuned[f"{metric}_stderr,none"], base[f"{metric}_stderr,none"]
        se = paired_se(run / "eval" / "samples_bbc_topic.jsonl", run / "eval" / "baseline" / "samples_bbc_topic.jsonl",
                       metric)
        row = f"| `eval_bbc_topic_{metric}` | {b:.4f} ± {bs:.4f} | {t:.4f} ± {ts:.4f} | {t - b:.4f} ± {se:.4f} |"
        assert row in section, (row, section)
    assert card.index("## Benchmarks") < card.index("## Training speed")
    ours(str(run), run / "eval")  # again, without a baseline: the section is replaced, not added
    card = (run / "README.md").read_text()
    assert card.count("## Benchmarks (lm-evaluation-harness)") == 1 and "base `" not in card


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
    from finetune.models.fetch import smollm2_gguf_path

    path = smollm2_gguf_path()
    if not path.is_file():
        pytest.skip("the shipped GGUF file is not fetched (python -m finetune.fetch smollm2-gguf)")
    assert_equal(ours(str(path), tmp_path / "ours"),
                 command_line(f"pretrained={path.parent},gguf_file={path.name}",
                              tmp_path / "cli"))


def test_the_headline_task_scores_rouge_l_as_the_recipe_does(tmp_path, chat_llama):
    """bbc_headline's per-document ROUGE-L is the bbc-headlines recipe's metric (finetune/metrics/rouge: Google's
    rouge_score, stemmed) on the filtered generation, and its exact match lm-eval's (case and punctuation
    ignored); the task's figures are their means. The scorer itself on a known pair: 4 of 5 words in order. With
    --apply_chat_template the results record the template, as the command line does."""
    import importlib.util

    from transformers import AutoTokenizer

    from finetune.commands.eval import main
    from finetune.metrics import load_metric
    from finetune.outputs.lm_eval import write_shipped_tasks

    spec = importlib.util.spec_from_file_location("bbc_metrics", write_shipped_tasks() / "bbc_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    scored = module.process_results({"headline": "Blair rejects Tory terror offer"}, ["blair rejects tory offer!"])
    assert scored["rougeL"] == pytest.approx(2 * 0.8 * 1.0 / 1.8) and scored["exact_match"] == 0.0
    assert module.process_results({"headline": "Blair rejects Tory offer"}, ["blair rejects tory offer!"]) == {
        "exact_match": 1.0, "rougeL": 1.0}

    out = tmp_path / "headline"
    assert main(["--model", chat_llama, "--tasks", "bbc_headline", "--limit", "3", "--output_path", str(out),
                 "--apply_chat_template"]) == 0
    written = json.loads((out / "eval_results.json").read_text())
    template = AutoTokenizer.from_pretrained(chat_llama).chat_template
    assert written["chat_template"] == template and len(written["chat_template_sha"]) == 64  # as the CLI records it
    assert "<|im_start|>user" in samples_arguments(out)  # the requests were rendered with it
    results = written["results"]["bbc_headline"]
    samples = [json.loads(line) for line in (out / "samples_bbc_headline.jsonl").read_text().splitlines()]
    rouge = load_metric("rouge")
    for sample in samples:
        expected = rouge.compute(predictions=[sample["filtered_resps"][0]], references=[sample["doc"]["headline"]])
        assert sample["rougeL"] == pytest.approx(expected["rougeL"], abs=1e-12)
    assert results["rougeL,strip"] == pytest.approx(sum(s["rougeL"] for s in samples) / 3, abs=1e-12)
    assert results["exact_match,strip"] == sum(s["exact_match"] for s in samples) / 3


def test_an_empty_task_list_is_refused_in_one_line(tmp_path, chat_llama, capsys):
    """--tasks "," names no task: exit 2 with one ``error:`` line, nothing written (before: lm-eval's ValueError
    traceback after the model was loaded)."""
    from finetune.commands.eval import main

    out = tmp_path / "empty"
    assert main(["--model", chat_llama, "--tasks", ",", "--output_path", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: --tasks ',' names no task: give lm-eval task names, comma-separated "
                                "(shipped offline: bbc_topic, bbc_headline)."], err[-2000:]
    assert not out.exists()


def test_a_model_against_itself_differs_by_zero_with_a_paired_standard_error_of_zero(tmp_path, chat_llama, capsys):
    """--baseline the model itself: every document's difference is 0, so the difference's standard error (paired,
    from lm-eval's per-document records) is exactly 0. Before: sqrt(se^2 + se^2), "0.0000 ± 0.2357" here."""
    from finetune.commands.eval import main

    assert main(["--model", chat_llama, "--tasks", "bbc_topic", "--limit", str(LIMIT), "--output_path",
                 str(tmp_path / "self"), "--baseline", chat_llama]) == 0
    rows = {line.split()[0]: [c.strip() for c in line.split("  ") if c.strip()][1:]
            for line in capsys.readouterr().out.splitlines() if line.startswith("eval_")}
    for metric in ("eval_bbc_topic_acc", "eval_bbc_topic_acc_norm"):
        base, tuned, difference = rows[metric]
        assert base == tuned and not base.endswith("± 0.0000")  # an unpaired standard error would not be 0
        assert difference == "0.0000 ± 0.0000", rows


def test_the_paired_standard_error_of_known_documents():
    """5 documents, acc tuned 1,1,0,1,0 and base 0,1,0,0,0: differences 1,0,0,1,0 (mean 0.4, sample variance 0.3),
    paired SE sqrt(0.3 / 5) = 0.2449; unpaired sqrt(0.3/5 + 0.2/5) = 0.3162, used (and marked) where a document
    differs (its doc_hash) or a figure is not the mean of its documents."""
    from finetune.outputs.lm_eval import comparison_rows, document_values

    def records(values, hashes="abcde"):
        return {"bbc_topic": [{"doc_id": i, "doc_hash": h, "filter": "none", "metrics": ["acc"], "acc": v}
                              for i, (v, h) in enumerate(zip(values, hashes))]}

    tuned = {"eval_bbc_topic_acc": 0.6, "eval_bbc_topic_acc_stderr": math.sqrt(0.3 / 5)}
    base = {"eval_bbc_topic_acc": 0.2, "eval_bbc_topic_acc_stderr": math.sqrt(0.2 / 5)}
    docs = document_values(records([1.0, 1.0, 0.0, 1.0, 0.0])), document_values(records([0.0, 1.0, 0.0, 0.0, 0.0]))
    assert docs[0] == {"eval_bbc_topic_acc": {(0, "a"): 1.0, (1, "b"): 1.0, (2, "c"): 0.0, (3, "d"): 1.0,
                                              (4, "e"): 0.0}}
    assert comparison_rows(tuned, base, docs) == [("eval_bbc_topic_acc", "0.2000 ± 0.2000", "0.6000 ± 0.2449",
                                                   "0.4000 ± 0.2449")]
    assert math.sqrt(0.3 / 5) == pytest.approx(0.2449, abs=5e-5)
    unpaired = "0.4000 ± 0.3162 (unpaired)"
    other = document_values(records([0.0, 1.0, 0.0, 0.0, 0.0], hashes="abcdX"))  # the fifth document is another
    assert comparison_rows(tuned, base, (docs[0], other))[0][3] == unpaired
    assert comparison_rows(tuned, {**base, "eval_bbc_topic_acc": 0.25}, docs)[0][3] == "0.3500 ± 0.3162 (unpaired)"
    assert comparison_rows(tuned, base)[0][3] == unpaired  # no per-document records


def samples_arguments(out: Path) -> str:
    """The first bbc_headline request's prompt, as lm-eval's per-document record holds it."""
    record = json.loads((out / "samples_bbc_headline.jsonl").read_text().splitlines()[0])
    return str(record["arguments"])
