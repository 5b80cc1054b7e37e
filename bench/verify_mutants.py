"""The soundness of ``finetune verify``, measured: every wrong engine of ``tests/faults/mutants.py`` (one
normalisation line of the accelerate backend changed) and the clean engine, through ``finetune verify`` in
every setting (precision, processes, LoRA, a mixture-of-experts model, classification and causal LM). A mutant
is *caught* when verify exits 1 naming a way as not exact; the clean engine must exit 0. A mutant that cannot
differ from the clean engine in a setting (the average over processes, or a process's own items, on one process)
is *equivalent* there, and shown so.

    python bench/verify_mutants.py [--settings NAME,...] [--mutants NAME,...] [--markdown docs/verify-mutants.md]
                                   [--smoke]

The small mutants (1% on the first micro-batch of each window, 1.5% on a short last window) are at the sizes
verify's calibrated small controls claim to detect; the table's last rows give, per setting, the threshold the
clean run printed (the smallest mis-weighting its small controls were caught at) and how far its correct ways
stood from the noise floor (the evidence for ``verify.FLOOR_FACTOR``).

Each verify runs through the real launcher (``accelerate launch --module finetune.commands.verify``) on tiny models
built from configs (``tests/tiny_models.py``), with ``tests/faults`` first on ``PYTHONPATH`` and
``FAULT_MUTANT`` naming the mutant. Prints the table (mutant x setting) and the seconds each took.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402  (puts the repository and tests/ on sys.path)
from faults.finetune_faults import FAULTS_DIR  # noqa: E402
from faults.mutants import MUTANT_ENV, MUTANTS  # noqa: E402
from tiny_models import build_tiny_bert, build_tiny_llama, build_tiny_moe, write_variable_length_texts  # noqa: E402

SMALL = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--verify_steps", "2",
         "--max_eval_samples", "4", "--max_length", "96", "--learning_rate", "1e-3", "--warmup_steps", "0"]
# name -> (model kind, recipe, processes, extra flags, environment)
SETTINGS = {
    "cls fp32 P1": ("bert", "bbc-news", 1, ["--mixed_precision", "no"], {}),
    "clm fp32 P1": ("llama", "bbc-news-clm", 1, ["--mixed_precision", "no"], {}),
    "clm bf16 P1": ("llama", "bbc-news-clm", 1, ["--mixed_precision", "bf16"], {}),
    "clm fp16 P1": ("llama", "bbc-news-clm", 1, ["--mixed_precision", "fp16"], {"FAULT_CPU_FP16": "1"}),
    "clm fp16 P2": ("llama", "bbc-news-clm", 2, ["--mixed_precision", "fp16"], {"FAULT_CPU_FP16": "1"}),
    "MoE bf16 P1": ("moe", "bbc-news-clm", 1, ["--mixed_precision", "bf16"], {}),
    "clm LoRA P1": ("llama", "bbc-news-clm", 1, ["--mixed_precision", "no", "--use_peft", "--lora_r", "4"], {}),
    "MoE fp32 P1": ("moe", "bbc-news-clm", 1, ["--mixed_precision", "no"], {}),
    "cls fp32 P2": ("bert", "bbc-news", 2, ["--mixed_precision", "no"], {}),
    "clm fp32 P2": ("llama", "bbc-news-clm", 2, ["--mixed_precision", "no"], {}),
    "cls bf16 P2": ("bert", "bbc-news", 2, ["--mixed_precision", "bf16"], {}),
    "clm bf16 P2": ("llama", "bbc-news-clm", 2, ["--mixed_precision", "bf16"], {}),
    "clm LoRA P2": ("llama", "bbc-news-clm", 2, ["--mixed_precision", "no", "--use_peft", "--lora_r", "4"], {}),
}
EQUIVALENT_ON_ONE_PROCESS = {"drop-processes", "own-items"}


def build_models(root: Path) -> dict:
    """The tiny models: BERT and Llama (tests' fixtures), and a Mixtral with its auxiliary loss off
    (``router_aux_loss_coef`` 0: the routed experts stay, and the clean engine is exact)."""
    moe = build_tiny_moe(root / "moe", "mixtral", auxiliary_loss=False)
    texts = [str(write_variable_length_texts(root / f"texts-{split}.jsonl", n, seed=n)) for split, n in
             (("train", 48), ("valid", 12))]
    return {"bert": str(build_tiny_bert(root / "bert")), "llama": str(build_tiny_llama(root / "llama")),
            "moe": str(moe), "texts": texts}


def run_one(setting: str, mutant: str | None, models: dict, root: Path) -> dict:
    """One ``finetune verify`` through the launcher: its exit code, verdict, the ways it called not exact."""
    kind, recipe, processes, flags, env = SETTINGS[setting]
    out = root / f"{bl._slug(setting)}-{mutant or 'clean'}"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no"]
    cmd += ["--multi_gpu", "--num_processes", str(processes)] if processes > 1 else ["--num_processes", "1"]
    # causal LM on texts of uneven length (2 to ~60 words, under --max_length): micro-batches' items differ
    data = ["--train_file", models["texts"][0], "--validation_file", models["texts"][1]] if kind != "bert" else []
    cmd += ["--module", "finetune.commands.verify", "--recipe", recipe, "--model_name_or_path", models[kind], *SMALL, *data,
            *flags, "--output_dir", str(out)]
    environment = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", **env,
                   "PYTHONPATH": os.pathsep.join(p for p in (FAULTS_DIR, str(bl.REPO), os.environ.get("PYTHONPATH", ""))
                                                 if p)}
    if mutant:
        environment[MUTANT_ENV] = mutant
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=environment, cwd=bl.REPO, timeout=1200)
    seconds = time.perf_counter() - start
    report = json.loads((out / "verify.json").read_text()) if (out / "verify.json").is_file() else {}
    return {"setting": setting, "mutant": mutant or "clean", "exit": result.returncode,
            "verdict": report.get("verdict"), "not_exact": report.get("not_exact", []), "seconds": round(seconds, 1),
            "threshold": threshold(report), "split_over_floor": report.get("split_over_floor"),
            "error": None if report else (result.stderr.strip().splitlines() or ["no output"])[-1]}


def threshold(report: dict) -> str:
    """The smallest mis-weightings verify's small controls were caught at, as it printed them: "1% / 1.5%" (a
    micro-batch / the last window), with ">X%" where even the largest size tried was not caught."""
    cells = []
    for d in report.get("detects") or []:
        cells.append(f"{100 * d['threshold']:g}%" if d["threshold"] is not None
                     else f">{100 * d['tried'][-1]['size']:g}%")
    return " / ".join(cells) or "-"


def outcome(row: dict) -> str:
    """The table's cell: caught (exit 1 naming a way), exact (the clean engine), or what went wrong."""
    if row["mutant"] == "clean":
        return "exact" if row["exit"] == 0 and row["verdict"] == "exact" else f"FAILED ({row['verdict'] or row['error']})"
    if row["exit"] == 1 and row["verdict"] == "not exact" and row["not_exact"]:
        return "caught: " + ", ".join(row["not_exact"])
    if row["exit"] == 1 and row["verdict"] == "inconclusive":  # the small controls showed it could not be excluded
        return f"caught: inconclusive (threshold {row['threshold']})"
    return f"MISSED ({row['verdict'] or row['error']}, exit {row['exit']})"


def table(rows: list[dict], settings: list[str], mutants: list[str]) -> str:
    """Markdown: a row per engine (clean, then each mutant), a column per setting."""
    cells = {(r["mutant"], r["setting"]): r for r in rows}
    lines = ["| engine | " + " | ".join(settings) + " |", "| --- |" + " --- |" * len(settings)]
    for mutant in ["clean", *mutants]:
        row = []
        for setting in settings:
            r = cells.get((mutant, setting))
            row.append("equivalent (P = 1)" if r is None and mutant in EQUIVALENT_ON_ONE_PROCESS
                       else "-" if r is None else outcome(r).split(":")[0])
        lines.append(f"| {mutant} | " + " | ".join(row) + " |")
    clean = [cells.get(("clean", setting)) for setting in settings]
    lines.append("| threshold printed (micro-batch / last window) | "
                 + " | ".join(r["threshold"] if r else "-" for r in clean) + " |")
    lines.append("| correct ways / noise floor (max) | "
                 + " | ".join(f"{r['split_over_floor']:.2f}" if r and r.get("split_over_floor") is not None else "-"
                              for r in clean) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated settings (default: all)")
    parser.add_argument("--mutants", default=",".join(MUTANTS), help="comma-separated mutants (default: all)")
    parser.add_argument("--markdown", help="write the table, the machine and the timings to this file")
    parser.add_argument("--work_dir", help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="one setting (cls fp32 P1), the clean engine and the "
                        "small last-window mutant only: a check that the campaign runs")
    args = parser.parse_args(argv)
    settings, mutants = args.settings.split(","), [m for m in args.mutants.split(",") if m]
    if args.smoke:  # one setting, the clean engine and one small mutant: that the campaign and its table run
        settings, mutants = ["cls fp32 P1"], ["last-window-1.5%"]
    unknown = [s for s in settings if s not in SETTINGS] + [m for m in mutants if m not in MUTANTS]
    if unknown:
        parser.error(f"unknown setting or mutant: {', '.join(unknown)}")
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="verify-mutants-"))
    root.mkdir(parents=True, exist_ok=True)
    models = build_models(root / "models")
    rows, start = [], time.perf_counter()
    for setting in settings:
        for mutant in [None, *mutants]:
            if mutant in EQUIVALENT_ON_ONE_PROCESS and SETTINGS[setting][2] == 1:
                continue
            rows.append(run_one(setting, mutant, models, root))
            print(f"{setting:12s} {rows[-1]['mutant']:15s} {rows[-1]['seconds']:7.1f} s  {outcome(rows[-1])}", flush=True)
    text = table(rows, settings, mutants)
    print("\n" + text)
    bad = [r for r in rows if outcome(r).startswith(("MISSED", "FAILED"))]
    print(f"\n{len(rows)} verify runs in {time.perf_counter() - start:.0f} s; {len(bad)} missed or failed")
    if args.markdown:
        machine = bl.format_machine(bl.machine_info())
        Path(args.markdown).write_text(
            "# verify's mutant suite\n\nGenerated by `python bench/verify_mutants.py --markdown docs/verify-mutants.md` "
            f"on this machine:\n\n{machine}\n\nEach cell: `finetune verify` (2 optimizer steps of B = 4 per process, the last window half "
            "full) on that setting with that engine; *caught* = exit 1 naming the way(s) not exact, *exact* = exit 0. "
            "How verify decides: [verify.md](verify.md).\n\n" + text + "\n\n<details><summary>Every run</summary>\n\n"
            "| setting | engine | exit | ways not exact | threshold printed | s |\n| --- | --- | --- | --- | --- | --- |\n"
            + "\n".join(f"| {r['setting']} | {r['mutant']} | {r['exit']} | {', '.join(r['not_exact']) or '-'} | "
                        f"{r['threshold']} | {r['seconds']} |" for r in rows) + "\n\n</details>\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
