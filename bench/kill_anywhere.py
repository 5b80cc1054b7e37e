"""Kill-anywhere campaign: SIGKILL a training run at random moments, resume it, repeat; the result must be the
uninterrupted run's.

    python bench/kill_anywhere.py --smoke                                  # CI variant: 5 kills, one process
    python bench/kill_anywhere.py --kills 30 --json k1.json                # the full campaign, one process
    python bench/kill_anywhere.py --kills 10 --processes 2 --json k2.json  # two gloo processes
    python bench/kill_anywhere.py --elastic --kills 10 --json ke.json      # each restart on 1 or 2 processes
    python bench/kill_anywhere.py --backend trainer --kills 30 --json kt.json  # the Trainer backend

A tiny BERT (``tests/tiny_models.py``) trains bbc-news through the real launcher (``accelerate launch
finetune/run.py``), writing a checkpoint after every optimizer step (``--save_steps 1 --save_total_limit 2``, so
saves also prune) and resuming with ``--resume_from_checkpoint auto``. Each trial starts the run, waits (seeded)
and sends SIGKILL to one of: every process of the launch (a node lost, an OOM kill of the job), one training
process (the launcher then tears the rest down), or the launcher alone (its workers see it die). A share of the
kills is timed inside a checkpoint write: the script polls the checkpoints folder for the temporary folders a
save makes (``.tmp-step_N``, and ``.replaced-``/``.deleting-`` while it prunes) and kills once one appears; no
hook in the product. ``--backend trainer``: the same campaign on the Trainer backend, where Trainer writes its
``checkpoint-N`` into ``.tmp-checkpoint/`` and the lifecycle seals it and renames it into place
(docs/backends.md); a save is in progress while that folder (or ``.replaced-``/``.deleting-checkpoint-N``) is
there. A kill counts as inside a save when such a folder is still there after every process is
gone. After each trial the output directory is checked as a resume would (``checkpoint.find_resume_checkpoint``:
every ``COMPLETE`` checkpoint must verify against its manifest) and the next trial resumes it; a trial that does
not end within ``--trial_timeout`` seconds is a hang. After the last kill the run finishes, and its final
weights and per-step losses are compared with an uninterrupted run's (bit-exact expected on one process). If a
run finishes before all kills are spent, a new round starts from scratch (each round is compared).

Exit status 0 when every round equals the reference, no directory was ever unresumable and nothing hung; else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402

from finetune.errors import FinetuneError  # noqa: E402
from finetune.lifecycle import checkpoint as ckpt  # noqa: E402  (benchlib puts the repository on sys.path)
from finetune.lifecycle.run_log import read_log  # noqa: E402

# what a save in progress leaves: ours, and the Trainer backend's (Trainer writes into .tmp-checkpoint/checkpoint-N)
SAVE_FOLDERS = (".tmp-step_", ".replaced-step_", ".deleting-step_", ckpt.TRAINER_STAGING, ".replaced-checkpoint-",
                ".deleting-checkpoint-")
TARGETS = ("all", "worker", "launcher")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=30, help="kills to make (trials that end in a kill)")
    p.add_argument("--processes", type=int, default=1, choices=(1, 2), help="training processes (2: gloo ranks)")
    p.add_argument("--in_save_share", type=float, default=0.45, help="share of kills timed inside a checkpoint write")
    p.add_argument("--train_samples", type=int, default=64, help="--max_train_samples of the run")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="seeds the kill schedule (the run's own seed is fixed)")
    p.add_argument("--trial_timeout", type=float, default=180.0, help="seconds before a trial counts as a hang")
    p.add_argument("--work_dir", help="keep the runs here (default: a temporary folder, removed at the end)")
    p.add_argument("--json", help="write the trials and the summary to this file")
    p.add_argument("--backend", default="accelerate", choices=("accelerate", "trainer"), help="the training loop")
    p.add_argument("--smoke", action="store_true", help="the CI variant: 5 kills, 48 samples, one epoch")
    p.add_argument("--elastic", action="store_true", help="each restart on a random process count, 1 or 2, with "
                   "another split of the same effective batch (run_elastic_campaign)")
    args = p.parse_args(argv)
    if args.smoke:
        args.kills, args.train_samples, args.epochs = min(args.kills, 5), 48, 1
    if args.kills < 1 or not 0 <= args.in_save_share <= 1:
        p.error("--kills must be >= 1 and --in_save_share in [0, 1]")
    return args


def run_args(model: str, out: Path, args) -> list[str]:
    """The run every trial launches: micro-batch 2 x accumulation 2 per process, dropout on (the resume must restore
    the random state), an evaluation at each epoch's end, a checkpoint after every optimizer step."""
    return ["--recipe", "bbc-news", "--model_name_or_path", model, "--output_dir", str(out),
            "--max_train_samples", str(args.train_samples), "--max_eval_samples", "8", "--max_length", "32",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--num_train_epochs", str(args.epochs), "--learning_rate", "1e-3", "--warmup_steps", "0", "--seed", "7",
            "--eval_strategy", "epoch", "--save_steps", "1", "--save_total_limit", "2",
            "--resume_from_checkpoint", "auto", "--ddp_timeout", "60", "--backend", args.backend]


def launch_command(args_list: list[str], processes: int) -> list[str]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no"]
    cmd += ["--multi_gpu", "--num_processes", str(processes)] if processes > 1 else ["--num_processes", "1"]
    return cmd + [str(bl.RUN_PY), *args_list]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=bl.REPO,
                                start_new_session=True)


def tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """The launcher and every process under it."""
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def workers(proc: subprocess.Popen) -> list[psutil.Process]:
    """The training processes: those running ``finetune/run.py`` under the launcher."""
    found = []
    for p in tree(proc)[1:]:
        try:
            if any(str(bl.RUN_PY) == a or a.endswith("finetune/run.py") for a in p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def save_folders(out: Path) -> set[str]:
    """The names of the temporary folders of saves in progress (or killed) under ``out``'s checkpoints."""
    try:
        return {e.name for e in os.scandir(ckpt.checkpoints_dir(out)) if e.name.startswith(SAVE_FOLDERS)}
    except OSError:
        return set()


def wait_all_gone(proc: subprocess.Popen, members: list[psutil.Process], limit: float) -> bool:
    """Wait until the launcher and every process that was under it have exited; False after ``limit`` s."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        proc.poll()
        alive = [m for m in members if m.is_running() and m.status() != psutil.STATUS_ZOMBIE]
        if proc.returncode is not None and not alive:
            return True
        time.sleep(0.05)
    return False


def kill_everything(proc: subprocess.Popen, members: list[psutil.Process]) -> None:
    for m in [*members, *tree(proc)]:
        try:
            m.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def check_resumable(out: Path, backend: str = "accelerate") -> tuple[str | None, int | None]:
    """(problem, step) as a resume sees ``out``: every complete checkpoint verifies, and "auto" finds the newest
    (step None: a fresh start). ``problem`` names what would make the directory unresumable."""
    for path in ckpt.list_checkpoints(out, backend):
        if ckpt.is_complete(path) and not ckpt.is_resumable(path):
            return f"complete checkpoint {path.name} does not verify", None
    try:
        path = ckpt.find_resume_checkpoint(out, "auto", backend)
    except FinetuneError as err:
        return str(err), None
    return None, (ckpt.step_of(path) if path is not None else None)


def final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_log(out, "step")]


def compare(out: Path, reference: Path) -> dict:
    """Final weights and per-step losses of ``out`` against ``reference``: bit-exact or not, the largest absolute
    weight difference, and whether the log has every step once with the reference's loss."""
    mine, ref = final_weights(out), final_weights(reference)
    exact = mine.keys() == ref.keys() and all(mine[k].dtype == ref[k].dtype and bool((mine[k] == ref[k]).all())
                                              for k in ref)
    diff = max(float((mine[k].double() - ref[k].double()).abs().max()) for k in ref) if mine.keys() == ref.keys() \
        else float("inf")
    return {"weights_bit_exact": exact, "max_abs_weight_diff": diff, "losses_equal": losses(out) == losses(reference)}


def run_campaign(args) -> dict:  # noqa: C901 - over the budget; to split
    rng = random.Random(args.seed)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kill-anywhere-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(bl.build_tiny_bert(work / "tiny-bert"))
    log = work / "launches.log"

    # the uninterrupted run: its weights, its wall time, when its first checkpoint appeared
    reference = work / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    t0 = time.monotonic()
    proc = start(launch_command(run_args(model, reference, args), args.processes), log)
    first_save = None
    while proc.poll() is None:
        if first_save is None and ckpt.checkpoints_dir(reference).is_dir():
            first_save = time.monotonic() - t0
        time.sleep(0.02)
    ref_wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise bl.BenchError(f"the uninterrupted run failed (exit {proc.returncode}); see {log}")
    first_save = first_save or ref_wall / 2
    print(f"reference: {len(losses(reference))} optimizer steps in {ref_wall:.1f} s (first checkpoint after "
          f"{first_save:.1f} s)", flush=True)

    trials, rounds, round_no, failures = [], [], 1, []
    out = work / "run"
    shutil.rmtree(out, ignore_errors=True)
    # the schedule: round(kills x share) kills inside a save (SIGKILL to every process or to one training process;
    # a killed launcher lets its workers finish their save), the rest at random moments, any target; shuffled
    inside = round(args.kills * args.in_save_share)
    schedule = [(True, rng.choice(TARGETS[:2])) for _ in range(inside)]
    schedule += [(False, rng.choice(TARGETS)) for _ in range(args.kills - inside)]
    rng.shuffle(schedule)
    kills = 0
    # random moments end where a launch from scratch ends: the reference's wall time at first, which holds its
    # cold start (the first launch of all; on the Trainer backend 2.4x a later launch from scratch), then the
    # shortest launch from scratch that ran to its end unkilled. A moment after the end is no kill: the trial
    # finishes the round instead (19 trials for 5 kills on the Trainer backend before the horizon shrank)
    horizon = ref_wall
    while True:
        finishing = kills >= args.kills
        in_save, target = schedule[kills] if not finishing else (False, None)
        # random moments span the start-up (imports, resume) as well as training
        delay = rng.uniform(0.6 * first_save, max(horizon, 0.6 * first_save))
        trial = {"trial": len(trials) + 1, "round": round_no, "target": target, "timing": "in save" if in_save else
                 ("random" if not finishing else "to the end"), "delay_s": None, "killed": False,
                 "inside_save": False}
        before = check_resumable(out, args.backend)[1]
        stale = save_folders(out)  # left by an earlier killed save: cleared by the next save, not a new one
        proc = start(launch_command(run_args(model, out, args), args.processes), log)
        t0 = time.monotonic()
        members: list[psutil.Process] = []
        hung = False
        if not finishing:
            while proc.poll() is None and time.monotonic() - t0 < args.trial_timeout:
                members = list({m.pid: m for m in [*members, *tree(proc)]}.values())
                elapsed = time.monotonic() - t0
                if (save_folders(out) - stale if in_save else elapsed >= delay):
                    victims = {"all": tree(proc), "worker": workers(proc)[:1] or tree(proc)[-1:],
                               "launcher": tree(proc)[:1]}[target]
                    if not victims:
                        break
                    if target == "worker" and args.processes > 1:
                        victims = [rng.choice(workers(proc) or victims)]
                    for v in victims:
                        try:
                            v.send_signal(signal.SIGKILL)
                        except psutil.NoSuchProcess:
                            pass
                    trial.update(killed=True, delay_s=round(elapsed, 2))
                    break
                time.sleep(0.002 if in_save else 0.01)
        members = list({m.pid: m for m in [*members, *tree(proc)]}.values())
        remaining = max(args.trial_timeout - (time.monotonic() - t0), 1.0)
        if not wait_all_gone(proc, members, remaining):
            hung = True
            kill_everything(proc, members)
        trial["exit_code"] = proc.returncode
        trial["seconds"] = round(time.monotonic() - t0, 2)
        trial["inside_save"] = trial["killed"] and bool(save_folders(out) - stale)
        problem, step = check_resumable(out, args.backend)
        trial.update(resumed_from=before, resumable_at=step, problem=problem, hung=hung)
        finished = (out / "metrics.json").is_file()
        trial["finished"] = finished
        if trial["killed"]:
            kills += 1
        elif finished and before is None and not hung:
            horizon = min(horizon, trial["seconds"])
        if hung:
            failures.append(f"trial {trial['trial']}: hung past {args.trial_timeout:.0f} s")
        if problem:
            failures.append(f"trial {trial['trial']}: unresumable: {problem}")
        if not trial["killed"] and not finished and not hung:
            failures.append(f"trial {trial['trial']}: exited {proc.returncode} without a kill and unfinished "
                            f"(see {log})")
        trials.append(trial)
        print(f"trial {trial['trial']:3d} round {round_no} {trial['timing']:10s} {str(target):8s} "
              f"killed={trial['killed']!s:5s} inside_save={trial['inside_save']!s:5s} delay={trial['delay_s']} "
              f"exit={proc.returncode} resumes_at={step} finished={finished}", flush=True)
        if hung or problem or (not trial["killed"] and not finished):
            break
        if finished:
            result = {"round": round_no, "kills": sum(t["killed"] for t in trials if t["round"] == round_no),
                      **compare(out, reference)}
            rounds.append(result)
            if not (result["weights_bit_exact"] if args.processes == 1 else result["max_abs_weight_diff"] < 1e-6) \
                    or not result["losses_equal"] and args.processes == 1:
                failures.append(f"round {round_no}: final weights or losses differ from the uninterrupted run: "
                                f"{result}")
            print(f"round {round_no}: {result}", flush=True)
            if finishing:
                break
            round_no += 1
            shutil.rmtree(out)
    summary = {
        "processes": args.processes, "backend": args.backend, "seed": args.seed, "trials": len(trials), "kills": kills,
        "kills_inside_save": sum(t["inside_save"] for t in trials),
        "kills_by_target": {t: sum(1 for x in trials if x["killed"] and x["target"] == t) for t in TARGETS},
        "unresumable_directories": sum(1 for t in trials if t["problem"]), "hangs": sum(t["hung"] for t in trials),
        "rounds": rounds, "reference_steps": len(losses(reference)), "reference_seconds": round(ref_wall, 1),
        "kill_horizon_seconds": round(horizon, 1),
        "median_trial_seconds": statistics.median(t["seconds"] for t in trials) if trials else None,
        "failures": failures, "machine": bl.format_machine(bl.machine_info()),
    }
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return {"summary": summary, "trials": trials}


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    if args.elastic:
        return elastic_main(args, t0)
    report = run_campaign(args)
    s = report["summary"]
    s["wall_seconds"] = round(time.monotonic() - t0, 1)
    print(f"\n{s['machine']}")
    print(f"{s['backend']} backend, {s['processes']} process(es), seed {s['seed']}: {s['trials']} trials, {s['kills']} kills "
          f"({s['kills_inside_save']} inside a save; by target {s['kills_by_target']}), "
          f"{len(s['rounds'])} round(s), unresumable directories {s['unresumable_directories']}, hangs {s['hangs']}, "
          f"{s['wall_seconds']} s")
    for r in s["rounds"]:
        print(f"  round {r['round']}: {r['kills']} kills, final weights bit-exact {r['weights_bit_exact']} "
              f"(max |diff| {r['max_abs_weight_diff']:.3g}), per-step losses equal {r['losses_equal']}")
    for f in s["failures"]:
        print(f"FAILURE: {f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    ok = not s["failures"] and s["rounds"] and s["kills"] >= args.kills
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1




# ------------------------------------------------------------------------------------------ the elastic variant
ELASTIC_FLOOR = 1e-6  # verify's floor in fp32: relative difference of the whole model (docs/resume.md)


def elastic_run_args(model: str, out: Path, args, processes: int) -> list[str]:
    """``run_args`` with dropout off and B = 8 split for ``processes``: 2 x 4 on one process, 2 x 2 on two."""
    argv = run_args(model, out, args)
    at = argv.index("--gradient_accumulation_steps")
    argv[at + 1] = str(4 // processes)
    return argv + ["--disable_dropout", "true"]


def step_hashes(out: Path) -> list[tuple[int, str | None]]:
    """(step, the hash of its sample ids) of each optimizer step in ``out``'s log."""
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r.get("sample_ids")) for r in records if "loss" in r]


def relative_gap(out: Path, reference: Path) -> float:
    """‖w − w_ref‖ / ‖w_ref‖ over the whole model's final weights."""
    mine, ref = final_weights(out), final_weights(reference)
    diff = sum(float((mine[k].double() - ref[k].double()).pow(2).sum()) for k in ref) ** 0.5
    return diff / sum(float(ref[k].double().pow(2).sum()) for k in ref) ** 0.5


def newest_step(out: Path) -> int:
    """The step of the newest complete checkpoint under ``out`` (0: none)."""
    done = [p for p in ckpt.list_checkpoints(out) if ckpt.is_complete(p)]
    return int(done[-1].name.removeprefix("step_")) if done else 0


def elastic_trial(model: str, out: Path, args, processes: int, kill_at: tuple[int, float] | None, target: str, rng,
                  log: Path) -> dict:
    """One launch on ``processes`` processes resuming ``out`` (``auto``), SIGKILLed (``target`` as in
    ``run_campaign``) ``kill_at`` = (step, seconds): that many seconds after the checkpoint of that optimizer step
    appears (a moment inside training whatever the machine's speed), or, with ``kill_at`` None, run to its end;
    the trial's record."""
    proc = start(launch_command(elastic_run_args(model, out, args, processes), processes), log)
    t0, members, killed, due = time.monotonic(), [], False, None
    while kill_at is not None and proc.poll() is None and time.monotonic() - t0 < args.trial_timeout:
        members = list({m.pid: m for m in [*members, *tree(proc)]}.values())
        if due is None and newest_step(out) >= kill_at[0]:
            due = time.monotonic() + kill_at[1]
        if due is not None and time.monotonic() >= due:
            victims = {"all": tree(proc), "worker": workers(proc)[:1] or tree(proc)[-1:],
                       "launcher": tree(proc)[:1]}[target]
            if target == "worker" and processes > 1 and workers(proc):
                victims = [rng.choice(workers(proc))]
            for v in victims:
                try:
                    v.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
            killed = bool(victims)
            break
        time.sleep(0.01)
    members = list({m.pid: m for m in [*members, *tree(proc)]}.values())
    hung = not wait_all_gone(proc, members, max(args.trial_timeout - (time.monotonic() - t0), 1.0))
    if hung:
        kill_everything(proc, members)
    return {"processes": processes, "target": target if kill_at is not None else None, "killed": killed,
            "kill_after_step": kill_at[0] if kill_at else None, "seconds_after_it": round(kill_at[1], 2) if kill_at
            else None, "exit_code": proc.returncode,
            "seconds": round(time.monotonic() - t0, 2), "hung": hung, "finished": (out / "metrics.json").is_file()}


def run_elastic_campaign(args) -> dict:  # noqa: C901 - one campaign loop, as run_campaign
    """The elastic variant: random SIGKILLs (each 0-1.5 s after the checkpoint of a random step still to come, to
    every process, one worker or the launcher), each restart on a randomly chosen process count (1 or 2, B = 8 split
    as ``elastic_run_args``), every directory resumable; the finished run's per-step sample-id hashes equal the
    uninterrupted run's (one process, 2 x 4) and its final weights are within ``ELASTIC_FLOOR`` of them. A restart
    whose directory holds no checkpoint yet (killed before the first save) starts afresh in an emptied directory:
    ``auto`` finds nothing to resume there, and the output-directory check would refuse another split's flags."""
    rng = random.Random(args.seed)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kill-elastic-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(bl.build_tiny_bert(work / "tiny-bert"))
    log = work / "launches.log"
    reference = work / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    t0 = time.monotonic()
    first = elastic_trial(model, reference, args, 1, None, "all", rng, log)
    ref_wall = time.monotonic() - t0
    if not first["finished"]:
        raise bl.BenchError(f"the uninterrupted run failed (exit {first['exit_code']}); see {log}")
    total = len(step_hashes(reference))
    print(f"reference (1 process, 2 x 4): {total} optimizer steps in {ref_wall:.1f} s", flush=True)
    out = work / "run"
    shutil.rmtree(out, ignore_errors=True)
    trials, failures, kills, rounds = [], [], 0, []
    while True:
        finishing = kills >= args.kills
        processes = rng.choice((1, 2))
        target = rng.choice(TARGETS)
        before = check_resumable(out)[1]
        if before is None and out.exists():
            shutil.rmtree(out)  # nothing to resume: a fresh start on this split
        # after a checkpoint of a step still to come, at a random moment of the next step (or the step after)
        ahead = (before or 0) + 1
        kill_at = None if finishing or ahead >= total else (rng.randint(ahead, total - 1), rng.uniform(0.0, 1.5))
        trial = {"trial": len(trials) + 1, "resumed_from": before,
                 **elastic_trial(model, out, args, processes, kill_at, target, rng, log)}
        problem, step = check_resumable(out)
        trial.update(resumable_at=step, problem=problem)
        trials.append(trial)
        kills += trial["killed"]
        print(f"trial {trial['trial']:3d} on {processes} process(es) {str(trial['target']):8s} "
              f"killed={trial['killed']!s:5s} after_step={trial['kill_after_step']} exit={trial['exit_code']} "
              f"resumed_from={before} resumes_at={step} finished={trial['finished']}", flush=True)
        if trial["hung"]:
            failures.append(f"trial {trial['trial']}: hung past {args.trial_timeout:.0f} s")
        if problem:
            failures.append(f"trial {trial['trial']}: unresumable: {problem}")
        if not trial["killed"] and not trial["finished"]:
            failures.append(f"trial {trial['trial']}: exited {trial['exit_code']} without a kill and unfinished "
                            f"(see {log})")
        if trial["hung"] or problem or (not trial["killed"] and not trial["finished"]):
            break
        if trial["finished"]:
            gap = relative_gap(out, reference)
            launches = trials[sum(r["trials"] for r in rounds):]  # this round's
            result = {"round": len(rounds) + 1, "relative_weight_gap": gap,
                      "sample_ids_equal": step_hashes(out) == step_hashes(reference),
                      "processes_used": sorted({t["processes"] for t in launches}), "trials": len(launches)}
            rounds.append(result)
            print(f"round {result['round']}: {result}", flush=True)
            if gap >= ELASTIC_FLOOR or not result["sample_ids_equal"]:
                failures.append(f"round {result['round']}: {result}")
            if finishing:
                break
            shutil.rmtree(out)
    summary = {"elastic": True, "seed": args.seed, "trials": len(trials), "kills": kills,
               "restarts_by_processes": {p: sum(1 for t in trials if t["processes"] == p) for p in (1, 2)},
               "unresumable_directories": sum(1 for t in trials if t["problem"]),
               "hangs": sum(t["hung"] for t in trials), "rounds": rounds, "reference_seconds": round(ref_wall, 1),
               "failures": failures, "machine": bl.format_machine(bl.machine_info())}
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return {"summary": summary, "trials": trials}


def elastic_main(args, t0: float) -> int:
    """``--elastic``: run ``run_elastic_campaign``, print and write its report; 0 when it passed."""
    report = run_elastic_campaign(args)
    s = report["summary"]
    s["wall_seconds"] = round(time.monotonic() - t0, 1)
    print(f"\n{s['machine']}")
    print(f"elastic, seed {s['seed']}: {s['trials']} trials, {s['kills']} kills, restarts by process count "
          f"{s['restarts_by_processes']}, unresumable directories {s['unresumable_directories']}, hangs {s['hangs']}, "
          f"{s['wall_seconds']} s")
    for r in s["rounds"]:
        print(f"  round {r['round']}: {r['trials']} launches on {r['processes_used']} process(es), relative weight gap "
              f"{r['relative_weight_gap']:.3g} (floor {ELASTIC_FLOOR:g}), per-step sample ids equal "
              f"{r['sample_ids_equal']}")
    for f in s["failures"]:
        print(f"FAILURE: {f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    ok = not s["failures"] and s["rounds"] and s["kills"] >= args.kills
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
