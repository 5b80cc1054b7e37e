"""Benchmark: what ``--auto_find_batch_size`` picks under two memory budgets, against every plan it could pick.

    python bench/bench_planner.py --smoke                                  # tiny BERT, checks the pipeline
    python bench/bench_planner.py --markdown bench-planner.md --json bench-planner.json

1. **The alternatives.** Every exact plan of ``--total_batch_size`` B (micro-batch m x accumulation B/m, one
   process) under activation checkpointing off and on is trained as a fresh ``python finetune/run.py`` with
   that plan fixed, ``--max_train_samples`` = B x ``--steps`` (one epoch: ``--steps`` optimizer steps),
   interleaved over ``--repeats`` rounds; its training samples/s (metrics.json) gives the time per sample
   of the whole optimizer step (forward, backward, optimizer, data), and its peak RSS.
2. **The planner.** ``finetune/run.py --total_batch_size B --auto_find_batch_size --max_memory_mb X
   --max_steps 1`` under two budgets, each run ``--repeats`` times, interleaved with the plans of step 1:
   - "generous": ``--generous_mb`` (default: what the machine has available), where every plan fits;
   - "tight": from the generous run's own memory probe (process size + gradients and AdamW state +
     ``--tight_samples`` samples of saved activations without checkpointing; default 2.5), so that without
     checkpointing only micro-batches 1 and 2 fit and checkpointing fits larger ones (smoke: + 256 MiB).
   Its printed table gives which plans fit under the budget, what it timed, its choice, and how long
   planning took.
3. **The verdict.** For each budget and planner run: its pick's measured time per sample (step 1) against the
   fastest plan that fits under that run's own "fits" column, as a ratio of medians (and per round). Goal: the
   pick is never slower than the best plan that fits, within noise: every run's ratio <= 1.03, the bar the
   other scripts use for "no difference". Sequence-classification recipes, on a CPU (the budgets are
   ``--max_memory_mb`` budgets).

Full mode: bbc-news with all-MiniLM-L6-v2 at ``--max_length`` 256, B = 16, 4 optimizer steps, fp32, 3 repeats.

``--estimates``: instead, ``finetune plan``'s estimated peak against the measured one, per setting of the base and the
optimizer (``ESTIMATE_SETTINGS``: LoRA on the fp32 base, QLoRA on an NF4 base, LoRA and the full fine-tune with
``--optim adamw_bnb_8bit``), any recipe: for each, ``python -m finetune.commands.plan`` (a fresh process) gives the
estimate of the plan micro-batch B x 1 without checkpointing, under the loss the run takes, and a fresh
``finetune/run.py`` of that plan for ``--steps`` optimizer steps (evaluation off) gives the peak RSS and the training
samples/s (medians over ``--repeats``); the error is (estimate - measured) / measured, goal within
``ESTIMATE_GOAL``. Measured on bbc-headlines (SmolLM2-135M), docs/plan.md:

    python bench/bench_planner.py --estimates --recipe bbc-headlines --total_batch_size 4 --steps 2 --repeats 1
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402
import psutil  # noqa: E402

from finetune.planner.plans import valid_plans  # noqa: E402  (benchlib puts the repository on sys.path)
from finetune.recipes import load_recipe  # noqa: E402
from finetune.tasks import task_of  # noqa: E402
from finetune.tasks.chunked_loss import DEFAULT_CHUNK_SIZE  # noqa: E402

NO_DIFFERENCE = 1.03  # a ratio of medians at or under this is "no slower, within noise"
LEVERS = {"no checkpointing": [], "checkpointing": ["--activation_checkpointing", "True"]}
# smoke: a tiny model's activations per sample are smaller than the process size's jitter between two runs, so
# the tight budget gets this much more room, lest the tight run find less room than the generous run's probe said
SMOKE_SLACK_MB = 256
ESTIMATE_GOAL = 0.15  # |estimate - measured| / measured of the peak, per setting
ESTIMATE_SETTINGS = {  # label -> flags: the base and the optimizer (LoRA's rank and targets: the recipe's)
    "LoRA (fp32 base)": ["--use_peft", "True"],
    "QLoRA (NF4 base)": ["--use_peft", "True", "--load_in_4bit", "True"],
    "LoRA + adamw_bnb_8bit": ["--use_peft", "True", "--optim", "adamw_bnb_8bit"],
    "full + adamw_bnb_8bit": ["--optim", "adamw_bnb_8bit"],
}
PROBE_RE = re.compile(r"Memory probe \(no checkpointing\): ([\d.]+) MiB per sample \+ ([\d.]+) MiB per step.*"
                      r"process holds (\d+) MiB")


def parse_args(argv=None):
    """Flags: the shared ones (``benchlib.base_parser``), the effective batch, steps, budgets."""
    p = bl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--recipe", default="bbc-news")
    p.add_argument("--total_batch_size", type=int, default=None, help="effective batch B (samples; default 16, smoke 4)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per plan run (default 4; smoke 2)")
    p.add_argument("--mixed_precision", default="no", choices=("no", "fp16", "bf16"))
    p.add_argument("--generous_mb", type=int, default=None,
                   help="the generous budget, MiB (default: the memory available when the script starts)")
    p.add_argument("--tight_samples", type=float, default=2.5,
                   help="the tight budget's room for saved activations, in samples without checkpointing")
    p.add_argument("--estimates", action="store_true",
                   help="finetune plan's estimated peak against the measured peak per ESTIMATE_SETTINGS (any recipe)")
    p.add_argument("--settings", default=None,
                   help=f"--estimates: comma-separated subset of the settings (default all: {', '.join(ESTIMATE_SETTINGS)})")
    args = p.parse_args(argv)
    task = load_recipe(args.recipe).TASK
    if task != "sequence-classification" and not args.estimates:
        p.error(f"--recipe {args.recipe} is a {task} recipe: this benchmark runs sequence-classification recipes "
                "(its fixed-plan runs vary checkpointing only; for a causal LM the planner also picks the loss)")
    if args.max_length is None and not args.smoke:
        args.max_length = 256
    bl.resolve_common(args)
    args.total_batch_size = args.total_batch_size or (4 if args.smoke else 16)
    args.steps = args.steps or (2 if args.smoke else 4)
    args.max_train_samples = args.max_train_samples or args.total_batch_size * args.steps
    if args.generous_mb is None:
        args.generous_mb = int(psutil.virtual_memory().available / bl.MIB)
    return args


def plan_label(checkpointing: str, m: int, n: int) -> str:
    return f"{m}x{n}" + (" + checkpointing" if checkpointing == "checkpointing" else "")


def build_configs(args, model: str | None) -> list[bl.Config]:
    """One configuration per exact plan and checkpointing setting (largest micro-batch first)."""
    common = bl.run_flags(args, model, "--num_train_epochs", "1", "--eval_strategy", "no")
    common += args.extra_args.split()
    plans = valid_plans(args.total_batch_size, 1)  # the planner's own list: micro-batch descending
    return [bl.Config(plan_label(lever, m, n), common + ["--per_device_train_batch_size", str(m),
                                                         "--gradient_accumulation_steps", str(n), *flags])
            for lever, flags in LEVERS.items() for m, n in plans]


def parse_planner_output(text: str) -> dict:
    """From a planner run's log: its rows (label -> fits, planner s/sample or None), the chosen label, the
    planning seconds and the no-checkpointing memory probe (MiB per sample, MiB fixed, MiB held). Raises
    ``BenchError`` naming what is missing."""
    rows, chosen = {}, None
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())  # plan_table pads its columns with two spaces or more
        if len(cells) >= 6 and cells[0] in LEVERS and cells[1].isdigit() and cells[2].isdigit():
            label = plan_label(cells[0], int(cells[1]), int(cells[2]))
            rows[label] = {"fits": cells[4] == "yes",
                           "planner_seconds_per_sample": None if cells[5] == "-" else float(cells[5])}
            if line.rstrip().endswith("<- chosen"):
                chosen = label
    planning = re.search(r"Planning took ([\d.]+) s", text)
    probe = PROBE_RE.search(text)
    missing = [what for what, found in (("its table", rows), ("its choice", chosen), ("the planning time", planning),
                                        ("the CPU memory probe (a GPU probes by out-of-memory: these budgets are "
                                         "CPU --max_memory_mb budgets)", probe)) if not found]
    if missing:
        raise bl.BenchError(f"the planner's output lacks {', '.join(missing)}:\n" + text[-3000:])
    return {"rows": rows, "chosen": chosen, "planning_seconds": float(planning.group(1)),
            "probe_mib": {"per_sample": float(probe.group(1)), "fixed": float(probe.group(2)),
                          "held": float(probe.group(3))}}


def run_planner(args, model, budget_mb: int, workdir: Path, tag: str, r: int) -> dict:
    """One planner run under ``budget_mb`` (one optimizer step of training after it); its parsed output."""
    flags = bl.run_flags(args, model, "--num_train_epochs", "1", "--eval_strategy", "no")
    flags += ["--total_batch_size", str(args.total_batch_size), "--auto_find_batch_size", "True",
              "--max_memory_mb", str(budget_mb), "--max_steps", "1", *args.extra_args.split()]
    out = workdir / "planner" / f"{tag}-r{r}"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"[planner] {tag} budget {budget_mb} MiB (repeat {r}) ...", end="", file=sys.stderr, flush=True)
    bl.run_cli(flags, out, out.with_suffix(".log"), num_threads=args.num_threads, timeout=args.timeout,
               start=args.start)
    parsed = parse_planner_output(out.with_suffix(".log").read_text())
    print(f" chose {parsed['chosen']} in {parsed['planning_seconds']:.1f} s", file=sys.stderr, flush=True)
    return parsed | {"budget_mb": budget_mb}


def run_all(args, model, workdir: Path) -> tuple[list[bl.Config], dict]:
    """The plan runs and the planner runs, interleaved round by round; returns (configs, planner runs by budget)."""
    configs = build_configs(args, model)
    planner = {"generous": [], "tight": []}
    budgets = {"generous": args.generous_mb}
    for r in range(1, args.repeats + 1):
        planner["generous"].append(run_planner(args, model, budgets["generous"], workdir, "generous", r))
        if "tight" not in budgets:
            probe = planner["generous"][0]["probe_mib"]
            budgets["tight"] = int(probe["held"] + probe["fixed"] + args.tight_samples * probe["per_sample"]
                                   + (SMOKE_SLACK_MB if args.smoke else 0))
        planner["tight"].append(run_planner(args, model, budgets["tight"], workdir, "tight", r))
        bl.run_interleaved(configs, 1, workdir / f"round{r}", num_threads=args.num_threads, timeout=args.timeout,
                           keep_outputs=args.keep_outputs, warmup=args.warmup if r == 1 else 0, start=args.start)
    for c in configs:
        for i, run in enumerate(c.runs):
            run["bench_repeat"] = i + 1
    return configs, planner


# ------------------------------------------------------------------------------------ --estimates
def estimate_configs(args, model: str | None) -> list[bl.Config]:
    """One fixed-plan configuration per chosen setting: micro-batch B x accumulation 1, no checkpointing, for a causal
    LM the chunked loss of a CPU's default (``--loss_chunk_size`` given, so the plan probes that loss alone), evaluation
    off (what the estimate is of: training)."""
    chosen = args.settings.split(",") if args.settings else list(ESTIMATE_SETTINGS)
    unknown = [name for name in chosen if name not in ESTIMATE_SETTINGS]
    if unknown:
        raise bl.BenchError(f"--settings: unknown {unknown}; choose among {list(ESTIMATE_SETTINGS)}")
    common = ["--recipe", args.recipe, "--mixed_precision", args.mixed_precision, "--max_train_samples",
              str(args.max_train_samples), "--num_train_epochs", "1", "--eval_strategy", "no", "--eval_on_start",
              "False", "--save_strategy", "no", "--per_device_train_batch_size", str(args.total_batch_size),
              "--gradient_accumulation_steps", "1", "--activation_checkpointing", "False"]
    common += (["--max_length", str(args.max_length)] if args.max_length else []) + (
        ["--model_name_or_path", model] if model else [])
    if task_of(load_recipe(args.recipe)).chunked_loss:  # the run's loss fixed, so the plan probes that one only
        common += ["--loss_chunk_size", str(DEFAULT_CHUNK_SIZE)]
    return [bl.Config(name, common + ESTIMATE_SETTINGS[name] + args.extra_args.split()) for name in chosen]


def parse_plan_estimate(text: str, micro_batch: int) -> dict:
    """From ``finetune plan``'s output: the block without checkpointing (the first: ``probes.levers`` lists it first,
    under the loss given) and its row of ``micro_batch``: {"estimate_mib", "weights_mib", "optimizer_state_mib",
    "activations_per_sample_mib", "held_mib", "header"}. Raises ``BenchError`` where it is missing."""
    header = re.search(r"^no checkpointing[^:]*: weights (\d+) MiB.*?optimizer state \(([^)]*)\) (\d+) MiB.*?"
                       r"activations ([\d.]+) MiB per sample; the optimizer step peaks at \d+ MiB .*?the estimate adds "
                       r"the (\d+) MiB this process holds$",
                       text, flags=re.M)
    if header is None:
        raise bl.BenchError("finetune plan's output has no block without checkpointing:\n" + text[-3000:])
    rows = text[header.end():].splitlines()[2:]
    for line in rows:
        cells = line.split()
        if len(cells) < 6 or not cells[0].isdigit():
            break
        if int(cells[0]) == micro_batch:
            return {"estimate_mib": float(cells[3]), "weights_mib": float(header.group(1)),
                    "optimizer": header.group(2), "optimizer_state_mib": float(header.group(3)),
                    "activations_per_sample_mib": float(header.group(4)), "held_mib": float(header.group(5)),
                    "header": header.group(0)}
    raise bl.BenchError(f"finetune plan's block without checkpointing has no row of micro-batch {micro_batch}")


def run_plan(args, config: bl.Config, workdir: Path) -> dict:
    """``python -m finetune.commands.plan`` with the configuration's flags (``--total_batch_size`` B), a fresh process;
    its estimate of micro-batch B (``parse_plan_estimate``) and its wall seconds."""
    log = workdir / "plan" / f"{bl._slug(config.label)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[plan] {config.label} ...", end="", file=sys.stderr, flush=True)
    started = time.perf_counter()
    code = bl.run_script(["-m", "finetune.commands.plan", *config.args, "--total_batch_size", str(args.total_batch_size),
                          "--output_dir", str(workdir / "plan-out")], log, num_threads=args.num_threads,
                         timeout=args.timeout)
    if code != 0:
        raise bl.BenchError(f"finetune plan failed (exit {code}): see {log}\n" + log.read_text()[-3000:])
    parsed = parse_plan_estimate(log.read_text(), args.total_batch_size)
    print(f" estimate {parsed['estimate_mib']:.0f} MiB", file=sys.stderr, flush=True)
    return parsed | {"plan_seconds": round(time.perf_counter() - started, 1)}


def summarize_estimates(configs: list[bl.Config], plans: dict) -> dict:
    """Per setting: the estimate, the measured peak RSS and samples/s (medians), the error (estimate - measured) /
    measured and whether it is within ``ESTIMATE_GOAL``."""
    out = {}
    for c in configs:
        measured = bl.median_of(c.runs, "peak_memory_bytes") / bl.MIB
        estimate = plans[c.label]["estimate_mib"]
        error = (estimate - measured) / measured
        out[c.label] = {**plans[c.label], "measured_mib": measured,
                        "samples_per_second": bl.median_of(c.runs, "train_samples_per_second"),
                        "error": error, "met": bool(abs(error) <= ESTIMATE_GOAL)}
    return {"settings": out, "goal": ESTIMATE_GOAL}


def render_estimates(args, info: dict, configs: list[bl.Config], results: dict) -> str:
    """The Markdown report of ``--estimates``: one row per setting."""
    rows = []
    for c in configs:
        r = results["settings"][c.label]
        rows.append([c.label, f"{r['weights_mib']:.0f}", f"{r['optimizer_state_mib']:.1f} ({r['optimizer']})",
                     f"{r['activations_per_sample_mib']:.1f}", f"{r['held_mib']:.0f}", f"{r['estimate_mib']:.0f}",
                     f"{r['measured_mib']:.0f}", f"{r['error']:+.1%}", bl.fmt(r["samples_per_second"], ".3f"),
                     "met" if r["met"] else "NOT met"])
    headers = ["setting", "weights MiB", "optimizer state MiB", "activations MiB/sample", "held MiB",
               "estimated peak MiB", "measured peak RSS MiB", "error", "training samples/s",
               f"within {ESTIMATE_GOAL:.0%}"]
    return "\n".join([*bl.report_header("finetune plan's estimate against the measured peak", args, info),
                      f"Plan {args.total_batch_size} x 1 (micro-batch x accumulation), no checkpointing, {args.steps} "
                      f"optimizer steps ({args.max_train_samples} samples), evaluation off.", "",
                      bl.markdown_table(headers, rows), "",
                      "- estimated: `finetune plan`'s est. peak of that plan (a fresh process); measured: the training "
                      "run's process max RSS (`metrics.json` peak_memory_bytes); samples/s: the run's training "
                      "samples/s (forward, backward, optimizer step, data)."])


def run_estimates(args) -> int:
    """``--estimates``: the plans, then the runs (interleaved over ``--repeats``), the report."""
    info = bl.machine_info()
    with bl.Workdir(args.workdir) as workdir:
        model = args.model_name_or_path
        if model is None and args.smoke:
            model = str(bl.build_tiny_llama(workdir / "tiny-llama"))
        configs = estimate_configs(args, model)
        if args.dry_run:
            bl.print_commands(configs, args)
            return 0
        plans = {c.label: run_plan(args, c, workdir) for c in configs}
        bl.run_configs(configs, args, workdir)
    results = summarize_estimates(configs, plans)
    bl.emit(render_estimates(args, info, configs, results), bl.result_record("planner-estimates", args, info, configs,
                                                                             results), args)
    return 0


def seconds_per_sample(run: dict) -> float:
    return 1.0 / run["train_samples_per_second"]


def summarize(configs: list[bl.Config], planner: dict) -> dict:
    """Per plan: median seconds per sample and peak memory. Per budget and planner run: the plans that fit (that
    run's own table), its pick, the fastest fitting plan (by the plans' median times), the ratio pick / fastest;
    the budget's verdict is its worst run's ratio (met when <= ``NO_DIFFERENCE``), with that pick's per-round
    ratios."""
    by = {c.label: c for c in configs}
    plans = {c.label: {"seconds_per_sample": bl.median_of([{"s": seconds_per_sample(r)} for r in c.runs], "s"),
                       "peak_memory_bytes": bl.median_of(c.runs, "peak_memory_bytes")} for c in configs}
    budgets = {}
    for name, runs in planner.items():
        judged = []
        for run in runs:
            fitting = [label for label, row in run["rows"].items() if row["fits"]]
            best = min(fitting, key=lambda label: plans[label]["seconds_per_sample"])
            judged.append({"pick": run["chosen"], "best": best, "fitting": fitting,
                           "ratio": bl.ratio(plans[run["chosen"]]["seconds_per_sample"],
                                             plans[best]["seconds_per_sample"])})
        worst = max(judged, key=lambda j: j["ratio"])
        pick, best = worst["pick"], worst["best"]
        largest = max((label for label in worst["fitting"] if "checkpointing" not in label),
                      key=lambda label: int(label.split("x")[0]), default=None)
        budgets[name] = {
            "budget_mb": runs[0]["budget_mb"], "picks": [j["pick"] for j in judged], "runs": judged,
            "pick": pick, "best": best, "fitting": worst["fitting"], "ratio_pick_over_best": worst["ratio"],
            "ratio_per_round": [seconds_per_sample(p) / seconds_per_sample(b) for p, b in zip(by[pick].runs,
                                                                                               by[best].runs)],
            "met": bool(worst["ratio"] <= NO_DIFFERENCE),
            "planning_seconds": bl.median_of([{"s": run["planning_seconds"]} for run in runs], "s"),
            "largest_without_checkpointing": largest,
            "ratio_largest_over_best": None if largest is None else
            bl.ratio(plans[largest]["seconds_per_sample"], plans[best]["seconds_per_sample"]),
            "planner_rows": runs[0]["rows"],
        }
    return {"plans": plans, "budgets": budgets, "no_difference": NO_DIFFERENCE}


def render(args, info: dict, configs: list[bl.Config], results: dict) -> str:
    """The Markdown report: every plan with its measured cost and whether it fit each budget; the verdicts."""
    budgets = results["budgets"]
    rows = []
    for c in configs:
        plan = results["plans"][c.label]
        cells = [c.label, bl.fmt(plan["seconds_per_sample"], ".4f"),
                 bl.fmt(None if plan["peak_memory_bytes"] is None else plan["peak_memory_bytes"] / bl.MIB, ".0f")]
        for b in budgets.values():
            row = b["planner_rows"].get(c.label, {})
            mark = "yes" if row.get("fits") else "no"
            if c.label == b["pick"]:
                mark += " **picked**"
            if c.label == b["best"]:
                mark += " (fastest that fits)"
            cells += [mark, bl.fmt(row.get("planner_seconds_per_sample"), ".4f")]
        rows.append(cells)
    headers = ["plan (micro-batch x accumulation)", "s/sample, training (median)", "peak RSS MiB (median)"]
    for name, b in budgets.items():
        headers += [f"{name} ({b['budget_mb']} MiB): fits", f"{name}: planner's probe s/sample"]
    verdicts = [["budget", "MiB", "picked (each repeat)", "fastest that fits", "worst pick / fastest (medians)",
                 "per round (min..max)", "largest micro-batch without checkpointing / fastest", "planning s (median)",
                 "goal: never slower, within noise"]]
    for name, b in budgets.items():
        rounds = b["ratio_per_round"]
        verdicts.append([name, str(b["budget_mb"]), ", ".join(b["picks"]), b["best"],
                         bl.fmt(b["ratio_pick_over_best"], ".3f"), f"{min(rounds):.3f}..{max(rounds):.3f}",
                         f"{b['largest_without_checkpointing']}: {bl.fmt(b['ratio_largest_over_best'], '.3f')}",
                         bl.fmt(b["planning_seconds"], ".1f"), "met" if b["met"] else "NOT met"])
    lines = [*bl.report_header("Batch planner", args, info),
             f"--total_batch_size {args.total_batch_size}, {args.steps} optimizer steps per plan run "
             f"({args.max_train_samples} samples). Budgets: generous {budgets['generous']['budget_mb']} MiB, tight "
             f"{budgets['tight']['budget_mb']} MiB (process + gradients and AdamW state + {args.tight_samples} samples "
             "of saved activations without checkpointing, from the planner's own probe).", "",
             bl.markdown_table(headers, rows), "", bl.markdown_table(verdicts[0], verdicts[1:]), "",
             "- s/sample, training: 1 / the run's training samples/s (forward, backward, optimizer step, data), fixed "
             "plan. The planner's probe times forward + backward only, on worst-case batches of max_length tokens.",
             f"- \"Never slower, within noise\": for every planner run, its pick / the fastest plan that fit under "
             f"that run's table <= {NO_DIFFERENCE} (ratio of the plans' medians); the worst run is shown, with its "
             "per-round ratios. The fits columns are the first run's table.",
             "- " + bl.CPU_MEMORY_NOTE if configs[0].runs[0]["peak_memory_kind"] == "process_max_rss"
             else "- " + bl.GPU_MEMORY_NOTE]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the benchmark; print the report; exit 0, or 1 if a run failed."""
    args = parse_args(argv)
    if args.estimates:
        return run_estimates(args)
    info = bl.machine_info()
    with bl.Workdir(args.workdir) as workdir:
        model = args.model_name_or_path
        if model is None and args.smoke:
            model = str(bl.build_tiny_bert(workdir / "tiny-bert"))
        if args.dry_run:
            bl.print_commands(build_configs(args, model), args)
            return 0
        configs, planner = run_all(args, model, workdir)
    results = summarize(configs, planner)
    record = bl.result_record("planner", args, info, configs, results) | {"planner_runs": planner}
    bl.emit(render(args, info, configs, results), record, args)
    return 0


if __name__ == "__main__":
    sys.exit(bl.main_guard(main))
