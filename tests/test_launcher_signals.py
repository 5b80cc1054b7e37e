"""SIGTERM to `accelerate launch` itself (as a scheduler or Kubernetes sends it), not to `finetune train`: the
training processes finish their optimizer step, checkpoint and stop (never train on as orphans), and resuming
ends with the weights of an uninterrupted run."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

import psutil
import pytest
import torch
from helpers import fault_env, launch, leave_records, load_params, start_launch, train_steps

pytestmark = pytest.mark.integration

PR_SET_CHILD_SUBREAPER = 36


def assert_same_weights(a_dir, b_dir):
    a, b = load_params(a_dir), load_params(b_dir)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")  # noqa: B023 - the lambda runs inside this iteration


def wait_for_steps(out, steps: int, process, timeout: float) -> None:
    """Wait until ``out/log.jsonl`` holds ``steps`` optimizer steps (the run is training)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the run ended early ({process.returncode})"
        if (out / "log.jsonl").is_file() and len(train_steps(out)) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {steps} optimizer steps within {timeout} s")


@contextlib.contextmanager
def subreaper():
    """Make this process the child subreaper (Linux): an orphaned descendant is re-parented to us, so we can
    wait for it and read its exit status."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def wait_pid(pid: int, timeout: float) -> int:
    """The exit code of ``pid`` (a process re-parented to us), or an AssertionError if it still runs after
    ``timeout`` seconds (then it is killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"process {pid} still ran {timeout} s after its launcher died: it trained on as an orphan")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_sigterm_to_bare_one_process_launcher_checkpoints_and_resumes(tmp_path, tiny_bert, shared_runs):
    """The bare 1-process launcher dies at once on SIGTERM; the kernel then signals the training process
    (PR_SET_PDEATHSIG), which finishes its step, checkpoints and exits 143 instead of training on. The
    uninterrupted run is test_machines.py's one-process micro-batch-4 reference (trained once per session)."""
    from test_machines import STEPS, one_process_reference
    from test_machines import common as machines_common

    # 96 samples / micro-batch 4 = 24 optimizer steps: the reference's own flags
    args = [*machines_common(tiny_bert), "--per_device_train_batch_size", "4"]
    reference = one_process_reference(shared_runs, tiny_bert)

    out = tmp_path / "stopped"
    with subreaper():
        # each step 0.2 s longer (tests/faults): a tiny model trains 24 steps in about a second on a quiet machine,
        # so the launcher's death after step 2 could reach the trainer after training, not inside it
        launcher = start_launch([*args, "--output_dir", str(out)], tmp_path / "stopped",
                                env={**fault_env(), "FAULT_SLOW_STEP": "0.2"})
        trainer = None
        try:
            wait_for_steps(out, 2, launcher, timeout=240)
            (trainer,) = psutil.Process(launcher.pid).children()
            launcher.send_signal(signal.SIGTERM)
            assert launcher.wait(timeout=30) == -signal.SIGTERM  # the bare launcher does not wait for anything
            assert wait_pid(trainer.pid, timeout=90) == 128 + signal.SIGTERM
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    stderr = (tmp_path / "stopped.err").read_text()
    stopped_at = len(train_steps(out))
    assert 2 <= stopped_at < STEPS, stderr[-3000:]
    assert "SIGTERM (the launcher exited): finishing this optimizer step" in stderr
    assert f"error: stopped by SIGTERM after optimizer step {stopped_at}; checkpoint: " in stderr
    assert (out / "checkpoints" / f"step_{stopped_at:08d}" / "COMPLETE").is_file()
    assert not (out / "model.safetensors").exists()
    size = (out / "log.jsonl").stat().st_size
    time.sleep(1.0)
    assert (out / "log.jsonl").stat().st_size == size  # nobody trains on

    resumed = launch([*args, "--output_dir", str(out), "--resume_from_checkpoint", "latest"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in train_steps(out)] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in train_steps(out)] == pytest.approx([r["loss"] for r in train_steps(reference)], rel=1e-5)
    assert_same_weights(out, reference)


def test_sigterm_to_two_process_launcher_checkpoints_within_torchrun_grace(tmp_path, tiny_bert, shared_runs):
    """With 2 processes torchrun passes SIGTERM on and kills the workers 30 s later: they checkpoint and end
    themselves well before that, and resuming ends with the uninterrupted run's weights, which are those of one
    process with twice the micro-batch (test_machines.py's reference, trained once for both tests)."""
    from test_machines import common as machines_common
    from test_machines import one_process_reference

    # 96 samples / (2 x 2 processes) = 24 optimizer steps
    args = [*machines_common(tiny_bert), "--per_device_train_batch_size", "2"]
    reference = one_process_reference(shared_runs, tiny_bert)

    out = tmp_path / "stopped"
    leaves = tmp_path / "leaves"
    leaves.mkdir()
    launcher = start_launch([*args, "--output_dir", str(out)], tmp_path / "stopped", num_processes=2,
                            env=fault_env(leave_log=str(leaves)))
    try:
        wait_for_steps(out, 2, launcher, timeout=240)
        signalled = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        checkpointed = None
        while launcher.poll() is None and time.monotonic() - signalled < 60:
            if checkpointed is None and any((out / "checkpoints").glob("step_*/COMPLETE")):
                checkpointed = time.monotonic() - signalled
            time.sleep(0.05)
        ended = time.monotonic() - signalled
        assert launcher.poll() is not None, "the launcher still runs 60 s after SIGTERM"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    stderr = (tmp_path / "stopped.err").read_text()
    stopped_at = len(train_steps(out))
    assert 2 <= stopped_at < 24, stderr[-3000:]
    assert (out / "checkpoints" / f"step_{stopped_at:08d}" / "COMPLETE").is_file()
    assert checkpointed is not None and checkpointed < 15, (checkpointed, stderr[-3000:])
    assert ended < 25, ended  # torchrun's SIGKILL would come at 30 s
    # both workers ended by themselves through TrainingStopped (exit code 143), none killed by torchrun
    assert stderr.count(f"error: stopped by SIGTERM after optimizer step {stopped_at}; checkpoint: {out}") == 2
    assert "Unable to shutdown process" not in stderr and "SIGKILL" not in stderr
    # each ended its process group in leave(), the stopped run's model dropped first (a model alive there joins
    # gloo's threads later with the GIL held: the hang that once made this launch outlast torchrun's 30 s)
    assert leave_records(leaves) == [{"group_started": True, "handle_alive": False}] * 2

    resumed = launch([*args, "--output_dir", str(out), "--resume_from_checkpoint", "latest"], num_processes=2,
                     timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in train_steps(out)] == list(range(1, 25))
    assert_same_weights(out, reference)
