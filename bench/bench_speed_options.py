"""Benchmark: each speed option of the accelerate engine against the same run without it.

    python bench/bench_speed_options.py --smoke                 # seconds: tiny BERT, checks the pipeline
    python bench/bench_speed_options.py --markdown bench/results/bench_speed_options.md --json bench/results/bench_speed_options.json

Configurations (all with the recipe's defaults otherwise; one flag changed at a time):
``baseline``; ``group_by_length`` (``--train_sampling_strategy group_by_length``); ``torch_compile``
(``--torch_compile``: inductor; its compilation time is inside ``train_runtime``, as a user pays it);
``fused_adamw`` (``--optim adamw_torch_fused``); ``workers_2`` (``--dataloader_num_workers 2``).
``--options`` picks a subset (smoke leaves out torch_compile, which compiles for ~40 s even a tiny model).

Full mode: bbc-news with all-MiniLM-L6-v2, micro-batch 8 x accumulation 4, fp32, 384 training samples at the
recipe's max_length unless ``--max_length`` says otherwise, 3 interleaved repeats, medians. Reports samples/s
and its ratio to the baseline (of the medians, and min..max over interleaved rounds), the padding fraction
(padding / input positions, metrics.json ``train_padding_fraction``) and peak memory, and a verdict: an
option "helps" when the median ratio is >= 1.03 and every round is > 1.0; the engine turns an option on by
default only where this benchmark, on that kind of device, says it helps.
"""

from __future__ import annotations

import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402

OPTIONS = {
    "group_by_length": ["--train_sampling_strategy", "group_by_length"],
    "torch_compile": ["--torch_compile", "True"],
    "fused_adamw": ["--optim", "adamw_torch_fused"],
    "workers_2": ["--dataloader_num_workers", "2"],
}
HELPS_RATIO = 1.03  # median samples/s ratio over the baseline for an option to count as helping


def parse_args(argv=None):
    """Flags: the shared ones (see ``benchlib.base_parser``), the options measured and the batch settings."""
    p = bl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--recipe", default="bbc-news")
    p.add_argument("--options", default=None,
                   help=f"comma-separated subset of {','.join(OPTIONS)} (default: all; smoke: all but torch_compile)")
    p.add_argument("--per_device_train_batch_size", type=int, default=8, help="micro-batch (samples)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--mixed_precision", default="no", choices=("no", "fp16", "bf16"))
    args = p.parse_args(argv)
    bl.resolve_common(args)
    if args.max_train_samples is None:
        args.max_train_samples = 64 if args.smoke else 384
    if args.options is None:
        args.options = [o for o in OPTIONS if not (args.smoke and o == "torch_compile")]
    else:
        args.options = [o.strip() for o in args.options.split(",") if o.strip()]
        unknown = [o for o in args.options if o not in OPTIONS]
        if unknown or not args.options:
            p.error(f"--options: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(OPTIONS)}")
    return args


def build_configs(args, model: str | None) -> list[bl.Config]:
    """``baseline`` and one configuration per option, identical flags otherwise."""
    common = bl.run_flags(args, model, "--per_device_train_batch_size", str(args.per_device_train_batch_size),
                          "--gradient_accumulation_steps", str(args.gradient_accumulation_steps))
    common += ["--num_train_epochs", "1", *shlex.split(args.extra_args)]
    return [bl.Config("baseline", common)] + [bl.Config(o, common + OPTIONS[o]) for o in args.options]


def summarize(configs: list[bl.Config]) -> dict:
    """Per option: median samples/s ratio over the baseline, per-round ratios, the verdict, padding fraction
    and peak memory medians (bytes)."""
    by = {c.label: c for c in configs}
    base = by["baseline"]
    base_speed = bl.median_of(base.runs, "train_samples_per_second")
    out = {"helps_ratio": HELPS_RATIO, "options": {}}
    for c in configs:
        speed = bl.median_of(c.runs, "train_samples_per_second")
        rounds = [bl.ratio(r["train_samples_per_second"], b["train_samples_per_second"]) for r, b in zip(c.runs, base.runs)]
        ratio = bl.ratio(speed, base_speed)
        out["options"][c.label] = {
            "samples_per_second": speed,
            "samples_per_second_ratio_over_baseline": ratio,
            "ratio_per_round": rounds,
            "helps": None if c.label == "baseline" or ratio is None else
            bool(ratio >= HELPS_RATIO and all(r is not None and r > 1.0 for r in rounds)),
            "train_padding_fraction": bl.median_of(c.runs, "train_padding_fraction"),
            "peak_memory_bytes": bl.median_of(c.runs, "peak_memory_bytes"),
            "train_runtime": bl.median_of(c.runs, "train_runtime"),
        }
    return out


def render(args, info: dict, configs: list[bl.Config], results: dict) -> str:
    """The Markdown report: machine, settings, one row per configuration, notes."""
    rows = []
    for c in configs:
        r = results["options"][c.label]
        rounds = [x for x in r["ratio_per_round"] if x is not None]
        verdict = "-" if r["helps"] is None else ("helps" if r["helps"] else "does not help")
        rows.append([c.label, " ".join(OPTIONS.get(c.label, [])) or "(recipe defaults)",
                     bl.fmt(r["samples_per_second"], ".2f"), bl.fmt(r["samples_per_second_ratio_over_baseline"], ".3f"),
                     f"{min(rounds):.3f}..{max(rounds):.3f}" if rounds else "n/a",
                     bl.fmt(r["train_padding_fraction"], ".3f"), bl.fmt(r["train_runtime"], ".2f"),
                     bl.fmt(None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / bl.MIB, ".0f"),
                     bl.precision_ran(c.runs), verdict])
    table = bl.markdown_table(["config", "flags", "samples/s (median)", "ratio vs baseline", "ratio per round (min..max)",
                               "padding fraction", "train_runtime s (median)", "peak memory MiB (median)",
                               "precision ran", "verdict"], rows)
    kind = configs[0].runs[0]["peak_memory_kind"]
    lines = [*bl.report_header("Speed options", args, info),
             f"One epoch over {args.max_train_samples} training samples.", "", table, "",
             f"- Verdict: \"helps\" when the median samples/s ratio is >= {HELPS_RATIO} and every interleaved round "
             "is > 1.0.",
             "- torch_compile's train_runtime includes its compilation (a user pays it once per run).",
             "- Padding fraction: padding / input positions over training (metrics.json `train_padding_fraction`).",
             "- " + (bl.CPU_MEMORY_NOTE if kind == "process_max_rss" else bl.GPU_MEMORY_NOTE)]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the benchmark; print the report; exit 0, or 1 if a run failed."""
    return bl.run_benchmark("speed_options", parse_args(argv), build_configs, summarize, render)


if __name__ == "__main__":
    sys.exit(bl.main_guard(main))
