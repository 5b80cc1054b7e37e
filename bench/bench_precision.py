"""Benchmark: fp32 vs fp16 vs bf16 mixed precision, on classification (bbc-news) and causal LM (bbc-news-clm).

    python bench/bench_precision.py --smoke                     # seconds: tiny BERT and tiny Llama
    python bench/bench_precision.py --markdown bench/results/bench_precision.md --json bench/results/bench_precision.json

Full mode: bbc-news with all-MiniLM-L6-v2 (recipe defaults: micro-batch 8 x 4, max_length 128) on 384
training samples, and bbc-news-clm with its default model (SmolLM2-135M GGUF, fetched with ``python -m
finetune.fetch smollm2-gguf``; skipped with a message if the file or the ``gguf`` package is missing) on 32
samples, one epoch each, 3 interleaved repeats, medians. Smoke mode: a tiny BERT and a tiny Llama built
from configs, the Llama trained on a few generated texts (``--train_file``).

Reports per recipe and precision: median samples/s, tokens/s, peak memory, the precision that actually
ran (metrics.json ``mixed_precision``, not the one requested: on a CPU fp16 runs as fp32), the model FLOP/s
6 x N_params x tokens/s, and on a GPU the MFU against the device's published dense bf16/fp16 tensor-core
peak (``PEAK_FLOPS``; sources named there). On a CPU MFU is not computed.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402

PRECISIONS = ("no", "fp16", "bf16")
PRECISION_LABEL = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
RECIPES = ("bbc-news", "bbc-news-clm")

from finetune.outputs.flops import peak_flops  # noqa: E402  (the table is shared with the engine)


def model_flops_per_second(num_parameters: int | None, tokens_per_second: float | None) -> float | None:
    """Training FLOP/s by the 6 x N x tokens rule (forward 2N + backward 4N per token; attention FLOPs
    left out, embedding parameters counted in N): FLOP/s from parameters and tokens/s."""
    if not num_parameters or not tokens_per_second:
        return None
    return 6.0 * num_parameters * tokens_per_second


def mfu(num_parameters: int | None, tokens_per_second: float | None, peak: float | None) -> float | None:
    """Model FLOP utilisation: ``6 x N x tokens/s / peak FLOP/s`` (a fraction; None without a peak)."""
    achieved = model_flops_per_second(num_parameters, tokens_per_second)
    return None if achieved is None or not peak else achieved / peak


def tokens_per_second(run: dict) -> tuple[float | None, str]:
    """(tokens/s, how it was obtained) for one run: causal LM has metrics.json ``train_trained_tokens_per_second``
    (label tokens, padding excluded); classification has none, so samples/s x max_length is used, an
    upper bound (shorter texts are padded only to the longest in their micro-batch)."""
    if run.get("train_trained_tokens_per_second"):
        return run["train_trained_tokens_per_second"], "trained (label) tokens/s (metrics.json)"
    if run.get("train_samples_per_second") and run.get("bench_max_length"):
        return run["train_samples_per_second"] * run["bench_max_length"], "upper bound: samples/s x max_length"
    return None, "n/a"


def parse_args(argv=None):
    """Flags: the shared ones (see ``benchlib.base_parser``; ``--model_name_or_path`` and ``--max_train_samples``
    apply to bbc-news) and the causal-LM ones."""
    p = bl.base_parser(__doc__.splitlines()[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated, from: " + ", ".join(RECIPES))
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated, from: no, fp16, bf16")
    p.add_argument("--num_train_epochs", type=float, default=1.0)
    p.add_argument("--clm_model_name_or_path", default=None,
                   help="bbc-news-clm model (default: the recipe's GGUF file; smoke: a tiny Llama)")
    p.add_argument("--clm_max_train_samples", type=int, default=None, help="bbc-news-clm training subset (default 32; smoke 16)")
    p.add_argument("--clm_train_file", default=None, help="bbc-news-clm --train_file (smoke: generated texts)")
    p.add_argument("--peak_tflops", type=float, default=None,
                   help="the GPU's dense bf16/fp16 peak in TFLOP/s, for a device not in PEAK_FLOPS")
    args = p.parse_args(argv)
    bl.resolve_common(args)
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    args.precisions = [x.strip() for x in args.precisions.split(",") if x.strip()]
    for r in args.recipes:
        if r not in RECIPES:
            p.error(f"--recipes: unknown {r!r} (choose from {', '.join(RECIPES)})")
    for x in args.precisions:
        if x not in PRECISIONS:
            p.error(f"--precisions: unknown {x!r} (choose from {', '.join(PRECISIONS)})")
    if args.max_train_samples is None:
        args.max_train_samples = 32 if args.smoke else 384
    if args.clm_max_train_samples is None:
        args.clm_max_train_samples = 16 if args.smoke else 32
    return args


def clm_model_problem(model: str) -> str | None:
    """Why the causal-LM model cannot be used (a missing file, or the ``gguf`` package missing for a
    ``.gguf`` file), or None when it can."""
    looks_like_path = model.startswith(("/", ".", "~")) or model.lower().endswith(".gguf")
    if looks_like_path and not Path(model).expanduser().exists():
        return (f"bbc-news-clm skipped: its model file {model} is missing. Fetch it with "
                "`python -m finetune.fetch smollm2-gguf` (or pass --clm_model_name_or_path).")
    if model.lower().endswith(".gguf"):
        from finetune.models.fetch import gguf_package_available

        if not gguf_package_available():
            return "bbc-news-clm skipped: reading a .gguf model needs the `gguf` package (`pip install gguf`)."
    return None


def build_configs(args, workdir: Path) -> tuple[list[bl.Config], dict[str, str]]:
    """The (recipe, precision) configurations, and {recipe: reason} for recipes skipped."""
    extra = shlex.split(args.extra_args)
    common = ["--num_train_epochs", str(args.num_train_epochs), *bl.QUIET_EVAL, "--eval_on_start", "False"]
    if args.max_length:
        common += ["--max_length", str(args.max_length)]
    per_recipe, skipped = {}, {}
    if "bbc-news" in args.recipes:
        model = args.model_name_or_path
        if model is None and args.smoke:
            model = str(bl.build_tiny_bert(workdir / "tiny-bert"))
        per_recipe["bbc-news"] = ["--recipe", "bbc-news", "--max_train_samples", str(args.max_train_samples), *common] + (
            ["--model_name_or_path", model] if model else [])
    if "bbc-news-clm" in args.recipes:
        model, train_file, validation_file = args.clm_model_name_or_path, args.clm_train_file, None
        if args.smoke:
            if model is None:
                model = str(bl.build_tiny_llama(workdir / "tiny-llama"))
            if train_file is None:
                train_file = str(bl.write_texts(workdir / "clm-train.jsonl", 32, seed=1))
                validation_file = str(bl.write_texts(workdir / "clm-valid.jsonl", 8, seed=2))
        if model is None:
            from finetune.recipes import load_recipe

            model = load_recipe("bbc-news-clm").DEFAULTS["model_name_or_path"]
        problem = clm_model_problem(model)
        if problem:
            skipped["bbc-news-clm"] = problem
        else:
            clm = ["--recipe", "bbc-news-clm", "--model_name_or_path", model,
                   "--max_train_samples", str(args.clm_max_train_samples), *common]
            if train_file:
                clm += ["--train_file", train_file]
            if validation_file:
                clm += ["--validation_file", validation_file]
            per_recipe["bbc-news-clm"] = clm
    configs = [bl.Config(f"{recipe} {PRECISION_LABEL[prec]}", argv + ["--mixed_precision", prec] + extra)
               for recipe, argv in per_recipe.items() for prec in args.precisions]
    return configs, skipped


def summarize(args, info: dict, configs: list[bl.Config]) -> dict:
    """Per configuration: medians of samples/s, tokens/s, FLOP/s, MFU (fraction), peak memory (bytes), the
    precision requested and the precision that ran; and samples/s relative to fp32 of the same recipe."""
    peak = peak_flops(info.get("gpu"), args.peak_tflops)
    out = {}
    for c in configs:
        recipe, _ = c.label.rsplit(" ", 1)
        per_run = []
        for r in c.runs:
            tps, how = tokens_per_second(r)
            per_run.append({"tokens_per_second": tps, "tokens_how": how,
                            "model_flops_per_second": model_flops_per_second(r.get("bench_num_parameters"), tps),
                            "mfu": mfu(r.get("bench_num_parameters"), tps, peak[0]) if peak and r.get("device") == "cuda"
                            else None})
        med = {k: bl.median_of(per_run, k) for k in ("tokens_per_second", "model_flops_per_second", "mfu")}
        out[c.label] = {
            "recipe": recipe,
            "mixed_precision_requested": c.runs[0].get("mixed_precision_requested"),
            "mixed_precision": bl.precision_ran(c.runs),
            "train_samples_per_second": bl.median_of(c.runs, "train_samples_per_second"),
            "train_runtime": bl.median_of(c.runs, "train_runtime"),
            "peak_memory_bytes": bl.median_of(c.runs, "peak_memory_bytes"),
            "peak_memory_kind": c.runs[0].get("peak_memory_kind"),
            "num_parameters": c.runs[0].get("bench_num_parameters"),
            "tokens_per_second": med["tokens_per_second"],
            "tokens_per_second_how": per_run[0]["tokens_how"],
            "model_flops_per_second": med["model_flops_per_second"],
            "mfu": med["mfu"],
            "device": c.runs[0].get("device"),
        }
    for _label, row in out.items():
        base = out.get(f"{row['recipe']} fp32")
        row["samples_per_second_vs_fp32"] = bl.ratio(row["train_samples_per_second"],
                                                     base["train_samples_per_second"]) if base else None
    return {"configs": out, "peak_flops": peak[0] if peak else None, "peak_flops_source": peak[1] if peak else None}


def render(args, info: dict, results: dict, skipped: dict[str, str]) -> str:
    """The Markdown report: machine, settings, one table over recipes and precisions, notes."""
    rows = []
    on_gpu = any(row["device"] == "cuda" for row in results["configs"].values())
    for _label, row in results["configs"].items():
        rows.append([row["recipe"], PRECISION_LABEL.get(row["mixed_precision_requested"], "?"), row["mixed_precision"],
                     bl.fmt(row["train_samples_per_second"], ".2f"), bl.fmt(row["samples_per_second_vs_fp32"], ".3f"),
                     bl.fmt(row["tokens_per_second"], ".0f"), bl.fmt(row["peak_memory_bytes"] / bl.MIB, ".0f"),
                     bl.fmt(row["num_parameters"] / 1e6 if row["num_parameters"] else None, ".2f"),
                     bl.fmt(row["model_flops_per_second"] / 1e12 if row["model_flops_per_second"] else None, ".4f"),
                     bl.fmt(row["mfu"] * 100 if row["mfu"] is not None else None, ".2f", " %") if on_gpu
                     else "not computed (CPU)"])
    table = bl.markdown_table(["recipe", "requested", "precision ran", "samples/s (median)", "samples/s vs fp32",
                               "tokens/s (median)", "peak memory MiB (median)", "params (M)", "model TFLOP/s",
                               "MFU"], rows)
    notes = ["- `precision ran` is metrics.json `mixed_precision`: what autocast really ran (`no` = fp32), not the "
             "request."]
    if not on_gpu:
        notes += ["- MFU is not computed on CPU (no published peak to divide by); model TFLOP/s is still shown.",
                  "- fp16 does not run on CPU: a run asked for fp16 runs fp32 and records `mixed_precision` = no."]
    else:
        if results["peak_flops"]:
            notes.append(f"- MFU = 6 x N_params x tokens/s / {results['peak_flops'] / 1e12:.1f} TFLOP/s "
                         f"(dense bf16/fp16 tensor-core peak of {info['gpu']}; source: {results['peak_flops_source']}). "
                         "fp32 rows are measured against the same peak.")
        else:
            notes.append(f"- MFU not computed: no peak FLOP/s known for {info['gpu']}; pass --peak_tflops.")
    notes += ["- model TFLOP/s = 6 x N_params x tokens/s (N from the saved model's safetensors, embeddings included; "
              "attention FLOPs left out).",
              "- tokens/s: bbc-news-clm reports trained (label) tokens/s (metrics.json `train_trained_tokens_per_second`); bbc-news has "
              "no token count, so it is samples/s x max_length, an upper bound.",
              "- " + (bl.GPU_MEMORY_NOTE if on_gpu else bl.CPU_MEMORY_NOTE)]
    notes += [f"- {reason}" for reason in skipped.values()]
    smoke = " (SMOKE: tiny models, numbers mean nothing)" if args.smoke else ""
    models = ("tiny BERT and tiny Llama (2 layers, 32 wide, built from configs; the Llama on generated texts)"
              if args.smoke else "the recipe defaults (all-MiniLM-L6-v2; SmolLM2-135M GGUF)")
    lines = [f"# Mixed precision: fp32 vs fp16 vs bf16{smoke}", "", bl.format_machine(info, args.num_threads), "",
             f"Recipes {', '.join(args.recipes)}; models: {models}; {args.num_train_epochs:g} epoch(s) over "
             f"{args.max_train_samples} (bbc-news) / {args.clm_max_train_samples} (bbc-news-clm) training samples, "
             f"recipe batch settings{f', max_length {args.max_length}' if args.max_length else ''}; {args.repeats} "
             f"repeat(s) interleaved, medians reported. {bl.run_process_text(args)}", "",
             table if rows else "(no configuration ran)", "", *notes]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the benchmark; print the report; exit 0, or 1 if a run failed."""
    args = parse_args(argv)
    info = bl.machine_info()
    with bl.Workdir(args.workdir) as workdir:
        configs, skipped = build_configs(args, workdir)
        for reason in skipped.values():
            print(reason, file=sys.stderr)
        if args.dry_run:
            bl.print_commands(configs, args)
            return 0
        bl.run_configs(configs, args, workdir)
    results = summarize(args, info, configs)
    results["skipped"] = skipped
    report = render(args, info, results, skipped)
    result = bl.result_record("precision", args, info, configs, results)
    bl.emit(report, result, args)
    return 0


if __name__ == "__main__":
    sys.exit(bl.main_guard(main))
