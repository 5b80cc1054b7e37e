"""The accelerate engine: setup, then one visible ``train()`` loop with exact gradient accumulation inline.

Exactness rules (tested in ``tests/test_accumulation.py``):

- An accumulation window is up to N = ``gradient_accumulation_steps`` micro-batches; an epoch of M
  micro-batches has ceil(M / N) optimizer steps; the last window may be partial.
- Every micro-batch's loss is the *sum* of its per-item losses divided by the number of items in the
  whole window, counted across all processes. So each window's gradient is the mean over exactly the
  items it holds, and a partial last window is weighted by its true size (Accelerate's own
  ``accelerator.backward`` divides by N, which under-weights it; we multiply N back in).
- Gradients are clipped only on the sync (last) micro-batch of a window; the LR schedule is sized in
  optimizer steps and advances only when the optimizer really stepped (fp16 overflow skips do not; a
  skip is Accelerate's flag or a drop of the GradScaler's scale, see ``components.optimizer_step_skipped``).
- Under DeepSpeed the same loop runs through Accelerate's DeepSpeed integration: ``accelerator.backward``
  runs DeepSpeed's backward (which divides by its ``gradient_accumulation_steps``, set to N) and, on the
  sync micro-batch, DeepSpeed's optimizer step with its clipping (set from ``--max_grad_norm``) and its
  overflow skip; ``optimizer.step()``/``zero_grad()`` are no-ops there, ``clip_grad_norm_`` reports the
  norm DeepSpeed computed (``finetune/sharded.py``).

Everything that is not the accumulation step (counters, the log record, trackers, progress, guards,
checkpoint and evaluation cadence) is ``RunState``'s.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from finetune import checkpoint as ckpt
from finetune import distributed
from finetune.components import (EpochSeededLengthGroupedSampler, StepPlan, build_optimizer, iter_windows,
                                 loss_function, loss_scale, make_accelerator, micro_batches_per_process,
                                 optimizer_step_skipped, parameter_groups, plan_steps)
from finetune.config import config_argv, reproduce_command
from finetune.builders import build_components, get_task
from finetune.errors import FinetuneError, NumericalError, TrainingStopped
from finetune.evaluation import check_eval_set, evaluate, generation_eval, write_generations
from finetune.lifeline import launcher_gone
from finetune.output import clear_output_dir
from finetune.precision import running_precision
from finetune.reporting import JsonlLog, restore_log, run_banner, run_metrics, write_outputs
from finetune.sharded import (check_deepspeed_engine, deepspeed_config_updates,
                              deepspeed_engine_settings, deepspeed_note, deepspeed_optimizer_and_scheduler,
                              grad_norm_value, sync_each_batch)
from finetune.tasks import CausalLM
from finetune.testing import forced_overflow_steps


# ------------------------------------------------------------------------------------------ setup
@dataclass
class Setup:
    """Everything ``train()`` needs, built from a config and a recipe."""

    accelerator: object
    model: object
    tokenizer: object
    optimizer: object
    scheduler: object
    train_dataloader: object
    eval_dataloader: object
    plan: StepPlan
    precision: str  # as it runs: "no", "fp16" or "bf16"
    task: object
    metric_specs: dict
    raw_validation: object  # the validation split before tokenizing (generation evaluates it)
    layout: distributed.StorageLayout  # who writes the run's files (one process, or one per machine)
    loss_sum: object = None  # (model, batch, labels) -> summed loss: components.loss_function
    engine_note: str | None = None  # a banner line for FSDP / DeepSpeed

    def learning_rate(self) -> float:
        """The learning rate the next optimizer step uses. Under DeepSpeed, read from the optimizer's
        parameter groups (a schedule from the DeepSpeed config may not answer ``get_last_lr`` before its
        first step); elsewhere the schedule's ``get_last_lr``."""
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            return self.optimizer.param_groups[0]["lr"]
        return self.scheduler.get_last_lr()[0]


def setup(config, recipe) -> Setup:
    """Build accelerator, tokenizer, datasets, model, optimizer and schedule for ``train()``. Raises
    ``FinetuneError`` for inputs that cannot run (before anything is written)."""
    accelerator = make_accelerator(config)
    layout = distributed.plan_storage(accelerator, config.output_dir)
    # each machine's local main process writes its own copy of the model, optimizer and scheduler states
    accelerator.project_configuration.save_on_each_node = layout.per_machine
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    engine_note = None
    if deepspeed:  # before prepare, which hands this config to deepspeed.initialize
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_config.update(deepspeed_config_updates(
            ds_config, max_grad_norm=config.max_grad_norm, micro_batch=config.per_device_train_batch_size,
            accumulation_steps=config.gradient_accumulation_steps))
    elif sync_each_batch(accelerator.distributed_type):
        engine_note = ("FSDP: gradients are reduce-scattered on every micro-batch (sync_each_batch), so each rank "
                       "keeps only its gradient shard while accumulating")
    precision = running_precision(accelerator)
    tokenizer, datasets, _, model, collator, raw_validation = build_components(
        config, recipe, precision, accelerator.main_process_first)
    check_eval_set(len(datasets["validation"]), config)
    # Own generators: otherwise every new iterator (each epoch, each evaluation, a resume's skip) draws a
    # seed from the global RNG, and a resumed run's dropout masks would drift from the uninterrupted run's.
    # The order itself comes from Accelerate's seeded sampler (data_seed + epoch).
    # Pinned host memory only helps copies to a GPU; workers collate in parallel (tokenizing is done already).
    loader_options = dict(collate_fn=collator, num_workers=config.dataloader_num_workers,
                          generator=torch.Generator().manual_seed(config.seed),
                          pin_memory=config.dataloader_pin_memory and accelerator.device.type == "cuda")
    if config.train_sampling_strategy == "group_by_length":
        global_batch = config.per_device_train_batch_size * config.gradient_accumulation_steps * accelerator.num_processes
        order = dict(sampler=EpochSeededLengthGroupedSampler(
            global_batch, [len(ids) for ids in datasets["train"]["input_ids"]], config.seed))
    else:  # Accelerate swaps this RandomSampler for its seedable one (data_seed + epoch)
        order = dict(shuffle=True)
    train_dataloader = DataLoader(datasets["train"], batch_size=config.per_device_train_batch_size, **order,
                                  **loader_options)
    eval_dataloader = DataLoader(datasets["validation"], shuffle=False, batch_size=config.per_device_eval_batch_size,
                                 **loader_options)
    if deepspeed:
        model, optimizer, scheduler, train_dataloader, eval_dataloader, plan = _prepare_deepspeed(
            accelerator, config, model, train_dataloader, eval_dataloader)
        settings = deepspeed_engine_settings(accelerator.deepspeed_engine_wrapped.engine)
        check_deepspeed_engine(settings, max_grad_norm=config.max_grad_norm, precision=precision,
                               micro_batch=config.per_device_train_batch_size,
                               accumulation_steps=config.gradient_accumulation_steps)
        engine_note = deepspeed_note(settings, accelerator.state.deepspeed_plugin.deepspeed_config)
    else:
        optimizer = build_optimizer(model, config)
        model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader)
        plan = plan_steps(len(train_dataloader), config)
        # Not passed to accelerator.prepare: its wrapper steps the schedule once per process per call and
        # assumes a schedule sized for that. Ours is sized in optimizer steps and stepped by hand.
        scheduler = get_scheduler(config.lr_scheduler_type, optimizer.optimizer, num_warmup_steps=plan.steps(config.warmup_steps),
                                  num_training_steps=plan.max_steps)
        accelerator.register_for_checkpointing(scheduler)  # not prepared, so registered by hand
    return Setup(accelerator, model, tokenizer, optimizer, scheduler, train_dataloader, eval_dataloader, plan,
                 precision, get_task(recipe.TASK), recipe.METRICS, raw_validation, layout,
                 loss_function(get_task(recipe.TASK), config, accelerator), engine_note)


def _prepare_deepspeed(accelerator, config, model, train_dataloader, eval_dataloader):
    """DeepSpeed's ``prepare``: model, optimizer and schedule go into one ``accelerator.prepare`` call
    (it runs ``deepspeed.initialize``), so the schedule is sized before the dataloaders are sharded, from
    the micro-batches Accelerate will give each process (``micro_batches_per_process``). Which optimizer
    and schedule: ``sharded.deepspeed_optimizer_and_scheduler``. A prepared schedule is checkpointed by
    ``save_state`` (ours, through Accelerate; one from the DeepSpeed config, inside DeepSpeed's checkpoint).
    Under ZeRO-3 the model arrives partitioned (transformers loaded it under ``deepspeed.zero.Init``), which
    ``parameter_groups`` and ``lora.parameter_counts`` see through.
    Returns (model, optimizer, scheduler, train_dataloader, eval_dataloader, plan)."""
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    plan = plan_steps(micro_batches_per_process(len(train_dataloader.dataset), config.per_device_train_batch_size,
                                                accelerator.num_processes), config)
    warmup = plan.steps(config.warmup_steps)

    def make_schedule(optimizer):
        return get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                             num_training_steps=plan.max_steps)

    # DeepSpeed drops an empty parameter group (e.g. no biases or norms under LoRA) from the optimizer, and a
    # schedule built before that would then hold one learning rate too many: leave empty groups out first.
    groups = [group for group in parameter_groups(model, config) if group["params"]]
    optimizer, scheduler = deepspeed_optimizer_and_scheduler(
        groups, config, plan.max_steps, warmup, ds_config, accelerator.num_processes,
        make_optimizer=lambda: build_optimizer(model, config, groups), make_schedule=make_schedule)
    model, optimizer, train_dataloader, eval_dataloader, scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, scheduler)
    if len(train_dataloader) != plan.micro_batches_per_epoch:
        raise RuntimeError(f"DeepSpeed: the schedule was sized for {plan.micro_batches_per_epoch} micro-batches per "
                           f"process per epoch, but the prepared dataloader has {len(train_dataloader)}")
    return model, optimizer, scheduler, train_dataloader, eval_dataloader, plan


@dataclass
class WindowCounts:
    """An accumulation window's sizes, summed over all processes: loss ``items`` (samples, or label tokens
    for causal LM), ``samples``, non-padding ``input_tokens`` and ``padded_tokens`` (input positions)."""

    items: float
    samples: int
    input_tokens: int
    padded_tokens: int


def count_window(window: list[dict], task, accelerator) -> WindowCounts:
    """The window's ``WindowCounts`` over all processes, known before any backward: one all-reduce (a
    sync point) per window."""
    device = accelerator.device
    local = torch.stack([sum(task.count(b["labels"]) for b in window),
                         torch.tensor(sum(b["labels"].shape[0] for b in window), device=device),
                         sum(b["attention_mask"].sum() for b in window),
                         torch.tensor(sum(b["attention_mask"].numel() for b in window), device=device)])
    items, samples, input_tokens, padded = accelerator.reduce(local, "sum").tolist()
    return WindowCounts(items, int(samples), int(input_tokens), int(padded))


# ------------------------------------------------------------------------------------------ the loop
def train(config, recipe, process_start: float | None = None) -> dict:
    """Fine-tune ``recipe`` with ``config``; write the model, ``metrics.json``, ``log.jsonl``, the model card
    and ``run_config.json`` into ``config.output_dir``; return the metrics (``reporting.run_metrics``).

    Checkpoints are taken after an optimizer step, never inside a window. Raises ``TrainingStopped`` after
    SIGINT/SIGTERM (checkpoint written, resume command in the message), ``NumericalError`` on a non-finite
    loss or gradient (fp32/bf16) or too many fp16 skips in a row, and ``FinetuneError`` for a checkpoint
    that cannot be resumed or written.
    """
    s = setup(config, recipe)
    accelerator, model, optimizer, scheduler, task = s.accelerator, s.model, s.optimizer, s.scheduler, s.task
    N, P = config.gradient_accumulation_steps, accelerator.num_processes
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
    overflow_steps = forced_overflow_steps()  # empty unless a test sets FINETUNE_TEST_FORCE_OVERFLOW_STEPS
    with RunState(s, config, recipe, process_start) as run, GracefulStop() as stop:
        model.train()
        while not run.done:
            for window in iter_windows(run.epoch_batches(), N):
                counts = count_window(window, task, accelerator)
                # Align Accelerate's micro-batch counter so the window's last micro-batch is the sync step,
                # also for a short last window (it syncs when its counter reaches a multiple of N).
                accelerator.step = N - len(window)
                window_loss = torch.zeros((), device=accelerator.device)
                # Read before any backward: under DeepSpeed the last one runs the optimizer step, and with a
                # schedule DeepSpeed owns, the schedule step too.
                learning_rate = s.learning_rate()
                for batch in window:
                    with accelerator.accumulate(model):
                        labels = batch.pop("labels")
                        loss_sum = s.loss_sum(model, batch, labels)  # forward; summed over the batch's items
                        # accelerator.backward divides by N and DDP averages over P processes: undo both, so
                        # the summed gradient is sum(per-item gradients) / items in the window.
                        scaled = loss_sum * (N * P / counts.items)
                        if overflow_steps and run.state.step + 1 in overflow_steps:
                            scaled = scaled * float("inf")  # test hook: an overflow on this optimizer step
                        accelerator.backward(scaled)
                        window_loss += loss_sum.detach()
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
                            run.check_finite(grad_norm, len(window))
                            scale_before = loss_scale(accelerator)  # fp16: a drop across step() means skipped
                        optimizer.step()  # a no-op until the sync micro-batch
                        if accelerator.sync_gradients:
                            skipped = optimizer_step_skipped(accelerator, scale_before)
                            if not skipped:
                                scheduler.step()
                        optimizer.zero_grad()
                run.end_step(window_loss, counts, len(window), learning_rate, grad_norm, skipped=skipped, stop=stop)
                if run.done:
                    break
            run.end_epoch()
        return run.finish()


# ------------------------------------------------------------------------------------------ bookkeeping
class RunState:
    """The run's bookkeeping around the loop: resuming, the output directory, ``log.jsonl``, trackers, the
    progress bar, guards, and the evaluation and checkpoint cadence. A context manager: whatever ends the
    loop (success, an error, a signal), the progress bar, the log and the trackers are closed."""

    def __init__(self, s: Setup, config, recipe, process_start: float | None):
        self.s, self.config, self.recipe, self.process_start = s, config, recipe, process_start
        self.accelerator = s.accelerator
        self.writes = s.layout.writes  # this process writes the files of its --output_dir
        self.output_dir = Path(config.output_dir)
        self.plan = s.plan
        self.eval_steps, self.save_steps = self.plan.steps(config.eval_steps), self.plan.steps(config.save_steps)
        self.logging_steps = max(self.plan.steps(config.logging_steps), 1)
        self.meaning = ckpt.step_meaning(config, self.accelerator.num_processes)
        self.state = ckpt.TrainerState(num_processes=self.accelerator.num_processes, step_meaning=self.meaning)
        self.resume_from = None
        self.eval_results, self.best_eval_results, self.eval_runtime, self.last_eval_step = {}, {}, 0.0, None
        self.stopping_early = False
        self.log = self.progress = None
        self.trackers = False

    # -------------------------------------------------------------------------------- start and end
    def __enter__(self) -> "RunState":
        config, accelerator = self.config, self.accelerator
        if config.resume_from_checkpoint:
            # every process must resume from the same step, also where each machine has its own files
            self.resume_from = distributed.agree_on_checkpoint(accelerator, self.output_dir, config.resume_from_checkpoint)
            distributed.agree(lambda: self._resume(self.resume_from), accelerator)
        if self.writes:
            if config.overwrite_output_dir and self.resume_from is None:
                clear_output_dir(self.output_dir)  # only now: a run refused before training touches nothing
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "run_config.json").write_text(config.to_json() + "\n")
            if self.resume_from is not None:
                restore_log(self.output_dir / "log.jsonl", self.state.step)
        accelerator.wait_for_everyone()
        self.log = JsonlLog(self.output_dir / "log.jsonl", self.writes, append=self.resume_from is not None)
        accelerator.print(run_banner(config, accelerator.num_processes, self.plan, self.s.precision,
                                     accelerator.device.type, self.s.model))
        if self.s.engine_note:
            accelerator.print(self.s.engine_note)
        if self.resume_from is not None:
            accelerator.print(f"Resuming from {self.resume_from}: optimizer step {self.state.step}, epoch "
                              f"{self.state.epoch}, skipping {self.state.micro_batches_done} micro-batches of it "
                              "(same data order).")
        if config.report_to != "none":
            # hyperparameters as the trackers accept them (no None), under <output_dir>/runs for TensorBoard
            hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                       for k, v in config.to_dict().items() if v is not None}
            accelerator.init_trackers("runs", config=hparams)
            self.trackers = True
        self.progress = tqdm(total=self.plan.max_steps, initial=self.state.step, desc="Training", unit="step",
                             disable=not accelerator.is_local_main_process)
        self.runtime_before, self.train_start = self.state.train_runtime, time.perf_counter()
        self.samples_at_start = self.state.samples_seen
        if config.eval_on_start and self.state.step == 0:
            self.evaluate()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.log is not None:
            self.log.close()
        if self.trackers:
            self.accelerator.end_training()
            self.trackers = False

    def _resume(self, path: Path) -> None:
        loaded = ckpt.read_state(path)
        ckpt.check_compatible(loaded, self.meaning, path, self.config.ignore_checkpoint_mismatch)
        try:
            self.accelerator.load_state(str(path))
        except Exception as err:  # torch/safetensors raise many types for damaged files
            raise FinetuneError(f"checkpoint {path} is corrupt and cannot be loaded ({type(err).__name__}: {err}). "
                                "Resume from another checkpoint (--resume_from_checkpoint PATH).") from None
        loaded.step_meaning = self.meaning
        self.state = loaded

    # -------------------------------------------------------------------------------- the loop's questions
    @property
    def done(self) -> bool:
        """Whether training is over: the last optimizer step or epoch is done, or early stopping fired."""
        return self.state.step >= self.plan.max_steps or self.state.epoch >= self.plan.num_epochs or self.stopping_early

    def epoch_batches(self):
        """The current epoch's micro-batches: the seeded order of this epoch, minus those a resumed run has
        already trained on."""
        dataloader = self.s.train_dataloader
        dataloader.set_epoch(self.state.epoch)  # the order depends on the seed and the epoch only
        if self.state.micro_batches_done:
            return self.accelerator.skip_first_batches(dataloader, self.state.micro_batches_done)
        return dataloader

    def check_finite(self, grad_norm, micro_batches: int) -> None:
        """Raise ``NumericalError`` for a non-finite gradient norm (fp32/bf16: it must not reach the weights;
        fp16 overflows are the GradScaler's to skip). A sync point per optimizer step. ``grad_norm``: a tensor,
        or under DeepSpeed a float (its optimizer step, and under fp32 its skip of a non-finite gradient, have
        already run) or None (DeepSpeed computed no norm: nothing to check)."""
        if self.s.precision == "fp16" or grad_norm is None or torch.isfinite(torch.as_tensor(grad_norm)).item():
            return
        first = self.state.micro_batches_done
        raise NumericalError(
            f"non-finite loss or gradient at optimizer step {self.state.step + 1} (epoch {self.state.epoch}, "
            f"micro-batches {first}-{first + micro_batches - 1} of the epoch, per process): grad norm "
            f"{float(grad_norm)}. Nothing after the last checkpoint was saved. Lower --learning_rate, set "
            "--max_grad_norm, or check those samples; resume with --resume_from_checkpoint latest.")

    # -------------------------------------------------------------------------------- after each step
    def end_step(self, window_loss, counts: WindowCounts, micro_batches: int, learning_rate: float, grad_norm,
                 skipped: bool, stop: "GracefulStop") -> None:
        """Account for the optimizer step just taken: counters, ``log.jsonl``, trackers, progress; then the
        guards (fp16 skips, a signal) and the evaluation and checkpoint cadence."""
        state, accelerator = self.state, self.accelerator
        # One reduction per optimizer step: the window's loss, and whether any process was signalled (every
        # process must stop at the same step).
        loss_sum, stop_votes = accelerator.reduce(
            torch.stack([window_loss, torch.tensor(float(stop.signum is not None), device=accelerator.device)]),
            "sum").tolist()
        loss = loss_sum / counts.items
        state.record_step(loss, skipped)
        state.micro_batches_done += micro_batches
        state.samples_seen += counts.samples
        state.input_tokens_seen += counts.input_tokens
        state.padded_tokens_seen += counts.padded_tokens
        record = {"step": state.step, "epoch": round(self.plan.epoch_fraction(state.step), 4), "loss": loss,
                  "learning_rate": learning_rate, "grad_norm": grad_norm_value(grad_norm), "samples": counts.samples,
                  "micro_batches": micro_batches}
        if isinstance(self.s.task, CausalLM):  # items are label tokens (also completion-only)
            record["label_tokens"] = counts.items
            state.tokens_seen += int(counts.items)
        if (scale := loss_scale(accelerator)) is not None:
            record["loss_scale"] = scale  # fp16: after this step's GradScaler update (halved by a skip)
        if skipped:
            record["skipped"] = True
        self.log.write(record)
        self.progress.update(1)
        if state.step % self.logging_steps == 0:
            elapsed = max(time.perf_counter() - self.train_start - self.eval_runtime, 1e-9)
            values = {"train/loss": loss, "train/learning_rate": learning_rate, "train/grad_norm": record["grad_norm"],
                      "train/samples_per_second": (state.samples_seen - self.samples_at_start) / elapsed,
                      "train/epoch": record["epoch"]}
            accelerator.log({k: v for k, v in values.items() if v is not None}, step=state.step)
            self.progress.set_postfix(loss=f"{loss:.4f}", lr=f"{learning_rate:.2e}")
        if state.consecutive_skipped > self.config.max_skipped_steps:
            raise NumericalError(
                f"fp16 loss scaling skipped {state.consecutive_skipped} optimizer steps in a row (up to step "
                f"{state.step}): the loss or gradients overflow fp16. Nothing after the last checkpoint was saved. "
                "Use --mixed_precision bf16 or no, or lower --learning_rate; raise --max_skipped_steps to tolerate more.")
        if stop_votes > 0:
            path = self.save("stopped by signal")
            signum = stop.signum or signal.SIGTERM
            raise TrainingStopped(f"stopped by {signal.Signals(signum).name} after optimizer step {state.step}; "
                                  f"checkpoint: {path}. Resume with:\n    {self.resume_command()}", signum)
        if self.config.eval_strategy == "steps" and state.step % self.eval_steps == 0:
            self.evaluate()
        if (self.config.save_strategy == "steps" and state.step % self.save_steps == 0
                and state.step < self.plan.max_steps and not self.stopping_early):
            self.save(f"every {self.save_steps} steps")

    def end_epoch(self) -> None:
        """After an epoch (or the last, partial one): evaluate per ``--eval_strategy`` (with "steps", the
        final model is evaluated too), then move to the next epoch and checkpoint per ``--save_strategy``."""
        last = self.state.step >= self.plan.max_steps or self.stopping_early
        strategy = self.config.eval_strategy
        if strategy == "epoch" or (strategy == "steps" and last and self.last_eval_step != self.state.step):
            self.evaluate()
        if last:
            return
        self.state.epoch, self.state.micro_batches_done = self.state.epoch + 1, 0
        if self.config.save_strategy == "epoch":
            self.save("end of epoch")

    # -------------------------------------------------------------------------------- evaluation, checkpoints
    def evaluate(self) -> None:
        """Evaluate now; log it; track the best model and early stopping."""
        start = time.perf_counter()
        results = evaluate(self.accelerator, self.s.model, self.s.eval_dataloader, self.s.task, self.s.metric_specs)
        generated, predictions = generation_eval(self.accelerator, self.s.model, self.s.tokenizer,
                                                 self.s.raw_validation, self.recipe, self.config)
        results.update(generated)
        self.eval_runtime += time.perf_counter() - start
        self.eval_results, self.last_eval_step = results, self.state.step
        epoch = self.plan.epoch_fraction(self.state.step)
        self.log.write({"step": self.state.step, "epoch": round(epoch, 4), **results})
        if predictions and self.writes:
            write_generations(self.output_dir, self.s.raw_validation, predictions)
        if self.trackers:
            self.accelerator.log({f"eval/{k.removeprefix('eval_')}": v for k, v in results.items()}, step=self.state.step)
        self.accelerator.print(f"eval at step {self.state.step} (epoch {epoch:.2f}): " + ", ".join(
            f"{k}={v:.4f}" for k, v in results.items() if isinstance(v, float)))
        config = self.config
        if config.metric_for_best_model is not None:
            if config.best_metric_key not in results:
                raise FinetuneError(f"--metric_for_best_model {config.metric_for_best_model!r}: the evaluation has no "
                                    f"{config.best_metric_key!r} (it has {', '.join(sorted(results))}).")
            if self.state.record_evaluation(results[config.best_metric_key], config.greater_is_better):
                self.best_eval_results = results
            patience = config.early_stopping_patience
            if patience and self.state.evals_without_improvement >= patience:
                self.stopping_early = True
                self.accelerator.print(f"early stopping: {config.best_metric_key} has not improved for {patience} "
                                       f"evaluation(s); best {self.state.best_metric:.4f} at step {self.state.best_step}.")

    def save(self, reason: str) -> Path:
        """Write a checkpoint of the state after the current optimizer step (collective)."""
        self.state.train_runtime = self.runtime_before + time.perf_counter() - self.train_start - self.eval_runtime
        path = ckpt.save_checkpoint(self.accelerator, self.output_dir, self.state, self.config.save_total_limit,
                                    model=self.s.model, tokenizer=self.s.tokenizer, layout=self.s.layout)
        self.accelerator.print(f"checkpoint ({reason}): {path}")
        return path

    def resume_command(self) -> str:
        """The command that continues this run from its newest checkpoint (on several machines: the one for
        this machine, run on each with its own ``--machine_rank``)."""
        argv = config_argv(self.config, self.recipe, exclude={"resume_from_checkpoint"})
        if "--output_dir" not in argv:
            argv += ["--output_dir", str(self.config.output_dir)]
        return reproduce_command(argv + ["--resume_from_checkpoint", "latest"],
                                 num_processes=self.accelerator.num_processes, device=self.accelerator.device.type,
                                 machine_flags=distributed.machine_flags(self.s.layout))

    def finish(self) -> dict:
        """After the loop: load the best checkpoint if asked, write the model, ``metrics.json`` and the model
        card; return the metrics."""
        state, accelerator = self.state, self.accelerator
        state.train_runtime = self.runtime_before + time.perf_counter() - self.train_start - self.eval_runtime
        eval_results = self.eval_results
        if self.config.load_best_model_at_end and state.best_step is not None:
            eval_results = self.best_eval_results or eval_results
            if state.best_step != state.step:
                best = ckpt.checkpoint_path(self.output_dir, state.best_step)
                accelerator.print(f"loading the best model: step {state.best_step} ({self.config.best_metric_key} "
                                  f"{state.best_metric:.4f}) from {best}")
                accelerator.load_state(str(best))
        metrics = run_metrics(self.config, state, eval_results, plan=self.plan, num_processes=accelerator.num_processes,
                              precision=self.s.precision, device=accelerator.device,
                              model=self.s.model,
                              eval_runtime=self.eval_runtime, process_start=self.process_start)
        if self.resume_from is not None:
            metrics["resumed_from"] = str(self.resume_from)
        write_outputs(accelerator, self.s.model, self.s.tokenizer, self.config, self.recipe, metrics, writes=self.writes)
        return metrics


class GracefulStop:
    """SIGINT/SIGTERM handling: the first signal sets ``signum`` (the loop finishes the optimizer step in
    progress, writes a checkpoint and exits); a second one exits at once.

    Except a SIGTERM after the launcher died (``finetune.lifeline``): that is the kernel's notice of the
    launcher's death, which follows the Ctrl-C that a terminal sends to the launcher and this process
    alike, and must not cut short the checkpoint that Ctrl-C started."""

    def __init__(self):
        self.signum = None
        self._launcher_noted = False
        self._previous = {}

    def __enter__(self) -> "GracefulStop":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        launcher_died = signum == signal.SIGTERM and launcher_gone()
        if self.signum is not None and launcher_died:  # the kernel may signal once per launcher thread
            if not self._launcher_noted:
                print("\nthe launcher exited: finishing the checkpoint (the bare launcher does not wait for it).",
                      file=sys.stderr)
            self._launcher_noted = True
            return
        if self.signum is not None:
            print(f"\n{signal.Signals(signum).name} again: exiting now, without a checkpoint.", file=sys.stderr)
            os._exit(128 + signum)
        self.signum, self._launcher_noted = signum, launcher_died
        cause = " (the launcher exited)" if launcher_died else ""
        again = "SIGINT" if launcher_died else "it"
        print(f"\n{signal.Signals(signum).name}{cause}: finishing this optimizer step, then saving a checkpoint "
              f"(send {again} again to exit at once).", file=sys.stderr)
