"""The accelerate backend: ``setup()`` asks the engine seam (``finetune.engine``), then one visible ``train()``
loop with exact accumulation inline. Each micro-batch's summed loss is divided by the items of its whole window
over all processes (a partial last window weighs its true size); clipping on the sync micro-batch only; the
schedule advances only after a real optimizer step. Under an engine that steps inside ``backward``
the same loop runs, ``optimizer.step()`` is a no-op there. Rules and their tests: docs/precision.md.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    TorchDynamoPlugin,
)
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from finetune import distributed
from finetune.config import config_argv, reproduce_command
from finetune.data import packing
from finetune.engine import PlainEngine, check_quantized_base, check_tracker, engine_for, local_mlflow_store
from finetune.engine.precision import check_precision_supported, loss_scale, optimizer_step_skipped
from finetune.errors import FinetuneError, NumericalError, TrainingStopped, together
from finetune.lifecycle import checkpoint as ckpt
from finetune.lifecycle import elastic
from finetune.lifecycle import run_state as lifecycle
from finetune.lifecycle.evaluation import check_benchmark_tasks, check_eval_set
from finetune.lifecycle.window import (
    EpochSeededLengthGroupedSampler,
    StepPlan,
    WindowCounts,
    align_sync_counter,
    count_window,
    iter_windows,
    mask_repeats,
    plan_steps,
    window_repeats,
)
from finetune.models.quantization import base_identity
from finetune.outputs.reporting import log_completions
from finetune.signals import GracefulStop
from finetune.tasks import IGNORE_INDEX, run_task
from finetune.tasks.builders import build_components
from finetune.tasks.loss import loss_function


# ------------------------------------------------------------------------------------------ setup
def make_accelerator(config) -> Accelerator:
    """An ``Accelerator`` for ``config``: N-step accumulation aligned to the loop's windows, a seeded sampler,
    the schedule stepped by hand. Raises ``FinetuneError`` for bf16 on a device without it, or a ``--report_to``
    tracker whose package is not installed."""
    check_precision_supported(config.mixed_precision)
    log_with = None if config.report_to == "none" else config.report_to
    check_tracker(config.report_to)
    local_mlflow_store(config)
    compile_options = {}
    if config.torch_compile:  # Accelerator.prepare wraps the model in torch.compile
        compile_options["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor", mode=config.torch_compile_mode)
    try:
        return Accelerator(
            **compile_options,
            log_with=log_with,
            project_dir=config.output_dir,
            mixed_precision=config.mixed_precision,
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=config.gradient_accumulation_steps, sync_with_dataloader=False),
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=config.ddp_timeout))],
            # Where Accelerate wraps the schedule (DeepSpeed), each step() call is then one step, not one per process.
            step_scheduler_with_optimizer=False,
        )
    except ValueError as err:
        if "bf16" in str(err):
            raise FinetuneError(f"--mixed_precision bf16 is not supported on this device ({err}). "
                                "Use --mixed_precision fp16 (GPU) or no.") from None
        raise


@dataclass
class Setup:
    """Everything ``train()`` needs, built from a config and a recipe."""

    accelerator: object
    engine: PlainEngine  # plain/DDP or a sharding engine: finetune.engine
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
    micro_batch_loss: object  # (model, batch) -> the loss summed over the batch's items: loss.loss_function
    pack: object = None  # --padding_free/--packing: window -> the micro-batches it runs (packing.Packer), else None
    train_dataset: object = None  # the tokenized training set (a datasets.Dataset): what the run is bound to
    base: dict | None = None  # a quantized base's identity (models.quantization.base_identity): part of a step's meaning

    def learning_rate(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.engine.learning_rate(self.optimizer, self.scheduler)


def setup(config, recipe) -> Setup:
    """Build accelerator, engine, tokenizer, datasets, model, optimizer and schedule for ``train()``. Raises
    ``FinetuneError`` for inputs that cannot run (before anything is written)."""
    accelerator = make_accelerator(config)
    engine = engine_for(accelerator)
    layout = distributed.plan_storage(accelerator, config.output_dir)
    # each machine's local main process writes its own copy of the model, optimizer and scheduler states
    accelerator.project_configuration.save_on_each_node = layout.per_machine
    engine.configure(config, per_machine=layout.per_machine)
    precision = engine.precision()
    check_quantized_base(config, engine)
    task = run_task(recipe, config)
    check_benchmark_tasks(config, task)
    tokenizer, datasets, _, model, collator, raw_validation = build_components(
        config, recipe, precision, accelerator.main_process_first, task, accelerator.device)
    check_eval_set(len(datasets["validation"]), config)
    base = base_identity(model)  # a quantized base's hash, before an engine places or wraps it
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
            global_batch, task.item_lengths(datasets["train"]), config.seed))
    else:  # Accelerate swaps this RandomSampler for its seedable one (data_seed + epoch)
        order = dict(shuffle=True)
    # its batches carry their rows' positions: each optimizer step logs the hash of its sample ids (elastic)
    train_dataloader = DataLoader(elastic.SampleIds(datasets["train"]), batch_size=config.per_device_train_batch_size,
                                  **order, **{**loader_options, "collate_fn": elastic.with_sample_ids(collator)})
    eval_dataloader = DataLoader(datasets["validation"], shuffle=False, batch_size=config.per_device_eval_batch_size,
                                 **loader_options)
    prepared = engine.prepare(config, model, train_dataloader, eval_dataloader, lambda n: plan_steps(n, config))
    micro_batch_loss = loss_function(task, config, accelerator)
    pack = packing.packer_for(config, task, accelerator.unwrap_model(prepared.model), engine,
                              precision=precision, loss_sum=micro_batch_loss)
    return Setup(accelerator, engine, prepared.model, tokenizer, prepared.optimizer, prepared.scheduler,
                 prepared.train_dataloader, prepared.eval_dataloader, prepared.plan, precision, task, recipe.METRICS,
                 raw_validation, layout, micro_batch_loss, pack, datasets["train"], base)


# ------------------------------------------------------------------------------------------ the loop
def train(config, recipe, process_start: float | None = None, build=None, hub=None) -> dict:
    """Fine-tune ``recipe`` with ``config``; write the model, ``metrics.json``, ``log.jsonl``, the model card
    and ``run_config.json`` into ``config.output_dir``; return the metrics (``reporting.run_metrics``).

    Checkpoints are taken after an optimizer step, never inside a window. Raises ``TrainingStopped`` after
    SIGINT/SIGTERM (checkpoint written, resume command in the message), ``NumericalError`` on a non-finite
    loss or gradient (fp32/bf16) or too many fp16 skips in a row, and ``FinetuneError`` for a checkpoint
    that cannot be resumed or written. ``build(config, recipe) -> Setup``: ``setup`` unless given
    (``finetune.commands.verify`` wraps it to observe a run, or to vary its data order or loss for its controls).
    ``hub``: a ``finetune.outputs.hub.HubPush`` (``--push_to_hub``, main process) told of each checkpoint (the
    final push is ``run.run``'s).
    """
    built = (build or setup)(config, recipe)
    accelerator, model, optimizer, scheduler, task = built.accelerator, built.model, built.optimizer, built.scheduler, built.task
    N, P, mu = config.gradient_accumulation_steps, accelerator.num_processes, config.num_iterations
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
    with Loop(built, config, recipe, process_start, hub) as run, GracefulStop() as stop:
        model.train()
        while not run.done:
            for window in iter_windows(run.epoch_batches(), N):
                # --num_iterations (GRPO's mu): mu optimizer steps per window, from the one a resume stopped inside
                for repeat in range(run.progress.step % mu, mu):
                    # the task's micro-batches of the window (GRPO: its prompts' completions, generated at its first
                    # step)
                    run_window = task.rollout(model, window, run.progress.step + 1)
                    # the micro-batches to compute: the window, or its own samples repacked (finetune.data.packing)
                    micro_batches = built.pack(run_window) if built.pack else run_window
                    counts = count_window(run_window, task, accelerator, run.repeats(len(window)), micro_batches)
                    # the window's last micro-batch is the sync step (a short or packed window too); K: what
                    # accelerator.backward will divide each loss by
                    K = align_sync_counter(accelerator, run_window, micro_batches, N)
                    window_loss = torch.zeros((), device=accelerator.device)
                    # Read before any backward: an engine may run the optimizer (and its own schedule's) step
                    # inside the last one.
                    learning_rate = built.learning_rate()
                    for batch in micro_batches:
                        with accelerator.accumulate(model):
                            loss_sum = built.micro_batch_loss(model, batch)  # forward; summed over its items
                            # accelerator.backward divides by K (its gradient_accumulation_steps) and DDP averages
                            # over P processes: undo both, so the summed gradient is sum(per-item gradients) / items
                            # in the window.
                            scaled = loss_sum * (K * P / counts.items)
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
                    # the data moves on by the window at its last step only
                    run.end_step(window_loss, counts, len(window) if repeat == mu - 1 else 0, learning_rate,
                                 grad_norm, skipped=skipped, stop=stop, metric_sums=task.take_metric_sums())
                    if run.done:
                        break
                if run.done:
                    break
            run.end_epoch()
        return run.finish()


# ------------------------------------------------------------------------------------------ around the loop
class Loop:
    """What the visible loop asks around each step: the epoch's batches, guards, the step's reduction and signals,
    checkpoints, trackers and the progress bar. It holds the run lifecycle (``self.run``, a ``lifecycle.RunState``:
    counters, log, resume, evaluation, timers, final outputs) as the Trainer backend's callback does. A context
    manager: setup on entry (resume, output directory, banner, trackers), cleanup on exit whatever ends the loop
    (success, an error, a signal): the progress bar, the log and the trackers are closed."""

    def __init__(self, built: Setup, config, recipe, process_start: float | None, hub=None):
        accelerator = built.accelerator
        self.run = lifecycle.RunState(
            config, recipe, backend="accelerate", plan=built.plan, num_processes=accelerator.num_processes,
            task=built.task, layout=built.layout, precision=built.precision, say=accelerator.print,
            main=accelerator.is_main_process, raw_validation=built.raw_validation, hub=hub,
            process_start=process_start, train_dataset=built.train_dataset, base=built.base)
        self.config, self.plan = config, built.plan
        self.built, self.accelerator = built, accelerator
        self.logging_steps = max(self.plan.steps(config.logging_steps), 1)
        self.progress_bar = None
        self.trackers = False

    @property
    def progress(self):
        """The run's counters (``lifecycle.RunState.progress``: what a checkpoint holds)."""
        return self.run.progress

    # -------------------------------------------------------------------------------- setup and cleanup
    def __enter__(self) -> "Loop":
        config, accelerator = self.config, self.accelerator
        self.run.resume(accelerator, self._load)
        self.run.open()
        if self.built.pack is not None and accelerator.is_main_process:
            self.built.pack.keep(config.output_dir)  # the layout cost, for a resume to choose alike
        accelerator.wait_for_everyone()
        self.run.announce(self.built.model, accelerator.device.type, self.built.engine.note,
                      self.built.pack.note if self.built.pack else None, self.built.task.note())
        if config.report_to != "none":
            # hyperparameters as the trackers accept them (no None), under <output_dir>/runs for TensorBoard
            hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                       for k, v in config.to_dict().items() if v is not None}
            accelerator.init_trackers("runs", config=hparams)
            self.trackers = True
        self.progress_bar = tqdm(total=self.plan.max_steps, initial=self.progress.step, desc="Training", unit="step",
                                 disable=not accelerator.is_local_main_process)
        self.run.begin_training(self.built.model)
        if config.eval_on_start and self.progress.step == 0:
            self.evaluate(at_epoch_end=False)
        if self.progress.evaluation_due:  # resumed from a signal's checkpoint: the evaluation the stop put off
            self.evaluate(at_epoch_end=False)
        self.run.mark()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress_bar is not None:
            self.progress_bar.close()
        self.run.close()
        if self.trackers:
            # Accelerator.end_training without its destroy_process_group (accelerate 1.15 accelerator.py:3429-3449
            # end_training: each tracker's finish(), then PartialState.destroy_process_group with no barrier):
            # the processes leave the group together afterwards (run.run, distributed.leave)
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.trackers = False

    def _load(self, path: Path, loaded) -> None:
        """The accelerate backend's state from ``path``; ``loaded``: the checkpoint's ``RunProgress``, its position
        moved to this launch's split of B (``elastic.resume_position``: the same samples of the seeded order)."""
        saved = loaded.step_meaning
        engine = self.built.engine
        resharded = (engine.resume_on_another_count(saved["num_processes"], self.run.meaning["num_processes"], path)
                     if elastic.processes_changed(saved, self.run.meaning) else None)
        loaded.samples_done, loaded.micro_batches_done = elastic.resume_position(
            loaded, saved, self.run.meaning, len(self.built.train_dataloader.dataset))
        self.run.resume_notes = [note for note in (elastic.resume_change(saved, self.run.meaning), resharded) if note]
        try:
            self.accelerator.load_state(str(path))
        except Exception as err:  # torch/safetensors raise many types for damaged files
            raise FinetuneError(f"checkpoint {path} is corrupt and cannot be loaded ({type(err).__name__}: {err}). "
                                "Resume from another checkpoint (--resume_from_checkpoint PATH).") from None
        if elastic.processes_changed(saved, self.run.meaning):  # the checkpoint's per-process generators do not fit
            elastic.reseed(self.config.seed, loaded.step)
            self.run.resume_notes.append(elastic.RNG_NOTE)

    # -------------------------------------------------------------------------------- the loop's questions
    @property
    def done(self) -> bool:
        """Whether training is over: the last optimizer step or epoch is done, or early stopping fired."""
        return (self.progress.step >= self.plan.max_steps or self.progress.epoch >= self.plan.num_epochs
                or self.run.stopping_early)

    def epoch_batches(self):
        """The current epoch's micro-batches: the seeded order of this epoch, minus those a resumed run has
        already trained on."""
        dataloader = self.built.train_dataloader
        dataloader.set_epoch(self.progress.epoch)  # the order depends on the seed and the epoch only
        done = self.progress.micro_batches_done
        batches = self.accelerator.skip_first_batches(dataloader, done) if done else dataloader
        # on several processes the epoch's last micro-batches are completed with repeated samples: masked
        return mask_repeats(batches, done, self.config.per_device_train_batch_size, self.accelerator.num_processes,
                            self.accelerator.process_index, len(dataloader.dataset), IGNORE_INDEX)

    def repeats(self, micro_batches: int) -> int:
        """This process's repeated rows (``window.repeated_rows``) in the window of ``micro_batches``
        micro-batches that starts at the epoch's ``micro_batches_done``."""
        return window_repeats(self.progress.micro_batches_done, micro_batches, self.config.per_device_train_batch_size,
                              self.accelerator.num_processes, self.accelerator.process_index,
                              len(self.built.train_dataloader.dataset))

    def check_finite(self, grad_norm, micro_batches: int) -> None:
        """Raise ``NumericalError`` for a non-finite gradient norm (fp32/bf16: it must not reach the weights;
        fp16 overflows are the loss scaler's to skip). A sync point per optimizer step. ``grad_norm``: a
        tensor, a float (an engine's own norm, its step already taken) or None (no norm computed)."""
        if self.built.precision == "fp16" or grad_norm is None or torch.isfinite(torch.as_tensor(grad_norm)).item():
            return
        first = self.progress.micro_batches_done
        # every process: the norm is of the all-reduced gradients
        raise together(NumericalError(
            f"non-finite loss or gradient at optimizer step {self.progress.step + 1} (epoch {self.progress.epoch}, "
            f"micro-batches {first}-{first + micro_batches - 1} of the epoch, per process): grad norm "
            f"{float(grad_norm)}. Nothing after the last checkpoint was saved. Lower --learning_rate, set "
            "--max_grad_norm, or check those samples; resume with --resume_from_checkpoint latest."))

    # -------------------------------------------------------------------------------- after each step
    def end_step(self, window_loss, counts: WindowCounts, micro_batches: int, learning_rate: float, grad_norm,
                 skipped: bool, stop: "GracefulStop", metric_sums=None) -> None:
        """Account for the optimizer step just taken (``lifecycle.RunState.record_step``), trackers and progress; then
        a signal, and the evaluation and checkpoint cadence. ``micro_batches``: the micro-batches of data the step
        moved on by (the window's; 0 for a ``--num_iterations`` step that is not its generation's last).
        ``metric_sums``: the task's own per-step metric sums of this process (``task.take_metric_sums``), reduced and
        divided by the window's items here."""
        accelerator, run = self.accelerator, self.run
        metrics = self.run.window_metrics(accelerator, metric_sums, counts.items)
        seconds = self.run.step_seconds()
        # One reduction per optimizer step: the window's loss, and whether any process was signalled (every
        # process must stop at the same step).
        loss_total, stop_votes = accelerator.reduce(
            torch.stack([window_loss, torch.tensor(float(stop.signum is not None), device=accelerator.device)]),
            "sum").tolist()
        loss = loss_total / counts.items
        self.progress.micro_batches_done += micro_batches
        self.progress.samples_done += micro_batches * self.config.per_device_train_batch_size * accelerator.num_processes
        record = self.run.record_step(loss=loss, samples=counts.samples, items=counts.items, micro_batches=micro_batches,
                                  learning_rate=learning_rate, grad_norm=grad_norm, loss_scale=loss_scale(accelerator),
                                  skipped=skipped, input_tokens=counts.input_tokens, padded_tokens=counts.padded_tokens,
                                  seconds=seconds, **({"sample_ids": counts.sample_ids} if counts.sample_ids else {}),
                                  **metrics)
        step = self.progress.step
        self.progress_bar.update(1)
        if step % self.logging_steps == 0:
            elapsed = max(time.perf_counter() - run.train_start - run.eval_runtime, 1e-9)
            values = {"train/loss": loss, "train/learning_rate": learning_rate, "train/grad_norm": record["grad_norm"],
                      "train/samples_per_second": (self.progress.samples_seen - run.samples_at_start) / elapsed,
                      "train/epoch": record["epoch"], **{f"train/{k}": v for k, v in metrics.items()}}
            accelerator.log({k: v for k, v in values.items() if v is not None}, step=step)
            self.progress_bar.set_postfix(loss=f"{loss:.4f}", lr=f"{learning_rate:.2e}", **run.postfix(metrics))
        if stop_votes > 0:
            # the evaluation due after this step waits for the resume (a preemption's grace is for the checkpoint)
            self.progress.evaluation_due = run.evaluate_after_step(step)
            path = self.save("stopped by signal", push=False)  # the process ends now: no upload to wait for
            signum = stop.signum or signal.SIGTERM
            # every process raises here, at the same step (the vote was all-reduced); run.run leaves the group
            raise TrainingStopped(f"stopped by {signal.Signals(signum).name} after optimizer step {step}; "
                                  f"checkpoint: {path}. Resume with:\n    {self.resume_command()}", signum)
        if run.evaluate_after_step(step):
            self.evaluate(at_epoch_end=False)
        if run.save_after_step(step):
            self.save(f"every {run.save_steps} steps")
        self.run.mark()

    def end_epoch(self) -> None:
        """After an epoch (or the last, partial one): evaluate per ``--eval_strategy``, then move to the next
        epoch and checkpoint per ``--save_strategy``."""
        last = self.progress.step >= self.plan.max_steps or self.run.stopping_early
        if self.run.evaluate_at_epoch_end(self.progress.step, last):
            self.evaluate(at_epoch_end=True)
        if last or self.run.stopping_early:  # early stopping at this evaluation ends the run here
            return
        self.progress.epoch, self.progress.micro_batches_done, self.progress.samples_done = self.progress.epoch + 1, 0, 0
        if self.config.save_strategy == "epoch":
            self.save("end of epoch")
        self.run.mark()

    # -------------------------------------------------------------------------------- evaluation, checkpoints
    def evaluate(self, at_epoch_end: bool) -> None:
        """Evaluate now (``lifecycle.RunState.evaluate``; padding-free under --padding_free/--packing) and tell the
        trackers."""
        built = self.built
        results = self.run.evaluate(self.accelerator, built.model, built.eval_dataloader, built.tokenizer, at_epoch_end,
                                   pack=built.pack)
        if self.trackers:
            self.accelerator.log({f"eval/{k.removeprefix('eval_')}": v for k, v in results.items()},
                                 step=self.progress.step)
            log_completions(self.accelerator.trackers, self.run.eval_samples, self.progress.step)

    def save(self, reason: str, push: bool = True) -> Path:
        """Write a checkpoint of the state after the current optimizer step (collective); ``push``: then hand it
        to ``--push_to_hub`` (``HubPush.after_save``: in the background, per ``--hub_strategy``)."""
        self.progress.train_runtime = self.run.train_runtime()
        start = time.perf_counter()
        path = ckpt.save_checkpoint(self.accelerator, self.run.output_dir, self.progress, self.config.save_total_limit,
                                    model=self.built.model, tokenizer=self.built.tokenizer, layout=self.built.layout,
                                    held=self.run.held_by_uploads())
        self.run.saved(path, time.perf_counter() - start, reason, push)
        return path

    def resume_command(self) -> str:
        """The command that continues this run from its newest checkpoint (on several machines: the one for
        this machine, run on each with its own ``--machine_rank``)."""
        argv = config_argv(self.config, self.run.recipe, exclude={"resume_from_checkpoint"})
        if "--output_dir" not in argv:
            argv += ["--output_dir", str(self.config.output_dir)]
        return reproduce_command(argv + ["--resume_from_checkpoint", "latest"],
                                 num_processes=self.accelerator.num_processes, device=self.accelerator.device.type,
                                 machine_flags=distributed.machine_flags(self.built.layout))

    def finish(self) -> dict:
        """After the loop: load the best checkpoint if asked, then the final outputs (``lifecycle.RunState.finish``);
        return the metrics."""
        progress, accelerator = self.progress, self.accelerator
        if self.config.load_best_model_at_end and progress.best_step is not None and progress.best_step != progress.step:
            best = ckpt.checkpoint_path(self.run.output_dir, progress.best_step)
            accelerator.print(f"loading the best model: step {progress.best_step} ({self.config.best_metric_key} "
                              f"{progress.best_metric:.4f}) from {best}")
            accelerator.load_state(str(best))
        return self.run.finish(self.built.engine, self.built.model, self.built.tokenizer, accelerator.device)
