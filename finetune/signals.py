"""Signals: a training process that stops with its launcher, and SIGINT/SIGTERM that end a run after its
optimizer step with a checkpoint (``GracefulStop``). When the launcher dies, the training process gets
SIGTERM, finishes its optimizer step, writes a checkpoint and exits 128 + 15.

Why: a 1-process ``accelerate launch`` (its "simple launcher", accelerate 1.15) neither handles SIGTERM
nor passes it on. ``kill -TERM`` to it, as a scheduler or Kubernetes sends, ends the launcher at once and
the training process trains on as an orphan, writing no checkpoint when its node is then torn down.
With ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (Linux) the kernel signals the training process the moment its
parent dies, whatever killed it (even SIGKILL). Torchrun workers get the same protection against a killed
agent.

The bare launcher still returns before the checkpoint is written: whoever waits for it (a job script, a
container runtime) sees it end while the orphaned training process is still saving, and may tear the
machine down under it. ``finetune train`` passes the signal on and waits for the checkpoint: use it.

The kernel ties the signal to the thread that started this process, and every launcher here (accelerate's
simple launcher, torchrun's agent, ``finetune train``) starts it from its main thread, which ends only with
the launcher.

Only this module's functions are imported before torch, so the window in which a launcher that dies
goes unnoticed is the interpreter's start-up, before ``watch_launcher`` runs (tens of milliseconds); a
death in that window is then seen as a changed parent process id.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PF_EXITING = 0x4  # <linux/sched.h>: the task is exiting (set before the kernel signals its children)

_launcher_pid: int | None = None  # the parent process id recorded when the watch started, or None


def launched_by_accelerate() -> bool:
    """Whether this process was started by ``accelerate launch`` (or ``finetune train``, or torchrun under
    ``accelerate launch``): the launcher exports ``ACCELERATE_DYNAMO_BACKEND`` to its children."""
    return "ACCELERATE_DYNAMO_BACKEND" in os.environ


def watch_launcher() -> bool:
    """If launched by accelerate: ask the kernel to send this process SIGTERM when its launcher (the parent
    process) dies, and check that it has not died already. Idempotent; a no-op (returns False) when not
    launched by accelerate or not on Linux. Returns True when the watch is on.

    If the launcher is already gone (the parent process id changed since the first call: it died before
    the request, which the kernel does not signal), nothing has been trained yet: this prints an
    ``error:`` line and exits 128 + 15 at once, as if the signal had arrived.
    """
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
    """Whether the launcher recorded by ``watch_launcher`` has died or is dying: this process was re-parented,
    or the launcher's main thread is exiting (``PF_EXITING``) or a zombie. False when no watch is on.

    The kernel sends the signal when the *thread* that started this process exits, and again on each
    re-parenting: a launcher with several threads dies thread by thread, so the first signal can come while
    ``getppid()`` still names the launcher. Its exiting main thread tells that signal apart from a SIGTERM
    sent to this process by someone else."""
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
    """SIGINT/SIGTERM handling: the first signal sets ``signum`` (the loop finishes the optimizer step in
    progress, writes a checkpoint and exits); a second one exits at once.

    Except a SIGTERM after the launcher died (``watch_launcher``): that is the kernel's notice of the
    launcher's death, which follows the Ctrl-C that a terminal sends to the launcher and this process
    alike, and must not cut short the checkpoint that Ctrl-C started."""

    def __init__(self):
        self.signum = None
        self._launcher_noted = False
        self._previous = {}

    def __enter__(self) -> "GracefulStop":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        launcher_died = signum == signal.SIGTERM and launcher_gone()
        if self.signum is not None and launcher_died:  # the kernel may signal once per launcher thread
            if not self._launcher_noted:
                print("\nthe launcher exited: finishing the checkpoint (the bare launcher does not wait for it).",
                      file=sys.stderr)
            self._launcher_noted = True
            return
        if self.signum is not None:
            print(f"\n{signal.Signals(signum).name} again: exiting now, without a checkpoint.", file=sys.stderr)
            os._exit(128 + signum)
        self.signum, self._launcher_noted = signum, launcher_died
        cause = " (the launcher exited)" if launcher_died else ""
        again = "SIGINT" if launcher_died else "it"
        print(f"\n{signal.Signals(signum).name}{cause}: finishing this optimizer step, then saving a checkpoint "
              f"(send {again} again to exit at once).", file=sys.stderr)
