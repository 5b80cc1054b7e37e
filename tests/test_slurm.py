"""The sbatch scripts of examples/slurm/, run as SLURM runs them, on the CPU: ``bash SCRIPT`` with the variables
SLURM sets for a batch job, and stand-ins for ``srun`` (one task per "node", all on this host, gloo; a signal to
it reaches every process of the step, as slurmstepd delivers it) and ``scontrol`` (``show hostnames``, and a
``requeue`` that is recorded) from tests/fake_slurm/. A two-node job gets ``--signal=B:USR1``'s signal in its
batch shell mid-run: the trap passes SIGTERM on, the training processes checkpoint, the script requeues the job;
started again (a requeue), it resumes and finishes with the weights of an uninterrupted run; a third start finds
the run finished and exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import REPO, train_steps
from test_launcher_signals import assert_same_weights

pytestmark = pytest.mark.integration

SCRIPTS = REPO / "examples" / "slurm"
FAKES = REPO / "tests" / "fake_slurm"
# 2 processes x micro-batch 2, 200 samples: 50 optimizer steps, long enough to be stopped mid-run (the stop
# lands within a step or two of the signal; 100 steps only made the three trainings twice as long)
ARGS = ("--recipe bbc-news --max_train_samples 200 --max_eval_samples 8 --per_device_train_batch_size 2 "
        "--gradient_accumulation_steps 1 --num_train_epochs 1 --max_length 32 --disable_dropout --eval_strategy no "
        "--learning_rate 1e-3 --warmup_steps 0 --seed 3 --save_steps 40")
STEPS = 50


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(tmp_path, tiny_bert, job_id: int, nodes: int, output_dir, restarts: int = 0, **extra) -> dict:
    """The environment SLURM gives a batch script (plus the scripts' own settings), on this host."""
    path = os.pathsep.join([str(FAKES), os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "FAKE_SLURM_PYTHON": sys.executable, "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
            "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NAME": "finetune", "SLURM_NNODES": str(nodes),
            "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NODELIST": ",".join(["127.0.0.1"] * nodes),
            "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_RESTART_COUNT": str(restarts),
            "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "OUTPUT_DIR": str(output_dir),
            "FINETUNE_ARGS": f"{ARGS} --model_name_or_path {tiny_bert}", "GRACE_SECONDS": "60",
            **{k: str(v) for k, v in extra.items()}}


def start_job(script: str, env: dict, log) -> subprocess.Popen:
    """``bash SCRIPT`` as slurmd starts a batch script, its output going to ``log`` (a path)."""
    with open(log, "a") as out:
        return subprocess.Popen(["bash", str(SCRIPTS / script)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=env["SLURM_SUBMIT_DIR"])


def finish(job: subprocess.Popen, timeout: float) -> int:
    try:
        return job.wait(timeout=timeout)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def requeues(tmp_path) -> list[str]:
    log = tmp_path / "slurm.log"
    return log.read_text().splitlines() if log.is_file() else []


def test_two_node_job_is_stopped_by_its_signal_requeued_and_finishes_as_an_uninterrupted_run(tmp_path, tiny_bert):
    # the uninterrupted run: the one-node script, 2 processes on one "node"
    reference = tmp_path / "reference"
    log = tmp_path / "reference.out"
    code = finish(start_job("train_one_node.sbatch", job_env(tmp_path, tiny_bert, 100, 1, reference, GPUS_PER_NODE=2),
                            log), timeout=300)
    out = log.read_text()
    assert code == 0, out[-4000:]
    assert "no complete checkpoint under" in out and "starting a fresh run" in out and requeues(tmp_path) == []

    # the two-node job, 1 process per node; USR1 to its batch shell alone, as --signal=B:USR1@120 sends it
    job = tmp_path / "job"
    log = tmp_path / "finetune-200.out"  # --open-mode=append: every start of the job appends here
    env = job_env(tmp_path, tiny_bert, 200, 2, job, GPUS_PER_NODE=1, MAIN_PORT=free_port())
    shell = start_job("train_multi_node.sbatch", env, log)
    deadline = time.monotonic() + 240
    while not ((job / "log.jsonl").is_file() and len(train_steps(job)) >= 5):
        assert shell.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.05)
    shell.send_signal(signal.SIGUSR1)
    code = finish(shell, timeout=120)
    out = log.read_text()
    assert code == 128 + signal.SIGTERM, out[-4000:]
    assert "batch shell: USR1 (time limit near): SIGTERM to the training step" in out
    assert "srun: SIGTERM to the " in out  # the trap passed it on; srun to every process of the step
    # torchrun's agent was given the grace (finetune train), and the run knows it
    assert out.count("grace before SIGKILL: 60 s (--preemption_grace_seconds).") == 1
    stopped_at = len(train_steps(job))
    assert 5 <= stopped_at < STEPS
    # every rank stopped at the same step, with a checkpoint written, not killed
    assert out.count(f"error: stopped by SIGTERM after optimizer step {stopped_at}; checkpoint: ") == 2, out[-4000:]
    assert "exiting now, without a checkpoint" not in out
    assert (job / "checkpoints" / f"step_{stopped_at:08d}" / "COMPLETE").is_file()
    assert not (job / "metrics.json").exists()
    assert requeues(tmp_path) == ["requeue 200"]

    # SLURM starts the requeued job again: the same script, the same job id
    env["SLURM_RESTART_COUNT"] = "1"
    code = finish(start_job("train_multi_node.sbatch", env, log), timeout=300)
    out = log.read_text()
    assert code == 0, out[-4000:]
    assert "job 200, start 2" in out
    assert f"Resuming from {job / 'checkpoints' / f'step_{stopped_at:08d}'}: optimizer step {stopped_at}," in out
    assert requeues(tmp_path) == ["requeue 200"]  # finished: not requeued again
    assert [r["step"] for r in train_steps(job)] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in train_steps(job)] == pytest.approx([r["loss"] for r in train_steps(reference)],
                                                                  rel=1e-5)
    assert_same_weights(job, reference)

    # started once more (requeued after it finished): nothing to do, exit 0
    code = finish(start_job("train_multi_node.sbatch", env, log), timeout=300)
    out = log.read_text()
    assert code == 0, out[-4000:]
    assert f"--resume_from_checkpoint auto: {job} holds a finished run (metrics.json); nothing to do." in out
