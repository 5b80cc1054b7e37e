"""This machine's CPU as ``/proc/cpuinfo`` names it: its model and the instruction sets that decide how fast it runs
bf16 (Linux; elsewhere what ``platform`` knows). No torch: ``finetune env`` and the peak measurement both read it."""

from __future__ import annotations

import platform
from pathlib import Path

# the flags that decide bf16 matmul speed on a CPU (Linux's names in /proc/cpuinfo): without avx512_bf16 or AMX,
# oneDNN emulates bf16 with fp32 arithmetic
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2")


def _cpuinfo_field(name: str) -> str | None:
    """The first value of field ``name`` in ``/proc/cpuinfo``, or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(name) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name: ``/proc/cpuinfo``'s first ``model name`` (Linux), else ``platform.processor()``, else
    "unknown"."""
    return _cpuinfo_field("model name") or platform.processor() or "unknown"


def cpu_features() -> list[str]:
    """Which of ``BF16_FLAGS`` the CPU has (``/proc/cpuinfo`` ``flags``), in that order; [] where it cannot tell."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return [flag for flag in BF16_FLAGS if flag in flags]


def cpu_kind() -> str:
    """This CPU as bf16 measurements are grouped by it (``recipes/bf16_measured.json``, docs/bf16-recipes.md): its
    model name and which of avx512_bf16 and amx_bf16 it has, e.g. "Intel(R) Xeon(R) Processor @ 2.50GHz (no
    avx512_bf16, no AMX: bf16 emulated)"."""
    flags = [f for f in cpu_features() if f in ("avx512_bf16", "amx_bf16")]
    return f"{cpu_model()} ({', '.join(flags) if flags else 'no avx512_bf16, no AMX: bf16 emulated'})"
