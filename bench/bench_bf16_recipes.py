"""Benchmark: bf16 against fp32 on whole recipes, over seeds, per CPU kind (issue 41's table).

    python bench/bench_bf16_recipes.py                                  # every recipe x seed x precision not yet recorded
    python bench/bench_bf16_recipes.py --recipes bbc-news --precisions no   # only part of it
    python bench/bench_bf16_recipes.py --render                         # only rewrite the table from the records
    python bench/bench_bf16_recipes.py --smoke                          # seconds: a tiny BERT, 2 seeds, its own files

Each run is the recipe at its defaults, ``finetune train --recipe R --seed S --mixed_precision P`` in a fresh
process, evaluation included (the metric is the point). One record per run (samples/s, train_runtime, the recipe's
metric, the precision that ran, the share of the measured matmul peak, the CPU's model and bf16 flags) is appended
to ``--records`` as soon as the run ends, so a long campaign stopped half-way keeps what it measured and a later call
(on this machine or on another CPU kind) runs only what is missing. Within a seed the precisions alternate in ABBA
order over the recipes, so drift on the machine falls on both.

The table (``--markdown``) has one block per CPU kind (model and bf16 flags, ``finetune.machine``): per recipe, the
seeds done in both precisions, median samples/s of each, the median of the per-seed ratios bf16 / fp32, and the
metric's mean and spread in each. Where the recipe's metric is a loss or perplexity lower is better.

The records (default: ``recipes/bf16_measured.json``, shipped with the package) also decide what a run that asks for
fp16 trains in on a CPU of that kind (``finetune/engine/cpu_bf16.py``); a machine's own measurements go to
``--records ~/.cache/finetune/bf16_measured.json``, which runs read too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402

from finetune.engine.cpu_bf16 import METRIC, RECORDS, load_records, summarize, verdict  # noqa: E402
from finetune.machine import cpu_kind  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RECIPES = ("bbc-news", "bbc-headlines", "bbc-news-clm")
SEEDS = (42, 1, 2)
LABEL = {"no": "fp32", "bf16": "bf16"}


def record_run(recipe: str, seed: int, precision: str, metrics: dict, kind: str, extra: list[str]) -> dict:
    """One run's record from its ``metrics.json`` (units: samples/s, seconds, shares of the measured peak)."""
    metric = METRIC.get(recipe, "eval_accuracy")
    return {"cpu_kind": kind, "recipe": recipe, "seed": seed, "precision_requested": precision,
            "precision_ran": metrics.get("mixed_precision"), "extra_args": extra,
            "train_samples_per_second": metrics.get("train_samples_per_second"),
            "train_runtime": metrics.get("train_runtime"), "metric": metric, "metric_value": metrics.get(metric),
            "hfu_of_measured_peak": metrics.get("hfu_of_measured_peak"),
            "measured_peak_flops_per_second": metrics.get("measured_peak_flops_per_second"),
            "bench_wall_seconds": metrics.get("bench_wall_seconds")}


def plan(recipes, seeds, precisions, done: set) -> list[tuple[str, int, str]]:
    """(recipe, seed, precision) still to run: seed by seed, each recipe's precisions in ABBA order over the
    recipes (A B for the first recipe, B A for the next, ...)."""
    todo, flip = [], False
    for seed in seeds:
        for recipe in recipes:
            order = list(reversed(precisions)) if flip else list(precisions)
            flip = not flip
            todo += [(recipe, seed, p) for p in order if (recipe, seed, p) not in done]
    return todo


def _metric_text(side: dict) -> str:
    if side["metric_mean"] is None:
        return "not run"
    spread = f" ± {side['metric_stdev']:.4f}" if side["metric_stdev"] is not None else ""
    return f"{side['metric_mean']:.4f}{spread} (n={len(side['metric_values'])})"


def render(table: dict, records: list[dict] | None = None) -> str:
    """The Markdown table, one block per CPU kind; with ``records`` (those ``table`` summarizes), what an fp16
    request runs for each recipe (``finetune.engine.cpu_bf16.verdict``)."""
    lines = ["# bf16 against fp32 on CPUs, per recipe (bench/bench_bf16_recipes.py)", "",
             "Each recipe at its defaults, `--mixed_precision no` (fp32) against `--mixed_precision bf16`, one run per "
             "seed (42, 1, 2), evaluation included. samples/s: training only, median over seeds; ratio: median of the "
             "per-seed ratios bf16 / fp32; metric: mean ± standard deviation over seeds (perplexity: lower is "
             "better). The records, with every run's figures, are in "
             "`recipes/bf16_measured.json`, which also decide whether a CPU run asked "
             "for fp16 trains in bf16 (`finetune/engine/cpu_bf16.py`). "
             "bbc-news's records of 2026-11-28 ran at micro-batch 8 x 4, its default then (16 x 2 since, the same "
             "32 samples a step). The shares of the peak in the records taken before 10:00 on 2026-11-28 are over one measurement of "
             "it, not the best measured (docs/speed.md, \"The peak moves\"). On that Intel VM the cores' speed "
             "moves up to 1.5x from one run to the next (bbc-headlines in fp32: 0.56 to 0.84 samples/s over three "
             "seeds), so one seed's ratio is rough there; the per-seed ratios are in the table.", ""]
    for kind, recipes in table.items():
        lines += [f"## {kind}", "", "| recipe | seeds in both | fp32 samples/s | bf16 samples/s | bf16 / fp32 | metric | "
                  "fp32 | bf16 | bf16 / fp32 per seed, in seed order | fp16 asked runs |", "|---|---|---|---|---|---|---|---|---|---|"]
        for recipe, row in recipes.items():
            found = verdict(recipe, kind, records) if records is not None else None
            runs = "not decided (fewer than 3 seeds)" if found is None else "bf16" if found.runs_bf16 else (
                f"fp32 ({'bf16 ' if found.reason == 'slower' else ''}{found.reason})")
            per_seed = ", ".join(f"{ratio:.2f}" for ratio in row["ratios"]) or "-"
            lines.append(f"| {recipe} | {len(row['seeds_both'])} | {bl.fmt(row['fp32']['samples_per_second'], '.2f')} | "
                         f"{bl.fmt(row['bf16']['samples_per_second'], '.2f')} | "
                         f"{bl.fmt(row['ratio_bf16_fp32'], '.2f', 'x')} | {row['metric']} | {_metric_text(row['fp32'])} | "
                         f"{_metric_text(row['bf16'])} | {per_seed} | {runs} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds")
    p.add_argument("--precisions", default="no,bf16", help="comma-separated --mixed_precision values")
    p.add_argument("--records", type=Path, default=RECORDS, help="the records (JSON), appended to")
    p.add_argument("--markdown", type=Path, default=REPO / "docs" / "bf16-recipes.md", help="the table, rewritten")
    p.add_argument("--render", action="store_true", help="only rewrite --markdown from --records")
    p.add_argument("--extra_args", default="", help="more run.py flags for every run, as one quoted string")
    p.add_argument("--timeout", type=float, default=7200, help="seconds per run before it is killed")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny BERT on bbc-news (24 samples, 2 seeds), records and table in a temporary folder "
                        "unless --records/--markdown are given; its numbers mean nothing")
    args = p.parse_args(argv)
    extra = args.extra_args.split()
    seeds = [int(s) for s in args.seeds.split(",")]
    recipes = args.recipes.split(",")
    with tempfile.TemporaryDirectory(prefix="finetune-bf16-") as tmp:
        workdir = Path(tmp)
        if args.smoke:
            if "--records" not in (argv or sys.argv):
                args.records = workdir / "records.json"
            if "--markdown" not in (argv or sys.argv):
                args.markdown = workdir / "table.md"
            model = bl.build_tiny_bert(args.records.parent / "tiny-bert")  # beside the records: the same flags next call
            extra = ["--model_name_or_path", str(model), "--max_train_samples", "24", "--max_eval_samples", "16",
                     "--max_length", "32", *extra]
            recipes, seeds = ["bbc-news"], seeds[:2]
        records = load_records(args.records)
        kind = cpu_kind()
        if not args.render:
            done = {(r["recipe"], r["seed"], r["precision_requested"]) for r in records
                    if r["cpu_kind"] == kind and r["extra_args"] == extra}
            todo = plan(recipes, seeds, args.precisions.split(","), done)
            print(f"{kind}: {len(todo)} run(s) to do, {len(done)} recorded", file=sys.stderr)
            for i, (recipe, seed, precision) in enumerate(todo, 1):
                out = workdir / f"{recipe}-{seed}-{precision}"
                print(f"[{i}/{len(todo)}] {recipe} seed {seed} {LABEL.get(precision, precision)} ...", end="",
                      file=sys.stderr, flush=True)
                metrics = bl.run_cli(["--recipe", recipe, "--seed", str(seed), "--mixed_precision", precision, *extra],
                                     out, out.with_suffix(".log"), timeout=args.timeout,
                                     num_threads=1 if args.smoke else None)
                record = record_run(recipe, seed, precision, metrics, kind, extra)
                records.append(record)
                args.records.parent.mkdir(parents=True, exist_ok=True)
                args.records.write_text(json.dumps(records, indent=1) + "\n")
                print(f" {record['train_samples_per_second']:.2f} samples/s, {record['metric']} "
                      f"{record['metric_value']}, ran {record['precision_ran']}", file=sys.stderr, flush=True)
        used = [r for r in records if not r["extra_args"] or args.smoke]
        text = render(summarize(used), used if not args.smoke else None)
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(bl.main_guard(main))
