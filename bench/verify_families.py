"""``finetune verify`` on every family of the model-family matrix (``tests/families.py``): is accumulation exact,
through both backends (the Trainer ways are part of verify's ways), for each?

    python bench/verify_families.py                               # every family, ~20 s each on 2 CPU cores
    python bench/verify_families.py --families gpt2 bert         # a subset
    python bench/verify_families.py --markdown docs/verify-families.md --json verify-families.json

Each family's tiny model (2 layers, 32 wide, random weights, seed 0) is built into a temporary directory and
verified in this process through verify's public entry, ``finetune.commands.verify.main(argv)``, on its task's recipe
(``bbc-news-clm`` or ``bbc-news``, offline data) with the tests' small settings (``VERIFY_ARGS``: B = 4 = 2 x 2,
2 optimizer steps, 16 samples of at most 32 tokens, fp32). Prints a table (family, task, verdict, expected,
seconds, noise floor, cause) and writes it as Markdown with the machine named (``lscpu``). Exit 0 when every
family gave its expected verdict (``exact``; ``not exact`` with the auxiliary loss named for the
mixture-of-experts families), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
for path in (str(REPO), str(TESTS)):
    if path not in sys.path:
        sys.path.insert(0, path)

from families import BY_NAME, FAMILIES, build  # noqa: E402

# B = 4 samples per window: the reference 4 x 1, splits 2 x 2 and 1 x 4, the Trainer on 4 x 1 and 1 x 4; 2 steps
VERIFY_ARGS = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--verify_steps", "2",
               "--max_train_samples", "16", "--max_eval_samples", "4", "--max_length", "32", "--learning_rate", "1e-3",
               "--warmup_steps", "0", "--mixed_precision", "no"]
AUXILIARY_CAUSE = "the model's auxiliary (router load-balancing) loss"


def _reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; each in-process verify starts from a clean state."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def verify_family(family, root: Path, quiet: bool = True) -> dict:
    """Build ``family`` (a ``families.Family`` or its name) under ``root`` and run ``finetune verify`` on it in this
    process. Returns the row: ``family``, ``task``, ``recipe``, ``verdict`` (verify's, or "error: ..." where it
    raised or exited 2), ``expected``, ``as_expected`` (bool: the expected verdict, and for "not exact" the
    auxiliary loss named first), ``seconds`` (wall, build + verify), ``noise_floor`` (verify's step-1 gradient
    floor, relative), ``loss_floor``, ``cause`` (verify's first cause, "" when exact), ``report`` (verify.json)."""
    from finetune.commands import verify

    family = BY_NAME[family] if isinstance(family, str) else family
    start = time.perf_counter()
    out = Path(root) / f"{family.name}-verify"
    row = {"family": family.name, "task": family.task, "recipe": family.recipe, "expected": family.expected,
           "why": family.why}
    sink = io.StringIO()
    try:
        model = build(family, Path(root) / family.name)
        _reset_accelerate()
        with contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
            code = verify.main(["--recipe", family.recipe, "--model_name_or_path", str(model), *VERIFY_ARGS,
                                "--output_dir", str(out)])
        report = json.loads((out / "verify.json").read_text()) if (out / "verify.json").is_file() else None
        verdict = report["verdict"] if report else f"error: exit {code}"
    except Exception as err:  # a family that cannot train at all is a row of the table, not the end of the bench
        report, verdict = None, f"error: {type(err).__name__}: {str(err)[:200]}"
    finally:
        _reset_accelerate()
    causes = (report or {}).get("causes") or []
    row.update(verdict=verdict, seconds=round(time.perf_counter() - start, 1),
               noise_floor=(report or {}).get("noise_floor", {}).get("gradients"),
               loss_floor=(report or {}).get("noise_floor", {}).get("losses"),
               cause=causes[0] if causes else "", report=report)
    row["as_expected"] = verdict == family.expected and (
        family.expected == "exact" or row["cause"].startswith(AUXILIARY_CAUSE))
    return row


def cpu_name() -> str:
    """The CPU as ``lscpu`` names it (model name, cores), else ``platform.processor()``."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        return f"{fields.get('Model name', '?')}, {fields.get('CPU(s)', '?')} CPU(s)"
    except (OSError, subprocess.SubprocessError):
        import platform

        return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The 1-minute load average (``os.getloadavg``), None where the platform has none."""
    import os

    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _fmt(value) -> str:
    return "" if value is None else f"{value:.1e}" if isinstance(value, float) else str(value)


def render(rows: list[dict], machine: str, load: str = "") -> str:
    """The table as Markdown: one row per family, then the settings and the machine (``load``: words on the load
    average while it ran; seconds are wall time, so a shared machine inflates them)."""
    import torch
    import transformers

    lines = ["# finetune verify on the model-family matrix", "",
             f"`python bench/verify_families.py`: {len(rows)} tiny families (2 layers, 32 wide, random weights, "
             "`tests/families.py`), each through `finetune verify` (both backends: the Trainer ways are among "
             f"verify's) on its task's recipe with `{' '.join(VERIFY_ARGS)}`. Machine: {machine}{load}; torch "
             f"{torch.__version__}, transformers {transformers.__version__}. Noise floor: verify's step-1 gradient "
             "difference of its floor ways from the reference (the samples reordered; computed in chunks), relative.", "",
             "| family | task | verdict | expected | s | noise floor (gradients) | noise floor (losses) | what it exercises "
             "| cause |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        verdict = r["verdict"] if r["as_expected"] else f"**{r['verdict']}** (unexpected)"
        lines.append(f"| {r['family']} | {r['task']} | {verdict} | {r['expected']} | {r['seconds']} | "
                     f"{_fmt(r['noise_floor'])} | {_fmt(r['loss_floor'])} | {r['why']} | "
                     f"{r['cause'].replace('|', '/')[:160]} |")
    ok = sum(r["as_expected"] for r in rows)
    lines += ["", f"{ok} of {len(rows)} families gave the expected verdict."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the matrix (or ``--families``), print the table, write ``--markdown``/``--json``; exit 0 when every
    family gave its expected verdict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=None, help=f"default: all ({', '.join(BY_NAME)})")
    parser.add_argument("--markdown", default=None, help="write the table here (e.g. docs/verify-families.md)")
    parser.add_argument("--json", default=None, help="write the rows (verify.json reports included) here")
    parser.add_argument("--verbose", action="store_true", help="show verify's own output")
    args = parser.parse_args(argv)
    unknown = [name for name in args.families or [] if name not in BY_NAME]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(BY_NAME)}")
    chosen = [BY_NAME[name] for name in args.families] if args.families else FAMILIES
    rows, load = [], load_average()
    with tempfile.TemporaryDirectory(prefix="verify-families-") as root:
        for family in chosen:
            row = verify_family(family, Path(root), quiet=not args.verbose)
            rows.append(row)
            print(f"{row['family']:18s} {row['task']:24s} {row['verdict']:12s} (expected {row['expected']}) "
                  f"{row['seconds']:6.1f} s  floor {_fmt(row['noise_floor'])}  {row['cause'][:80]}", flush=True)
    end = load_average()
    text = render(rows, cpu_name(), "" if load is None else
                  f", 1-minute load average {load:.1f} at the start and {end:.1f} at the end")
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["as_expected"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
