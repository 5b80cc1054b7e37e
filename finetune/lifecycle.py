"""The run lifecycle both backends drive, in torchtune's setup / train / cleanup shape: ``RunState`` owns the run's
counters (``progress.RunProgress``), its records and cadence (``bookkeeping.Bookkeeping``: ``log.jsonl``, best
model, early stopping), the resume (one checkpoint format for both backends, checked alike and agreed on by every
process), evaluation with generation and the rule of which evaluated model is kept, the step and save timers
(``preemption.SaveBudget``), the banner and the final outputs. The accelerate backend (``finetune.train``) adds
its loop's own questions around it; the Trainer backend (``finetune.trainer_backend``) forwards Trainer's events
to it from a thin callback. Units: optimizer steps, samples and tokens over all processes, seconds. See
docs/lifecycle.md.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune import checkpoint as ckpt
from finetune import distributed, elastic, packing
from finetune.bookkeeping import Bookkeeping, empty_window_error
from finetune.data import training_set_identity
from finetune.errors import FinetuneError
from finetune.evaluation import evaluate, generation_eval, write_generations
from finetune.preemption import SaveBudget
from finetune.progress import RunProgress
from finetune.reporting import run_banner, run_metrics, write_outputs
from finetune.steps import micro_batches_per_process, plan_steps


@dataclass
class WindowCounts:
    """An accumulation window's sizes, summed over all processes: loss ``items`` (samples, or label tokens
    for causal LM), ``samples``, non-padding ``input_tokens`` and ``padded_tokens`` (input positions)."""

    items: float
    samples: int
    input_tokens: int
    padded_tokens: int
    sample_ids: str | None = None  # the hash of the window's sample ids over all processes (elastic.window_ids_hash)


def count_window(window: list[dict], task, accelerator, repeats: int = 0, run: list[dict] | None = None) -> WindowCounts:
    """The window's ``WindowCounts`` over all processes, known before any backward: one all-reduce (a
    sync point) per window. ``repeats``: this process's rows that repeat samples at the epoch's end
    (``sampling.repeated_rows``), not counted. ``run``: the micro-batches actually computed when packing
    rebuilt the window (``packing.Packer``): tokens are counted on them, items and samples on ``window`` (equal
    either way: packing masks only labels the shift never trains). Both backends count their windows here. Raises ``FinetuneError``
    (on every process alike) for a window with no item. Takes the sample ids out of the batches where they carry
    them (``elastic.window_ids_hash``: a second all-reduce)."""
    device = accelerator.device
    sample_ids = elastic.window_ids_hash(window, accelerator)
    input_tokens, positions = map(sum, zip(*(packing.tokens(b) for b in (run or window)), strict=True))
    local = torch.stack([sum(task.count(b) for b in window),
                         torch.tensor(sum(task.samples(b) for b in window) - repeats, device=device),
                         torch.tensor(input_tokens, device=device), torch.tensor(positions, device=device)])
    items, samples, input_tokens, padded = accelerator.reduce(local, "sum").tolist()
    if items == 0:
        raise empty_window_error(int(samples))
    return WindowCounts(items, int(samples), int(input_tokens), int(padded), sample_ids)


class RunState:
    """One run, whichever backend trains it. ``backend``: "accelerate" or "trainer" (whose checkpoints it resumes:
    ``checkpoint.list_checkpoints``); ``plan``: the ``steps.StepPlan``; ``task``: the recipe's task;
    ``layout``: the ``distributed.StorageLayout`` (who writes the run's files); ``precision``: "no", "fp16" or
    "bf16" as it runs; ``say``: prints on the main process only; ``main``: this is the main process; ``hub``: a
    ``finetune.hub.HubPush`` or None; ``process_start``: ``time.time()`` when the process started (for
    ``metrics.json``); ``raw_validation``: the validation split before tokenizing (generation evaluates it);
    ``train_dataset``: the tokenized training set (a ``datasets.Dataset``) that the run and its checkpoints are
    bound to (``data.training_set_identity``; None: not recorded)."""

    def __init__(self, config, recipe, *, backend: str, plan, num_processes: int, task, layout, precision: str, say,
                 main: bool, raw_validation=None, hub=None, process_start: float | None = None, train_dataset=None):
        self.config, self.recipe, self.backend, self.plan = config, recipe, backend, plan
        self.num_processes, self.task, self.layout, self.precision = num_processes, task, layout, precision
        self.say, self.raw_validation, self.hub, self.process_start = say, raw_validation, hub, process_start
        self.output_dir = Path(config.output_dir)
        identity = training_set_identity(train_dataset) if train_dataset is not None else None
        self.meaning = ckpt.step_meaning(config, num_processes, identity)
        self.book = Bookkeeping(config, plan, RunProgress(num_processes=num_processes, step_meaning=self.meaning),
                                writes=layout.writes, say=say, counts_tokens=task.counts_tokens)
        # will a stop signal's step and checkpoint fit the grace before SIGKILL? (the main process says)
        self.budget = SaveBudget(config.preemption_grace_seconds, say, active=main)
        self.resume_from: Path | None = None
        self.resume_notes: list[str] = []  # what a resume on another split of B changed (banner lines)
        self.overridden: list[str] = []  # what --ignore_checkpoint_mismatch let through on resume (banner lines)
        self.runtime_before, self.train_start, self.samples_at_start = 0.0, time.perf_counter(), 0
        self.step_mark = time.perf_counter()  # when the optimizer step (or the save) in progress began

    @property
    def progress(self) -> RunProgress:
        """The counters a checkpoint holds."""
        return self.book.progress

    # -------------------------------------------------------------------------------- setup
    def resume(self, state, load=None) -> Path | None:
        """``--resume_from_checkpoint``: the checkpoint every process agrees on (``ckpt.agree_on_checkpoint``:
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
            load(path, loaded)  # the backend's own state; it may move ``loaded``'s position (finetune.elastic)
        loaded.step_meaning = self.meaning
        self.book.progress = loaded

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
        """Prepare ``--output_dir`` (``Bookkeeping.open``: cleared for a fresh ``--overwrite_output_dir`` run,
        ``run_config.json``, a resumed run's log cut back to its step)."""
        self.book.open(self.progress.step if self.resume_from is not None else None)

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

    def record_step(self, **counts) -> dict:
        """``Bookkeeping.record_step``: count the optimizer step and write its ``log.jsonl`` record."""
        return self.book.record_step(**counts)

    def model_kept(self, step: int, at_epoch_end: bool) -> bool:
        """Whether the model evaluated after optimizer step ``step`` is kept, so that it can be the best model: a
        checkpoint follows the evaluation (``--save_strategy`` steps at a ``save_steps`` multiple, or epoch at an
        epoch's end: both backends save there, Trainer by its DefaultFlowCallback, transformers 5.24
        trainer_callback.py), or it is the final model."""
        if step >= self.plan.max_steps:
            return True
        if at_epoch_end:
            return self.config.save_strategy == "epoch"
        return self.config.save_strategy == "steps" and step > 0 and step % self.book.save_steps == 0

    def evaluate(self, accelerator, model, dataloader, tokenizer, at_epoch_end: bool, pack=None) -> dict:
        """Evaluate ``model`` now (``evaluation.evaluate``: loss and metrics, padding-free as ``pack`` packs, if given;
        then generation for SFT recipes, its predictions written beside the log); record it (``Bookkeeping.record_evaluation``, the model kept per
        ``model_kept``). Returns the results. Raises ``FinetuneError`` as ``record_evaluation`` does."""
        start = time.perf_counter()
        results = evaluate(accelerator, model, dataloader, self.task, self.recipe.METRICS, pack=pack)
        generated, predictions = generation_eval(accelerator, model, tokenizer, self.raw_validation, self.recipe,
                                                 self.config)
        results.update(generated)
        if predictions and self.book.writes:
            write_generations(self.output_dir, self.raw_validation, predictions)
        step = self.progress.step
        self.book.record_evaluation(results, time.perf_counter() - start, self.model_kept(step, at_epoch_end))
        return results

    @property
    def new_best(self) -> bool:
        """Whether the last evaluation is the new best model."""
        return self.progress.best_step == self.progress.step and self.book.best_eval_results is self.book.eval_results

    def train_runtime(self) -> float:
        """Seconds of training over every start of the run, evaluations excluded."""
        return self.runtime_before + time.perf_counter() - self.train_start - self.book.eval_runtime

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
        metrics = run_metrics(self.config, progress, self.book.final_eval_results(), plan=self.plan,
                              num_processes=self.num_processes, precision=self.precision, device=device, model=model,
                              eval_runtime=self.book.eval_runtime, process_start=self.process_start)
        if self.resume_from is not None:
            metrics["resumed_from"] = str(self.resume_from)
        write_outputs(engine, written if written is not None else model, tokenizer, self.config, self.recipe, metrics,
                      writes=self.book.writes)
        return metrics

    def close(self) -> None:
        """Close ``log.jsonl`` (idempotent): whatever ended the run."""
        self.book.close()
