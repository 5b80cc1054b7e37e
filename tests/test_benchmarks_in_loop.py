"""Benchmarks during training (``--eval_tasks``, issue 39): a benchmark at step k equals ``finetune eval`` on that
step's checkpoint, also after a resume; the model is in eval mode for it and training is left as it was; the best
checkpoint and early stopping follow the logged benchmark; 2 processes log what 1 does; the card shows base
(step 0) against tuned."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import load_params, read_log, run_in_process, stop_during_window, train_steps
from lm_eval_helpers import LIMIT, in_loop, loglikelihoods, ours, paired_se, sft_rows
from tiny_models import build_tiny_chat_llama

from finetune.errors import FinetuneError, TrainingStopped

pytest.importorskip("lm_eval", reason="benchmarks need lm-eval (the [eval] extra, installed by [test])")


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


@pytest.fixture(scope="module")
def dropout_llama(tmp_path_factory, chat_llama) -> str:
    """The tiny chat Llama with attention dropout 0.3: a model whose outputs depend on train or eval mode."""
    import shutil

    path = tmp_path_factory.mktemp("dropout-llama") / "model"
    shutil.copytree(chat_llama, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    return str(path)


def benchmarked(run, step: int) -> dict:
    """doc_id -> per-choice log-likelihoods of the in-loop benchmark after optimizer step ``step``."""
    return loglikelihoods(run / "benchmarks" / f"step_{step:08d}" / "samples_bbc_topic.jsonl")


def test_a_benchmark_in_the_loop_equals_finetune_eval_on_that_checkpoint_also_after_a_resume(
        tmp_path, dropout_llama, monkeypatch):
    """--eval_tasks bbc_topic after every step, dropout on: step 2's logged accuracy and every document's
    per-choice log-likelihoods equal ``finetune eval`` on step 2's checkpoint (1e-6), the model in eval mode for the
    benchmark. A run stopped by SIGTERM during step 2 and resumed benchmarks step 2 (the evaluation the stop put
    off) and step 3 as ``finetune eval`` scores its step-2 checkpoint and final model, and as the uninterrupted run
    did (the resume is exact). A mutant that leaves dropout on
    during the benchmark (train mode) differs."""
    run = in_loop(tmp_path, "run", dropout_llama, eval_tasks="bbc_topic", eval_limit=LIMIT)
    logged = next(r for r in read_log(run) if r.get("step") == 2 and "eval_bbc_topic_acc" in r)
    metrics, after = ours(str(run / "checkpoints" / "step_00000002"), tmp_path / "after")
    assert logged["eval_bbc_topic_acc"] == pytest.approx(metrics["acc,none"], abs=1e-6)
    loop = benchmarked(run, 2)
    assert sorted(loop) == sorted(after) == list(range(LIMIT))
    assert all(loop[d] == pytest.approx(after[d], abs=1e-6) for d in loop)

    original = stop_during_window(monkeypatch, index=1)
    with pytest.raises(TrainingStopped):
        in_loop(tmp_path, "resumed", dropout_llama, eval_tasks="bbc_topic", eval_limit=LIMIT)
    monkeypatch.setattr("finetune.backends.accelerate.iter_windows", original)
    resumed = in_loop(tmp_path, "resumed", dropout_llama, eval_tasks="bbc_topic", eval_limit=LIMIT,
                      resume_from_checkpoint="latest")
    # step 2's evaluation, put off by the stop, runs first on the resume; step 3's is the final model's
    assert [r["step"] for r in read_log(resumed) if "eval_bbc_topic_acc" in r] == [1, 2, 3]
    for step, model in ((2, resumed / "checkpoints" / "step_00000002"), (3, resumed)):
        _, after = ours(str(model), tmp_path / f"after-resume-{step}")
        loop = benchmarked(resumed, step)
        assert sorted(loop) == sorted(after) and all(loop[d] == pytest.approx(after[d], abs=1e-6) for d in loop)
        assert loop == benchmarked(run, step)  # the uninterrupted run's, bit for bit

    from lm_eval.models import huggingface

    init = huggingface.HFLM.__init__

    def leaves_dropout_on(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.model.train()

    monkeypatch.setattr(huggingface.HFLM, "__init__", leaves_dropout_on)
    mutant = in_loop(tmp_path, "mutant", dropout_llama, eval_tasks="bbc_topic", eval_limit=LIMIT)
    wrong, right = benchmarked(mutant, 2), benchmarked(run, 2)
    assert any(abs(a - b) > 1e-3 for d in wrong for a, b in zip(wrong[d], right[d]))


def test_a_benchmark_in_the_loop_leaves_training_as_it_was(tmp_path, dropout_llama):
    """With dropout on, a run benchmarked after every step trains the same losses and weights as one that is not:
    the model goes back to train mode and lm-eval's seeding of the global generators is undone (without either,
    the later steps' dropout masks differ)."""
    plain = in_loop(tmp_path, "plain", dropout_llama)
    scored = in_loop(tmp_path, "benchmarked", dropout_llama, eval_tasks="bbc_topic", eval_limit=2)
    assert [r["loss"] for r in train_steps(scored)] == [r["loss"] for r in train_steps(plain)]
    a, b = load_params(plain), load_params(scored)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_best_benchmark_checkpoint_is_kept_and_early_stopping_stops_where_the_log_says(tmp_path, chat_llama):
    """--metric_for_best_model eval_bbc_topic_acc_norm: the run's best step is the logged evaluation with the
    highest value (the first of equals), the final model is that checkpoint's weights, and the card shows base
    (step 0, --eval_on_start) against it with standard errors; with --early_stopping_patience 1 the run stops after
    the first evaluation that does not improve on the best."""
    from safetensors.torch import load_file

    run = in_loop(tmp_path, "best", chat_llama, eval_tasks="bbc_topic", eval_limit=LIMIT, disable_dropout=True,
                  load_best_model_at_end=True, metric_for_best_model="eval_bbc_topic_acc_norm", max_steps=4,
                  eval_on_start=True)
    evals = [r for r in read_log(run) if "eval_bbc_topic_acc_norm" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 3, 4]
    values = [r["eval_bbc_topic_acc_norm"] for r in evals[1:]]  # step 0 has no checkpoint to keep
    best = evals[1 + values.index(max(values))]["step"]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["best_step"] == best and metrics["best_metric"] == max(values)
    final, kept = load_params(run), load_file(run / "checkpoints" / f"step_{best:08d}" / "model.safetensors")
    assert all(torch.equal(final[k], kept[k]) for k in final if k in kept)

    card = (run / "README.md").read_text()
    assert f"| metric | base (step 0) | tuned (step {best}) | difference |" in card
    base, tuned = evals[0], next(r for r in evals if r["step"] == best)
    for metric in ("acc", "acc_norm"):
        key = f"eval_bbc_topic_{metric}"
        b, t, bs, ts = base[key], tuned[key], base[f"{key}_stderr"], tuned[f"{key}_stderr"]
        se = paired_se(run / "benchmarks" / f"step_{best:08d}" / "samples_bbc_topic.jsonl",
                       run / "benchmarks" / "step_00000000" / "samples_bbc_topic.jsonl", metric)  # paired
        assert f"| `{key}` | {b:.4f} ± {bs:.4f} | {t:.4f} ± {ts:.4f} | {t - b:.4f} ± {se:.4f} |" in card

    stopped = in_loop(tmp_path, "stopped", chat_llama, eval_tasks="bbc_topic", eval_limit=LIMIT, disable_dropout=True,
                      load_best_model_at_end=True, metric_for_best_model="eval_bbc_topic_acc_norm",
                      early_stopping_patience=1, max_steps=6)
    values = [r["eval_bbc_topic_acc_norm"] for r in read_log(stopped) if "eval_bbc_topic_acc_norm" in r]
    first_worse = next((i for i in range(1, len(values)) if values[i] <= max(values[:i])), None)
    expected = len(values) if first_worse is None else first_worse + 1  # evaluations run
    assert len(values) == expected and (first_worse is not None or len(values) == 6)


def test_an_unknown_task_or_a_classifier_fails_before_training(tmp_path, chat_llama, tiny_bert):
    """--eval_tasks is checked before the model is built: an unknown name, or a model that is not a causal LM."""
    with pytest.raises(FinetuneError, match="--eval_tasks: unknown lm-eval task.*bbc_topics"):
        run_in_process(tmp_path, "unknown", recipe="bbc-headlines", model_name_or_path=chat_llama,
                       train_file=str(sft_rows(tmp_path)), eval_tasks="bbc_topics")
    assert not (tmp_path / "unknown" / "log.jsonl").exists()
    with pytest.raises(FinetuneError, match="--eval_tasks scores causal language models"):
        run_in_process(tmp_path, "classifier", model_name_or_path=tiny_bert, eval_tasks="bbc_topic")


def test_an_empty_task_list_is_refused_in_one_line_before_anything_is_written(tmp_path, chat_llama, capsys):
    """--eval_tasks "," names no task: exit 2 with one ``error:`` line and no output directory, as ``finetune eval
    --tasks ","`` (tests/test_benchmarks.py). Before, it passed the up-front check (no unknown task among none),
    trained, and died at the first evaluation with lm-eval's ValueError traceback."""
    from finetune.run import main

    out = tmp_path / "empty"
    assert main(["--recipe", "bbc-headlines", "--model_name_or_path", chat_llama, "--train_file",
                 str(sft_rows(tmp_path)), "--output_dir", str(out), "--max_steps", "1", "--eval_tasks", ","]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: --eval_tasks ',' names no task: give lm-eval task names, comma-separated "
                                "(shipped offline: bbc_topic, bbc_headline), or drop --eval_tasks."], err[-2000:]
    assert not out.exists()


def test_two_processes_benchmark_what_one_does(tmp_path, chat_llama):
    """2 processes x 1 x 1 against one process's 2 x 1 (B = 2), --eval_tasks bbc_topic after each step: the same
    logged accuracy and per-document log-likelihoods (1e-5: the trained weights differ by float order)."""
    from helpers import launch

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
        docs = [benchmarked(out, step) for out in (one, two)]
        assert all(docs[0][d] == pytest.approx(docs[1][d], rel=1e-5) for d in docs[0])


def test_two_processes_wait_for_a_benchmark_that_outlasts_the_collective_timeout(tmp_path, chat_llama):
    """--ddp_timeout 2 s and a benchmark that takes longer (lm-eval's forwards slowed from tests/faults: 10 forwards
    x 0.4 s): the main process runs it while the other waits outside the training's collective timeout, and both
    go on with its figures: the run completes, keeps the best step by the benchmark's metric (every process
    decides on it), and logs the mean of the benchmark's logged documents. Before, the waiting rank's broadcast
    timed out after 2 s ("Timed out waiting 2000ms for recv"), exit 1."""
    from helpers import fault_env, launch

    from finetune.lifecycle.evaluation import BENCHMARKS_RUNTIME

    out = tmp_path / "two"
    flags = dict(recipe="bbc-headlines", model_name_or_path=chat_llama, train_file=str(sft_rows(tmp_path)),
                 validation_file=str(sft_rows(tmp_path)), max_steps=1, per_device_train_batch_size=1, max_length=96,
                 learning_rate=3e-2, warmup_steps=0, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                 save_steps=1, eval_on_start=False, max_eval_samples=2, mixed_precision="no", disable_dropout=True,
                 eval_tasks="bbc_topic", eval_limit=2, load_best_model_at_end=True,
                 metric_for_best_model="eval_bbc_topic_acc", ddp_timeout=2, output_dir=str(out))
    args = [a for key, value in flags.items() for a in (f"--{key}", str(value))]
    result = launch(args, num_processes=2, env=fault_env(slow_benchmark=0.4))
    assert result.returncode == 0, result.stderr[-3000:]
    record = next(r for r in read_log(out) if "eval_bbc_topic_acc" in r)
    assert record[BENCHMARKS_RUNTIME] > 2  # the benchmark did outlast --ddp_timeout
    samples = [json.loads(line) for line in (out / "benchmarks" / "step_00000001" / "samples_bbc_topic.jsonl")
               .read_text().splitlines()]
    assert len(samples) == 2 and record["eval_bbc_topic_acc"] == sum(s["acc"] for s in samples) / 2
    assert json.loads((out / "metrics.json").read_text())["best_step"] == 1


def test_a_failed_wait_for_the_benchmark_names_it(monkeypatch):
    """Where rank 0's figures do not arrive (it ended during the benchmark, or the wait's bound passed), the waiting
    process's error names --eval_tasks, its tasks and that --ddp_timeout does not bound the wait."""
    from finetune.lifecycle import evaluation

    def broken(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:22930.\nmore")

    monkeypatch.setattr(torch.distributed, "broadcast_object_list", broken)
    with pytest.raises(FinetuneError) as failed:
        evaluation._share_from_main([None], None, ["bbc_topic", "bbc_headline"])
    assert str(failed.value) == (
        "--eval_tasks bbc_topic,bbc_headline: the benchmark's figures did not reach every process ([gloo/transport/"
        "tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:22930.). The main process runs the benchmark while "
        "the others wait for it, not bounded by --ddp_timeout; a process that ended has its own error above.")
