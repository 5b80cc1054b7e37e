"""Helpers for tests that run the real engine in-process or the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOST_CPUS_ENV = "FINETUNE_TEST_HOST_CPUS"  # set by conftest.py when it pins a parallel worker to a share


def host_cpus() -> set[int]:
    """The CPUs the test run may use, those of this process's affinity set before ``conftest.py`` pinned this
    xdist worker to its share (a test that needs several cores launches on them: ``launch(cpus=...)``)."""
    listed = os.environ.get(HOST_CPUS_ENV)
    return {int(cpu) for cpu in listed.split(",")} if listed else set(os.sched_getaffinity(0))


def run_in_process(tmp_path: Path, name: str, **overrides) -> tuple[dict, Path]:
    """Run the CLI's ``run.run`` in this process on the bbc-news recipe (or ``recipe=``) with ``overrides``
    as flags; return (metrics, output dir)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from finetune.config import parse_config
    from finetune.run import run

    # Accelerate's state is process-wide; every in-process run starts from a clean one.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()

    out = tmp_path / name
    argv = ["--recipe", overrides.pop("recipe", "bbc-news"), "--output_dir", str(out)]
    for key, value in overrides.items():
        argv += [f"--{key}", str(value)]
    return run(parse_config(argv)), out


def load_params(output_dir: Path) -> dict:
    """The saved model's tensors (safetensors), name -> tensor."""
    from safetensors.torch import load_file

    return load_file(str(output_dir / "model.safetensors"))


def read_log(output_dir: Path) -> list[dict]:
    """``log.jsonl`` as a list of records."""
    return [json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines()]


def train_steps(output_dir: Path) -> list[dict]:
    """Only the per-optimizer-step records of ``log.jsonl``."""
    return [r for r in read_log(output_dir) if "loss" in r]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the kernel's pick for port 0). Every test that
    starts a process group takes its own: tests run in parallel (``pytest -n``), and two groups on one port
    (torch's and accelerate's default 29500) fail or join each other."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(args: list[str], num_processes: int = 1, machine: tuple[int, int, int] | None = None,
                   module: str | None = None) -> list[str]:
    """The ``accelerate launch finetune/run.py ARGS`` command line on CPU; ``num_processes`` > 1 gives gloo
    ranks, rendezvousing on a port of their own (``--main_process_port 0``: accelerate picks a free one; its
    default 29500 would be shared by every launch of a parallel test run). ``machine``: (machine rank, number
    of machines, main process port) for one "machine" of a run over several, all on 127.0.0.1
    (``num_processes`` is then the total over all machines). ``module``: run that module instead
    (``--module finetune.commands.verify``)."""
    machines = machine[1] if machine else 1
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", str(machines), "--mixed_precision",
           "no", "--dynamo_backend", "no"]
    # several CPU processes: --multi_gpu with ACCELERATE_USE_CPU=1 gives gloo ranks (--cpu with it is refused)
    # one process: like the README command, no --cpu (ACCELERATE_USE_CPU=1 keeps it on the CPU)
    cmd += ["--multi_gpu", "--num_processes", str(num_processes)] if num_processes > 1 else ["--num_processes", "1"]
    if machine:
        cmd += ["--machine_rank", str(machine[0]), "--main_process_ip", "127.0.0.1", "--main_process_port",
                str(machine[2])]
    elif num_processes > 1:
        cmd += ["--main_process_port", "0"]
    if module:
        return cmd + ["--module", module, *args]
    return cmd + [str(REPO / "finetune" / "run.py"), *args]


def launch_env(env: dict | None = None) -> dict:
    """The environment of a launch: CPU only, hub offline, plus ``env``."""
    return {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", **(env or {})}


def fault_env(cpu_fp16: bool = False, overflow_steps=(), save_error: str | None = None,
              sync_log: str | None = None, leave_log: str | None = None, layout_cost: str | None = None,
              slow_benchmark: float | None = None) -> dict:
    """The environment additions that make a launched process inject faults (``tests/faults``): its folder
    first on ``PYTHONPATH`` (before this process's), so its ``sitecustomize`` runs, and the variables it
    reads: ``cpu_fp16``: fp16 on a CPU really runs fp16; ``overflow_steps``: those optimizer steps (1-based)
    overflow; ``save_error``: ``FAULT_SAVE_ERROR`` (e.g. "RuntimeError@rank1@step2": that rank's checkpoint
    write of that step fails); ``sync_log``: a folder where each rank logs which backwards DDP all-reduced in
    (``install_sync_log``); ``leave_log``: a folder where each rank records whether ``distributed.leave``
    ended its process group (``install_leave_log``; ``leave_records`` reads them); ``layout_cost``: "A,B,C", the
    layout cost ``--packing`` gets instead of measuring (``install_layout_cost``); ``slow_benchmark``: seconds
    each lm-eval forward or generation sleeps first (``install_slow_benchmark``). Pass the result as ``env=``
    to ``launch``, ``run_script`` and the like."""
    from faults.finetune_faults import (
        CPU_FP16_ENV,
        FAULTS_DIR,
        LAYOUT_COST_ENV,
        LEAVE_LOG_ENV,
        OVERFLOW_STEPS_ENV,
        SAVE_ERROR_ENV,
        SLOW_BENCHMARK_ENV,
        SYNC_LOG_ENV,
    )

    env = {"PYTHONPATH": os.pathsep.join(p for p in (FAULTS_DIR, os.environ.get("PYTHONPATH", "")) if p)}
    if cpu_fp16:
        env[CPU_FP16_ENV] = "1"
    if overflow_steps:
        env[OVERFLOW_STEPS_ENV] = ",".join(str(step) for step in sorted(overflow_steps))
    if save_error:
        env[SAVE_ERROR_ENV] = save_error
    if sync_log:
        env[SYNC_LOG_ENV] = sync_log
    if leave_log:
        env[LEAVE_LOG_ENV] = leave_log
    if layout_cost:
        env[LAYOUT_COST_ENV] = layout_cost
    if slow_benchmark:
        env[SLOW_BENCHMARK_ENV] = str(slow_benchmark)
    return env


def leave_records(folder: Path) -> list[dict]:
    """The ``install_leave_log`` records in ``folder``, rank by rank, in call order."""
    return [json.loads(path.read_text()) for path in sorted(Path(folder).glob("leave-rank*-*.json"))]


def launch(args: list[str], num_processes: int = 1, timeout: int = 600, env: dict | None = None,
           module: str | None = None, cpus: set[int] | None = None):
    """Run ``accelerate launch finetune/run.py ARGS`` on CPU; ``num_processes`` > 1 gives gloo ranks; ``cpus``:
    the launch's CPU affinity (default: this process's).

    Returns the ``CompletedProcess`` (stdout and stderr captured as text).
    """
    return subprocess.run(launch_command(args, num_processes, module=module), capture_output=True, text=True,
                          timeout=timeout, env=launch_env(env), cwd=REPO,
                          preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)


def machine_cpus(rank: int, machines: int) -> set[int]:
    """The CPUs of this host that "machine" ``rank`` of ``machines`` (all on this host) owns: a disjoint share of
    this process's affinity set (round-robin where there are fewer CPUs than machines). A real machine has cores
    of its own; without a share, each machine's processes take every core of the host (``finetune`` undoes
    accelerate's ``OMP_NUM_THREADS=1``: threads = cores / local processes), and two machines' gloo ranks fight
    over the same cores (measured on 2 cores: 0.48 s per optimizer step instead of 0.03 s)."""
    cpus = sorted(os.sched_getaffinity(0))
    return set(cpus[rank::machines]) if len(cpus) >= machines else {cpus[rank % len(cpus)]}


def start_launch(args: list[str], logs: Path, num_processes: int = 1, machine: tuple[int, int, int] | None = None,
                 env: dict | None = None):
    """Start ``accelerate launch finetune/run.py ARGS`` (see ``launch_command``) in the background, its stdout
    and stderr going to ``logs``.out and ``logs``.err (files, not pipes: a full pipe would stall a run nobody
    reads), with ``env`` added to its environment. A ``machine`` runs on its own share of this host's CPUs
    (``machine_cpus``). Returns the ``Popen``."""
    cpus = machine_cpus(machine[0], machine[1]) if machine and hasattr(os, "sched_setaffinity") else None
    with open(f"{logs}.out", "w") as out, open(f"{logs}.err", "w") as err:
        return subprocess.Popen(launch_command(args, num_processes, machine), stdout=out, stderr=err,
                                env=launch_env(env), cwd=REPO,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)


def run_script(args: list[str], timeout: int = 300, env: dict | None = None):
    """Run ``python finetune/run.py ARGS`` (the other supported entry); returns the ``CompletedProcess``."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, str(REPO / "finetune" / "run.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=REPO)


def assert_user_error(result, *fragments: str) -> None:
    """A user error: non-zero exit, an ``error:`` line holding every fragment, and no traceback from our
    code (``accelerate launch`` adds its own ``CalledProcessError`` traceback for any failing child)."""
    assert result.returncode != 0, result.stdout[-2000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ") or ": error: " in line]
    assert error_lines, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in error_lines[0], (fragment, error_lines[0])
    ours = [line for line in result.stderr.splitlines()
            if line.strip().startswith("File ") and ("/finetune/" in line or "/recipes/" in line)]
    assert not ours, result.stderr[-3000:]


def run_args_in_process(args: list[str]) -> dict:
    """The CLI's ``run.run`` in this process on ``ARGS`` exactly as a launch would get them (``--recipe`` and
    ``--output_dir`` included), on the CPU as ``launch_env`` keeps a launch (``ACCELERATE_USE_CPU=1`` while it
    runs): the metrics. For a reference run a test compares a launch with, where the launcher is not what it
    tests: the same code and flags without a process start (its imports cost ~10 s of CPU)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from finetune.config import parse_config
    from finetune.run import run

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    before = os.environ.get("ACCELERATE_USE_CPU")
    os.environ["ACCELERATE_USE_CPU"] = "1"
    try:
        return run(parse_config(args))
    finally:
        if before is None:
            del os.environ["ACCELERATE_USE_CPU"]
        else:
            os.environ["ACCELERATE_USE_CPU"] = before


def stop_during_window(monkeypatch, index: int):
    """Send ourselves SIGTERM as the ``index``-th window of the run (0-based, over all epochs) starts:
    an in-process preemption at a known point."""
    import finetune.backends.accelerate as engine

    original = engine.iter_windows
    seen = {"n": 0}

    def iter_windows(dataloader, n):
        for window in original(dataloader, n):
            if seen["n"] == index:
                os.kill(os.getpid(), signal.SIGTERM)
            seen["n"] += 1
            yield window

    monkeypatch.setattr(engine, "iter_windows", iter_windows)
    return original
