"""Evaluation metrics shipped as local `evaluate` modules, loaded by path: no hub (docs/outputs.md#the-metrics)."""

from __future__ import annotations

from pathlib import Path

METRICS_DIR = Path(__file__).resolve().parent


def available_metrics() -> list[str]:
    """Names of the shipped metric modules, sorted (e.g. ``["accuracy", "f1"]``)."""
    return sorted(p.name for p in METRICS_DIR.iterdir() if (p / f"{p.name}.py").is_file())


def load_metric(name: str):
    """The shipped ``evaluate.EvaluationModule`` ``name``, by path; ``ValueError`` naming the shipped if unknown."""
    if name not in available_metrics():
        raise ValueError(f"unknown metric {name!r}; shipped metrics: {', '.join(available_metrics())}")
    import evaluate  # lazy: ~1 s (its evaluator imports scipy, sklearn's kin), for runs that compute metrics only

    # keep_in_memory: no cache file, so several processes computing the same metric never collide.
    return evaluate.load(str(METRICS_DIR / name), keep_in_memory=True)
