"""Shared machinery of the benchmark scripts in ``bench/``.

Every measurement is one run of the real CLI, ``python finetune/run.py ... --output_dir DIR
--overwrite_output_dir True``, in a fresh subprocess, whose ``metrics.json`` is read back: so the peak
memory (``peak_memory_bytes``: the process max RSS on CPU, ``torch.cuda.max_memory_allocated`` on GPU)
belongs to that configuration alone. (``--smoke`` forks each run from a server that has imported the
libraries instead, ``--start forkserver``: still one fresh process per run, seconds faster; see
``run_script``.) Configurations are repeated interleaved (A, B, A, B, ...) so that machine noise hits all of
them alike, and medians are reported.

Units throughout: samples/s, seconds, bytes (MiB = 2**20 bytes in tables), FLOP/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_PY = REPO / "finetune" / "run.py"
TESTS = REPO / "tests"  # tiny_models.py: the smoke runs' tiny models live with the tests
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))  # last: nothing of the tests shadows a module found elsewhere

MIB = 2**20
# Flags every measurement gets: evaluation is kept negligible (8 samples, after each epoch).
QUIET_EVAL = ["--eval_strategy", "epoch", "--max_eval_samples", "8"]
CPU_MEMORY_NOTE = ("On CPU, peak memory is the process max RSS (getrusage ru_maxrss): it includes the Python, torch "
                   "and data baseline, so ratios understate the difference in training memory; the difference in "
                   "MiB is the clearer figure.")
GPU_MEMORY_NOTE = "On GPU, peak memory is torch.cuda.max_memory_allocated of the training process."


class BenchError(RuntimeError):
    """A measurement that could not be taken (a run failed, or its outputs are missing)."""


# ------------------------------------------------------------------------------------------ machine
def machine_info() -> dict:
    """What the numbers were measured on: CPU model (``/proc/cpuinfo``, else ``platform``), logical cores
    (and those this process may use), GPU name and count if CUDA is available, torch and Python versions,
    and the 1-minute load average (a busy machine distorts timings)."""
    import torch

    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "gpu": gpu,
        "gpu_count": torch.cuda.device_count() if gpu else 0,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_1min": round(load, 2) if load is not None else None,
    }


def format_machine(info: dict, num_threads: int | None = None) -> str:
    """The machine header printed above every results table (Markdown bullet lines)."""
    lines = [f"- Machine: {info['cpu']}, {info['cpu_cores']} logical cores ({info['cpu_cores_usable']} usable)",
             f"- GPU: {info['gpu']} x {info['gpu_count']}" if info["gpu"] else "- GPU: none (CPU run)",
             f"- torch {info['torch']}, Python {info['python']}, {info['platform']}"]
    if num_threads:
        lines.append(f"- Child runs limited to {num_threads} CPU thread(s) (OMP_NUM_THREADS)")
    load = info.get("load_average_1min")
    if load is not None:
        busy = load > 0.5 * (info["cpu_cores_usable"] or 1)
        lines.append(f"- Load average at start: {load}" + (" -- the machine was busy: timings are noisy" if busy else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ tiny models
# tests/tiny_models.py is imported where a tiny model is built, not with this module: it imports transformers' model
# classes (seconds), which a script given its model, a --dry_run, and each run forked from the fork server (which
# imports the bench script again) would otherwise pay for nothing.
def build_tiny_bert(path: Path) -> Path:
    """``tiny_models.build_tiny_bert``: a 2-layer, 32-wide BERT with the MiniLM tokenizer, saved to ``path``."""
    from tiny_models import build_tiny_bert as build

    return build(path)


def build_tiny_llama(path: Path) -> Path:
    """``tiny_models.build_tiny_llama``: a 2-layer, 32-wide Llama with the MiniLM tokenizer, saved to ``path``."""
    from tiny_models import build_tiny_llama as build

    return build(path)


def write_texts(path: Path, n: int, seed: int = 0) -> Path:
    """A JSON-lines file of ``n`` variable-length texts (see ``tests/tiny_models.py``)."""
    from tiny_models import write_variable_length_texts

    return write_variable_length_texts(path, n, seed)


# ------------------------------------------------------------------------------------------ one run
def count_safetensors_params(model_dir: Path) -> int | None:
    """Parameters stored in ``model_dir``'s ``*.safetensors`` files (top level only), counted from the
    file headers without loading any tensor. Tied weights are stored once, so counted once. None if no
    file is there."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total


def child_env(num_threads: int | None = None) -> dict:
    """The environment of a measured run: offline hub, no tokenizer threads, and ``OMP_NUM_THREADS`` /
    ``MKL_NUM_THREADS`` set to ``num_threads`` when given."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    if num_threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(num_threads)
    return env


# Imported once by the fork server of ``--start forkserver`` (the smoke default), so that each run forked from it
# starts with them loaded: what a run.py run of the accelerate backend imports, with the evaluation metrics' libraries
# and the smoke's tiny models' classes (BERT, Llama); no model, no tensor, no data.
FORKSERVER_PRELOAD = ["torch", "transformers", "accelerate", "datasets", "evaluate", "sklearn.metrics",
                      "transformers.models.bert.modeling_bert", "transformers.models.llama.modeling_llama",
                      "finetune.config", "finetune.lifecycle.resolve", "finetune.backends.accelerate"]
_FORKSERVER = None


def run_script(argv: list[str], log_path: Path, *, num_threads: int | None = None, timeout: float = 3600,
               start: str = "subprocess") -> int | None:
    """``python ARGV`` (``argv[0]`` the script) as a fresh process in the repository, in ``child_env(num_threads)``,
    its command line then its stdout and stderr written to ``log_path``; returns its exit status (negative: killed
    by that signal), or None if it ran past ``timeout`` seconds (it is killed).

    ``start``: "subprocess", a new Python interpreter; "forkserver", a process forked from a server that has
    imported ``FORKSERVER_PRELOAD`` (no model, no tensor) and runs the script as ``__main__``, with the same
    ``sys.argv``, environment and working directory: several seconds less per run, and its max RSS starts from the
    server's import baseline (less the library pages the run never touches) rather than from an empty interpreter.
    """
    with open(log_path, "w") as log:
        log.write(shlex.join([sys.executable, *argv]) + "\n")
        log.flush()
        if start == "forkserver":
            process = _forkserver(num_threads).Process(target=_forked_script, args=(list(argv), str(log_path)))
            process.start()
            process.join(timeout)
            if process.exitcode is None:
                process.kill()
                process.join()
                return None
            return process.exitcode
        try:
            return subprocess.run([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                  env=child_env(num_threads), cwd=REPO, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return None


def _forkserver(num_threads: int | None):
    """The ``multiprocessing`` fork-server context, its server started (once per process) in the runs'
    environment (``child_env``: offline hub, ``OMP_NUM_THREADS``), with ``FORKSERVER_PRELOAD`` imported."""
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing

        os.environ.update(child_env(num_threads))  # inherited by the fork server when it starts
        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(FORKSERVER_PRELOAD)
    return _FORKSERVER


def _forked_script(argv: list[str], log_path: str) -> None:
    """The body of a forked run: stdout and stderr appended to ``log_path``; in the repository; ``sys.argv`` and
    ``sys.path`` as ``python ARGV`` would have them (the script's folder first; not this driver's bench/ and tests/
    entries); ``multiprocessing``'s start method unset; the script run as ``__main__``; then, as an interpreter on its way out, waiting for its threads and
    running its ``atexit`` handlers (``multiprocessing`` ends a forked process with ``os._exit``). Its
    ``SystemExit`` is the process's exit status (``multiprocessing`` makes it the exit code, as the interpreter
    does)."""
    import atexit
    import multiprocessing
    import runpy
    import threading

    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(fd, 1), os.dup2(fd, 2)
    os.close(fd)
    os.chdir(REPO)
    multiprocessing.set_start_method(None, force=True)  # the platform's default again, as in a new interpreter:
    # multiprocessing set "forkserver" in this process, which the run's own workers (DataLoader) would then use
    script = os.path.abspath(argv[0])
    driver_paths = {os.path.dirname(os.path.abspath(__file__)), str(TESTS)}
    sys.argv = [script, *argv[1:]]
    sys.path[:] = [os.path.dirname(script)] + [p for p in sys.path
                                               if os.path.abspath(p or os.curdir) not in driver_paths]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush(), sys.stderr.flush()


def run_cli(args: list[str], output_dir: Path, log_path: Path, *, num_threads: int | None = None,
            timeout: float = 3600, start: str = "subprocess") -> dict:
    """Run ``python finetune/run.py ARGS --output_dir OUTPUT_DIR --overwrite_output_dir True`` in a fresh
    process (stdout and stderr to ``log_path``; ``start``: a new interpreter, or forked from the fork server,
    see ``run_script``) and return its ``metrics.json``, with added ``bench_wall_seconds`` (the process's wall
    time, seconds), ``bench_num_parameters`` (from the saved safetensors) and ``bench_max_length`` (tokens, from
    ``run_config.json``).

    Raises ``BenchError`` with the end of the run's output if it fails or writes no ``metrics.json``.
    """
    argv = [sys.executable, str(RUN_PY), *args, "--output_dir", str(output_dir), "--overwrite_output_dir", "True"]
    begin = time.perf_counter()
    returncode = run_script(argv[1:], log_path, num_threads=num_threads, timeout=timeout, start=start)
    if returncode is None:
        raise BenchError(f"run timed out after {timeout:.0f} s: {shlex.join(argv)} (log: {log_path})")
    wall = time.perf_counter() - begin
    metrics_path = Path(output_dir) / "metrics.json"
    if returncode != 0 or not metrics_path.is_file():
        tail = "".join(Path(log_path).read_text(errors="replace").splitlines(True)[-25:])
        raise BenchError(f"run failed (exit {returncode}): {shlex.join(argv)}\n--- end of its output ---\n{tail}")
    metrics = json.loads(metrics_path.read_text())
    metrics["bench_wall_seconds"] = round(wall, 3)
    metrics["bench_num_parameters"] = metrics.get("num_parameters") or count_safetensors_params(Path(output_dir))
    run_config = Path(output_dir) / "run_config.json"
    if run_config.is_file():
        metrics["bench_max_length"] = json.loads(run_config.read_text()).get("max_length")
    return metrics


# ------------------------------------------------------------------------------------------ many runs
@dataclass
class Config:
    """One benchmark configuration: a label and the ``run.py`` flags that define it."""

    label: str
    args: list[str]
    runs: list[dict] = field(default_factory=list)


def run_interleaved(configs: list[Config], repeats: int, workdir: Path, *, num_threads: int | None = None,
                    timeout: float = 3600, keep_outputs: bool = False, warmup: int = 0,
                    start: str = "subprocess") -> list[Config]:
    """Run every configuration ``repeats`` times, interleaved (round r runs A, B, C, ... in order), each
    run in a fresh process (``start``: see ``run_script``) with its own output directory; append each run's
    metrics to ``config.runs``.

    First, ``warmup`` unrecorded runs of each configuration with ``--max_steps 1`` fill the datasets'
    tokenization cache and the file cache, so that every measured run reads the same caches. Prints one
    progress line per run on stderr. Model files of finished runs are deleted unless ``keep_outputs``
    (``metrics.json``, ``log.jsonl`` and the run's log file stay). Raises ``BenchError`` when a run fails.
    """
    for w in range(warmup):
        for config in configs:
            out = workdir / "warmup" / f"{_slug(config.label)}-w{w + 1}"
            out.parent.mkdir(parents=True, exist_ok=True)
            print(f"[warm-up] {config.label} (1 optimizer step, not recorded) ...", end="", file=sys.stderr, flush=True)
            run_cli(config.args + ["--max_steps", "1"], out, out.with_suffix(".log"), num_threads=num_threads,
                    timeout=timeout, start=start)
            print(" done", file=sys.stderr, flush=True)
            if not keep_outputs:
                shutil.rmtree(out, ignore_errors=True)
    total = repeats * len(configs)
    done = 0
    for r in range(repeats):
        for config in configs:
            done += 1
            out = workdir / "runs" / f"{_slug(config.label)}-r{r + 1}"
            out.parent.mkdir(parents=True, exist_ok=True)
            print(f"[{done}/{total}] {config.label} (repeat {r + 1}/{repeats}) ...", end="", file=sys.stderr, flush=True)
            metrics = run_cli(config.args, out, out.with_suffix(".log"), num_threads=num_threads, timeout=timeout,
                              start=start)
            metrics["bench_repeat"] = r + 1
            config.runs.append(metrics)
            print(f" {metrics['train_samples_per_second']:.2f} samples/s, train_runtime {metrics['train_runtime']:.2f} s, "
                  f"peak {metrics['peak_memory_bytes'] / MIB:.0f} MiB, precision ran: {metrics['mixed_precision']}",
                  file=sys.stderr, flush=True)
            if not keep_outputs:
                for item in out.iterdir():
                    if item.suffix in (".safetensors", ".bin") or item.is_dir():
                        shutil.rmtree(item) if item.is_dir() else item.unlink()
    return configs


def print_commands(configs: list[Config], args) -> None:
    """``--dry_run``: the command line of each configuration (output directory left out), and the run count."""
    for config in configs:
        print(f"{config.label}: {shlex.join([sys.executable, str(RUN_PY), *config.args])}")
    print(f"{len(configs)} configuration(s) x {args.repeats} repeat(s), interleaved, after {args.warmup} warm-up "
          "run(s) of each")


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


def median_of(runs: list[dict], key: str) -> float | None:
    """Median of ``key`` over ``runs`` (None if no run has it)."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def precision_ran(runs: list[dict]) -> str:
    """The ``mixed_precision`` recorded by the runs (what actually ran), e.g. "no", or "no/bf16" if they differ."""
    return "/".join(sorted({str(r.get("mixed_precision")) for r in runs}))


def goal_text(value: float | None, op: str, target: float) -> str:
    """"met" / "NOT met" / "n/a" for ``value op target`` (``op`` is ">=" or "<=")."""
    if value is None or not math.isfinite(value):
        return "n/a"
    ok = value >= target if op == ">=" else value <= target
    return "met" if ok else "NOT met"


def fmt(value, spec: str = ".3f", unit: str = "") -> str:
    """Format a number for a table cell ("n/a" for None)."""
    if value is None:
        return "n/a"
    return f"{value:{spec}}{unit}"


def run_flags(args, model: str | None, *flags: str) -> list[str]:
    """The run.py flags every configuration of a script shares, in this order: ``--recipe``, ``flags``,
    ``--mixed_precision``, ``--max_train_samples``, the quiet evaluation, then ``--max_length`` and
    ``--model_name_or_path`` where given. (``--extra_args`` is the caller's to place: it must come after any flag it may override.)"""
    out = ["--recipe", args.recipe, *flags, "--mixed_precision", args.mixed_precision,
           "--max_train_samples", str(args.max_train_samples), *QUIET_EVAL]
    if args.max_length:
        out += ["--max_length", str(args.max_length)]
    if model:
        out += ["--model_name_or_path", model]
    return out


def model_description(args) -> str:
    """The model a report measured, in words: ``--model_name_or_path``, the smoke tiny BERT, or the recipe's."""
    if args.model_name_or_path:
        return args.model_name_or_path
    return "tiny BERT (2 layers, 32 wide, built from a config)" if args.smoke else "the recipe's default"


def report_header(title: str, args, info: dict) -> list[str]:
    """The first lines of a report: the title (marked SMOKE in smoke mode), the machine, and the model
    with the settings every report shares (recipe, micro-batch, accumulation where set, precision)."""
    batch = ""
    if hasattr(args, "per_device_train_batch_size"):
        batch = f"micro-batch {args.per_device_train_batch_size} x accumulation {args.gradient_accumulation_steps}, "
    return [f"# {title}{' (SMOKE: tiny model, numbers mean nothing)' if args.smoke else ''}", "",
            format_machine(info, args.num_threads), "",
            f"Recipe {args.recipe}, model {model_description(args)}; {batch}precision requested {args.mixed_precision}"
            f"{f', max_length {args.max_length}' if args.max_length else ''}; {args.repeats} repeat(s) interleaved, "
            f"medians reported. {run_process_text(args)}"]


def run_process_text(args) -> str:
    """How each run started, for a report: a fresh interpreter, or forked from the fork server (``--start``)."""
    if getattr(args, "start", "subprocess") == "forkserver":
        return ("Each run is a fresh process running `finetune/run.py`, forked from a server that had imported the "
                "libraries (`--start forkserver`).")
    return "Each run is a fresh `python finetune/run.py` process."


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (also what is printed on stdout)."""
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ command line
def base_parser(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark script shares."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny BERT/Llama built from a config, a few dozen samples, 1 repeat: checks the pipeline in seconds; "
                        "its numbers mean nothing")
    p.add_argument("--repeats", type=int, default=None, help="runs per configuration, interleaved (default 3; smoke 1)")
    p.add_argument("--model_name_or_path", default=None, help="model (default: the recipe's; smoke: a tiny BERT)")
    p.add_argument("--max_train_samples", type=int, default=None, help="training subset (samples)")
    p.add_argument("--max_length", type=int, default=None, help="truncation in tokens (default: the recipe's; smoke 32)")
    p.add_argument("--num_threads", type=int, default=None,
                   help="OMP_NUM_THREADS for the measured runs (default: torch's own choice; smoke 1, which keeps tiny "
                        "runs fast on a busy machine)")
    p.add_argument("--warmup", type=int, default=None,
                   help="unrecorded 1-step runs of each configuration first, to fill caches (default 1; smoke 0)")
    p.add_argument("--dry_run", action="store_true", help="print the run.py command of each configuration and exit")
    p.add_argument("--extra_args", default="", help="more run.py flags for every run, as one quoted string")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run before it is killed (default 3600; smoke 300)")
    p.add_argument("--start", choices=("auto", "subprocess", "forkserver"), default="auto",
                   help="how each run's fresh process starts: a new Python interpreter (subprocess), or forked from a "
                        "server that has only imported torch, transformers, accelerate, datasets and the engine, no "
                        "model and no tensor (forkserver: seconds less per run; its max RSS starts from that import "
                        "baseline). auto: forkserver with --smoke, else subprocess")
    p.add_argument("--workdir", type=Path, default=None, help="where run outputs go (default: a temporary directory, removed)")
    p.add_argument("--keep_outputs", action="store_true", help="keep the saved models of every run (in --workdir)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the results as Markdown to this file")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    return p


def resolve_common(args) -> None:
    """Fill the smoke/full defaults of the shared flags in place."""
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 3
    if args.repeats < 1:
        raise SystemExit("error: --repeats must be >= 1")
    if args.num_threads is None and args.smoke:
        args.num_threads = 1
    if args.timeout is None:
        args.timeout = 300 if args.smoke else 3600
    if args.max_length is None and args.smoke:
        args.max_length = 32
    if args.warmup is None:
        args.warmup = 0 if args.smoke else 1
    if args.start == "auto":
        args.start = "forkserver" if args.smoke else "subprocess"


class Workdir:
    """``--workdir`` if given (kept), else a temporary directory removed on exit."""

    def __init__(self, path: Path | None):
        self.path, self._tmp = path, None

    def __enter__(self) -> Path:
        if self.path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="finetune-bench-")
            return Path(self._tmp.name)
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path

    def __exit__(self, *exc):
        if self._tmp is not None:
            self._tmp.cleanup()


def emit(report_md: str, result: dict, args) -> None:
    """Print the Markdown report on stdout and write it to ``--markdown`` and ``result`` to ``--json``."""
    print(report_md)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(report_md + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")


def run_summary(config: Config, keys: tuple[str, ...]) -> dict:
    """A configuration for the JSON output: its flags, each run's ``keys`` and the medians of the numeric ones."""
    runs = [{k: r.get(k) for k in keys if k in r} | {"repeat": r.get("bench_repeat")} for r in config.runs]
    medians = {k: median_of(config.runs, k) for k in keys
               if any(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) for r in config.runs)}
    return {"args": config.args, "runs": runs, "median": medians, "mixed_precision": precision_ran(config.runs)}


RUN_KEYS = ("train_samples_per_second", "train_runtime", "peak_memory_bytes", "peak_memory_kind", "mixed_precision",
            "mixed_precision_requested", "optimizer_steps", "train_samples", "effective_batch_size",
            "per_device_train_batch_size", "gradient_accumulation_steps", "train_trained_tokens", "train_trained_tokens_per_second",
            "bench_wall_seconds", "bench_num_parameters", "bench_max_length", "device", "backend",
            "train_padding_fraction")


def main_guard(fn) -> int:
    """Run a benchmark ``main``; a ``BenchError`` prints ``error: ...`` on stderr and returns 1."""
    try:
        return fn()
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def run_configs(configs, args, workdir) -> None:
    """``run_interleaved`` with the common flags of every benchmark script (repeats, threads, timeout,
    kept outputs, warm-up runs, how a run starts)."""
    run_interleaved(configs, args.repeats, workdir, num_threads=args.num_threads, timeout=args.timeout,
                    keep_outputs=args.keep_outputs, warmup=args.warmup, start=args.start)


def result_record(name: str, args, info: dict, configs, results: dict) -> dict:
    """The ``--json`` record of a benchmark run: name, mode, machine, settings, per-configuration runs,
    and the script's ``results``."""
    return {"benchmark": name, "mode": "smoke" if args.smoke else "full", "machine": info,
            "settings": {k: (str(v) if hasattr(v, "__fspath__") else v) for k, v in vars(args).items()},
            "configs": {c.label: run_summary(c, RUN_KEYS) for c in configs}, "results": results}


def run_benchmark(name: str, args, build_configs, summarize, render, measure_more=None) -> int:
    """The body of a benchmark script's ``main``: machine info; in ``--workdir`` (or a temporary one) the model
    (``--model_name_or_path``, a tiny BERT in smoke mode, else the recipe's: None), ``build_configs(args,
    model)``, ``--dry_run`` (print the commands, return 0) or the interleaved runs, then
    ``measure_more(args, model, workdir)`` if given (extra measurements needing the model, passed to ``summarize``);
    ``summarize(configs[, extra])`` -> results, ``render(args, info, configs, results)`` -> Markdown; print
    and write them (``emit``). Returns 0; a failed run raises ``BenchError``."""
    info = machine_info()
    with Workdir(args.workdir) as workdir:
        model = args.model_name_or_path
        if model is None and args.smoke:
            model = str(build_tiny_bert(workdir / "tiny-bert"))
        configs = build_configs(args, model)
        if args.dry_run:
            print_commands(configs, args)
            return 0
        run_configs(configs, args, workdir)
        extra = (measure_more(args, model, workdir),) if measure_more else ()
    results = summarize(configs, *extra)
    emit(render(args, info, configs, results), result_record(name, args, info, configs, results), args)
    return 0
