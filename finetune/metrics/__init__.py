"""Evaluation metrics shipped with finetune as local `evaluate` modules.

`evaluate.load("accuracy")` fetches its script from the Hugging Face Hub; these modules are loaded by
path instead, so evaluation works offline. Each sub-folder is a standard evaluate module
(`<name>/<name>.py` defining an `evaluate.Metric`).
"""

from __future__ import annotations

from pathlib import Path

import evaluate

METRICS_DIR = Path(__file__).resolve().parent


def available_metrics() -> list[str]:
    """Names of the metric modules shipped in this folder, sorted (e.g. ``["accuracy", "f1"]``)."""
    return sorted(p.name for p in METRICS_DIR.iterdir() if (p / f"{p.name}.py").is_file())


def load_metric(name: str):
    """Load the shipped evaluate module ``name`` by path (no network).

    Returns an ``evaluate.EvaluationModule``. Raises ``ValueError`` naming the available metrics if
    ``name`` is not one of them.
    """
    if name not in available_metrics():
        raise ValueError(f"unknown metric {name!r}; shipped metrics: {', '.join(available_metrics())}")
    # keep_in_memory: no cache file, so several processes computing the same metric never collide.
    return evaluate.load(str(METRICS_DIR / name), keep_in_memory=True)
