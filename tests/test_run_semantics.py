"""TrainingArguments semantics in both engines (eval/save/logging/warmup steps as counts or ratios,
load_best_model_at_end, early stopping, Trainer resume), loadable intermediate checkpoints, and the
bugs the architecture review found (overwrite leaves old files, unknown flags, empty eval sets, files
left open when training raises)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import load_params, read_log, run_in_process, train_steps
from transformers import AutoModelForSequenceClassification

from finetune.errors import FinetuneError
from finetune.run import main

# 32 samples, micro-batch 4 x 2: 4 optimizer steps per epoch
TINY = dict(max_train_samples=32, max_eval_samples=8, per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_length=32, disable_dropout=True, learning_rate=5e-3, warmup_steps=0, seed=7)


def evals(out: Path) -> list[dict]:
    return [r for r in read_log(out) if "eval_loss" in r]


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_eval_strategy_steps_no_and_epoch(tmp_path, tiny_bert, backend):
    """steps: every eval_steps and after the last step; no: never (no eval_* in metrics.json); epoch: after
    each epoch. eval_steps as a ratio of the total (0.5 of 6 = 3) means the same as the count."""
    kw = dict(model_name_or_path=tiny_bert, backend=backend, **TINY)
    metrics, out = run_in_process(tmp_path, "steps", max_steps=6, eval_strategy="steps", eval_steps=4, **kw)
    assert [r["step"] for r in evals(out)] == [4, 6] and "eval_loss" in metrics
    _, ratio = run_in_process(tmp_path, "ratio", max_steps=6, eval_strategy="steps", eval_steps=0.5, **kw)
    assert [r["step"] for r in evals(ratio)] == [3, 6]
    never, out = run_in_process(tmp_path, "no", max_steps=6, eval_strategy="no", **kw)
    assert evals(out) == [] and not any(k.startswith("eval_") and k != "eval_runtime" for k in never)
    _, out = run_in_process(tmp_path, "epoch", num_train_epochs=2, eval_strategy="epoch", **kw)
    assert [r["step"] for r in evals(out)] == [4, 8]


def test_warmup_ratio_equals_the_count_it_stands_for(tmp_path, tiny_bert):
    """--warmup_steps 0.25 of 8 optimizer steps is 2 steps (rounded up, as TrainingArguments does)."""
    kw = dict(model_name_or_path=tiny_bert, num_train_epochs=2, eval_strategy="no",
              **{k: v for k, v in TINY.items() if k != "warmup_steps"})
    _, ratio = run_in_process(tmp_path, "ratio", warmup_steps=0.25, **kw)
    _, count = run_in_process(tmp_path, "count", warmup_steps=2, **kw)
    lrs = [r["learning_rate"] for r in train_steps(ratio)]
    assert lrs == [r["learning_rate"] for r in train_steps(count)]
    assert lrs[:3] == pytest.approx([0.0, 2.5e-3, 5e-3])


def test_intermediate_checkpoint_is_a_loadable_model(tmp_path, tiny_bert):
    """A checkpoint taken every 2 steps (--save_steps) holds a model that from_pretrained loads, equal to the
    final model of a run stopped at that step (a constant schedule, so both runs take the same steps)."""
    kw = dict(model_name_or_path=tiny_bert, eval_strategy="no", lr_scheduler_type="constant", **TINY)
    _, out = run_in_process(tmp_path, "long", max_steps=4, save_steps=2, **kw)
    checkpoint = out / "checkpoints" / "step_00000002"
    assert (checkpoint / "config.json").is_file() and (checkpoint / "tokenizer.json").is_file()
    loaded = AutoModelForSequenceClassification.from_pretrained(checkpoint)
    _, short = run_in_process(tmp_path, "short", max_steps=2, **kw)
    reference = load_params(short)
    for name, tensor in loaded.state_dict().items():
        if name in reference:
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_load_best_model_at_end_with_early_stopping(tmp_path, tiny_bert, backend):
    """Evaluating and checkpointing every step with patience 1: the run stops at the first evaluation that
    does not improve eval_loss (Trainer's EarlyStoppingCallback rule, threshold 0), and the final model is
    the best checkpoint's, reported with that evaluation's metrics."""
    from safetensors.torch import load_file

    metrics, out = run_in_process(tmp_path, "best", backend=backend, model_name_or_path=tiny_bert, num_train_epochs=5,
                                  eval_strategy="steps", eval_steps=1, save_steps=1, load_best_model_at_end=True,
                                  early_stopping_patience=1, **TINY)
    losses = [r["eval_loss"] for r in evals(out)]
    best, stop = 0, None
    for i, loss in enumerate(losses[1:], start=1):  # the rule, replayed on the logged evaluations
        if loss < losses[best]:
            best = i
        else:
            stop = i
            break
    assert stop is not None and len(losses) == stop + 1 < 20  # it stopped early, at the right evaluation
    assert metrics["optimizer_steps"] == stop + 1 and metrics["best_step"] == best + 1
    assert metrics["eval_loss"] == losses[best] and metrics["best_metric"] == losses[best]
    name = f"step_{best + 1:08d}" if backend == "accelerate" else f"checkpoint-{best + 1}"
    checkpoint, final = load_file(str(out / "checkpoints" / name / "model.safetensors")), load_params(out)
    for key, tensor in final.items():
        torch.testing.assert_close(tensor, checkpoint[key], rtol=0, atol=0)


def test_trainer_backend_resumes_from_its_checkpoint(tmp_path, tiny_bert):
    """--resume_from_checkpoint on the Trainer backend: continuing from step 2 of 4 gives the uninterrupted
    run's per-step losses and weights; a resume with another micro-batch is refused."""
    kw = dict(model_name_or_path=tiny_bert, backend="trainer", max_steps=4, save_steps=2, eval_strategy="no", **TINY)
    full_metrics, full = run_in_process(tmp_path, "full", **kw)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "checkpoint-4")
    for name in ("model.safetensors", "metrics.json"):
        (resumed_dir / name).unlink()
    resumed_metrics, _ = run_in_process(tmp_path, "resumed", resume_from_checkpoint="latest", **kw)
    assert [r["loss"] for r in train_steps(resumed_dir)] == pytest.approx([r["loss"] for r in train_steps(full)],
                                                                          rel=1e-6)
    assert resumed_metrics["train_loss"] == pytest.approx(full_metrics["train_loss"], rel=1e-6)
    a, b = load_params(full), load_params(resumed_dir)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)
    # another effective batch is another run (issue 28: a step means B samples), named with both B's ...
    with pytest.raises(FinetuneError, match=r"effective batch was B = 8 .* this launch's is B = 4"):
        run_in_process(tmp_path, "resumed", resume_from_checkpoint="latest", **{**kw, "per_device_train_batch_size": 2})
    # ... and the same B split another way is refused by this backend (its resume is exact on its own split only)
    with pytest.raises(FinetuneError, match=r"--backend trainer on another split \(4 x 2 x 1 process -> 2 x 4 x 1"):
        run_in_process(tmp_path, "resumed", resume_from_checkpoint="latest",
                       **{**kw, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4})


def test_overwrite_leaves_only_the_new_runs_files_and_a_refused_run_touches_nothing(tmp_path, tiny_bert):
    kw = dict(model_name_or_path=tiny_bert, max_steps=2, eval_strategy="no", **TINY)
    _, out = run_in_process(tmp_path, "run", save_steps=1, report_to="tensorboard", **kw)
    assert (out / "runs").is_dir() and (out / "checkpoints").is_dir()
    (out / "notes.txt").write_text("left by the user")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # refused on bad input (a missing data file) after --overwrite_output_dir: nothing changes
    code = main(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out),
                 "--overwrite_output_dir", "--train_file", str(tmp_path / "missing.csv")])
    assert code == 2 and {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # a successful overwrite with other settings: only the new run's files
    run_in_process(tmp_path, "run", overwrite_output_dir=True, **{**kw, "max_steps": 1})
    names = {p.name for p in out.iterdir()}
    assert not {"runs", "checkpoints", "notes.txt"} & names
    assert json.loads((out / "metrics.json").read_text())["optimizer_steps"] == 1
    assert json.loads((out / "run_config.json").read_text())["max_steps"] == 1


def test_overwrite_refuses_the_current_directory(tmp_path, tiny_bert, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("x")
    assert main(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", ".",
                 "--overwrite_output_dir"]) == 2
    assert "would delete the current directory" in capsys.readouterr().err and (tmp_path / "keep.txt").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["--learnig_rate", "1e-4"], "unknown flag --learnig_rate. Did you mean --learning_rate?"),
    (["--gradient_acumulation_steps=4"], "Did you mean --gradient_accumulation_steps?"),
    (["--use_liger_kernel", "True"], "unknown flag --use_liger_kernel. See --help"),
])
def test_unknown_flag_is_one_error_line(argv, fragment, capsys):
    assert main(["--recipe", "bbc-news", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and "Traceback" not in err


def test_empty_causal_lm_eval_set_is_refused_before_training(tmp_path, tiny_llama):
    """Validation texts shorter than one --block_size block leave nothing to evaluate: a clear error, and
    with --eval_strategy no the run trains (and evaluate() of an empty set returns no loss, not a crash)."""
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    train.write_text("".join(json.dumps({"text": "the market rose as shares fell " * 8}) + "\n" for _ in range(8)))
    valid.write_text(json.dumps({"text": "short"}) + "\n")
    kw = dict(recipe="bbc-news-clm", model_name_or_path=tiny_llama, train_file=str(train), validation_file=str(valid),
              block_size=16, per_device_train_batch_size=2, max_steps=1)
    with pytest.raises(FinetuneError, match="validation set is empty.*--block_size 16"):
        run_in_process(tmp_path, "refused", **kw)
    assert not (tmp_path / "refused").exists()
    metrics, _ = run_in_process(tmp_path, "trains", eval_strategy="no", **kw)
    assert metrics["optimizer_steps"] == 1


def test_log_and_trackers_are_closed_when_training_raises(tmp_path, tiny_bert, monkeypatch):
    """A non-finite loss at step 2 raises NumericalError: log.jsonl keeps step 1 and is closed, and the
    TensorBoard writer was closed (its events file holds step 1)."""
    from finetune.tasks import SequenceClassification

    original, calls = SequenceClassification.loss_from_logits, {"n": 0}

    def loss_sum(self, logits, labels):
        calls["n"] += 1
        loss = original(self, logits, labels)
        return loss * float("nan") if calls["n"] > 2 else loss  # micro-batches 3+: step 2

    monkeypatch.setattr(SequenceClassification, "loss_from_logits", loss_sum)
    from finetune.errors import NumericalError

    with pytest.raises(NumericalError, match="optimizer step 2"):
        run_in_process(tmp_path, "nan", model_name_or_path=tiny_bert, max_steps=4, eval_strategy="no",
                       report_to="tensorboard", **TINY)
    out = tmp_path / "nan"
    assert [r["step"] for r in train_steps(out)] == [1]
    open_files = {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                  if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not any(str(out) in f for f in open_files), open_files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((out / "runs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1]


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_the_best_model_is_the_best_evaluation_that_has_a_checkpoint(tmp_path, tiny_bert, backend):
    """--save_steps a multiple (2) of --eval_steps (1), as validate() and Trainer accept: the best model is
    the best evaluation whose model was kept (a checkpoint at an even step, or the final model), the final
    weights are that checkpoint's, and metrics.json reports that evaluation. Before, the accelerate engine
    looked for a checkpoint that was never written and the Trainer backend kept the last model while
    reporting the best evaluation. A high learning rate makes the loss rise and fall: the best of all
    evaluations is at step 3, which has no checkpoint (checked below)."""
    from safetensors.torch import load_file

    kw = dict(TINY, learning_rate=0.02)
    metrics, out = run_in_process(tmp_path, "best", backend=backend, model_name_or_path=tiny_bert, max_steps=7,
                                  eval_strategy="steps", eval_steps=1, save_steps=2, load_best_model_at_end=True, **kw)
    losses = {r["step"]: r["eval_loss"] for r in evals(out)}
    assert min(losses, key=losses.get) == 3  # the case at issue: the best evaluation was not kept
    kept = {step: loss for step, loss in losses.items() if step % 2 == 0 or step == 7}
    best = min(kept, key=kept.get)
    assert metrics["best_step"] == best and metrics["eval_loss"] == losses[best] == metrics["best_metric"]
    final = load_params(out)
    if best != 7:
        name = f"step_{best:08d}" if backend == "accelerate" else f"checkpoint-{best}"
        checkpoint = load_file(str(out / "checkpoints" / name / "model.safetensors"))
        for key, tensor in final.items():
            torch.testing.assert_close(tensor, checkpoint[key], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_early_stopping_at_an_epoch_evaluation_ends_the_run_there(tmp_path, tiny_bert, backend):
    """Early stopping at an epoch's evaluation: no further epoch starts and (accelerate engine) no
    checkpoint is written after it; the run's last record is that evaluation."""
    kw = dict(TINY, learning_rate=0.05)
    metrics, out = run_in_process(tmp_path, "epochs", backend=backend, model_name_or_path=tiny_bert, num_train_epochs=8,
                                  eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True,
                                  early_stopping_patience=1, **kw)
    records = read_log(out)
    stopped = records[-1]["step"]
    assert "eval_loss" in records[-1] and stopped < 32 and metrics["optimizer_steps"] == stopped
    if backend == "accelerate":
        steps = sorted(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))
        assert steps and max(steps) < stopped, steps
