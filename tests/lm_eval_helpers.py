"""Shared by the lm-evaluation-harness tests (tests/test_benchmarks*.py): ``finetune eval`` in process, the tiny SFT
rows the in-loop runs train on, lm-eval's per-document log-likelihoods read back."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from helpers import run_in_process

LIMIT = 6


def loglikelihoods(path: Path) -> dict[int, list[float]]:
    """doc_id -> per-choice log-likelihoods of an lm-eval ``samples_<task>.jsonl`` file."""
    return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in map(
        json.loads, path.read_text().splitlines())}


def ours(model: str, out: Path, *extra: str, limit: int = LIMIT) -> tuple[dict, dict]:
    """``finetune eval`` on ``bbc_topic``: (lm-eval's results of the task, doc_id -> per-choice log-likelihoods)."""
    from finetune.commands.eval import main

    assert main(["--model", model, "--tasks", "bbc_topic", "--limit", str(limit), "--output_path", str(out),
                 *extra]) == 0
    results = json.loads((out / "eval_results.json").read_text())
    return results["results"]["bbc_topic"], loglikelihoods(out / "samples_bbc_topic.jsonl")


def sft_rows(tmp_path: Path) -> Path:
    """8 prompt/completion rows of BBC-like words (the tiny runs' train and validation file)."""
    path = tmp_path / "sft.jsonl"
    if not path.is_file():
        words = "the market rose as shares in the bank fell after the match ended with a late goal".split()
        path.write_text("".join(json.dumps({"prompt": " ".join(words[i:i + 6]), "completion": " ".join(
            words[i + 6:i + 8])}) + "\n" for i in range(8)))
    return path


def in_loop(tmp_path: Path, name: str, model: str, **extra) -> Path:
    """bbc-headlines on ``model`` for 3 steps (B = 2), evaluated and checkpointed after every step."""
    _, run = run_in_process(tmp_path, name, **{**dict(
        recipe="bbc-headlines", model_name_or_path=model, train_file=str(sft_rows(tmp_path)),
        validation_file=str(sft_rows(tmp_path)), max_steps=3, per_device_train_batch_size=2,
        gradient_accumulation_steps=1, max_length=96, learning_rate=3e-2, warmup_steps=0, eval_strategy="steps",
        eval_steps=1, save_strategy="steps", save_steps=1, eval_on_start=False, max_eval_samples=2,
        mixed_precision="no"), **extra})
    return run


def paired_se(tuned: Path, base: Path, metric: str) -> float:
    """The standard error of the mean per-document difference of ``metric`` between two ``samples_<task>.jsonl``
    files of the same documents (statistics.stdev, n - 1, / sqrt(n)), computed here independently of the package."""
    values = [{s["doc_id"]: float(s[metric]) for s in map(json.loads, path.read_text().splitlines())}
              for path in (tuned, base)]
    assert sorted(values[0]) == sorted(values[1])
    differences = [values[0][d] - values[1][d] for d in values[0]]
    return statistics.stdev(differences) / math.sqrt(len(differences))
