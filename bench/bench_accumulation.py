"""Benchmark: the time and memory cost of gradient accumulation.

    python bench/bench_accumulation.py --smoke                  # seconds: tiny BERT, checks the pipeline
    python bench/bench_accumulation.py --markdown bench/results/bench_accumulation.md --json bench/results/bench_accumulation.json

Three configurations train on the same samples (``--samples``, default 384: ``--max_train_samples`` of
that and ``--max_steps`` = samples / effective batch, so each processes every sample exactly once):
micro-batch 8 x accumulation 4 (the bbc-news default), micro-batch 32 x 1 (the same effective batch in one
forward/backward) and micro-batch 8 x 1 (the same micro-batch, no accumulation). Full mode: bbc-news
with all-MiniLM-L6-v2 at the recipe defaults, fp32, 3 interleaved repeats, medians.

Reports the time per sample (seconds = 1 / samples/s) of each, the ratio (8x4) / (32x1) (goal <= 1.03:
accumulating costs at most 3% over the large batch), and the peak memory ratios 8x4 / 8x1 (goal <= 1.05:
accumulation keeps the micro-batch's memory) and 8x4 / 32x1, with the differences in MiB.

The floor (classification recipes; ``--no_floor`` skips it): ``bench/raw_loop.py``, a bare PyTorch loop on the
same model, shapes and accumulation, run interleaved as many times. Its 8x4 / 32x1 ratio is what the hardware
charges for the smaller micro-batch; the engine's 8x4 time over the bare loop's is the engine's own overhead.
"""

from __future__ import annotations

import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402

GOAL_TIME_RATIO = 1.03  # time per sample, accumulated / large batch
GOAL_MEMORY_RATIO = 1.05  # peak memory, accumulated / same micro-batch without accumulation


def parse_args(argv=None):
    """Flags: the shared ones (see ``benchlib.base_parser``), the micro-batch, the accumulation and the samples."""
    p = bl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--recipe", default="bbc-news")
    p.add_argument("--micro_batch", type=int, default=8, help="micro-batch of the accumulated and small configurations")
    p.add_argument("--accumulation", type=int, default=4, help="accumulation steps of the accumulated configuration")
    p.add_argument("--samples", type=int, default=None,
                   help="samples each configuration trains on (default 384; smoke 64); a multiple of micro x accumulation")
    p.add_argument("--mixed_precision", default="no", choices=("no", "fp16", "bf16"))
    p.add_argument("--no_floor", action="store_true", help="skip the bare PyTorch loop (bench/raw_loop.py)")
    args = p.parse_args(argv)
    bl.resolve_common(args)
    if args.samples is None:
        args.samples = args.max_train_samples or (64 if args.smoke else 384)
    effective = args.micro_batch * args.accumulation
    if args.samples % effective:
        p.error(f"--samples {args.samples} must be a multiple of micro x accumulation = {effective}")
    if args.max_train_samples is not None and args.max_train_samples != args.samples:
        p.error("--max_train_samples and --samples must agree here (each configuration trains on every sample once)")
    args.max_train_samples = args.samples
    return args


def labels(args) -> tuple[str, str, str]:
    """(accumulated, large batch, small batch) labels, e.g. ("8x4", "32x1", "8x1")."""
    m, n = args.micro_batch, args.accumulation
    return f"{m}x{n}", f"{m * n}x1", f"{m}x1"


def build_configs(args, model: str | None) -> list[bl.Config]:
    """The three configurations, each with ``--max_steps`` = samples / its effective batch."""
    common = bl.run_flags(args, model)  # args.max_train_samples == args.samples (parse_args)
    extra = shlex.split(args.extra_args)
    m, n = args.micro_batch, args.accumulation
    configs = []
    for label, (micro, accum) in zip(labels(args), ((m, n), (m * n, 1), (m, 1))):
        configs.append(bl.Config(label, common + ["--per_device_train_batch_size", str(micro),
                                                  "--gradient_accumulation_steps", str(accum),
                                                  "--max_steps", str(args.samples // (micro * accum))] + extra))
    return configs


def time_per_sample(runs: list[dict]) -> float | None:
    """Median over runs of 1 / train_samples_per_second: seconds per training sample."""
    values = [1.0 / r["train_samples_per_second"] for r in runs if r.get("train_samples_per_second")]
    return bl.median_of([{"t": v} for v in values], "t")


def measure_floor(args, model: str | None, workdir) -> dict | None:
    """Time per sample (seconds, median over ``args.repeats`` interleaved runs) of ``bench/raw_loop.py`` at
    the accumulated and the large-batch configuration, or None for a recipe that is not classification.
    (``--start forkserver``: each forked as the runs are, its output logged in ``workdir``.)"""
    import json
    import subprocess

    from finetune.recipes import load_recipe

    recipe = load_recipe(args.recipe)
    if args.no_floor or recipe.TASK != "sequence-classification":
        return None
    model = model or recipe.DEFAULTS["model_name_or_path"]
    max_length = args.max_length or recipe.DEFAULTS.get("max_length", 128)
    acc, big, _ = labels(args)
    m, n = args.micro_batch, args.accumulation
    times = {acc: [], big: []}
    for r in range(args.repeats):
        for label, (micro, accum) in ((acc, (m, n)), (big, (m * n, 1))):
            cmd = [sys.executable, str(bl.REPO / "bench" / "raw_loop.py"), "--model", model, "--micro_batch", str(micro),
                   "--accumulation", str(accum), "--samples", str(args.samples), "--max_length", str(max_length)]
            if args.start == "forkserver":  # smoke: forked like the runs (benchlib.run_script), output in a log
                log = workdir / f"raw_loop-{label}-r{r + 1}.log"
                code = bl.run_script(cmd[1:], log, num_threads=args.num_threads, timeout=args.timeout, start=args.start)
                output = log.read_text(errors="replace")
                if code != 0:
                    how = f"timed out after {args.timeout:.0f} s" if code is None else f"exit {code}"
                    raise bl.BenchError(f"bench/raw_loop.py failed ({label}, {how}):\n{output[-2000:]}")
                result = json.loads([line for line in output.splitlines() if line.startswith("{")][-1])
            else:
                done = subprocess.run(cmd, capture_output=True, text=True, env=bl.child_env(args.num_threads),
                                      timeout=args.timeout)
                if done.returncode != 0:
                    raise bl.BenchError(f"bench/raw_loop.py failed ({label}):\n{done.stderr[-2000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
            times[label].append(result["seconds"] / result["samples"])
    return {label: bl.median_of([{"t": t} for t in values], "t") for label, values in times.items()}


def summarize(args, configs: list[bl.Config], floor: dict | None = None) -> dict:
    """Time per sample (s) and peak memory (bytes) medians per configuration, and the ratios and differences."""
    acc, big, small = labels(args)
    by = {c.label: c for c in configs}
    tps = {c.label: time_per_sample(c.runs) for c in configs}
    mem = {c.label: bl.median_of(c.runs, "peak_memory_bytes") for c in configs}
    per_round = [bl.ratio(b["train_samples_per_second"], a["train_samples_per_second"])  # = tps(acc) / tps(big)
                 for a, b in zip(by[acc].runs, by[big].runs)]
    time_ratio = bl.ratio(tps[acc], tps[big])
    mem_small = bl.ratio(mem[acc], mem[small])

    def diff(a, b):
        """Peak memory of configuration ``a`` minus ``b``, bytes."""
        return None if None in (mem[a], mem[b]) else mem[a] - mem[b]

    return {
        "labels": {"accumulated": acc, "large_batch": big, "small_batch": small},
        "time_per_sample_seconds": tps,
        "peak_memory_bytes": mem,
        "samples_processed": {c.label: [r["train_samples"] for r in c.runs] for c in configs},
        "time_per_sample_ratio_accumulated_over_large_batch": time_ratio,
        "time_per_sample_ratio_per_round": per_round,
        "goal_time_per_sample_ratio": GOAL_TIME_RATIO,
        "goal_time_met": None if time_ratio is None else time_ratio <= GOAL_TIME_RATIO,
        "peak_memory_ratio_accumulated_over_small_batch": mem_small,
        "goal_peak_memory_ratio": GOAL_MEMORY_RATIO,
        "goal_memory_met": None if mem_small is None else mem_small <= GOAL_MEMORY_RATIO,
        "peak_memory_ratio_accumulated_over_large_batch": bl.ratio(mem[acc], mem[big]),
        "peak_memory_difference_bytes_accumulated_minus_small_batch": diff(acc, small),
        "peak_memory_difference_bytes_accumulated_minus_large_batch": diff(acc, big),
        "bare_loop_time_per_sample_seconds": floor,
        "bare_loop_time_per_sample_ratio_accumulated_over_large_batch": floor and bl.ratio(floor[acc], floor[big]),
        "engine_over_bare_loop_time_per_sample_accumulated": floor and bl.ratio(tps[acc], floor[acc]),
    }


def render(args, info: dict, configs: list[bl.Config], results: dict) -> str:
    """The Markdown report: machine, settings, per-configuration table, ratio table, notes."""
    acc, big, small = labels(args)
    kind = configs[0].runs[0]["peak_memory_kind"]
    rows = []
    for c in configs:
        r0 = c.runs[0]
        rows.append([c.label, str(r0["per_device_train_batch_size"]), str(r0["gradient_accumulation_steps"]),
                     str(r0["optimizer_steps"]), str(r0["train_samples"]),
                     bl.fmt(bl.median_of(c.runs, "train_samples_per_second"), ".2f"),
                     bl.fmt(results["time_per_sample_seconds"][c.label] * 1e3, ".3f"),
                     bl.fmt(bl.median_of(c.runs, "train_runtime"), ".2f"),
                     bl.fmt(results["peak_memory_bytes"][c.label] / bl.MIB, ".0f"), bl.precision_ran(c.runs),
                     str(len(c.runs))])
    table = bl.markdown_table(["config", "micro-batch", "accumulation", "optimizer steps", "samples", "samples/s (median)",
                               "ms per sample (median)", "train_runtime s (median)", "peak memory MiB (median)",
                               "precision ran", "runs"], rows)
    t = results["time_per_sample_ratio_accumulated_over_large_batch"]
    rounds = [r for r in results["time_per_sample_ratio_per_round"] if r is not None]
    ms = results["peak_memory_ratio_accumulated_over_small_batch"]

    def mib(value):
        """Bytes as a signed MiB cell."""
        return bl.fmt(None if value is None else value / bl.MIB, "+.1f")

    ratio_rows = [
        [f"time per sample ratio {acc} / {big}", bl.fmt(t, ".3f"), f"<= {GOAL_TIME_RATIO:.2f}",
         bl.goal_text(t, "<=", GOAL_TIME_RATIO)],
        [f"time per sample ratio {acc} / {big} per round (min..max)",
         f"{min(rounds):.3f}..{max(rounds):.3f}" if rounds else "n/a", "", ""],
        [f"peak memory ratio {acc} / {small}", bl.fmt(ms, ".3f"), f"<= {GOAL_MEMORY_RATIO:.2f}",
         bl.goal_text(ms, "<=", GOAL_MEMORY_RATIO)],
        [f"peak memory difference {acc} - {small} MiB",
         mib(results["peak_memory_difference_bytes_accumulated_minus_small_batch"]), "", ""],
        [f"peak memory ratio {acc} / {big}", bl.fmt(results["peak_memory_ratio_accumulated_over_large_batch"], ".3f"),
         "", ""],
        [f"peak memory difference {acc} - {big} MiB",
         mib(results["peak_memory_difference_bytes_accumulated_minus_large_batch"]), "", ""],
    ]
    if results["bare_loop_time_per_sample_seconds"]:
        floor = results["bare_loop_time_per_sample_seconds"]
        ratio_rows += [
            [f"bare PyTorch loop: ms per sample {acc} / {big}",
             f"{floor[acc] * 1e3:.3f} / {floor[big] * 1e3:.3f}", "", ""],
            [f"bare PyTorch loop: time per sample ratio {acc} / {big}",
             bl.fmt(results["bare_loop_time_per_sample_ratio_accumulated_over_large_batch"], ".3f"), "", ""],
            [f"engine / bare loop, time per sample at {acc}",
             bl.fmt(results["engine_over_bare_loop_time_per_sample_accumulated"], ".3f"), "", ""],
        ]
    lines = [*bl.report_header("Gradient accumulation: time and memory", args, info),
             f"Every configuration trains on the same {args.samples} samples (--max_steps = samples / effective "
             "batch).", "",
             table, "", bl.markdown_table(["figure", "value", "goal", "status"], ratio_rows), "",
             "- Time per sample = 1 / metrics.json `train_samples_per_second` (training only, evaluation excluded).",
             "- Bare PyTorch loop: bench/raw_loop.py, the same model and micro-batch shapes (random tokens, full "
             "length, no data loader or logging), interleaved as often: the hardware's own price for smaller "
             "micro-batches, and what the engine adds on top.",
             "- " + (bl.CPU_MEMORY_NOTE if kind == "process_max_rss" else bl.GPU_MEMORY_NOTE)]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the benchmark; print the report; exit 0, or 1 if a run failed."""
    args = parse_args(argv)
    return bl.run_benchmark("accumulation", args, build_configs, lambda configs, floor: summarize(args, configs, floor),
                            render, measure_more=measure_floor)


if __name__ == "__main__":
    sys.exit(bl.main_guard(main))
