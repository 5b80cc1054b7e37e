"""The run lifecycle both backends drive, in torchtune's setup / train / cleanup shape: ``RunState`` owns the run's
counters (``progress.RunProgress``), its records and cadence (``log.jsonl`` through ``run_log``, the evaluation
and save cadence, the best model, early stopping, fp16 skips), the resume (one checkpoint format for both
backends, checked alike and agreed on by every process), evaluation with generation and the rule of which
evaluated model is kept, the step and save timers (``preemption.SaveBudget``), the banner and the final outputs.
Both backends hold one: the accelerate backend's ``Loop`` (``backends.accelerate``) asks it around the visible
loop, the Trainer backend's thin callback (``backends.trainer.BookkeepingCallback``) forwards Trainer's events to
it. Units: optimizer steps, samples and tokens over all processes, seconds. See docs/backends.md.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from finetune import distributed
from finetune.data.loading import training_set_identity
from finetune.errors import FinetuneError, NumericalError, together
from finetune.lifecycle import checkpoint as ckpt
from finetune.lifecycle import elastic
from finetune.lifecycle.evaluation import benchmark_eval, evaluate, generation_eval, write_generations
from finetune.lifecycle.output import clear_output_dir
from finetune.lifecycle.preemption import SaveBudget
from finetune.lifecycle.progress import RunProgress
from finetune.lifecycle.run_log import LOG_FILE, JsonlLog, grad_norm_value, restore_log
from finetune.lifecycle.window import micro_batches_per_process, plan_steps
from finetune.outputs.reporting import run_banner, run_metrics, write_outputs


class RunState:
    """One run, whichever backend trains it. ``backend``: "accelerate" or "trainer" (whose checkpoints it resumes:
    ``checkpoint.list_checkpoints``); ``plan``: the ``window.StepPlan``; ``task``: the recipe's task;
    ``layout``: the ``distributed.StorageLayout`` (who writes the run's files); ``precision``: "no", "fp16" or
    "bf16" as it runs; ``say``: prints on the main process only; ``main``: this is the main process; ``hub``: a
    ``finetune.outputs.hub.HubPush`` or None; ``process_start``: ``time.time()`` when the process started (for
    ``metrics.json``); ``raw_validation``: the validation split before tokenizing (generation evaluates it);
    ``train_dataset``: the tokenized training set (a ``datasets.Dataset``) that the run and its checkpoints are
    bound to (``data.training_set_identity``; None: not recorded); ``base``: a quantized base's identity
    (``models.quantization.base_identity``; None: a full-precision base), part of a step's meaning too."""

    def __init__(self, config, recipe, *, backend: str, plan, num_processes: int, task, layout, precision: str, say,
                 main: bool, raw_validation=None, hub=None, process_start: float | None = None, train_dataset=None,
                 base: dict | None = None):
        self.config, self.recipe, self.backend, self.plan = config, recipe, backend, plan
        self.num_processes, self.task, self.layout, self.precision = num_processes, task, layout, precision
        self.say, self.raw_validation, self.hub, self.process_start = say, raw_validation, hub, process_start
        self.output_dir = Path(config.output_dir)
        identity = training_set_identity(train_dataset) if train_dataset is not None else None
        self.meaning = ckpt.step_meaning(config, num_processes, identity, base)
        self.progress = RunProgress(num_processes=num_processes, step_meaning=self.meaning)  # what a checkpoint holds
        self.writes = layout.writes  # this process writes --output_dir
        self.counts_tokens = task.counts_tokens  # loss items are label tokens (causal LM), recorded as such
        self.warm = False  # the first optimizer step of this start (compile, allocator warm-up) is not timed
        self.eval_steps, self.save_steps = plan.steps(config.eval_steps), plan.steps(config.save_steps)
        self.eval_results, self.best_eval_results, self.eval_runtime, self.last_eval_step = {}, {}, 0.0, None
        self.eval_samples: list[dict] = []  # the latest evaluation's generated completions (task.eval_samples)
        self.stopping_early = False
        self.log: JsonlLog | None = None
        # will a stop signal's step and checkpoint fit the grace before SIGKILL? (the main process says)
        self.budget = SaveBudget(config.preemption_grace_seconds, say, active=main)
        self.resume_from: Path | None = None
        self.resume_notes: list[str] = []  # what a resume on another split of B changed (banner lines)
        self.overridden: list[str] = []  # what --ignore_checkpoint_mismatch let through on resume (banner lines)
        self.runtime_before, self.train_start, self.samples_at_start = 0.0, time.perf_counter(), 0
        self.step_mark = time.perf_counter()  # when the optimizer step (or the save) in progress began

    # -------------------------------------------------------------------------------- setup
    def resume(self, state, load=None) -> Path | None:
        """``--resume_from_checkpoint``: the checkpoint every process agrees on (``checkpoint.agree_on_checkpoint``:
        complete, verified against its manifest, holding each process's random state, the same step everywhere),
        its ``RunProgress`` checked to mean the same step (``checkpoint.check_compatible``) and restored, after
        ``load(path, progress)`` loaded the backend's own state (the accelerate backend's ``load_state``; Trainer loads its
        own inside ``Trainer.train``). Collective: every process calls it; ``state``: an ``Accelerator`` or
        ``PartialState``. Returns the checkpoint, or None for a fresh start. Raises ``FinetuneError`` on every
        process alike where it cannot resume."""
        spec = self.config.resume_from_checkpoint
        if not spec:
            return None
        path = ckpt.agree_on_checkpoint(state, self.output_dir, spec, self.backend)
        if path is None:
            self.say(f"--resume_from_checkpoint auto: no complete checkpoint under "
                     f"{ckpt.checkpoints_dir(self.output_dir)}; starting a fresh run.")
            return None
        distributed.agree(lambda: self._restore(path, load), state)
        self.resume_from = path
        return path

    def _restore(self, path: Path, load) -> None:
        loaded = ckpt.read_state(path)
        overridden = ckpt.check_compatible(loaded, self.meaning, path, self.config.ignore_checkpoint_mismatch)
        self.overridden = [self._override_note(overridden, loaded)] if overridden else []
        if self.backend == "trainer":  # Trainer's skip and length groups are sized per process: no re-split
            elastic.refuse_trainer_split_change(loaded.step_meaning, self.meaning, path)  # also under the flag
        if load is not None:
            load(path, loaded)  # the backend's own state; it may move ``loaded``'s position (finetune.lifecycle.elastic)
        loaded.step_meaning = self.meaning
        self.progress = loaded

    def _override_note(self, overridden: list[str], loaded) -> str:
        """The banner's warning for a resume that ``--ignore_checkpoint_mismatch`` let through despite
        ``overridden`` (``checkpoint.check_compatible``): what changed and what it does to the run."""
        before = loaded.step_meaning.get(elastic.DATA) or {}
        effects = []
        if elastic.DATA in self.meaning and before.get("samples") not in (None, self.meaning[elastic.DATA]["samples"]):
            m, processes = self.config.per_device_train_batch_size, self.num_processes
            old = plan_steps(micro_batches_per_process(before["samples"], m, processes), self.config)
            effects.append(f"the schedule is re-sized from {old.max_steps} to {self.plan.max_steps} optimizer steps "
                           f"({old.steps_per_epoch} -> {self.plan.steps_per_epoch} per epoch)")
        if any(note.startswith("training set") for note in overridden):
            effects.append(f"the epoch resumes at sample {loaded.samples_done} of the new set's order, so samples "
                           "of this epoch are trained twice or not at all")
        return (f"warning: resuming despite --ignore_checkpoint_mismatch: {'; '.join(overridden)}"
                + (f". So {'; '.join(effects)}." if effects else "."))

    def open(self) -> None:
        """Prepare ``--output_dir``: cleared for a fresh ``--overwrite_output_dir`` run, ``run_config.json``, the
        files the task derived from the model (``task.keep``: precomputed reference log-probabilities), a resumed
        run's ``log.jsonl`` cut back to its step and appended to (``run_log``)."""
        resume_step = self.progress.step if self.resume_from is not None else None
        if self.writes:
            if self.config.overwrite_output_dir and resume_step is None:
                clear_output_dir(self.output_dir)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "run_config.json").write_text(self.config.to_json() + "\n")
            self.task.keep(self.output_dir)  # what attach derived (precomputed reference), after the clearing
            if resume_step is not None:
                restore_log(self.output_dir / LOG_FILE, resume_step)
        self.log = JsonlLog(self.output_dir / LOG_FILE, self.writes, append=resume_step is not None)

    def announce(self, model, device_type: str, *notes: str | None) -> None:
        """Print the banner (``reporting.run_banner``), the backend's and the packer's ``notes`` (None: nothing to
        say), and where a resume continues."""
        self.say(run_banner(self.config, self.num_processes, self.plan, self.precision, device_type, model))
        for note in notes:
            if note:
                self.say(note)
        if self.resume_from is not None:
            order = "(same data order)" if not self.overridden else "(the data order is not the checkpoint's run's)"
            self.say(f"Resuming from {self.resume_from}: optimizer step {self.progress.step}, epoch "
                     f"{self.progress.epoch}, skipping {self.progress.micro_batches_done} micro-batches of it "
                     f"{order}.")
            for note in self.overridden + self.resume_notes:
                self.say(note)

    def begin_training(self, model) -> None:
        """Training starts now: the save estimate (``SaveBudget.start``), the clocks of ``train_runtime``."""
        self.budget.start(model, self.output_dir)
        self.runtime_before, self.train_start = self.progress.train_runtime, time.perf_counter()
        self.samples_at_start = self.progress.samples_seen
        self.step_mark = time.perf_counter()

    # -------------------------------------------------------------------------------- train
    def mark(self) -> None:
        """An optimizer step (or a save) begins now."""
        self.step_mark = time.perf_counter()

    def step_seconds(self) -> float:
        """Seconds since ``mark()``: the optimizer step just taken (told to the ``SaveBudget``)."""
        seconds = time.perf_counter() - self.step_mark
        self.budget.step(seconds)
        return seconds

    def since_mark(self) -> float:
        """Seconds since ``mark()``."""
        return time.perf_counter() - self.step_mark

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

    def window_metrics(self, accelerator, sums, items: float) -> dict[str, float]:
        """The task's own per-step metrics over the whole window (``task.step_metrics``): this process's sums
        (``task.take_metric_sums``, or None) summed over every process (one all-reduce) and divided by the window's
        ``items`` (all processes): e.g. a preference task's ``rewards/accuracies``, the share of the window's pairs
        whose chosen reward is the larger, not a mean of micro-batch means. {} where the task has none."""
        names = self.task.step_metrics
        if not names:
            return {}
        if sums is None:  # no trained pair on this process in this window: it adds zeros
            sums = torch.zeros(len(names), dtype=torch.float64)
        total = accelerator.reduce(sums.to(accelerator.device), "sum").tolist()
        return {name: value / items for name, value in zip(names, total)}

    @staticmethod
    def postfix(metrics: dict[str, float]) -> dict[str, str]:
        """The progress bar's share of a step's task metrics: a preference task's reward accuracy and margin."""
        short = {"rewards/accuracies": "acc", "rewards/margins": "margin"}
        return {short[k]: f"{v:.3f}" for k, v in metrics.items() if k in short}

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

    def model_kept(self, step: int, at_epoch_end: bool) -> bool:
        """Whether the model evaluated after optimizer step ``step`` is kept, so that it can be the best model: a
        checkpoint follows the evaluation (``--save_strategy`` steps at a ``save_steps`` multiple, or epoch at an
        epoch's end: both backends save there, Trainer by its DefaultFlowCallback, transformers 5.24
        trainer_callback.py), or it is the final model."""
        if step >= self.plan.max_steps:
            return True
        if at_epoch_end:
            return self.config.save_strategy == "epoch"
        return self.config.save_strategy == "steps" and step > 0 and step % self.save_steps == 0

    def evaluate(self, accelerator, model, dataloader, tokenizer, at_epoch_end: bool, pack=None) -> dict:
        """Evaluate ``model`` now (``evaluation.evaluate``: loss and metrics, padding-free as ``pack`` packs, if given;
        then generation for SFT recipes, its predictions written beside the log); record it (``_record_evaluation``, the model kept per
        ``model_kept``), with the task's generated completions (``task.eval_samples``: GRPO's), kept in
        ``eval_samples`` for the trackers. Returns the results. Raises ``FinetuneError`` as ``record_evaluation``
        does."""
        start = time.perf_counter()
        results = evaluate(accelerator, model, dataloader, self.task, self.recipe.METRICS, pack=pack)
        self.eval_samples = self.task.eval_samples()
        generated, predictions = generation_eval(accelerator, model, tokenizer, self.raw_validation, self.recipe,
                                                 self.config, self.task)
        results.update(generated)
        results.update(benchmark_eval(accelerator, model, tokenizer, self.config, self.output_dir, self.progress.step))
        if predictions and self.writes:
            write_generations(self.output_dir, self.raw_validation, predictions, self.task)
        step = self.progress.step
        self._record_evaluation(results, time.perf_counter() - start, self.model_kept(step, at_epoch_end))
        return results

    def _record_evaluation(self, results: dict, seconds: float, checkpointed: bool) -> None:
        """Log an evaluation (``seconds``, kept out of ``train_runtime``), track early stopping and the best
        model: the best evaluation whose model is ``checkpointed``. Raises ``FinetuneError`` when
        ``--metric_for_best_model`` is not among ``results``."""
        step, config = self.progress.step, self.config
        self.eval_runtime += seconds
        self.eval_results, self.last_eval_step = results, step
        self.progress.evaluation_due = False
        epoch = self.plan.epoch_fraction(step)
        shown = {"completions": self.eval_samples} if self.eval_samples else {}
        self.log.write({"step": step, "epoch": round(epoch, 4), **results, **shown})
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

    @property
    def new_best(self) -> bool:
        """Whether the last evaluation is the new best model."""
        return self.progress.best_step == self.progress.step and self.best_eval_results is self.eval_results

    def train_runtime(self) -> float:
        """Seconds of training over every start of the run, evaluations excluded."""
        return self.runtime_before + time.perf_counter() - self.train_start - self.eval_runtime

    def saved(self, path: Path, seconds: float, reason: str | None = None, push: bool = True) -> None:
        """After checkpoint ``path`` is complete: its time (``SaveBudget.saved``, ``seconds``); ``reason``: say so;
        ``push``: hand it to ``--push_to_hub`` (``HubPush.after_save``), which also gets this save's prune to run
        again after its uploads (``HubPush.prune_later``)."""
        if reason is not None:
            self.say(f"checkpoint ({reason}): {path}")
        self.budget.saved(seconds)
        if self.hub is not None:  # the prune this save ran, again once no upload holds a checkpoint (at_end)
            self.hub.prune_later = functools.partial(ckpt.prune, self.output_dir, path, self.progress.best_step,
                                                     self.config.save_total_limit, self.backend)
        if push and self.hub is not None:
            self.hub.after_save(path, self.progress.step)

    def held_by_uploads(self) -> set[Path]:
        """The checkpoints a ``--push_to_hub`` upload still reads (``HubPush.held``), which pruning leaves."""
        return self.hub.held() if self.hub is not None else set()

    def commit_trainer_checkpoint(self, staged: Path, writes: bool, barrier) -> Path:
        """Make the Trainer checkpoint ``staged`` (``checkpoint-<step>`` in ``checkpoint.trainer_staging``) of the
        current step one of ours once every process wrote its part (``barrier()``): sealed with this run's
        ``RunProgress``, manifest and ``COMPLETE`` marker, renamed into place (``checkpoint.commit_staged``), then
        pruned to ``--save_total_limit`` (never the new nor the best one). ``writes``: this process writes the
        folder. Returns the checkpoint's path. Raises ``FinetuneError`` when it cannot be written."""
        self.progress.train_runtime = self.train_runtime()
        final = ckpt.checkpoint_path(self.output_dir, self.progress.step, self.backend)
        barrier()  # every process's random state is in the folder

        def commit() -> None:
            if not writes:
                return
            try:
                ckpt.commit_staged(staged, final, self.progress)
            except OSError as err:
                raise FinetuneError(f"writing checkpoint {final.name} failed ({err}); the previous checkpoints are "
                                    "intact. Free disk space (or choose another --output_dir) and resume with "
                                    "--resume_from_checkpoint latest.") from None
            ckpt.prune(self.output_dir, final, self.progress.best_step, self.config.save_total_limit, self.backend,
                       held=self.held_by_uploads())

        # the writer's outcome, agreed: a failed commit stops every process together (not the writer alone, its
        # peers at a barrier)
        distributed.agree(commit)
        return final

    # -------------------------------------------------------------------------------- cleanup
    def finish(self, engine, model, tokenizer, device, written=None) -> dict:
        """After training: the metrics (``reporting.run_metrics``), the model, ``metrics.json`` and the model card
        (``reporting.write_outputs``: ``written``, the model as the backend holds it, else ``model``). Returns the
        metrics. The hub's end of training is the caller's (``run.run``), once every process has left the group."""
        progress = self.progress
        progress.train_runtime = self.train_runtime()
        metrics = run_metrics(self.config, progress, self.final_eval_results(), plan=self.plan,
                              num_processes=self.num_processes, precision=self.precision, device=device, model=model,
                              eval_runtime=self.eval_runtime, process_start=self.process_start)
        if self.resume_from is not None:
            metrics["resumed_from"] = str(self.resume_from)
        write_outputs(engine, written if written is not None else model, tokenizer, self.config, self.recipe, metrics,
                      writes=self.writes)
        return metrics

    def close(self) -> None:
        """Close ``log.jsonl`` (idempotent): whatever ended the run."""
        if self.log is not None:
            self.log.close()
