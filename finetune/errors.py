"""User-facing errors: printed as one clear message (no traceback) with a non-zero exit code."""

from __future__ import annotations

import functools
import sys
from typing import Callable


class FinetuneError(Exception):
    """A problem with the user's input or environment; ``reports_errors`` prints ``error: <message>`` (name and fix)."""

    exit_code = 2  # like argparse
    # Raised on every process at the same point (agreed on, or decided by a collective's result): the command
    # leaves the process group before it exits (``distributed.leaving_together``). False: it may be this process's
    # alone, which must not wait at a barrier its peers may never reach.
    every_rank = False


class HubUnreachableError(FinetuneError):
    """A model or dataset must come from the Hugging Face Hub, and the hub cannot be reached."""


class TrainingStopped(FinetuneError):
    """Stopped on purpose (SIGTERM/SIGINT) after a checkpoint; the message holds the command that resumes it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # as a shell reports a signalled process

    every_rank = True  # the stop vote is all-reduced: every process stops at the same step


class NumericalError(FinetuneError):
    """A non-finite loss or gradient, or too many fp16 overflow skips in a row; the last good checkpoint is kept."""

    exit_code = 3


def together(err: FinetuneError) -> FinetuneError:
    """``err``, marked as raised on every process at the same point (``FinetuneError.every_rank``); for ``raise``."""
    err.every_rank = True
    return err


def reports_errors(main: Callable[..., int]) -> Callable[..., int]:
    """The one ``error:`` wrapper of the commands: ``main`` (a command's entry, returning its exit code) with a
    ``FinetuneError`` ended as one ``error: <message>`` line on stderr and the error's ``exit_code`` returned."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except FinetuneError as err:
            # one write of the whole line: under ``python -u`` (accelerate launch's workers) ``print`` writes the
            # text and its newline apart, and two ranks' lines interleave on the launcher's stderr
            sys.stderr.write(f"error: {err}\n")
            sys.stderr.flush()
            if isinstance(err, TrainingStopped):  # its line is out: SIGTERM acts again (GracefulStop held it)
                from finetune.signals import release_sigterm

                release_sigterm()
            return err.exit_code

    return wrapped


class VerificationFailed(FinetuneError):
    """An export's verification is beyond its tolerance (``finetune export``): the folder stays marked incomplete."""

    exit_code = 1
