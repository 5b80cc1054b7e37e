"""The device's matmul peak, measured: the FLOP/s of a large square matmul (2 n^3 FLOPs) in the precision a run
trained in, on the threads it trained with, so that a run's achieved FLOP/s has a limit beside it on a CPU, where no
datasheet gives one, as on a GPU. Measured per machine, precision, thread count and torch version, at the largest
size whose matmuls fit ``PROBE_SECONDS`` (``probe_size``: an emulated bf16 matmul on a CPU without bf16 instructions
is hundreds of times slower than fp32's, so no fixed size suits both), and cached in ``~/.cache/finetune/matmul_peak.json``, which keeps the best measurement seen: a measurement taken
while something else used the cores (a shared virtual machine's neighbours move it 1.5x from second to second,
docs/speed.md "The peak moves") can only lower a run's share, never inflate it. A lock lets one process of a
run measure while the others wait, so they do not share the cores during the measurement."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from finetune.models.fetch import default_cache_dir

DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIZES = {"cpu": 2048, "cuda": 8192}  # the largest n: 17 GFLOP a matmul on a CPU (~0.1 s on 2 cores), 1.1 TFLOP on a GPU
SMALLEST = 256  # probe_size's first size
REPEATS = 5  # timed matmuls after 2 warm-up ones; the fastest is the peak
PROBE_SECONDS = 1.5  # what one peak measurement may cost, about: probe_size and measure_matmul together


def cache_path() -> Path:
    """``matmul_peak.json`` in the cache folder (``fetch.default_cache_dir``: ``FINETUNE_CACHE``, default
    ``~/.cache/finetune``)."""
    return default_cache_dir() / "matmul_peak.json"


def device_name(device: torch.device) -> str:
    """The CPU's model name (``/proc/cpuinfo``) or the GPU's (``torch.cuda.get_device_name``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from finetune.machine import cpu_model

    return cpu_model()


def _operands(device: torch.device, dtype: torch.dtype, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random ``size`` x ``size`` matrices from a generator of their own (the global ones, which order a run's
    data and dropout, are not drawn from)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    return tuple(torch.randn(size, size, generator=generator).to(device=device, dtype=dtype) for _ in range(2))


def _timed_mm(a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds of one ``a @ b`` (synchronised on a GPU)."""
    sync = torch.cuda.synchronize if a.device.type == "cuda" else (lambda *_: None)
    sync(a.device)
    start = time.perf_counter()
    torch.mm(a, b)
    sync(a.device)
    return time.perf_counter() - start


def probe_size(device: torch.device, dtype: torch.dtype, largest: int, seconds: float = PROBE_SECONDS,
               repeats: int = REPEATS) -> int:
    """The matmul size ``n`` (``SMALLEST`` doubled, at most ``largest``) whose ``repeats`` + 2 matmuls in ``dtype``
    fit ``seconds``, from short first measurements: the faster of two matmuls timed at each size after a warm-up at
    the first (one slow timing, a neighbour's burst on a shared machine, does not stop it), doubling while eight times
    that (a matmul's 2 n^3 FLOPs at twice n) times ``repeats`` + 2 fits. Costs at most 2/7 of ``seconds``; where a
    matmul is slow at every size, ``SMALLEST``."""
    size = min(SMALLEST, largest)
    a, b = _operands(device, dtype, size)
    torch.mm(a, b)  # warm-up: first-call kernel choices and allocations
    while size * 2 <= largest and min(_timed_mm(a, b), _timed_mm(a, b)) * 8 * (repeats + 2) <= seconds:
        size *= 2
        a, b = _operands(device, dtype, size)
    return size


def measure_matmul(device: torch.device, dtype: torch.dtype, size: int, repeats: int = REPEATS,
                   seconds: float = PROBE_SECONDS) -> float:
    """FLOP/s of the fastest of ``repeats`` ``size`` x ``size`` matmuls in ``dtype`` on ``device`` (2 size^3 FLOPs
    each), after two warm-up ones, on torch's current threads; fewer timed ones where the matmuls have taken
    ``seconds`` already (at least one). Its inputs come from a generator of its own (``_operands``)."""
    a, b = _operands(device, dtype, size)
    started, best = time.perf_counter(), float("inf")
    for index in range(repeats + 2):
        took = _timed_mm(a, b)
        if index >= 2:
            best = min(best, took)
            if time.perf_counter() - started >= seconds:
                break
    return 2 * size ** 3 / best


def matmul_peak(device: torch.device, precision: str, refresh: bool = False) -> tuple[float, str] | None:
    """(peak FLOP/s of one process's matmuls on ``device`` in ``precision`` ("no", "bf16", "fp16"), where it came
    from): the best measurement cached for this machine, precision, thread count and torch version, measured first
    where there is none and again with ``refresh`` (``measure_matmul`` at ``probe_size``, about ``PROBE_SECONDS``
    whatever the precision; the cache keeps the higher of the two). None for a precision the device does not run (fp16 on a CPU) or a device other than cpu and cuda."""
    from filelock import FileLock

    dtype, largest = DTYPES.get(precision), SIZES.get(device.type)
    if dtype is None or largest is None or (dtype == torch.float16 and device.type == "cpu"):
        return None
    name, threads = device_name(device), torch.get_num_threads()
    key = f"{name} | {str(dtype).removeprefix('torch.')} | {threads} threads | torch {torch.__version__}"
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
        if refresh or key not in cached:
            size = probe_size(device, dtype, largest)
            flops = measure_matmul(device, dtype, size)
            now = time.strftime("%Y-%m-%d %H:%M:%S")
            before = cached.get(key)
            count = 1 if before is None else before.get("measurements", 1) + 1
            best = before if before is not None and before["flops_per_second"] >= flops else {
                "flops_per_second": flops, "size": size, "measured": now}
            cached[key] = {**best, "measurements": count, "last_flops_per_second": flops, "last_measured": now}
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(cached, indent=1) + "\n")
            tmp.replace(path)
    entry = cached[key]
    count = entry.get("measurements", 1)
    best_of = f"the best of {count} measurements of " if count > 1 else ""
    matmul = f"{entry['size']}^2 {str(dtype).removeprefix('torch.')} matmul"
    return entry["flops_per_second"], f"measured: {best_of}a {matmul} on {name}, {threads} threads ({path})"


def bf16_ratio(device: torch.device) -> tuple[float, float, float] | None:
    """(bf16's matmul peak over fp32's, bf16's FLOP/s, fp32's FLOP/s) on ``device`` at torch's current threads, each
    ``matmul_peak`` (the best cached, measured first where there is none: about ``PROBE_SECONDS`` each); None off
    cpu and cuda."""
    bf16, fp32 = matmul_peak(device, "bf16"), matmul_peak(device, "no")
    if bf16 is None or fp32 is None:
        return None
    return bf16[0] / fp32[0], bf16[0], fp32[0]
