"""Signals: a training process that stops with its launcher (``prctl(PR_SET_PDEATHSIG, SIGTERM)``, Linux), and
SIGINT/SIGTERM that end a run after its optimizer step with a checkpoint and exit 128 + signal
(``GracefulStop``). Imported before torch, to narrow the start-up window.
Why: docs/design-notes.md#stops-that-checkpoint."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PF_EXITING = 0x4  # <linux/sched.h>: the task is exiting (set before the kernel signals its children)

_launcher_pid: int | None = None  # the parent process id recorded when the watch started, or None


def launched_by_accelerate() -> bool:
    """Whether ``accelerate launch`` (or ``finetune train``) started us: it exports ``ACCELERATE_DYNAMO_BACKEND``."""
    return "ACCELERATE_DYNAMO_BACKEND" in os.environ


def watch_launcher() -> bool:
    """If launched by accelerate on Linux: have the kernel send SIGTERM when the launcher (parent) dies; True when
    the watch is on (idempotent). A launcher already gone (the parent id changed) prints an ``error:`` line and
    exits 128 + 15 at once."""
    global _launcher_pid
    if not launched_by_accelerate() or not sys.platform.startswith("linux"):
        return False
    if _launcher_pid is None:
        _launcher_pid = os.getppid()
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
                _launcher_pid = None
                return False
        except (OSError, AttributeError):  # no libc prctl (not glibc/musl Linux): no watch
            _launcher_pid = None
            return False
    # The kernel signals only a death after the request: one just before it is seen as a changed parent.
    if launcher_gone():
        print(f"error: the launcher (process {_launcher_pid}) exited before training started; nothing was "
              "trained. Start the run again (with finetune train, which waits for the checkpoint on SIGTERM).",
              file=sys.stderr)
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)
    return True


def launcher_gone() -> bool:
    """Whether the watched launcher died or is dying: re-parented, or its main thread exiting (``PF_EXITING``) or
    a zombie; False with no watch (why the thread: docs/resume.md#how-a-stop-works)."""
    if _launcher_pid is None:
        return False
    if os.getppid() != _launcher_pid:
        return True
    try:
        with open(f"/proc/{_launcher_pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return True
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, session, tty, tpgid, flags
    return fields[0] in ("Z", "X", "x") or bool(int(fields[6]) & _PF_EXITING)


class GracefulStop:
    """SIGINT/SIGTERM: the first sets ``signum`` (the loop finishes its optimizer step, checkpoints, exits), a
    second exits at once; not a SIGTERM after the launcher died, the kernel's echo of a Ctrl-C being handled, nor
    a SIGTERM within ``repeat_window`` seconds of the first SIGTERM: a scheduler signals every process of a job step
    (SLURM, on preemption and at the time limit), and torchrun's agent, signalled too, passes it on as well."""

    def __init__(self, repeat_window: float = 5.0):
        self.signum = None
        self.repeat_window = repeat_window
        self._since = None  # time.monotonic() of the first signal
        self._launcher_noted = False
        self._repeat_noted = False
        self._previous = {}

    def __enter__(self) -> "GracefulStop":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self.signum is not None:  # stopping: the process exits 128 + signum once the checkpoint is out; a late
            # SIGTERM (the kernel's, per launcher thread, or a scheduler's repeat) must not kill it with -15 meanwhile
            hold_sigterm()


    def _handle(self, signum, frame):
        launcher_died = signum == signal.SIGTERM and launcher_gone()
        if self.signum is not None and launcher_died:  # the kernel may signal once per launcher thread
            if not self._launcher_noted:
                print("\nthe launcher exited: finishing the checkpoint (the bare launcher does not wait for it).",
                      file=sys.stderr)
            self._launcher_noted = True
            return
        if (self.signum == signum == signal.SIGTERM and self._since is not None
                and time.monotonic() - self._since < self.repeat_window):
            if not self._repeat_noted:
                print(f"\nSIGTERM again within {self.repeat_window:g} s: the same request (a scheduler signals every "
                      "process, and the launcher passes it on); still finishing the checkpoint.", file=sys.stderr)
            self._repeat_noted = True
            return
        if self.signum is not None:
            print(f"\n{signal.Signals(signum).name} again: exiting now, without a checkpoint.", file=sys.stderr)
            os._exit(128 + signum)
        self.signum, self._launcher_noted, self._since = signum, launcher_died, time.monotonic()
        cause = " (the launcher exited)" if launcher_died else ""
        again = ("SIGINT again" if launcher_died else
                 f"it again after {self.repeat_window:g} s" if signum == signal.SIGTERM else "it again")
        print(f"\n{signal.Signals(signum).name}{cause}: finishing this optimizer step, then saving a checkpoint "
              f"(send {again} to exit at once).", file=sys.stderr)


_held_sigterm = None  # the SIGTERM handler that ``hold_sigterm`` replaced, until ``release_sigterm``


def _late_sigterm(signum, frame) -> None:
    """A SIGTERM while a stopped run reports its stop: the same request, already being honoured."""


def hold_sigterm() -> None:
    """Ignore SIGTERM until ``release_sigterm`` (a stopped run, on its way to its ``error:`` line and exit 143).
    A Python handler, not ``SIG_IGN``: a process started meanwhile (``exec``) gets the default action back, where an
    ignored disposition would be inherited and leave it deaf to SIGTERM."""
    global _held_sigterm
    previous = signal.signal(signal.SIGTERM, _late_sigterm)
    if previous is not _late_sigterm:
        _held_sigterm = previous


def release_sigterm() -> None:
    """Give SIGTERM back the handler ``hold_sigterm`` replaced (no-op when none is held): called once a stop's
    ``error:`` line is out (``errors.reports_errors``), so a process that goes on (a notebook, a test) is not left
    ignoring SIGTERM."""
    global _held_sigterm
    if _held_sigterm is not None:
        signal.signal(signal.SIGTERM, _held_sigterm)
        _held_sigterm = None
