"""This machine's CPU as ``/proc/cpuinfo`` names it: its model and the instruction sets that decide how fast it runs
bf16 (Linux; elsewhere what ``platform`` knows). No torch: ``finetune env`` and the peak measurement both read it."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# the flags that decide bf16 matmul speed on a CPU (Linux's names in /proc/cpuinfo): without avx512_bf16 or AMX,
# oneDNN emulates bf16 with fp32 arithmetic
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2")
# the flags with bf16 dot products, each with the oneDNN ISA (its cpu_isa_t names, ``ONEDNN_MAX_CPU_ISA``'s values)
# that uses it and how a person names it
NATIVE_BF16 = (("amx_bf16", "AVX512_CORE_AMX", "AMX"), ("avx512_bf16", "AVX512_CORE_BF16", "AVX512-BF16"))
# oneDNN's ISA names, lowest first (oneDNN docs, "CPU Dispatcher Control"; the AVX10 names are aliases)
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16")
_ISA_ALIASES = {"AVX10_1_512": "AVX512_CORE_FP16", "AVX10_1_512_AMX": "AVX512_CORE_AMX",
                "AVX10_1_512_AMX_FP16": "AVX512_CORE_AMX_FP16"}


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


def onednn_max_isa(environ=None) -> str | None:
    """The highest ISA oneDNN may use as the environment caps it (``ONEDNN_MAX_CPU_ISA``, or its older name
    ``DNNL_MAX_CPU_ISA``), upper-cased with its AVX10 aliases resolved; None where unset, "ALL" or "DEFAULT"."""
    environ = os.environ if environ is None else environ
    value = (environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    value = _ISA_ALIASES.get(value, value)
    return None if value in ("", "ALL", "DEFAULT") else value


def native_bf16(features: list[str] | None = None, max_isa: str | None = None) -> list[str]:
    """The bf16 matmul instructions this CPU runs natively, as a person names them ("AMX", "AVX512-BF16"), best
    first; [] where bf16 matmuls are emulated in fp32 arithmetic (several times slower than fp32: docs/precision.md).
    ``features``: the CPU's flags (default ``cpu_features()``); ``max_isa``: oneDNN's cap (default
    ``onednn_max_isa()``): an instruction set above the cap is not used, so a CPU capped below AVX512_CORE_BF16
    emulates bf16 whatever its flags (an unknown cap name counts as no cap)."""
    features = cpu_features() if features is None else features
    max_isa = onednn_max_isa() if max_isa is None else max_isa
    cap = ONEDNN_ISAS.index(max_isa) if max_isa in ONEDNN_ISAS else len(ONEDNN_ISAS)
    return [name for flag, isa, name in NATIVE_BF16 if flag in features and ONEDNN_ISAS.index(isa) <= cap]


def bf16_support(features: list[str] | None = None, max_isa: str | None = None) -> str:
    """How this CPU runs bf16 matmuls, in words: "native (AVX512-BF16)", or "emulated (no avx512_bf16, no AMX)", or
    "emulated (ONEDNN_MAX_CPU_ISA=AVX2 leaves out AVX512-BF16)" where oneDNN's cap hides what the flags have
    (``native_bf16``; the same arguments)."""
    features = cpu_features() if features is None else features
    max_isa = onednn_max_isa() if max_isa is None else max_isa
    native = native_bf16(features, max_isa)
    if native:
        return f"native ({', '.join(native)})"
    hidden = native_bf16(features, "AVX512_CORE_AMX_FP16")
    if hidden:
        return f"emulated (ONEDNN_MAX_CPU_ISA={max_isa} leaves out {', '.join(hidden)})"
    return "emulated (no avx512_bf16, no AMX)"


def cpu_kind() -> str:
    """This CPU as bf16 measurements are grouped by it (``recipes/bf16_measured.json``, docs/bf16-recipes.md): its
    model name and which of avx512_bf16 and amx_bf16 it has, e.g. "Intel(R) Xeon(R) Processor @ 2.50GHz (no
    avx512_bf16, no AMX: bf16 emulated)"; where oneDNN's cap (``onednn_max_isa``) hides them, "(..., capped at AVX2:
    bf16 emulated)"."""
    flags = [f for f in cpu_features() if f in ("avx512_bf16", "amx_bf16")]
    if flags and not native_bf16():
        return f"{cpu_model()} ({', '.join(flags)}, capped at {onednn_max_isa()}: bf16 emulated)"
    return f"{cpu_model()} ({', '.join(flags) if flags else 'no avx512_bf16, no AMX: bf16 emulated'})"
