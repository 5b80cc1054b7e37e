"""Runs that survive: checkpoints, exact mid-epoch resume, preemption and numerical faults."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import load_params, read_log, run_in_process, stop_during_window, train_steps

from finetune.errors import FinetuneError, NumericalError, TrainingStopped

# 40 samples, micro 2 x accumulation 3: 20 micro-batches -> windows 3,3,3,3,3,3,2 = 7 steps per epoch.
RUN = dict(max_train_samples=40, max_eval_samples=8, per_device_train_batch_size=2, gradient_accumulation_steps=3,
           num_train_epochs=3, max_length=32, learning_rate=1e-3, warmup_steps=2, seed=11, eval_strategy="epoch")


def test_resume_mid_epoch_equals_uninterrupted(tmp_path, tiny_bert, monkeypatch):
    """SIGTERM during step 10 (epoch 1, third window): the run finishes that step, checkpoints and stops;
    resuming from 'latest' continues across the next epoch boundary with exactly the uninterrupted losses."""
    import finetune.backends.accelerate as engine

    full_metrics, full = run_in_process(tmp_path, "full", model_name_or_path=tiny_bert, **RUN)
    out = tmp_path / "killed"
    original = stop_during_window(monkeypatch, index=9)
    with pytest.raises(TrainingStopped) as stopped:
        run_in_process(tmp_path, "killed", model_name_or_path=tiny_bert, **RUN)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    message = str(stopped.value)
    assert "after optimizer step 10" in message and "--resume_from_checkpoint latest" in message
    assert (out / "checkpoints" / "step_00000010" / "COMPLETE").is_file()
    assert not (out / "model.safetensors").exists()  # a stopped run does not pretend to be finished

    monkeypatch.setattr(engine, "iter_windows", original)
    resumed_metrics, _ = run_in_process(tmp_path, "killed", model_name_or_path=tiny_bert,
                                        resume_from_checkpoint="latest", **RUN)
    full_steps, resumed_steps = train_steps(full), train_steps(out)
    assert [r["step"] for r in resumed_steps] == list(range(1, 22))
    assert [r["loss"] for r in resumed_steps] == [r["loss"] for r in full_steps]  # exactly, fp32 CPU
    assert [r["learning_rate"] for r in resumed_steps] == [r["learning_rate"] for r in full_steps]
    assert [r["micro_batches"] for r in resumed_steps] == [3] * 6 + [2] + [3] * 6 + [2] + [3] * 6 + [2]
    assert resumed_metrics["eval_loss"] == full_metrics["eval_loss"]
    assert resumed_metrics["train_loss"] == full_metrics["train_loss"]
    assert len([r for r in read_log(out) if "eval_loss" in r]) == 3


def test_checkpoints_are_pruned_complete_and_refused_without_resume(tmp_path, tiny_bert):
    _, out = run_in_process(tmp_path, "ckpt", model_name_or_path=tiny_bert, checkpointing_steps=3, save_total_limit=2,
                            **{**RUN, "num_train_epochs": 1})
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_00000003", "step_00000006"]
    for name in names:
        state = json.loads((out / "checkpoints" / name / "trainer_state.json").read_text())
        assert (out / "checkpoints" / name / "COMPLETE").is_file()
        assert state["micro_batches_done"] == state["step"] * 3  # taken on window boundaries only
    # rerunning into the same dir without --resume would throw the checkpoints away: refused
    with pytest.raises(FinetuneError, match="--resume_from_checkpoint latest"):
        from finetune.config import parse_config
        from finetune.lifecycle.output import check_output_dir

        config = parse_config(["--recipe", "bbc-news", "--output_dir", str(out), "--model_name_or_path", tiny_bert,
                               *[f"--{k}={v}" for k, v in {**RUN, "num_train_epochs": 1,
                                                          "checkpointing_steps": 3, "save_total_limit": 2}.items()]])
        check_output_dir(config)


def _checkpointed_epoch(shared_runs, tiny_bert, tmp_path, name: str) -> Path:
    """A copy, at ``tmp_path/name``, of one epoch of ``RUN`` with a checkpoint every 2 optimizer steps (7 steps:
    checkpoints 2, 4, 6), trained once per session: the tests that damage, resume or overwrite it get their own."""
    _, shared = shared_runs.in_process(model_name_or_path=tiny_bert, checkpointing_steps=2,
                                       **{**RUN, "num_train_epochs": 1})
    return Path(shutil.copytree(shared, tmp_path / name))


def test_latest_skips_incomplete_and_corrupt_gives_clear_error(tmp_path, tiny_bert, capsys, shared_runs):
    from finetune.lifecycle.checkpoint import find_resume_checkpoint

    out = _checkpointed_epoch(shared_runs, tiny_bert, tmp_path, "ckpt")
    newest = out / "checkpoints" / "step_00000006"
    (newest / "COMPLETE").unlink()  # as if the process died before the marker
    assert find_resume_checkpoint(out, "latest").name == "step_00000004"
    assert "skipping incomplete checkpoint" in capsys.readouterr().out
    with pytest.raises(FinetuneError, match="incomplete"):
        find_resume_checkpoint(out, str(newest))

    good = out / "checkpoints" / "step_00000004"
    weights = good / "model.safetensors"
    # the same size, a broken header: the manifest checks only the size of a file this big, so the load finds it
    with open(weights, "r+b") as handle:
        handle.write(b"\xff" * 8)
    with pytest.raises(FinetuneError, match="corrupt"):
        run_in_process(tmp_path, "ckpt", model_name_or_path=tiny_bert, resume_from_checkpoint=str(good),
                       **{**RUN, "num_train_epochs": 1})
    weights.write_bytes(b"not a safetensors file")  # another size: verification refuses it before loading
    with pytest.raises(FinetuneError, match="damaged: model.safetensors has 22 bytes"):
        run_in_process(tmp_path, "ckpt", model_name_or_path=tiny_bert, resume_from_checkpoint=str(good),
                       **{**RUN, "num_train_epochs": 1})


def test_resume_refuses_a_changed_step_meaning(tmp_path, tiny_bert, shared_runs):
    _checkpointed_epoch(shared_runs, tiny_bert, tmp_path, "ckpt")
    # B = 2 x 3 = 6 samples per step, now 4 x 3 = 12: refused (another split of the same B would resume)
    with pytest.raises(FinetuneError, match=r"effective batch was B = 6 .*this launch's is B = 12"):
        run_in_process(tmp_path, "ckpt", model_name_or_path=tiny_bert, resume_from_checkpoint="latest",
                       **{**RUN, "num_train_epochs": 1, "per_device_train_batch_size": 4})
    metrics, _ = run_in_process(tmp_path, "ckpt", model_name_or_path=tiny_bert, resume_from_checkpoint="latest",
                                ignore_checkpoint_mismatch=True,
                                **{**RUN, "num_train_epochs": 1, "gradient_accumulation_steps": 2})
    assert metrics["resumed_from"].endswith("step_00000006")


def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(tmp_path, tiny_bert, monkeypatch, shared_runs):
    import torch

    from finetune.tasks import SequenceClassification

    original = SequenceClassification.loss_from_logits
    calls = {"n": 0}

    def poisoned(self, logits, labels):
        calls["n"] += 1
        loss = original(self, logits, labels)
        return loss * float("nan") if calls["n"] == 14 else loss  # micro-batch 14 = in optimizer step 5

    out = _checkpointed_epoch(shared_runs, tiny_bert, tmp_path, "nan")
    # the good run's final files: the failed run below must leave them as they are (it writes no model)
    finished = {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
                for name in ("model.safetensors", "metrics.json")}
    monkeypatch.setattr(SequenceClassification, "loss_from_logits", poisoned)
    with pytest.raises(NumericalError, match="optimizer step 5 .*micro-batches 12-14"):
        run_in_process(tmp_path, "nan", model_name_or_path=tiny_bert, checkpointing_steps=2, overwrite_output_dir=True,
                       **{**RUN, "num_train_epochs": 1})
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step_00000002", "step_00000004"]  # the last good ones, complete
    assert all((out / "checkpoints" / c / "COMPLETE").is_file() for c in checkpoints)
    # No model or metrics from the failed run: each final file is gone (--overwrite_output_dir may clear it)
    # or still the good run's, byte for byte; one the failed run wrote would have other bytes.
    after = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() if (out / name).is_file() else None
             for name in finished}
    assert all(after[name] in (None, finished[name]) for name in finished), (after, finished)
    assert torch.isfinite(torch.tensor([r["loss"] for r in train_steps(out)])).all()


def _safetensor_error(message):
    from safetensors import SafetensorError

    return SafetensorError(message)


@pytest.mark.parametrize("make_error", [
    lambda: OSError(errno.ENOSPC, "No space left on device"),
    lambda: _safetensor_error("Error while serializing: No space left on device (os error 28)"),  # not an OSError
    lambda: RuntimeError("[enforce fail at inline_container.cc] PytorchStreamWriter failed writing file: No space "
                         "left on device"),  # torch.save's
], ids=["OSError", "SafetensorError", "RuntimeError"])
def test_disk_full_while_checkpointing_keeps_the_previous_one(tmp_path, tiny_bert, monkeypatch, make_error):
    """Each error type the writers raise on a full disk ends the run with one clear error, the partial write
    removed and the previous checkpoint intact (only OSError was caught before: the others escaped as a
    traceback, and with several processes the failing rank skipped the collective the others waited in)."""
    from accelerate import Accelerator

    original = Accelerator.save_state
    calls = {"n": 0}

    def failing(self, output_dir=None, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.makedirs(output_dir, exist_ok=True)
            open(os.path.join(output_dir, "partial.bin"), "wb").write(b"x" * 10)
            raise make_error()
        return original(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", failing)
    with pytest.raises(FinetuneError, match="No space left on device.*previous checkpoints are intact"):
        run_in_process(tmp_path, "full", model_name_or_path=tiny_bert, checkpointing_steps=2,
                       **{**RUN, "num_train_epochs": 1})
    root = tmp_path / "full" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]  # no partial, no temp dir
    assert (root / "step_00000002" / "COMPLETE").is_file()


@pytest.mark.integration
def test_sigterm_to_finetune_train_then_resume(tmp_path, tiny_bert):
    """A real SIGTERM to the `finetune train` launcher (as Kubernetes signals PID 1): it passes the signal on,
    the training process finishes its step and checkpoints, the launcher exits 143 after it with the resume
    command, and running that printed command completes the run with the same steps."""
    out = tmp_path / "cli"
    cli = [sys.executable, "-m", "finetune.cli"]
    # 60 optimizer steps: the signal comes after step 3, so 57 (several seconds) are left to stop in
    args = ["train", "--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out),
            "--max_train_samples", "120", "--max_eval_samples", "8", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--num_train_epochs", "2", "--max_length", "48",
            "--eval_strategy", "no"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    proc = subprocess.Popen(cli + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path)
    deadline = time.time() + 240
    while time.time() < deadline:
        log = out / "log.jsonl"
        if log.is_file() and sum(1 for line in log.read_text().splitlines() if '"loss"' in line) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "error: stopped by SIGTERM after optimizer step" in stderr and "Traceback" not in stderr
    stopped_at = len(train_steps(out))
    assert stopped_at < 60 and (out / "checkpoints" / f"step_{stopped_at:08d}" / "COMPLETE").is_file()
    resume_line = next(line for line in stderr.splitlines() if "--resume_from_checkpoint latest" in line).strip()
    assert resume_line.startswith("finetune train ") and str(out) in resume_line
    resumed = subprocess.run(cli + shlex.split(resume_line)[1:], capture_output=True, text=True, env=env,
                             cwd=tmp_path, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in train_steps(out)] == list(range(1, 61))


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_resume_auto_is_one_command_for_every_start_of_a_requeued_job(tmp_path, tiny_bert, backend, capsys):
    """--resume_from_checkpoint auto: the first start (no checkpoint) trains from scratch; a start after a
    preemption resumes the newest checkpoint, even with --overwrite_output_dir (a complete checkpoint is never
    cleared), to the uninterrupted run's weights; a start after the run finished exits at once, touching
    nothing. `latest` fails on the first start, so a requeued job could not use one command."""
    from finetune.run import main

    kw = dict(model_name_or_path=tiny_bert, backend=backend, save_steps=2, max_steps=4, eval_strategy="no",
              max_train_samples=32, max_eval_samples=8, per_device_train_batch_size=4, max_length=32,
              disable_dropout=True, seed=3)
    # the first start of the job: nothing there yet; it runs uninterrupted to the end, the reference below
    first, out = run_in_process(tmp_path, "job", resume_from_checkpoint="auto", **kw)
    assert "starting a fresh run" in capsys.readouterr().out and "resumed_from" not in first
    full = Path(shutil.copytree(out, tmp_path / "full"))
    # preempted after step 2: what a killed run leaves (the step-2 checkpoint, no final model)
    name = "step_00000002" if backend == "accelerate" else "checkpoint-2"
    for leftover in ("model.safetensors", "metrics.json"):
        (out / leftover).unlink()
    for path in (out / "checkpoints").iterdir():
        if path.name != name:
            shutil.rmtree(path)
    resumed, _ = run_in_process(tmp_path, "job", resume_from_checkpoint="auto", overwrite_output_dir=True, **kw)
    assert resumed["resumed_from"].endswith(name)
    a, b = load_params(full), load_params(out)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)
    # the requeued job starts once more after it finished: exit 0, nothing touched
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    code = main(["--recipe", "bbc-news", "--output_dir", str(out), "--resume_from_checkpoint", "auto",
                 *[f"--{k}={v}" for k, v in kw.items()]])
    assert code == 0 and "holds a finished run" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.integration
def test_resume_auto_on_two_processes_starts_fresh_then_resumes(tmp_path, tiny_bert):
    """Through the real launcher with two gloo processes: every rank agrees that there is no checkpoint on the
    first start (a fresh run), and on the newest one afterwards."""
    from helpers import launch

    out = tmp_path / "job"
    args = ["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out), "--max_steps", "4",
            "--save_steps", "2", "--eval_strategy", "no", "--max_train_samples", "32", "--max_length", "32",
            "--per_device_train_batch_size", "2", "--resume_from_checkpoint", "auto"]
    first = launch(args, num_processes=2, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "starting a fresh run" in first.stdout and len(train_steps(out)) == 4
    for leftover in ("model.safetensors", "metrics.json"):
        (out / leftover).unlink()
    again = launch(args, num_processes=2, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming from" in again.stdout and "step_00000002" in again.stdout
    assert [r["step"] for r in train_steps(out)] == [1, 2, 3, 4]
