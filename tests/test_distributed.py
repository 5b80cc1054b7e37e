"""Several processes (gloo ranks on the CPU, launched through `accelerate launch`): m x N on 2 processes
equals one process with micro-batch 2*m*N, for classification and for causal LM with uneven token counts."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import launch, load_params, run_args_in_process, train_steps

pytestmark = pytest.mark.integration


def _assert_same(a_dir, b_dir):
    a, b = load_params(a_dir), load_params(b_dir)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")  # noqa: B023 - the lambda runs inside this iteration


def _run(tmp_path, name, processes, micro, accum, common):
    """The run on ``processes`` processes through the launcher; the one-process reference in this process (the
    same flags and code: the launcher is what the 2-process run tests, and a launch costs ~10 s of imports)."""
    out = tmp_path / name
    args = [*common, "--output_dir", str(out), "--per_device_train_batch_size", str(micro),
            "--gradient_accumulation_steps", str(accum)]
    if processes == 1:
        run_args_in_process(args)
        return out, None
    result = launch(args, num_processes=processes)
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result


def test_two_processes_classification(tmp_path, tiny_bert):
    common = ["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--max_train_samples", "32",
              "--max_eval_samples", "10", "--num_train_epochs", "1", "--disable_dropout", "--max_length", "32",
              "--learning_rate", "1e-3", "--warmup_steps", "0", "--seed", "4"]
    one, _ = _run(tmp_path, "one", 1, 8, 1, common)
    two, result = _run(tmp_path, "two", 2, 2, 2, common)
    assert "x 2 (accumulation) x 2 (processes) = 8 samples" in result.stdout
    _assert_same(two, one)
    metrics = json.loads((two / "metrics.json").read_text())
    assert metrics["num_processes"] == 2 and metrics["effective_batch_size"] == 8 and metrics["optimizer_steps"] == 4
    assert metrics["eval_samples"] == 10  # gather_for_metrics dropped the padding duplicates
    assert [r["loss"] for r in train_steps(two)] == pytest.approx([r["loss"] for r in train_steps(one)], rel=1e-5)


# group_by_length: one global length-grouped order (sized by the effective batch, reseeded each epoch) dealt
# out in micro-batches, so each window holds the same samples however many processes share it
@pytest.mark.parametrize("order", [["--num_train_epochs", "1"],
                                   ["--num_train_epochs", "2", "--train_sampling_strategy", "group_by_length"]],
                         ids=["random", "group_by_length"])
def test_two_processes_causal_lm_uneven_tokens(tmp_path, tiny_llama, clm_texts, order):
    common = ["--recipe", "bbc-news-clm", "--model_name_or_path", tiny_llama, "--train_file", clm_texts[0],
              "--validation_file", clm_texts[1], "--max_train_samples", "48", *order,
              "--disable_dropout", "--max_length", "64", "--learning_rate", "1e-3", "--warmup_steps", "0",
              "--seed", "4", "--eval_on_start", "False"]
    one, _ = _run(tmp_path, "one", 1, 8, 1, common)
    two, _ = _run(tmp_path, "two", 2, 2, 2, common)
    _assert_same(two, one)
    steps_one, steps_two = train_steps(one), train_steps(two)
    assert len(steps_two) == 6 * int(order[1])
    assert [r["trained_tokens"] for r in steps_two] == [r["trained_tokens"] for r in steps_one]
    assert [r["loss"] for r in steps_two] == pytest.approx([r["loss"] for r in steps_one], rel=1e-5)
    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (one, two))
    assert m2["eval_loss"] == pytest.approx(m1["eval_loss"], rel=1e-5)
    assert m2["eval_tokens"] == m1["eval_tokens"]
