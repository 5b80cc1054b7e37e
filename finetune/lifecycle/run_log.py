"""The run's record, ``log.jsonl``: its schema, its one writer's file (``JsonlLog``, held by the run lifecycle) and
its one reader (``read_log``). Standing alone, so that commands and scripts read a run without the lifecycle.

``log.jsonl``'s schema (one JSON object a line, written by ``lifecycle.RunState`` only): a step record has ``step``,
``epoch``, ``loss`` (mean per item over the window), ``learning_rate``, ``grad_norm``, ``samples``,
``micro_batches``, and where known ``padded_tokens``, ``input_tokens``, ``trained_tokens``, ``step_seconds`` with
their ``*_per_second`` rates, ``warmup``, ``loss_scale``, ``skipped`` (and the Trainer backend's
``trainer_logged_loss``); an evaluation record has ``step``, ``epoch`` and the evaluation's ``eval_*`` results, and
no ``loss``; where the task generates completions (GRPO), also ``completions``: a list of ``{"prompt",
"completion", "reward", "rewards": {function: value or null}}``, one per held-out prompt. ``read_log`` reads it."""

from __future__ import annotations

import json
from pathlib import Path


def grad_norm_value(grad_norm) -> float | None:
    """A gradient norm (tensor, float, or None) as a float for the log, or None."""
    return None if grad_norm is None else float(grad_norm)


LOG_FILE = "log.jsonl"


def read_log(output_dir, kind: str | None = None) -> list[dict]:
    """The records of ``<output_dir>/log.jsonl`` in order ([] where there is no log); ``kind``: "step" for the
    optimizer steps only (records with a ``loss``), "eval" for the evaluations only, None for both. Blank lines
    are skipped. Raises ``ValueError`` for a line that is not JSON."""
    path = Path(output_dir) / LOG_FILE
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if kind is None:
        return records
    return [r for r in records if ("loss" in r) == (kind == "step")]


class JsonlLog:
    """``log.jsonl``, one JSON object per line, main process only, flushed at once; ``append`` resumes."""

    def __init__(self, path: Path, enabled: bool, append: bool = False):
        self.file = open(path, "a" if append else "w", encoding="utf-8") if enabled else None

    def write(self, record: dict) -> None:
        """Append ``record`` as one line."""
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self.file:
            self.file.close()
            self.file = None


def restore_log(path: Path, step: int) -> None:
    """On resume: drop the log records a killed run wrote after the checkpoint's ``step``."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if (r := json.loads(line))["step"] < step or (r["step"] == step and "loss" in r)]
    path.write_text("".join(line + "\n" for line in kept))
