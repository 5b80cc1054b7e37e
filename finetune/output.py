"""Output-directory checks, done before any work so a bad ``--output_dir`` loses nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune.errors import FinetuneError

# Settings whose change does not make a run "different" (where it goes, whether it may overwrite).
_IGNORED = {"output_dir", "overwrite_output_dir", "list_recipes"}


def check_output_dir(config) -> None:
    """Refuse an ``--output_dir`` that holds a different run (unless ``--overwrite_output_dir``) or
    cannot be written. A directory holding the same run's config may be reused (a rerun).

    Raises ``FinetuneError`` naming the differing settings and the flags that fix it.
    """
    out = Path(config.output_dir)
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"--output_dir {str(out)!r} is a file, not a directory. Choose another --output_dir.")
    previous = out / "run_config.json"
    if previous.is_file() and not config.overwrite_output_dir:
        try:
            old = json.loads(previous.read_text())
        except (OSError, ValueError):
            old = {}
        new = config.to_dict()
        differences = sorted(k for k in set(old) | set(new) if k not in _IGNORED and old.get(k) != new.get(k))
        if differences:
            raise FinetuneError(
                f"--output_dir {str(out)!r} holds a different run (settings that differ: {', '.join(differences)}). "
                "Choose another --output_dir, or pass --overwrite_output_dir to replace it."
            )
    elif out.is_dir() and any(out.iterdir()) and not previous.is_file() and not config.overwrite_output_dir:
        raise FinetuneError(
            f"--output_dir {str(out)!r} is not empty and does not hold a finetune run. "
            "Choose another --output_dir, or pass --overwrite_output_dir."
        )
    parent = out if out.exists() else next((p for p in out.absolute().parents if p.exists()), Path("/"))
    if not os.access(parent, os.W_OK):
        raise FinetuneError(f"--output_dir {str(out)!r} is not writable ({parent} denies writing). "
                            "Choose a directory you can write to.")
