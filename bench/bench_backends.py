"""Benchmark: the accelerate backend vs the Trainer backend on the same recipe and settings.

    python bench/bench_backends.py --smoke                      # seconds: tiny BERT, checks the pipeline
    python bench/bench_backends.py --markdown bench/results/bench_backends.md --json bench/results/bench_backends.json

Full mode: bbc-news with all-MiniLM-L6-v2 (the recipe defaults), micro-batch 8 x accumulation 4, fp32,
one epoch over 384 training samples (about a minute per run on 2 CPU cores), 3 interleaved repeats
(accelerate, trainer, accelerate, trainer, ...). Reports the median train samples/s of each backend and
their ratio accelerate / trainer (goal >= 1.10), the median train_runtime and peak memory of each.
"""

from __future__ import annotations

import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402

GOAL_RATIO = 1.10  # accelerate samples/s / trainer samples/s
BACKENDS = ("accelerate", "trainer")


def parse_args(argv=None):
    """Flags: the shared ones (see ``benchlib.base_parser``) and the training settings compared."""
    p = bl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--recipe", default="bbc-news")
    p.add_argument("--per_device_train_batch_size", type=int, default=8, help="micro-batch (samples)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--mixed_precision", default="no", choices=("no", "fp16", "bf16"))
    p.add_argument("--num_train_epochs", type=float, default=1.0)
    args = p.parse_args(argv)
    bl.resolve_common(args)
    if args.max_train_samples is None:
        args.max_train_samples = 32 if args.smoke else 384
    return args


def build_configs(args, model: str | None) -> list[bl.Config]:
    """One ``Config`` per backend, identical flags except ``--backend``."""
    common = bl.run_flags(args, model, "--per_device_train_batch_size", str(args.per_device_train_batch_size),
                          "--gradient_accumulation_steps", str(args.gradient_accumulation_steps))
    common += ["--num_train_epochs", str(args.num_train_epochs), *shlex.split(args.extra_args)]
    return [bl.Config(backend, common + ["--backend", backend]) for backend in BACKENDS]


def summarize(configs: list[bl.Config]) -> dict:
    """Medians per backend (samples/s, seconds, bytes) and the ratios: accelerate / trainer samples/s (of the
    medians, and per interleaved round), peak memory accelerate / trainer and the difference in bytes."""
    by = {c.label: c for c in configs}
    med = {b: {k: bl.median_of(by[b].runs, k) for k in ("train_samples_per_second", "train_runtime", "peak_memory_bytes")}
           for b in BACKENDS}
    speed = bl.ratio(med["accelerate"]["train_samples_per_second"], med["trainer"]["train_samples_per_second"])
    per_round = [bl.ratio(a["train_samples_per_second"], t["train_samples_per_second"])
                 for a, t in zip(by["accelerate"].runs, by["trainer"].runs)]
    mem_a, mem_t = med["accelerate"]["peak_memory_bytes"], med["trainer"]["peak_memory_bytes"]
    return {
        "samples_per_second_ratio_accelerate_over_trainer": speed,
        "samples_per_second_ratio_per_round": per_round,
        "goal_samples_per_second_ratio": GOAL_RATIO,
        "goal_met": None if speed is None else speed >= GOAL_RATIO,
        "peak_memory_ratio_accelerate_over_trainer": bl.ratio(mem_a, mem_t),
        "peak_memory_difference_bytes_accelerate_minus_trainer": None if None in (mem_a, mem_t) else mem_a - mem_t,
        "medians": med,
    }


def render(args, info: dict, configs: list[bl.Config], results: dict) -> str:
    """The Markdown report: machine, settings, per-backend table, ratio table, notes."""
    by = {c.label: c for c in configs}
    kind = by["accelerate"].runs[0]["peak_memory_kind"]
    rows = []
    for b in BACKENDS:
        runs = by[b].runs
        rows.append([b, bl.fmt(bl.median_of(runs, "train_samples_per_second"), ".2f"),
                     bl.fmt(bl.median_of(runs, "train_runtime"), ".2f"),
                     bl.fmt(bl.median_of(runs, "peak_memory_bytes") / bl.MIB, ".0f"), runs[0]["peak_memory_kind"],
                     bl.precision_ran(runs), str(runs[0]["optimizer_steps"]), str(len(runs))])
    table = bl.markdown_table(["backend", "samples/s (median)", "train_runtime s (median)", "peak memory MiB (median)",
                               "memory measured as", "precision ran", "optimizer steps", "runs"], rows)
    speed = results["samples_per_second_ratio_accelerate_over_trainer"]
    rounds = [r for r in results["samples_per_second_ratio_per_round"] if r is not None]
    diff = results["peak_memory_difference_bytes_accelerate_minus_trainer"]
    ratio_rows = [
        ["samples/s ratio accelerate / trainer", bl.fmt(speed, ".3f"), f">= {GOAL_RATIO:.2f}",
         bl.goal_text(speed, ">=", GOAL_RATIO)],
        ["samples/s ratio per round (min..max)", f"{min(rounds):.3f}..{max(rounds):.3f}" if rounds else "n/a", "", ""],
        ["peak memory ratio accelerate / trainer", bl.fmt(results["peak_memory_ratio_accelerate_over_trainer"], ".3f"), "", ""],
        ["peak memory difference accelerate - trainer MiB", bl.fmt(None if diff is None else diff / bl.MIB, "+.1f"), "", ""],
    ]
    ratios = bl.markdown_table(["figure", "value", "goal", "status"], ratio_rows)
    lines = [*bl.report_header("accelerate vs Trainer backend", args, info),
             f"{args.num_train_epochs:g} epoch(s) over {args.max_train_samples} training samples.", "",
             table, "", ratios, "",
             "- " + (bl.CPU_MEMORY_NOTE if kind == "process_max_rss" else bl.GPU_MEMORY_NOTE),
             "- samples/s is metrics.json `train_samples_per_second` (training only, evaluation excluded).",
             "- Precision ran is metrics.json `mixed_precision` (what autocast really ran, not what was requested)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the benchmark; print the report; exit 0, or 1 if a run failed."""
    return bl.run_benchmark("backends", parse_args(argv), build_configs, summarize, render)


if __name__ == "__main__":
    sys.exit(bl.main_guard(main))
