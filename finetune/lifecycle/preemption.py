"""Will a stop signal's checkpoint fit the grace before SIGKILL? After a scheduler's SIGTERM the loop finishes its
optimizer step and then saves (``signals.GracefulStop``); the grace is torchrun's shutdown timeout (its agent
SIGKILLs the workers that long after passing SIGTERM on: 30 s by default, ``finetune.commands.launch``) or the scheduler's
(``--preemption_grace_seconds``), whichever is shorter. ``SaveBudget`` estimates a save at start-up (the bytes a
checkpoint holds, at the write speed of a small probe in ``--output_dir``), replaces the estimate with the first
save's measured time, takes the second optimizer step's time (the first includes warm-up), and warns once, on the
main process, when a step plus a save exceed the grace (docs/resume.md#the-grace-before-sigkill)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from finetune.distributed import WRITE_PROBE
from finetune.engine import parameter_numel

PROBE_BYTES = 4 << 20  # the write probe: small enough to cost milliseconds
# check_output_dir ignores files named so (another process's probe is not a previous run's content)
PROBE_NAME = f"{WRITE_PROBE}-speed"
TORCHRUN_DEFAULT_TIMEOUT = 30.0  # torch 2.13 launcher/api.py: TORCH_ELASTIC_SHUTDOWN_TIMEOUT's default
_MIB = 1 << 20


def _seconds(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def known_grace(grace_flag: float | None, environ=os.environ) -> tuple[float, str] | None:
    """(seconds, what sets them): the shorter of ``--preemption_grace_seconds`` and, in a process torchrun's
    agent started (it exports ``TORCHELASTIC_RUN_ID``), the agent's shutdown timeout (``PET_SHUTDOWN_TIMEOUT``,
    else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30: the order torch 2.13 reads them in); None if neither."""
    known = []
    if grace_flag is not None:
        known.append((float(grace_flag), "--preemption_grace_seconds"))
    if "TORCHELASTIC_RUN_ID" in environ:
        for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
            if environ.get(name):
                try:
                    known.append((float(environ[name]), f"torchrun's shutdown timeout ({name})"))
                    break
                except ValueError:
                    pass
        else:
            known.append((TORCHRUN_DEFAULT_TIMEOUT, "torchrun's shutdown timeout (its default; "
                                                    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT)"))
    return min(known) if known else None


def checkpoint_bytes(model) -> int:
    """The bytes a checkpoint of ``model`` holds, whole (what one writer saves without sharding): every
    parameter and buffer, plus AdamW's two moments per trainable parameter, in the parameter's dtype."""
    total = 0
    for param in model.parameters():
        size = parameter_numel(param) * param.element_size()
        total += size * (3 if param.requires_grad else 1)
    return total + sum(buffer.numel() * buffer.element_size() for buffer in model.buffers())


def write_speed(directory, size: int = PROBE_BYTES) -> float | None:
    """Bytes per second of a ``size``-byte write with ``fsync`` into ``directory`` (as a checkpoint is written:
    ``checkpoint._seal``); None when it cannot be written. The file is removed."""
    probe = Path(directory) / f"{PROBE_NAME}-{os.getpid()}"
    data = os.urandom(size)  # incompressible, as weights are to a compressing file system
    try:
        start = time.perf_counter()
        with open(probe, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        elapsed = time.perf_counter() - start
    except OSError:
        return None
    finally:
        probe.unlink(missing_ok=True)
    return size / max(elapsed, 1e-6)


class SaveBudget:
    """A run's step and save times against the grace it knows of (``known_grace``); ``say`` prints (the main
    process's; other processes pass ``active=False`` and do nothing). Units: seconds, bytes."""

    def __init__(self, grace_flag: float | None, say, active: bool = True, environ=os.environ):
        self.grace = known_grace(grace_flag, environ)
        self.say, self.active = say, active
        self.step_seconds = self.save_seconds = None
        self.save_source = ""
        self.steps_timed = 0
        self.warned = False

    def start(self, model, output_dir) -> None:
        """At start-up: estimate a save from the state's size and a write probe in ``output_dir``; print it."""
        if not self.active:
            return
        size, speed = checkpoint_bytes(model), write_speed(output_dir)
        grace = f"{self.grace[0]:g} s ({self.grace[1]})" if self.grace else "none known (--preemption_grace_seconds)"
        if speed is None:
            self.say(f"Checkpoint: {size / _MIB:.1f} MiB of model and optimizer state; grace before SIGKILL: {grace}.")
            return
        self.save_seconds = size / speed
        self.save_source = f"estimated: {size / _MIB:.1f} MiB at {speed / _MIB:.0f} MiB/s"
        self.say(f"Checkpoint: {size / _MIB:.1f} MiB of model and optimizer state; --output_dir writes "
                 f"{speed / _MIB:.0f} MiB/s: ~{_seconds(self.save_seconds)} s to save; grace before SIGKILL: {grace}.")
        self.check()

    def step(self, seconds: float) -> None:
        """After each optimizer step: its duration. The second one's counts (the first includes warm-up)."""
        self.steps_timed += 1
        if self.active and self.steps_timed <= 2:
            self.step_seconds = seconds
            if self.steps_timed == 2:
                self.check()

    def saved(self, seconds: float) -> None:
        """After a checkpoint: its measured duration replaces the estimate (the first save only)."""
        if self.active and not self.save_source.startswith("measured"):
            self.save_seconds, self.save_source = seconds, "measured at the first save"
            self.check()

    def check(self) -> bool:
        """Warn (once) when a step plus a save exceed the grace; True when they do."""
        if self.grace is None or self.save_seconds is None:
            return False
        step = self.step_seconds or 0.0
        total = step + self.save_seconds
        if total <= self.grace[0]:
            return False
        if not self.warned:
            timed = f"an optimizer step ({_seconds(step)} s) plus " if self.step_seconds is not None else ""
            self.say(f"warning: {timed}a checkpoint ({_seconds(self.save_seconds)} s, {self.save_source}) take "
                     f"{_seconds(total)} s, more than the {self.grace[0]:g} s grace of {self.grace[1]}: a stop signal now "
                     "would end in SIGKILL before the checkpoint is complete, losing the work since the last one. "
                     "Give the run more time (finetune train --preemption_grace_seconds N raises torchrun's timeout; "
                     "SLURM: --signal=B:USR1@N, or a longer GraceTime), or write --output_dir to faster storage.")
            self.warned = True
        return True
