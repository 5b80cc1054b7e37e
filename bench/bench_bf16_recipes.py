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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402

from finetune.machine import cpu_features, cpu_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RECIPES = ("bbc-news", "bbc-headlines", "bbc-news-clm")
METRIC = {"bbc-news": "eval_accuracy", "bbc-headlines": "eval_rougeL", "bbc-news-clm": "eval_perplexity"}
SEEDS = (42, 1, 2)
LABEL = {"no": "fp32", "bf16": "bf16"}


def cpu_kind() -> str:
    """The CPU as the table groups it: model name and the bf16-relevant flags it has (``finetune.machine``)."""
    flags = [f for f in cpu_features() if f in ("avx512_bf16", "amx_bf16")]
    return f"{cpu_model()} ({', '.join(flags) if flags else 'no avx512_bf16, no AMX: bf16 emulated'})"


def load_records(path: Path) -> list[dict]:
    """The records of ``path`` (a JSON list), [] if it does not exist."""
    return json.loads(path.read_text()) if path.is_file() else []


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


def summarize(records: list[dict]) -> dict:
    """Per CPU kind and recipe: the seeds measured in both precisions, median samples/s of each, the median
    per-seed ratio bf16 / fp32, and the metric's values, mean and standard deviation (over seeds) per precision."""
    out: dict = {}
    for r in records:
        out.setdefault(r["cpu_kind"], {}).setdefault(r["recipe"], {}).setdefault(r["precision_requested"], {})[r["seed"]] = r
    table = {}
    for kind, recipes in out.items():
        for recipe, by_precision in recipes.items():
            fp32, bf16 = by_precision.get("no", {}), by_precision.get("bf16", {})
            both = sorted(set(fp32) & set(bf16))
            row = {"seeds_both": both, "metric": METRIC.get(recipe, "eval_accuracy")}
            for label, runs in (("fp32", fp32), ("bf16", bf16)):
                values = [runs[s]["metric_value"] for s in sorted(runs) if runs[s]["metric_value"] is not None]
                row[label] = {"seeds": sorted(runs), "precision_ran": sorted({runs[s]["precision_ran"] for s in runs}),
                              "samples_per_second": statistics.median([runs[s]["train_samples_per_second"] for s in runs])
                              if runs else None,
                              "hfu_of_measured_peak": [runs[s]["hfu_of_measured_peak"] for s in sorted(runs)],
                              "metric_values": values,
                              "metric_mean": statistics.fmean(values) if values else None,
                              "metric_stdev": statistics.stdev(values) if len(values) > 1 else None}
            ratios = [bf16[s]["train_samples_per_second"] / fp32[s]["train_samples_per_second"] for s in both]
            row["ratio_bf16_fp32"] = statistics.median(ratios) if ratios else None
            row["ratios"] = ratios
            table.setdefault(kind, {})[recipe] = row
    return table


def _metric_text(side: dict) -> str:
    if side["metric_mean"] is None:
        return "not run"
    spread = f" ± {side['metric_stdev']:.4f}" if side["metric_stdev"] is not None else ""
    return f"{side['metric_mean']:.4f}{spread} (n={len(side['metric_values'])})"


def render(table: dict) -> str:
    """The Markdown table, one block per CPU kind."""
    lines = ["# bf16 against fp32 on CPUs, per recipe (bench/bench_bf16_recipes.py)", "",
             "Each recipe at its defaults, `--mixed_precision no` (fp32) against `--mixed_precision bf16`, one run per "
             "seed (42, 1, 2), evaluation included. samples/s: training only, median over seeds; ratio: median of the "
             "per-seed ratios bf16 / fp32; metric: mean ± standard deviation over seeds (perplexity: lower is "
             "better). The records, with every run's figures, are in [bf16-recipes.json](bf16-recipes.json). "
             "bbc-news's records of 2026-11-28 ran at micro-batch 8 x 4, its default then (16 x 2 since, the same "
             "32 samples a step). The shares of the peak in the records taken before 10:00 on 2026-11-28 are over one measurement of "
             "it, not the best measured (docs/benchmarks.md, \"The peak moves\").", ""]
    for kind, recipes in table.items():
        lines += [f"## {kind}", "", "| recipe | seeds in both | fp32 samples/s | bf16 samples/s | bf16 / fp32 | metric | "
                  "fp32 | bf16 |", "|---|---|---|---|---|---|---|---|"]
        for recipe, row in recipes.items():
            lines.append(f"| {recipe} | {len(row['seeds_both'])} | {bl.fmt(row['fp32']['samples_per_second'], '.2f')} | "
                         f"{bl.fmt(row['bf16']['samples_per_second'], '.2f')} | "
                         f"{bl.fmt(row['ratio_bf16_fp32'], '.2f', 'x')} | {row['metric']} | {_metric_text(row['fp32'])} | "
                         f"{_metric_text(row['bf16'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds")
    p.add_argument("--precisions", default="no,bf16", help="comma-separated --mixed_precision values")
    p.add_argument("--records", type=Path, default=REPO / "docs" / "bf16-recipes.json", help="the records (JSON), appended to")
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
        table = summarize([r for r in records if not r["extra_args"] or args.smoke])
        text = render(table)
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(bl.main_guard(main))
