"""Preemption by a cluster scheduler: ``--resume_from_checkpoint auto`` (one command for every start of a requeued
job), ``--preemption_grace_seconds`` (torchrun's shutdown timeout raised to it by ``finetune train``; a warning
when a step plus a checkpoint will not fit), and a SIGTERM that reaches a training process twice at once (a
scheduler signals every process of a job step, and the launcher passes the signal on as well)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from finetune.run import main
from helpers import REPO, load_params, train_steps
from test_resume import _stop_during_window

# 40 samples, micro 2 x accumulation 3: windows 3,3,3,3,3,3,2 = 7 optimizer steps (1 epoch)
RUN = ["--recipe", "bbc-news", "--max_train_samples", "40", "--max_eval_samples", "8", "--per_device_train_batch_size",
       "2", "--gradient_accumulation_steps", "3", "--num_train_epochs", "1", "--max_length", "32", "--learning_rate",
       "1e-3", "--warmup_steps", "0", "--seed", "11", "--eval_strategy", "no"]


def digest(path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def argv(tiny_bert, out, *extra) -> list[str]:
    return [*RUN, "--model_name_or_path", tiny_bert, "--output_dir", str(out), *extra]


def test_auto_starts_fresh_resumes_after_a_stop_and_then_has_nothing_to_do(tmp_path, tiny_bert, monkeypatch, capsys):
    """The one command a requeued job runs every time: a fresh start (no checkpoint yet), a resume after SIGTERM
    stopped it, and exit 0 once the run is finished, touching nothing; the weights equal an uninterrupted run's."""
    import finetune.train as engine

    assert main(argv(tiny_bert, tmp_path / "full")) == 0
    out = tmp_path / "auto"
    command = argv(tiny_bert, out, "--save_steps", "2", "--resume_from_checkpoint", "auto")
    capsys.readouterr()

    original = _stop_during_window(monkeypatch, index=3)  # SIGTERM during optimizer step 4
    assert main(command) == 128 + signal.SIGTERM
    first = capsys.readouterr()
    assert f"--resume_from_checkpoint auto: no complete checkpoint under {out / 'checkpoints'}: starting a fresh " \
           "run." in first.out
    assert "error: stopped by SIGTERM after optimizer step 4" in first.err
    assert (out / "checkpoints" / "step_00000004" / "COMPLETE").is_file() and not (out / "metrics.json").exists()

    monkeypatch.setattr(engine, "iter_windows", original)
    assert main(command) == 0
    second = capsys.readouterr()
    assert "--resume_from_checkpoint auto: resuming from the newest complete checkpoint " \
           f"({out / 'checkpoints' / 'step_00000004'})." in second.out
    assert "Resuming from" in second.out
    assert [r["step"] for r in train_steps(out)] == list(range(1, 8))
    assert [r["loss"] for r in train_steps(out)] == [r["loss"] for r in train_steps(tmp_path / "full")]
    full, resumed = load_params(tmp_path / "full"), load_params(out)
    assert all(torch.equal(full[name], resumed[name]) for name in full)

    before = digest(out)
    assert main(command) == 0
    third = capsys.readouterr()
    assert f"--resume_from_checkpoint auto: {out} holds this run, finished (7 optimizer steps, metrics.json): " \
           "nothing to do." in third.out
    assert "Run summary" not in third.out and not third.err.strip()
    assert digest(out) == before


def test_auto_never_clears_a_complete_checkpoint_even_with_overwrite(tmp_path, tiny_bert, monkeypatch, capsys):
    import finetune.train as engine

    out = tmp_path / "run"
    original = _stop_during_window(monkeypatch, index=2)
    assert main(argv(tiny_bert, out, "--save_steps", "2")) == 128 + signal.SIGTERM
    monkeypatch.setattr(engine, "iter_windows", original)
    kept = digest(out / "checkpoints" / "step_00000003")
    capsys.readouterr()
    assert main(argv(tiny_bert, out, "--save_steps", "2", "--resume_from_checkpoint", "auto",
                     "--overwrite_output_dir")) == 0
    assert "resuming from the newest complete checkpoint" in capsys.readouterr().out
    assert [r["step"] for r in train_steps(out)] == list(range(1, 8))  # steps 1-3 kept, not started over
    assert digest(out / "checkpoints" / "step_00000003") == kept


def test_auto_fresh_start_gets_the_new_run_checks_of_the_output_dir(tmp_path, tiny_bert, capsys):
    """No checkpoint: a fresh start, so an output dir holding another run, or something else, is refused as for
    any new run (nothing touched), and --overwrite_output_dir replaces it."""
    other = tmp_path / "other"
    assert main(argv(tiny_bert, other, "--max_steps", "1")) == 0  # finished, no checkpoint
    before = digest(other)
    capsys.readouterr()
    assert main(argv(tiny_bert, other, "--resume_from_checkpoint", "auto")) == 2
    err = capsys.readouterr().err
    assert "holds a different run (settings that differ: max_steps)" in err and "Traceback" not in err
    assert digest(other) == before

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(argv(tiny_bert, foreign, "--resume_from_checkpoint", "auto")) == 2
    assert "not empty and does not hold a finetune run" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "mine"

    assert main(argv(tiny_bert, other, "--resume_from_checkpoint", "auto", "--overwrite_output_dir")) == 0
    assert "starting a fresh run" in capsys.readouterr().out
    assert [r["step"] for r in train_steps(other)] == list(range(1, 8))


def test_auto_on_the_trainer_backend(tmp_path, tiny_bert, capsys):
    """Trainer's checkpoints (checkpoint-N): a fresh start, a resume from the newest one that holds its
    trainer_state.json after a run that died (no metrics.json), and nothing to do once finished."""
    out = tmp_path / "trainer"
    command = argv(tiny_bert, out, "--backend", "trainer", "--save_steps", "2", "--resume_from_checkpoint", "auto")
    assert main(command) == 0
    assert "no complete checkpoint under" in capsys.readouterr().out
    full = load_params(out)
    # as if the run had died while writing step 6's checkpoint: no metrics.json, no final model or checkpoint-7,
    # checkpoint-6 without its state
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"checkpoint-{n}" for n in (2, 4, 6, 7)]
    (out / "metrics.json").unlink()
    (out / "model.safetensors").unlink()
    shutil.rmtree(out / "checkpoints" / "checkpoint-7")
    (out / "checkpoints" / "checkpoint-6" / "trainer_state.json").unlink()
    assert main(command) == 0
    assert f"resuming from the newest complete checkpoint ({out / 'checkpoints' / 'checkpoint-4'})" \
           in capsys.readouterr().out
    assert json.loads((out / "metrics.json").read_text())["resumed_from"].endswith("checkpoint-4")
    assert [r["step"] for r in train_steps(out)] == list(range(1, 8))
    resumed = load_params(out)
    for name in full:
        torch.testing.assert_close(resumed[name], full[name], rtol=1e-5, atol=1e-6)
    assert main(command) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_finetune_train_raises_torchruns_shutdown_timeout_to_the_grace(monkeypatch):
    """What torchrun's agent really gets (its LaunchConfig, built from the arguments accelerate hands it):
    30 s by default, the grace rounded up with --preemption_grace_seconds, also over PET_SHUTDOWN_TIMEOUT."""
    import torch.distributed.run as distrib_run

    from finetune.launch import train_command

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
    from finetune.launch import train_command

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
    from finetune.preemption import known_grace

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
    from finetune.preemption import PROBE_NAME, SaveBudget, checkpoint_bytes

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
