"""A run's counters at an optimizer-step boundary (``RunProgress``): what a checkpoint of either backend holds
and a resume restores. The run lifecycle (``finetune.lifecycle.run_state``) owns them; ``finetune.lifecycle.checkpoint`` stores them.
Here, below both, so that storage and lifecycle import it one way."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunProgress:
    """The loop's own state at an optimizer-step boundary (units: optimizer steps, micro-batches per
    process, samples and label tokens over all processes, seconds)."""

    step: int = 0
    epoch: int = 0  # the epoch in progress (0-based)
    micro_batches_done: int = 0  # micro-batches of that epoch already consumed, per process (this launch's plan)
    samples_done: int = 0  # positions of that epoch's seeded order consumed, over all processes (any plan of B)
    samples_seen: int = 0
    tokens_seen: int = 0
    input_tokens_seen: int = 0
    padded_tokens_seen: int = 0  # input positions incl. padding (what the model computed on)
    # throughput over the timed steps: every optimizer step but the first of each start (warm-up)
    timed_steps: int = 0
    timed_seconds: float = 0.0
    timed_samples: int = 0
    timed_padded_tokens: int = 0
    timed_input_tokens: int = 0
    timed_trained_tokens: int = 0
    skipped_steps: int = 0
    consecutive_skipped: int = 0
    step_loss_total: float = 0.0  # sum over optimizer steps of each step's mean loss (train_loss: / step)
    last_loss: float | None = None
    best_metric: float | None = None  # --metric_for_best_model's best value so far, and where
    best_step: int | None = None
    evals_without_improvement: int = 0  # for --early_stopping_patience
    patience_best: float | None = None  # the best value of every evaluation (best_metric: of those kept)
    evaluation_due: bool = False  # a signal stopped the run after a step due for evaluation: the resume runs it
    train_runtime: float = 0.0
    num_processes: int = 1
    step_meaning: dict = field(default_factory=dict)

    def record_step(self, loss: float, skipped: bool) -> None:
        """Count one optimizer step whose mean loss per item was ``loss``."""
        self.step += 1
        self.step_loss_total += loss
        self.last_loss = loss
        self.skipped_steps += int(skipped)
        self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0

    def record_evaluation(self, value: float | None, greater_is_better: bool, checkpointed: bool = True) -> bool:
        """Track ``--metric_for_best_model`` after an evaluation at ``self.step``. Early stopping counts
        evaluations without a strict improvement over every evaluation so far (Trainer's
        ``EarlyStoppingCallback``, threshold 0); the best model is the best evaluation whose model is kept
        (``checkpointed``: a checkpoint follows it, or it is the final model). Returns whether this
        evaluation is the new best model."""
        if value is None:
            return False

        def better(than):
            return than is None or (value > than if greater_is_better else value < than)

        if better(self.patience_best):
            self.patience_best, self.evals_without_improvement = value, 0
        else:
            self.evals_without_improvement += 1
        if checkpointed and better(self.best_metric):
            self.best_metric, self.best_step = value, self.step
            return True
        return False
