"""User-facing errors: printed as one clear message (no traceback) with a non-zero exit code."""


class FinetuneError(Exception):
    """A problem with the user's input or environment, with a message that names it and the fix.

    ``run.py`` prints ``error: <message>`` and exits with ``exit_code`` (2 by default, like argparse).
    """

    exit_code = 2


class HubUnreachableError(FinetuneError):
    """A model or dataset must come from the Hugging Face Hub, and the hub cannot be reached."""


class TrainingStopped(FinetuneError):
    """The run stopped early on purpose (SIGTERM/SIGINT) after writing a checkpoint; the message holds
    the command that resumes it. Exit code 128 + signal number, as a shell reports a signalled process."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class NumericalError(FinetuneError):
    """A non-finite loss or gradient (fp32/bf16), or too many fp16 overflow skips in a row. The last good
    checkpoint is kept; nothing after it is saved."""

    exit_code = 3
