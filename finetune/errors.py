"""User-facing errors: printed as one clear message (no traceback) with a non-zero exit code."""


class FinetuneError(Exception):
    """A problem with the user's input or environment, with a message that names it and the fix.

    ``run.py`` prints ``error: <message>`` and exits with ``exit_code`` (2 by default, like argparse).
    """

    exit_code = 2


class HubUnreachableError(FinetuneError):
    """A model or dataset must come from the Hugging Face Hub, and the hub cannot be reached."""
