"""Bookkeeping both backends share (output directory, ``log.jsonl`` and its one reader, cadence, best model, early
stopping, fp16 skips); the run lifecycle (``finetune.lifecycle.RunState``) holds it. Units: optimizer steps,
samples and tokens over all processes, seconds. See docs/design-notes.md#bookkeeping.

``log.jsonl``'s schema (one JSON object a line, written by ``Bookkeeping`` only): a step record has ``step``,
``epoch``, ``loss`` (mean per item over the window), ``learning_rate``, ``grad_norm``, ``samples``,
``micro_batches``, and where known ``padded_tokens``, ``input_tokens``, ``trained_tokens``, ``step_seconds`` with
their ``*_per_second`` rates, ``warmup``, ``loss_scale``, ``skipped`` (and the Trainer backend's
``trainer_logged_loss``); an evaluation record has ``step``, ``epoch`` and the evaluation's ``eval_*`` results, and
no ``loss``. ``read_log`` reads it."""

from __future__ import annotations

import json
from pathlib import Path

from finetune.errors import FinetuneError, NumericalError, together
from finetune.output import clear_output_dir
from finetune.progress import RunProgress
from finetune.steps import StepPlan


def empty_window_error(samples: int) -> FinetuneError:
    """The error for an accumulation window whose ``samples`` hold no trained item (no label token): its loss
    would divide by zero. Marked ``every_rank``: both backends count the window's items over every process first."""
    return together(FinetuneError(
        f"an accumulation window of {samples} samples has no trained tokens (every label is masked: texts of one "
        "token, or --max_length too small to keep a target). Raise --max_length (>= 2 for causal LM) or remove such "
        "samples (finetune check-data)."))


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


class Bookkeeping:
    """One run's records and cadence. ``writes``: this process writes ``--output_dir``; ``say``: prints where it
    should; ``progress``: the counters a checkpoint holds (``checkpoint.RunProgress``)."""

    def __init__(self, config, plan: StepPlan, progress: RunProgress, *, writes: bool, say, counts_tokens: bool):
        self.config, self.plan, self.progress, self.writes, self.say = config, plan, progress, writes, say
        self.counts_tokens = counts_tokens  # loss items are label tokens (causal LM), recorded as such
        self.warm = False  # the first optimizer step of this start (compile, allocator warm-up) is not timed
        self.output_dir = Path(config.output_dir)
        self.eval_steps, self.save_steps = plan.steps(config.eval_steps), plan.steps(config.save_steps)
        self.eval_results, self.best_eval_results, self.eval_runtime, self.last_eval_step = {}, {}, 0.0, None
        self.stopping_early = False
        self.log = None

    # -------------------------------------------------------------------------------- the output directory
    def open(self, resume_step: int | None) -> None:
        """Clear (``--overwrite_output_dir``, fresh runs only), write ``run_config.json``, resume ``log.jsonl``."""
        if self.writes:
            if self.config.overwrite_output_dir and resume_step is None:
                clear_output_dir(self.output_dir)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "run_config.json").write_text(self.config.to_json() + "\n")
            if resume_step is not None:
                restore_log(self.output_dir / LOG_FILE, resume_step)
        self.log = JsonlLog(self.output_dir / LOG_FILE, self.writes, append=resume_step is not None)

    def close(self) -> None:
        """Close ``log.jsonl`` (idempotent)."""
        if self.log is not None:
            self.log.close()

    # -------------------------------------------------------------------------------- cadence
    def evaluate_after_step(self, step: int) -> bool:
        """``--eval_strategy steps``: evaluate after optimizer step ``step``."""
        return self.config.eval_strategy == "steps" and step % self.eval_steps == 0

    def save_after_step(self, step: int) -> bool:
        """``--save_strategy steps``: checkpoint after ``step`` (not the last, nor after early stopping)."""
        return (self.config.save_strategy == "steps" and step % self.save_steps == 0 and step < self.plan.max_steps
                and not self.stopping_early)

    def evaluate_at_epoch_end(self, step: int, last: bool) -> bool:
        """Evaluate at the end of an epoch: ``--eval_strategy epoch``, or with "steps" the final model once."""
        strategy = self.config.eval_strategy
        return strategy == "epoch" or (strategy == "steps" and last and self.last_eval_step != step)

    # -------------------------------------------------------------------------------- records
    def record_step(self, *, loss: float, samples: int, items: float, micro_batches: int, learning_rate: float | None,
                    grad_norm, loss_scale: float | None, skipped: bool, input_tokens: int | None = None,
                    padded_tokens: int | None = None, seconds: float | None = None, **extra) -> dict:
        """Count one optimizer step and return its ``log.jsonl`` record (``loss``: mean per item over the window;
        ``samples``, ``items`` over all processes; ``input_tokens`` without padding, ``padded_tokens`` with it;
        ``seconds`` the step's duration, evaluation and checkpoints excluded). The record's throughput: padded,
        input and trained tokens (the loss's items, causal LM) per second; the first step of each start is marked
        ``warmup`` and left out of the run's figures. Raises ``NumericalError`` past ``--max_skipped_steps`` skips."""
        progress = self.progress
        progress.record_step(loss, skipped)
        progress.samples_seen += samples
        trained = int(items) if self.counts_tokens else 0
        progress.input_tokens_seen += input_tokens or 0
        progress.padded_tokens_seen += padded_tokens or 0
        progress.tokens_seen += trained
        record = {"step": progress.step, "epoch": round(self.plan.epoch_fraction(progress.step), 4), "loss": loss,
                  "learning_rate": learning_rate, "grad_norm": grad_norm_value(grad_norm), "samples": samples,
                  "micro_batches": micro_batches}
        counts = {"padded_tokens": padded_tokens, "input_tokens": input_tokens,
                  "trained_tokens": trained if self.counts_tokens else None}
        record.update({k: v for k, v in counts.items() if v is not None})
        if seconds is not None and seconds > 0:
            record["step_seconds"] = round(seconds, 6)
            record.update({f"{k}_per_second": round(v / seconds, 3) for k, v in counts.items() if v is not None})
            if self.warm:
                progress.timed_steps += 1
                progress.timed_seconds += seconds
                progress.timed_samples += samples
                progress.timed_padded_tokens += padded_tokens or 0
                progress.timed_input_tokens += input_tokens or 0
                progress.timed_trained_tokens += trained
            else:
                record["warmup"] = True
            self.warm = True
        if loss_scale is not None:
            record["loss_scale"] = loss_scale  # fp16: after this step's GradScaler update (halved by a skip)
        if skipped:
            record["skipped"] = True
        record.update(extra)
        self.log.write(record)
        if progress.consecutive_skipped > self.config.max_skipped_steps:
            # every process: a skip follows the all-reduced gradients' overflow
            raise together(NumericalError(
                f"fp16 loss scaling skipped {progress.consecutive_skipped} optimizer steps in a row (up to step "
                f"{progress.step}): the loss or gradients overflow fp16. Nothing after the last checkpoint was saved. "
                "Use --mixed_precision bf16 or no, or lower --learning_rate; raise --max_skipped_steps to tolerate "
                "more."))
        return record

    def record_evaluation(self, results: dict, seconds: float, checkpointed: bool) -> None:
        """Log an evaluation (``seconds``, kept out of ``train_runtime``), track early stopping and the best
        model: the best evaluation whose model is ``checkpointed``. Raises ``FinetuneError`` when
        ``--metric_for_best_model`` is not among ``results``."""
        step, config = self.progress.step, self.config
        self.eval_runtime += seconds
        self.eval_results, self.last_eval_step = results, step
        epoch = self.plan.epoch_fraction(step)
        self.log.write({"step": step, "epoch": round(epoch, 4), **results})
        self.say(f"eval at step {step} (epoch {epoch:.2f}): " + ", ".join(
            f"{k}={v:.4f}" for k, v in results.items() if isinstance(v, float)))
        if config.metric_for_best_model is None:
            return
        if config.best_metric_key not in results:
            raise FinetuneError(f"--metric_for_best_model {config.metric_for_best_model!r}: the evaluation has no "
                                f"{config.best_metric_key!r} (it has {', '.join(sorted(results))}).")
        if self.progress.record_evaluation(results[config.best_metric_key], config.greater_is_better, checkpointed):
            self.best_eval_results = results
        patience = config.early_stopping_patience
        if patience and self.progress.evals_without_improvement >= patience:
            self.stopping_early = True
            self.say(f"early stopping: {config.best_metric_key} has not improved for {patience} evaluation(s); "
                     f"best {self.progress.best_metric:.4f} at step {self.progress.best_step}.")

    def final_eval_results(self) -> dict:
        """The evaluation ``metrics.json`` reports: the best under ``--load_best_model_at_end``, else the last."""
        if self.config.load_best_model_at_end and self.best_eval_results:
            return self.best_eval_results
        return self.eval_results
