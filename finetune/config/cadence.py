"""The cadence section: when a run evaluates, writes a checkpoint and logs, which evaluation makes the best model,
and when it stops early."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from finetune.config.flags import flag
from finetune.errors import FinetuneError


def or_trainer_save_steps(save_steps: float | None) -> float:
    """``--save_steps`` as ``TrainingArguments(save_steps=...)``, which takes no None: its default, 500
    (transformers 5.24 training_args.py lines 1183-1184), where the flag is unset (Trainer ignores it unless
    ``save_strategy`` is ``steps``, which needs ``--save_steps``)."""
    return 500 if save_steps is None else save_steps


def task_names(text: str | None) -> list[str]:
    """lm-eval task names of a comma-separated ``--tasks``/``--eval_tasks`` value (each stripped, empty names
    dropped): ``"bbc_topic, bbc_headline"`` -> ``["bbc_topic", "bbc_headline"]``, ``","`` -> ``[]``."""
    return [name.strip() for name in (text or "").split(",") if name.strip()]


@dataclass
class CadenceArguments:
    """Evaluation, checkpoints, the best model and early stopping, logging and experiment tracking."""

    eval_strategy: Literal["no", "steps", "epoch"] = flag(
        "epoch",
        "When to evaluate: after every epoch, every --eval_steps optimizer steps "
        "(and after the last one), or never ('no').",
        step=False, trainer=None, verify="no",
    )
    eval_steps: float | None = flag(
        None,
        "With --eval_strategy steps: optimizer steps between evaluations, or a float in "
        "[0, 1): that ratio of the total steps.",
        step=False, trainer=None,
    )
    logging_steps: float = flag(
        1,
        "Optimizer steps between console/tracker updates (or a ratio in [0, 1) of the "
        "total). log.jsonl always has one record per optimizer step.",
        step=False, trainer=None, same_run=False, verify=1,
    )
    eval_on_start: bool = flag(
        False, "Also evaluate before the first optimizer step.",
        step=False, trainer=None, verify=False,
    )
    save_strategy: Literal["no", "steps", "epoch"] = flag(
        "no",
        "When to write a resumable checkpoint: every --save_steps optimizer steps, after "
        "every epoch, or never. A signal (SIGTERM/SIGINT) always writes one.",
        step=False, trainer="save_strategy", same_run=False, verify="no",
    )
    save_steps: float | None = flag(
        None,
        "With --save_strategy steps (implied when only this is given): optimizer steps "
        "between checkpoints, or a float in [0, 1): that ratio of the total steps.",
        step=False, trainer="save_steps", to_trainer=or_trainer_save_steps, same_run=False,
    )
    checkpointing_steps: str | None = flag(
        None,
        "Older spelling: N means --save_strategy steps --save_steps N; 'epoch' means --save_strategy "
        "epoch.",
        step=False, trainer=None, same_run=False, verify=None,
    )
    load_best_model_at_end: bool = flag(
        False,
        "Keep the checkpoint with the best --metric_for_best_model and make it the final "
        "model. Needs --save_strategy equal to --eval_strategy (steps: --save_steps a "
        "multiple of --eval_steps).",
        step=False, trainer=None, verify=False,
    )
    metric_for_best_model: str | None = flag(
        None, "The eval metric that decides the best model (default 'loss', i.e. eval_loss).",
        step=False, trainer=None,
    )
    greater_is_better: bool | None = flag(
        None,
        "Whether a larger --metric_for_best_model is better (default: False for a "
        "loss, True otherwise).",
        step=False, trainer=None,
    )
    early_stopping_patience: int | None = flag(
        None,
        "Stop after this many evaluations in a row without improving "
        "--metric_for_best_model (needs --load_best_model_at_end).",
        step=False, trainer=None, verify=None,
    )
    eval_tasks: str | None = flag(
        None,
        "lm-evaluation-harness tasks, comma-separated, also run at every evaluation on the model being trained, "
        "logged as eval_<task>_<metric> (usable as --metric_for_best_model); shipped offline: bbc_topic, "
        "bbc_headline (docs/benchmarks-lm-eval.md). Needs lm-eval (the [eval] extra).",
        step=False, trainer=None, verify=None,
    )
    eval_limit: float | None = flag(
        None, "With --eval_tasks: documents per task (lm-eval's --limit; below 1, a fraction of the task).",
        step=False, trainer=None,
    )
    eval_num_fewshot: int | None = flag(
        None, "With --eval_tasks: few-shot examples per document (lm-eval's --num_fewshot).",
        step=False, trainer=None,
    )
    save_total_limit: int | None = flag(
        None, "Keep only the newest K checkpoints.",
        step=False, trainer="save_total_limit", same_run=False, verify=None,
    )
    report_to: Literal["none", "all", "tensorboard", "wandb", "trackio", "comet_ml", "aim", "mlflow", "clearml",
                       "dvclive", "swanlab"] = flag(
        "none", "Experiment tracking through Accelerate's trackers (accelerate.utils.LoggerType; `all`: every one "
        "installed). TensorBoard and MLflow work offline (MLflow into <output_dir>/mlruns unless MLFLOW_TRACKING_URI "
        "is set).",
        step=False, trainer="report_to", verify="none",
    )

    def _resolve_cadence(self) -> None:
        """The older ``--checkpointing_steps`` parsed once into the ``TrainingArguments`` pair, ``--save_steps`` alone
        implying ``steps``, and the best model's metric and direction. Raises ``FinetuneError`` for a
        ``--checkpointing_steps`` that is neither a positive integer nor ``epoch``."""
        if self.checkpointing_steps is not None:  # the older flag, parsed once into the TrainingArguments pair
            value, self.checkpointing_steps = str(self.checkpointing_steps), None
            if value == "epoch":
                self.save_strategy = "epoch"
            elif value.isdigit() and int(value) >= 1:
                self.save_strategy, self.save_steps = "steps", int(value)
            else:
                raise FinetuneError(f"--checkpointing_steps must be a positive integer (optimizer steps) or 'epoch', "
                                    f"got {value!r}.")
        if self.save_steps is not None and self.save_strategy == "no":
            self.save_strategy = "steps"
        if self.metric_for_best_model is None and self.load_best_model_at_end:
            self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            # TrainingArguments' rule: a metric named like a loss is minimised
            self.greater_is_better = not self.metric_for_best_model.removeprefix("eval_").endswith("loss")

    @property
    def best_metric_key(self) -> str:
        """The ``metrics`` key of ``metric_for_best_model`` (``eval_`` prefixed, as Trainer does)."""
        name = self.metric_for_best_model or "loss"
        return name if name.startswith("eval_") else f"eval_{name}"

    def _check_evaluation_and_saving(self) -> None:
        """When to evaluate and to save, and what the two decide together (the best model, early stopping)."""
        if self.eval_strategy == "steps" and self.eval_steps is None:
            raise FinetuneError("--eval_strategy steps needs --eval_steps N (optimizer steps between evaluations).")
        if self.eval_steps is not None and self.eval_strategy != "steps":
            raise FinetuneError(f"--eval_steps is used only with --eval_strategy steps (it is {self.eval_strategy!r}); "
                                "add --eval_strategy steps or drop --eval_steps.")
        if self.save_strategy == "steps" and self.save_steps is None:
            raise FinetuneError("--save_strategy steps needs --save_steps N (optimizer steps between checkpoints).")
        if self.load_best_model_at_end:
            self._check_best_model()
        if self.early_stopping_patience is not None:
            if self.early_stopping_patience < 1:
                raise FinetuneError(f"--early_stopping_patience must be >= 1, got {self.early_stopping_patience}.")
            if not self.load_best_model_at_end:
                raise FinetuneError("--early_stopping_patience needs --load_best_model_at_end (as Trainer's "
                                    "EarlyStoppingCallback): otherwise the run would end on a worse model.")
        if self.eval_tasks is not None and not task_names(self.eval_tasks):
            raise FinetuneError(f"--eval_tasks {self.eval_tasks!r} names no task: give lm-eval task names, "
                                "comma-separated (shipped offline: bbc_topic, bbc_headline), or drop --eval_tasks.")
        if (self.eval_limit is not None or self.eval_num_fewshot is not None) and not self.eval_tasks:
            raise FinetuneError("--eval_limit and --eval_num_fewshot are for --eval_tasks: add --eval_tasks T1,T2 or "
                                "drop them.")
        if self.eval_limit is not None and (self.eval_limit <= 0 or (self.eval_limit >= 1 and
                                                                     self.eval_limit != int(self.eval_limit))):
            raise FinetuneError(f"--eval_limit must be a whole number of documents or a fraction in (0, 1), got "
                                f"{self.eval_limit}.")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise FinetuneError(f"--save_total_limit must be >= 1, got {self.save_total_limit}.")

    def _check_best_model(self) -> None:
        """``--load_best_model_at_end``: a checkpoint at every evaluation."""
        if self.eval_strategy == "no":
            raise FinetuneError("--load_best_model_at_end needs evaluations: set --eval_strategy epoch or steps.")
        if self.save_strategy != self.eval_strategy:
            raise FinetuneError(f"--load_best_model_at_end needs --save_strategy equal to --eval_strategy "
                                f"({self.eval_strategy!r}), got {self.save_strategy!r}: the best model is one of the "
                                "checkpoints, so one must be written at every evaluation.")
        if self.eval_strategy == "steps" and ((self.save_steps < 1) != (self.eval_steps < 1) or
                                             (self.save_steps / self.eval_steps) != int(self.save_steps / self.eval_steps)):
            raise FinetuneError(f"--load_best_model_at_end needs --save_steps ({self.save_steps}) to be a round "
                                f"multiple of --eval_steps ({self.eval_steps}).")
