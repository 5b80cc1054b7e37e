"""``finetune env``: this machine and its software in one block to paste into an issue, as ``transformers env`` and
``accelerate env`` print theirs (accelerate 1.15 ``commands/env.py``): versions, platform, CPU, memory, GPUs (memory,
compute capability), the Hugging Face Hub settings and Accelerate's default config file."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from finetune import __version__
from finetune.machine import BF16_FLAGS, bf16_support, cpu_features, cpu_model


def cpu_cores() -> str:
    """Logical cores (``os.cpu_count``), physical cores (``psutil``, where it can tell) and the cores this process
    may run on (``os.sched_getaffinity``: a container or ``taskset`` gives fewer)."""
    import psutil  # a dependency of accelerate

    logical = os.cpu_count() or 0
    physical = psutil.cpu_count(logical=False)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    return f"{logical} logical" + (f", {physical} physical" if physical else "") + f"; {usable} usable by this process"


def gpus() -> list[str]:
    """One line per CUDA device: index, name, memory (GiB, ``total_memory``) and compute capability; [] without one."""
    import torch

    if not torch.cuda.is_available():
        return []
    lines = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        lines.append(f"{index}: {props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability "
                     f"{props.major}.{props.minor}")
    return lines


def matmul_peaks() -> str:
    """This device's matmul peak per precision it runs (``lifecycle.peak.matmul_peak``: measured now, the best
    measurement on this machine kept; a few seconds each, whatever the precision), in GFLOP/s with the threads it
    used: fp32 and bf16 on a CPU (fp16 does not run there), with fp16 on a GPU."""
    import torch

    from finetune.outputs.peak import matmul_peak

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    figures = []
    for precision, name in (("no", "fp32"), ("bf16", "bf16"), ("fp16", "fp16")):
        peak = matmul_peak(device, precision, refresh=True)
        if peak is not None:
            figures.append(f"{name} {peak[0] / 1e9:.1f} GFLOP/s")
    return f"{', '.join(figures)} ({device.type}, {torch.get_num_threads()} threads)"


def accelerate_default_config() -> tuple[str, dict | None]:
    """(the path of Accelerate's default config file, its settings or None when there is no such file), as
    ``accelerate env`` reads it (``accelerate.commands.config.default_config_file``, under ``HF_HOME``)."""
    from accelerate.commands.config import default_config_file, load_config_from_file

    if not os.path.isfile(default_config_file):
        return default_config_file, None
    return default_config_file, load_config_from_file(default_config_file).to_dict()


def environment() -> list[tuple[str, str]]:
    """(what, value) pairs of ``finetune env``, in print order (sizes in GiB)."""
    import psutil
    import torch
    from huggingface_hub import constants, get_token

    from finetune.engine import cpu_bf16
    from finetune.outputs.card import framework_versions
    from finetune.outputs.reporting import cpu_bf16_line

    versions = dict(framework_versions())
    info = [("`finetune` version", f"{__version__} ({Path(__file__).resolve().parents[1]})"),
            ("Platform", platform.platform()),
            ("Python version", f"{platform.python_version()} ({sys.executable})")]
    for name, version in versions.items():
        if name in ("Python", "finetune"):
            continue
        if name == "PyTorch":
            version += f" (CUDA build: {torch.version.cuda or 'none'}; CUDA available: {torch.cuda.is_available()})"
        info.append((f"{name} version", version))
    features = cpu_features()
    info += [("CPU", cpu_model()), ("CPU features", f"{', '.join(features) or 'none of ' + ', '.join(BF16_FLAGS)} "
                                                    f"(bf16 matmul {bf16_support(features)})"),
             ("CPU cores", cpu_cores()),
             ("System RAM", f"{psutil.virtual_memory().total / 2**30:.1f} GiB")]
    devices = gpus()
    info.append(("GPUs", "none" if not devices else f"{len(devices)}"))
    info += [(f"GPU {line.split(':', 1)[0]}", line.split(": ", 1)[1]) for line in devices]
    info.append(("Matmul peak (best measured)", matmul_peaks()))
    info.append(("bf16 on this CPU", cpu_bf16_line("no")))
    info.append(("fp16 requested on this CPU trains in", cpu_bf16.summary()))
    info.append(("Hugging Face Hub", f"{constants.ENDPOINT}; offline mode: {constants.is_offline_mode()}; token "
                                     f"set: {get_token() is not None}"))
    return info


def format_env() -> str:
    """``finetune env``'s text: a Markdown list, ready to paste, ending with Accelerate's default config."""
    lines = ["Copy-and-paste the text below in your GitHub issue", ""]
    lines += [f"- {what}: {value}" for what, value in environment()]
    path, settings = accelerate_default_config()
    if settings is None:
        lines.append(f"- `Accelerate` default config: not found ({path}; `accelerate config` writes one, "
                     "`finetune train --config_file NAME` takes a shipped one: finetune recipes)")
    else:
        lines.append(f"- `Accelerate` default config ({path}):")
        lines += [f"\t- {key}: {value}" for key, value in settings.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``finetune env``: print ``format_env()``; returns 0 (2 for an argument: it takes none)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):
        print("usage: finetune env   (this machine's versions, CPU, GPUs and Accelerate config, to paste in an issue)")
        return 0
    if argv:
        print(f"error: finetune env takes no arguments, got {' '.join(argv)!r}. Run `finetune env`.", file=sys.stderr)
        return 2
    print(format_env())
    return 0
