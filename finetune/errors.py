"""User-facing errors: printed as one clear message (no traceback) with a non-zero exit code."""

from __future__ import annotations

import functools
import sys
from typing import Callable


class FinetuneError(Exception):
    """A problem with the user's input or environment; ``reports_errors`` prints ``error: <message>`` (name and fix)."""

    exit_code = 2  # like argparse


class HubUnreachableError(FinetuneError):
    """A model or dataset must come from the Hugging Face Hub, and the hub cannot be reached."""


class TrainingStopped(FinetuneError):
    """Stopped on purpose (SIGTERM/SIGINT) after a checkpoint; the message holds the command that resumes it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # as a shell reports a signalled process


class NumericalError(FinetuneError):
    """A non-finite loss or gradient, or too many fp16 overflow skips in a row; the last good checkpoint is kept."""

    exit_code = 3


def reports_errors(main: Callable[..., int]) -> Callable[..., int]:
    """The one ``error:`` wrapper of the commands: ``main`` (a command's entry, returning its exit code) with a
    ``FinetuneError`` ended as one ``error: <message>`` line on stderr and the error's ``exit_code`` returned."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except FinetuneError as err:
            print(f"error: {err}", file=sys.stderr)
            return err.exit_code

    return wrapped
