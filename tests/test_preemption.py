"""Preemption by a cluster scheduler (``--resume_from_checkpoint auto`` is tested in ``test_resume.py``):
``--preemption_grace_seconds`` (torchrun's shutdown timeout raised to it by ``finetune train``; a warning
when a step plus a checkpoint will not fit), and a SIGTERM that reaches a training process twice at once (a
scheduler signals every process of a job step, and the launcher passes the signal on as well)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from finetune.run import main

# 40 samples, micro 2 x accumulation 3: windows 3,3,3,3,3,3,2 = 7 optimizer steps (1 epoch)
RUN = ["--recipe", "bbc-news", "--max_train_samples", "40", "--max_eval_samples", "8", "--per_device_train_batch_size",
       "2", "--gradient_accumulation_steps", "3", "--num_train_epochs", "1", "--max_length", "32", "--learning_rate",
       "1e-3", "--warmup_steps", "0", "--seed", "11", "--eval_strategy", "no"]


def argv(tiny_bert, out, *extra) -> list[str]:
    return [*RUN, "--model_name_or_path", tiny_bert, "--output_dir", str(out), *extra]


def test_finetune_train_raises_torchruns_shutdown_timeout_to_the_grace(monkeypatch):
    """What torchrun's agent really gets (its LaunchConfig, built from the arguments accelerate hands it):
    30 s by default, the grace rounded up with --preemption_grace_seconds, also over PET_SHUTDOWN_TIMEOUT."""
    import torch.distributed.run as distrib_run

    from finetune.commands.launch import train_command

    timeouts = []

    def fake_run(args):  # instead of starting the agent
        timeouts.append(distrib_run.config_from_args(args)[0].shutdown_timeout)

    monkeypatch.setattr(distrib_run, "run", fake_run)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    for name in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    launch = ["--multi_gpu", "--num_processes", "2", "--main_process_port", "0", "--recipe", "bbc-news"]
    assert train_command(launch) == 0
    assert train_command([*launch, "--preemption_grace_seconds", "90.5"]) == 0
    assert train_command([*launch, "--preemption_grace_seconds=45"]) == 0
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ  # set for the launch only
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "10")
    assert train_command(launch) == 0
    assert train_command([*launch, "--preemption_grace_seconds", "120"]) == 0
    assert os.environ["PET_SHUTDOWN_TIMEOUT"] == "10"
    assert timeouts == [30, 91, 45, 10, 120]


@pytest.mark.parametrize("value", ["0", "-5", "abc", "inf", "nan"])
def test_bad_grace_gets_one_error_line(value, tmp_path, tiny_bert, capsys):
    """Through finetune train (before anything is launched) and through the training entry point alike."""
    from finetune.commands.launch import train_command

    out = tmp_path / "out"
    assert train_command(["--multi_gpu", "--num_processes", "2", *argv(tiny_bert, out),
                          "--preemption_grace_seconds", value]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "error:" in line] == [
        f"error: --preemption_grace_seconds must be a positive number of seconds (the scheduler's grace between its "
        f"stop signal and SIGKILL, e.g. 120), got {value!r}."]
    try:
        code = main(argv(tiny_bert, out, "--preemption_grace_seconds", value))
    except SystemExit as exit_info:  # argparse's own error: "invalid float value"
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2 and len([line for line in err.splitlines() if "error: " in line]) == 1, err
    assert "--preemption_grace_seconds" in err and "Traceback" not in err
    assert not out.exists()


def test_a_sigterm_repeated_at_once_is_the_same_request(monkeypatch, capsys):
    """SLURM signals every process of a job step (the training processes and torchrun's agent alike) and the
    agent passes its SIGTERM on: a training process gets two at once. The second must not cut the checkpoint
    short; a SIGTERM after the window, or a second SIGINT, still exits at once."""
    import time

    from finetune import signals

    exits = []
    monkeypatch.setattr(signals.os, "_exit", exits.append)
    with signals.GracefulStop(repeat_window=1.0) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and exits == []
        time.sleep(1.1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits == [128 + signal.SIGTERM]
    err = capsys.readouterr().err
    assert "send it again after 1 s to exit at once" in err
    assert err.count("SIGTERM again within 1 s: the same request") == 1
    assert "SIGTERM again: exiting now, without a checkpoint." in err
    with signals.GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert exits == [128 + signal.SIGTERM, 128 + signal.SIGINT]


def test_known_grace_is_the_shorter_of_the_flag_and_torchruns_timeout():
    from finetune.lifecycle.preemption import known_grace

    torchrun = {"TORCHELASTIC_RUN_ID": "x"}
    assert known_grace(None, {}) is None  # not under torchrun, no flag: nothing is known
    assert known_grace(None, torchrun)[0] == 30.0
    assert known_grace(120, {})[0] == 120.0
    assert known_grace(120, torchrun) == (30.0, "torchrun's shutdown timeout (its default; "
                                                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT)")  # bare accelerate launch
    assert known_grace(120, {**torchrun, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}) == (120.0,
                                                                                      "--preemption_grace_seconds")
    assert known_grace(None, {**torchrun, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60", "PET_SHUTDOWN_TIMEOUT": "15"}) == (
        15.0, "torchrun's shutdown timeout (PET_SHUTDOWN_TIMEOUT)")


def test_save_budget_estimates_measures_and_warns_once(tmp_path):
    from finetune.lifecycle.preemption import PROBE_NAME, SaveBudget, checkpoint_bytes

    model = torch.nn.Linear(256, 256)  # 65,792 fp32 parameters, all trainable: x3 with AdamW's moments
    assert checkpoint_bytes(model) == 3 * 4 * (256 * 256 + 256)
    said = []
    budget = SaveBudget(10.0, said.append, environ={})
    budget.start(model, tmp_path)
    assert said[0].startswith("Checkpoint: 0.8 MiB of model and optimizer state; --output_dir writes ")
    assert said[0].endswith("s to save; grace before SIGKILL: 10 s (--preemption_grace_seconds).")
    assert not list(tmp_path.iterdir())  # the probe is gone
    budget.step(60.0)  # the first step (warm-up) does not count
    budget.step(4.0)
    assert len(said) == 1 and budget.step_seconds == 4.0
    budget.saved(7.0)  # measured: 4 + 7 > 10
    assert said[1].startswith("warning: an optimizer step (4.0 s) plus a checkpoint (7.0 s, measured at the first "
                              "save) take 11.0 s, more than the 10 s grace of --preemption_grace_seconds")
    budget.saved(1.0)  # only the first save replaces the estimate
    budget.check()
    assert len(said) == 2 and budget.save_seconds == 7.0
    quiet = SaveBudget(10.0, said.append, active=False, environ={})  # not the main process
    quiet.start(model, tmp_path)
    quiet.step(1.0), quiet.step(100.0), quiet.saved(100.0)
    assert len(said) == 2
    assert PROBE_NAME.startswith(".write_test")  # what check_output_dir takes for another process's probe


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_a_run_warns_when_a_step_and_a_save_exceed_the_grace(backend, tmp_path, tiny_bert, capsys):
    assert main(argv(tiny_bert, tmp_path / "roomy", "--backend", backend, "--save_steps", "3",
                     "--preemption_grace_seconds", "600")) == 0
    out = capsys.readouterr().out
    assert out.count("Checkpoint: ") == 1 and "grace before SIGKILL: 600 s (--preemption_grace_seconds)." in out
    assert "warning:" not in out
    assert main(argv(tiny_bert, tmp_path / "tight", "--backend", backend, "--save_steps", "3",
                     "--preemption_grace_seconds", "0.001")) == 0
    out = capsys.readouterr().out
    assert out.count("warning: ") == 1, out
    assert "estimated: " in out and "more than the 0.001 s grace of --preemption_grace_seconds" in out


def test_a_late_sigterm_while_a_stop_exits_is_ignored_until_its_error_line():
    """After a stop was requested and the loop left, the process is on its way out with 128 + signum: a late SIGTERM
    (the kernel signals once per launcher thread) must not end it with -15 before its error line (seen in CI). Held by
    a Python handler, not SIG_IGN: a process started meanwhile still dies of SIGTERM (an inherited SIG_IGN made a
    later test's launcher deaf to it, seen in CI), and the stop's error line gives SIGTERM back."""
    import os
    import signal as signal_module
    import subprocess
    import sys

    from finetune import signals
    from finetune.errors import TrainingStopped, reports_errors

    previous = signal_module.getsignal(signal_module.SIGTERM)
    try:
        with signals.GracefulStop() as stop:
            os.kill(os.getpid(), signal_module.SIGTERM)
            assert stop.signum == signal_module.SIGTERM
        assert signal_module.getsignal(signal_module.SIGTERM) not in (previous, signal_module.SIG_IGN)
        os.kill(os.getpid(), signal_module.SIGTERM)  # ignored: the test goes on
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        child.send_signal(signal_module.SIGTERM)
        assert child.wait(timeout=30) == -signal_module.SIGTERM

        @reports_errors
        def stopped() -> int:
            raise TrainingStopped("stopped by SIGTERM after optimizer step 2", signal_module.SIGTERM)

        assert stopped() == 143
        assert signal_module.getsignal(signal_module.SIGTERM) == previous
        with signals.GracefulStop():  # without a stop, the handler before is restored
            pass
        assert signal_module.getsignal(signal_module.SIGTERM) == previous
    finally:
        signal_module.signal(signal_module.SIGTERM, previous)
