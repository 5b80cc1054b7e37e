"""How long a 2-process run takes to end after SIGTERM, on a loaded machine.

Each trial launches a tiny BERT (``tests/tiny_models.py``) on bbc-news through ``accelerate launch --multi_gpu
--num_processes 2`` (gloo ranks), waits for its second optimizer step in ``log.jsonl``, and sends SIGTERM to the
launcher, as a scheduler's preemption does. torchrun passes it on and kills the workers 30 s later; each worker
should finish its step, checkpoint, leave the process group (``finetune.distributed.leave``) and exit 143 well
before that. ``--busy`` processes spin on the CPU meanwhile (one torch thread each): a suite's other worker, a
neighbour's job. A trial whose launcher has not ended ``--grace`` seconds after the signal is a hang; with
``--py_spy`` (``pip install py-spy``) each of its processes' Python and native stacks are saved beside its log.

Printed: per trial the seconds from SIGTERM to the launcher's end; then the hangs, and the median and maximum.
Exit status 0 when nothing hung. Run: ``python bench/stop_under_load.py --trials 36 --busy 4``; CI runs
``--smoke`` (one trial, nothing busy). Figures: docs/resume.md#leaving-the-process-group.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402  (puts the repository and tests/ on sys.path)

from finetune.lifecycle.run_log import read_log  # noqa: E402

SPIN = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a = (a @ a).tanh()\n"


def parse_args(argv=None):
    """The command line (``--smoke``: one trial, nothing busy)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=36, help="launches, each stopped by SIGTERM")
    p.add_argument("--busy", type=int, default=4, help="processes spinning on the CPU during the trials")
    p.add_argument("--grace", type=float, default=25.0, help="seconds after SIGTERM before a trial counts as a hang "
                   "(torchrun kills the workers at 30 s)")
    p.add_argument("--py_spy", action="store_true", help="save each hung process's stacks (needs py-spy)")
    p.add_argument("--work_dir", help="keep the runs here (default: a temporary folder, removed at the end)")
    p.add_argument("--json", help="write the trials and the summary to this file")
    p.add_argument("--smoke", action="store_true", help="the CI variant: one trial, nothing busy")
    args = p.parse_args(argv)
    if args.smoke:
        args.trials, args.busy = 1, 0
    if args.trials < 1 or args.busy < 0:
        p.error("--trials must be >= 1 and --busy >= 0")
    return args


def run_args(model: str, out: Path) -> list[str]:
    """The run each trial launches: 96 samples at micro-batch 2 on each of 2 processes, 24 optimizer steps."""
    return ["--recipe", "bbc-news", "--model_name_or_path", model, "--max_train_samples", "96", "--max_eval_samples",
            "8", "--num_train_epochs", "1", "--max_length", "32", "--per_device_train_batch_size", "2",
            "--eval_strategy", "no", "--learning_rate", "1e-3", "--warmup_steps", "0", "--seed", "5",
            "--output_dir", str(out)]


def launch_command(args_list: list[str]) -> list[str]:
    """``accelerate launch`` of ``finetune/run.py ARGS`` on 2 gloo processes, on a port of their own."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--multi_gpu", "--num_processes", "2", "--main_process_port", "0",
            str(bl.RUN_PY), *args_list]


def steps_done(out: Path) -> int:
    """Optimizer steps the run in ``out`` has logged so far (0 before its log exists)."""
    try:
        return sum(1 for record in read_log(out) if "loss" in record)
    except (OSError, ValueError):  # not written yet, or a line being written
        return 0


def save_stacks(pids: list[int], log: Path) -> None:
    """Each process's Python and native stacks (``py-spy dump --native``) into ``LOG.stacks.PID``."""
    for pid in pids:
        result = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True, text=True)
        Path(f"{log}.stacks.{pid}").write_text(result.stdout + result.stderr)


def trial(model: str, out: Path, grace: float, py_spy: bool) -> dict:
    """One launch, SIGTERMed after its second optimizer step; returns its record (``hung``, ``seconds``)."""
    import psutil

    log = out.with_suffix(".log")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(launch_command(run_args(model, out)), stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=bl.REPO)
    started = time.monotonic()
    while steps_done(out) < 2:
        if proc.poll() is not None or time.monotonic() - started > 300:
            proc.kill()
            proc.wait()
            raise SystemExit(f"the launch ended or stalled before its second step; see {log}")
        time.sleep(0.05)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stacks_saved = killed = False
    while proc.poll() is None:
        waited = time.monotonic() - signalled
        if waited > grace and not stacks_saved:
            stacks_saved = True
            if py_spy:
                save_stacks([p.pid for p in psutil.Process(proc.pid).children(recursive=True)], log)
        if waited > 60 and not killed:  # torchrun did not end it: end the launch and everything under it
            killed = True
            for process in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
        time.sleep(0.05)
    seconds = time.monotonic() - signalled
    text = log.read_text(errors="replace")
    stopped = text.count("error: stopped by SIGTERM after optimizer step")
    return {"seconds": round(seconds, 2), "hung": seconds > grace, "workers_stopped_themselves": stopped,
            "exit_code": proc.returncode, "log": str(log)}


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="stop-under-load-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(bl.build_tiny_bert(work / "tiny-bert"))
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for _ in range(args.busy)]
    info = bl.machine_info()
    print(bl.format_machine(info))
    records = []
    try:
        for i in range(args.trials):
            record = trial(model, work / f"t{i:03d}", args.grace, args.py_spy)
            records.append(record)
            print(f"trial {i + 1}/{args.trials}: ended {record['seconds']:.1f} s after SIGTERM"
                  f"{'  HUNG' if record['hung'] else ''} ({record['workers_stopped_themselves']} of 2 workers "
                  "stopped themselves)", flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    seconds = [r["seconds"] for r in records]
    hung = sum(r["hung"] for r in records)
    summary = {"machine": info, "trials": len(records), "busy": args.busy, "grace_seconds": args.grace, "hung": hung,
               "median_seconds": statistics.median(seconds), "max_seconds": max(seconds)}
    print(f"{hung} of {len(records)} launches hung (> {args.grace:g} s after SIGTERM) with {args.busy} busy "
          f"processes; median {summary['median_seconds']:.1f} s, max {summary['max_seconds']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "trials": records}, indent=1) + "\n")
    if not args.work_dir and not hung:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    elif hung:
        print(f"the hung launches' logs{' and stacks' if args.py_spy else ''} are in {work}")
    return 1 if hung else 0


if __name__ == "__main__":
    sys.exit(main())
