"""The accelerate engine: ``setup()`` asks the engine seam (``finetune.engine``), then one visible ``train()``
loop with exact accumulation inline. Each micro-batch's summed loss is divided by the items of its whole window
over all processes (a partial last window weighs its true size); clipping on the sync micro-batch only; the
schedule advances only after a real optimizer step. Under an engine that steps inside ``backward``
the same loop runs, ``optimizer.step()`` is a no-op there. Rules and their tests: docs/design-notes.md#train.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from finetune import checkpoint as ckpt
from finetune import distributed, packing
from finetune.bookkeeping import Bookkeeping, empty_window_error
from finetune.builders import build_components, get_task
from finetune.config import config_argv, reproduce_command
from finetune.engine import PlainEngine, engine_for, make_accelerator
from finetune.errors import FinetuneError, NumericalError, TrainingStopped
from finetune.evaluation import check_eval_set, evaluate, generation_eval, write_generations
from finetune.loss import loss_function
from finetune.precision import loss_scale, optimizer_step_skipped
from finetune.preemption import SaveBudget
from finetune.reporting import run_banner, run_metrics, write_outputs
from finetune.sampling import EpochSeededLengthGroupedSampler, iter_windows, mask_repeats, window_repeats
from finetune.signals import GracefulStop
from finetune.steps import StepPlan
from finetune.tasks import IGNORE_INDEX, CausalLM


# ------------------------------------------------------------------------------------------ setup
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
    micro_batch_loss: object  # (model, batch, labels) -> the summed loss tensor: loss.loss_function
    pack: object = None  # --padding_free/--packing: window -> the micro-batches it runs (packing.Packer), else None

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
    task = get_task(recipe.TASK)
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
    prepared = engine.prepare(config, model, train_dataloader, eval_dataloader)
    pack = packing.packer_for(config, task, accelerator.unwrap_model(prepared.model), accelerator.distributed_type)
    return Setup(accelerator, engine, prepared.model, tokenizer, prepared.optimizer, prepared.scheduler,
                 prepared.train_dataloader, prepared.eval_dataloader, prepared.plan, precision, task, recipe.METRICS,
                 raw_validation, layout, loss_function(task, config, accelerator), pack)


@dataclass
class WindowCounts:
    """An accumulation window's sizes, summed over all processes: loss ``items`` (samples, or label tokens
    for causal LM), ``samples``, non-padding ``input_tokens`` and ``padded_tokens`` (input positions)."""

    items: float
    samples: int
    input_tokens: int
    padded_tokens: int


def count_window(window: list[dict], task, accelerator, repeats: int = 0, run: list[dict] | None = None) -> WindowCounts:
    """The window's ``WindowCounts`` over all processes, known before any backward: one all-reduce (a
    sync point) per window. ``repeats``: this process's rows that repeat samples at the epoch's end
    (``sampling.repeated_rows``), not counted. ``run``: the micro-batches actually computed when packing
    rebuilt the window (``packing.Packer``): tokens are counted on them, items and samples on ``window`` (equal
    either way: packing masks only labels the shift never trains). Raises ``FinetuneError`` (on every process
    alike) for a window with no item."""
    device = accelerator.device
    input_tokens, positions = map(sum, zip(*(packing.tokens(b) for b in (run or window)), strict=True))
    local = torch.stack([sum(task.count(b["labels"]) for b in window),
                         torch.tensor(sum(b["labels"].shape[0] for b in window) - repeats, device=device),
                         torch.tensor(input_tokens, device=device), torch.tensor(positions, device=device)])
    items, samples, input_tokens, padded = accelerator.reduce(local, "sum").tolist()
    if items == 0:
        raise empty_window_error(int(samples))
    return WindowCounts(items, int(samples), int(input_tokens), int(padded))


# ------------------------------------------------------------------------------------------ the loop
def train(config, recipe, process_start: float | None = None, build=None, hub=None) -> dict:
    """Fine-tune ``recipe`` with ``config``; write the model, ``metrics.json``, ``log.jsonl``, the model card
    and ``run_config.json`` into ``config.output_dir``; return the metrics (``reporting.run_metrics``).

    Checkpoints are taken after an optimizer step, never inside a window. Raises ``TrainingStopped`` after
    SIGINT/SIGTERM (checkpoint written, resume command in the message), ``NumericalError`` on a non-finite
    loss or gradient (fp32/bf16) or too many fp16 skips in a row, and ``FinetuneError`` for a checkpoint
    that cannot be resumed or written. ``build(config, recipe) -> Setup``: ``setup`` unless given
    (``finetune.verify`` wraps it to observe a run, or to vary its data order or loss for its controls).
    ``hub``: a ``finetune.hub.HubPush`` (``--push_to_hub``, main process) told of each checkpoint and of the end.
    """
    built = (build or setup)(config, recipe)
    accelerator, model, optimizer, scheduler, task = built.accelerator, built.model, built.optimizer, built.scheduler, built.task
    N, P = config.gradient_accumulation_steps, accelerator.num_processes
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
    with RunState(built, config, recipe, process_start, hub) as run, GracefulStop() as stop:
        model.train()
        while not run.done:
            for window in iter_windows(run.epoch_batches(), N):
                # the micro-batches to compute: the window, or its own samples repacked (finetune.packing)
                micro_batches = built.pack(window) if built.pack else window
                counts = count_window(window, task, accelerator, run.repeats(len(window)), micro_batches)
                # Align Accelerate's micro-batch counter so the window's last micro-batch is the sync step,
                # also for a short last window (it syncs when its counter reaches a multiple of N). A packed
                # window has its own count (any number, differing by process): the counter runs over it alone.
                if micro_batches is window:
                    K, accelerator.step = N, N - len(window)
                else:
                    K = accelerator.gradient_accumulation_steps = len(micro_batches)
                    accelerator.step = 0
                window_loss = torch.zeros((), device=accelerator.device)
                # Read before any backward: an engine may run the optimizer (and its own schedule's) step
                # inside the last one.
                learning_rate = built.learning_rate()
                for batch in micro_batches:
                    with accelerator.accumulate(model):
                        labels = batch.pop("labels")
                        loss_sum = built.micro_batch_loss(model, batch, labels)  # forward; summed over its items
                        # accelerator.backward divides by K (its gradient_accumulation_steps) and DDP averages over
                        # P processes: undo both, so the summed gradient is sum(per-item gradients) / items in the
                        # window.
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
                run.end_step(window_loss, counts, len(window), learning_rate, grad_norm, skipped=skipped, stop=stop)
                if run.done:
                    break
            run.end_epoch()
        return run.finish()


# ------------------------------------------------------------------------------------------ around the loop
class RunState:
    """What the loop needs around it: resuming, trackers, the progress bar, guards, checkpoints and the final
    outputs; the records and cadence both engines share are ``bookkeeping.Bookkeeping``'s. A context
    manager: whatever ends the loop (success, an error, a signal), the progress bar, the log and the
    trackers are closed."""

    def __init__(self, built: Setup, config, recipe, process_start: float | None, hub=None):
        self.built, self.config, self.recipe, self.process_start = built, config, recipe, process_start
        self.hub = hub  # finetune.hub.HubPush or None
        self.accelerator = built.accelerator
        self.output_dir = Path(config.output_dir)
        self.plan = built.plan
        self.logging_steps = max(self.plan.steps(config.logging_steps), 1)
        self.meaning = ckpt.step_meaning(config, self.accelerator.num_processes)
        self.book = Bookkeeping(config, self.plan, ckpt.RunProgress(num_processes=self.accelerator.num_processes,
                                                                    step_meaning=self.meaning),
                                writes=built.layout.writes, say=self.accelerator.print,
                                counts_tokens=isinstance(built.task, CausalLM))
        self.resume_from = None
        self.progress_bar = None
        self.trackers = False
        # will a stop signal's step and checkpoint fit the grace before SIGKILL? (the main process says)
        self.budget = SaveBudget(config.preemption_grace_seconds, self.accelerator.print,
                                 active=self.accelerator.is_main_process)
        self.step_mark = None  # time.perf_counter() when the optimizer step in progress began

    @property
    def progress(self) -> ckpt.RunProgress:
        """The counters a checkpoint holds."""
        return self.book.progress

    # -------------------------------------------------------------------------------- start and end
    def __enter__(self) -> "RunState":
        config, accelerator = self.config, self.accelerator
        if config.resume_from_checkpoint:
            # every process must resume from the same step, also where each machine has its own files
            self.resume_from = distributed.agree_on_checkpoint(accelerator, self.output_dir, config.resume_from_checkpoint)
            if self.resume_from is None:
                accelerator.print(f"--resume_from_checkpoint auto: no complete checkpoint under "
                                  f"{ckpt.checkpoints_dir(self.output_dir)}; starting a fresh run.")
            else:
                distributed.agree(lambda: self._resume(self.resume_from), accelerator)
        self.book.open(self.progress.step if self.resume_from is not None else None)
        accelerator.wait_for_everyone()
        accelerator.print(run_banner(config, accelerator.num_processes, self.plan, self.built.precision,
                                     accelerator.device.type, self.built.model))
        if self.built.engine.note:
            accelerator.print(self.built.engine.note)
        if self.resume_from is not None:
            accelerator.print(f"Resuming from {self.resume_from}: optimizer step {self.progress.step}, epoch "
                              f"{self.progress.epoch}, skipping {self.progress.micro_batches_done} micro-batches of it "
                              "(same data order).")
        if config.report_to != "none":
            # hyperparameters as the trackers accept them (no None), under <output_dir>/runs for TensorBoard
            hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                       for k, v in config.to_dict().items() if v is not None}
            accelerator.init_trackers("runs", config=hparams)
            self.trackers = True
        self.budget.start(self.built.model, self.output_dir)
        self.progress_bar = tqdm(total=self.plan.max_steps, initial=self.progress.step, desc="Training", unit="step",
                                 disable=not accelerator.is_local_main_process)
        self.runtime_before, self.train_start = self.progress.train_runtime, time.perf_counter()
        self.samples_at_start = self.progress.samples_seen
        if config.eval_on_start and self.progress.step == 0:
            self.evaluate(at_epoch_end=False)
        self.step_mark = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress_bar is not None:
            self.progress_bar.close()
        self.book.close()
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
        self.book.progress = loaded

    # -------------------------------------------------------------------------------- the loop's questions
    @property
    def done(self) -> bool:
        """Whether training is over: the last optimizer step or epoch is done, or early stopping fired."""
        return (self.progress.step >= self.plan.max_steps or self.progress.epoch >= self.plan.num_epochs
                or self.book.stopping_early)

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
        """This process's repeated rows (``sampling.repeated_rows``) in the window of ``micro_batches``
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
        raise NumericalError(
            f"non-finite loss or gradient at optimizer step {self.progress.step + 1} (epoch {self.progress.epoch}, "
            f"micro-batches {first}-{first + micro_batches - 1} of the epoch, per process): grad norm "
            f"{float(grad_norm)}. Nothing after the last checkpoint was saved. Lower --learning_rate, set "
            "--max_grad_norm, or check those samples; resume with --resume_from_checkpoint latest.")

    # -------------------------------------------------------------------------------- after each step
    def end_step(self, window_loss, counts: WindowCounts, micro_batches: int, learning_rate: float, grad_norm,
                 skipped: bool, stop: "GracefulStop") -> None:
        """Account for the optimizer step just taken (``Bookkeeping.record_step``), trackers and progress; then
        a signal, and the evaluation and checkpoint cadence."""
        accelerator, book = self.accelerator, self.book
        seconds = time.perf_counter() - self.step_mark
        self.budget.step(seconds)
        # One reduction per optimizer step: the window's loss, and whether any process was signalled (every
        # process must stop at the same step).
        loss_total, stop_votes = accelerator.reduce(
            torch.stack([window_loss, torch.tensor(float(stop.signum is not None), device=accelerator.device)]),
            "sum").tolist()
        loss = loss_total / counts.items
        self.progress.micro_batches_done += micro_batches
        record = book.record_step(loss=loss, samples=counts.samples, items=counts.items, micro_batches=micro_batches,
                                  learning_rate=learning_rate, grad_norm=grad_norm, loss_scale=loss_scale(accelerator),
                                  skipped=skipped, input_tokens=counts.input_tokens, padded_tokens=counts.padded_tokens,
                                  seconds=seconds)
        step = self.progress.step
        self.progress_bar.update(1)
        if step % self.logging_steps == 0:
            elapsed = max(time.perf_counter() - self.train_start - book.eval_runtime, 1e-9)
            values = {"train/loss": loss, "train/learning_rate": learning_rate, "train/grad_norm": record["grad_norm"],
                      "train/samples_per_second": (self.progress.samples_seen - self.samples_at_start) / elapsed,
                      "train/epoch": record["epoch"]}
            accelerator.log({k: v for k, v in values.items() if v is not None}, step=step)
            self.progress_bar.set_postfix(loss=f"{loss:.4f}", lr=f"{learning_rate:.2e}")
        if stop_votes > 0:
            path = self.save("stopped by signal", push=False)  # the process ends now: no upload to wait for
            signum = stop.signum or signal.SIGTERM
            raise TrainingStopped(f"stopped by {signal.Signals(signum).name} after optimizer step {step}; "
                                  f"checkpoint: {path}. Resume with:\n    {self.resume_command()}", signum)
        if book.evaluate_after_step(step):
            self.evaluate(at_epoch_end=False)
        if book.save_after_step(step):
            self.save(f"every {book.save_steps} steps")
        self.step_mark = time.perf_counter()

    def end_epoch(self) -> None:
        """After an epoch (or the last, partial one): evaluate per ``--eval_strategy``, then move to the next
        epoch and checkpoint per ``--save_strategy``."""
        last = self.progress.step >= self.plan.max_steps or self.book.stopping_early
        if self.book.evaluate_at_epoch_end(self.progress.step, last):
            self.evaluate(at_epoch_end=True)
        if last or self.book.stopping_early:  # early stopping at this evaluation ends the run here
            return
        self.progress.epoch, self.progress.micro_batches_done = self.progress.epoch + 1, 0
        if self.config.save_strategy == "epoch":
            self.save("end of epoch")
        self.step_mark = time.perf_counter()

    # -------------------------------------------------------------------------------- evaluation, checkpoints
    def evaluate(self, at_epoch_end: bool) -> None:
        """Evaluate now (loss and metrics, then generation for SFT recipes); record it."""
        built, start = self.built, time.perf_counter()
        results = evaluate(self.accelerator, built.model, built.eval_dataloader, built.task, built.metric_specs,
                           padding_free=built.pack is not None)
        generated, predictions = generation_eval(self.accelerator, built.model, built.tokenizer,
                                                 built.raw_validation, self.recipe, self.config)
        results.update(generated)
        if predictions and self.book.writes:
            write_generations(self.output_dir, built.raw_validation, predictions)
        if self.trackers:
            self.accelerator.log({f"eval/{k.removeprefix('eval_')}": v for k, v in results.items()},
                                 step=self.progress.step)
        step = self.progress.step
        self.book.record_evaluation(results, time.perf_counter() - start, self.book.checkpointed_after(step, at_epoch_end))

    def save(self, reason: str, push: bool = True) -> Path:
        """Write a checkpoint of the state after the current optimizer step (collective); ``push``: then hand it
        to ``--push_to_hub`` (``HubPush.after_save``: in the background, per ``--hub_strategy``)."""
        self.progress.train_runtime = self._train_runtime()
        start = time.perf_counter()
        path = ckpt.save_checkpoint(self.accelerator, self.output_dir, self.progress, self.config.save_total_limit,
                                    model=self.built.model, tokenizer=self.built.tokenizer, layout=self.built.layout)
        self.accelerator.print(f"checkpoint ({reason}): {path}")
        self.budget.saved(time.perf_counter() - start)
        if push and self.hub is not None:
            self.hub.after_save(path, self.progress.step)
        return path

    def _train_runtime(self) -> float:
        return self.runtime_before + time.perf_counter() - self.train_start - self.book.eval_runtime

    def resume_command(self) -> str:
        """The command that continues this run from its newest checkpoint (on several machines: the one for
        this machine, run on each with its own ``--machine_rank``)."""
        argv = config_argv(self.config, self.recipe, exclude={"resume_from_checkpoint"})
        if "--output_dir" not in argv:
            argv += ["--output_dir", str(self.config.output_dir)]
        return reproduce_command(argv + ["--resume_from_checkpoint", "latest"],
                                 num_processes=self.accelerator.num_processes, device=self.accelerator.device.type,
                                 machine_flags=distributed.machine_flags(self.built.layout))

    def finish(self) -> dict:
        """After the loop: load the best checkpoint if asked, write the model, ``metrics.json`` and the model
        card; return the metrics."""
        progress, accelerator = self.progress, self.accelerator
        progress.train_runtime = self._train_runtime()
        if self.config.load_best_model_at_end and progress.best_step is not None and progress.best_step != progress.step:
            best = ckpt.checkpoint_path(self.output_dir, progress.best_step)
            accelerator.print(f"loading the best model: step {progress.best_step} ({self.config.best_metric_key} "
                              f"{progress.best_metric:.4f}) from {best}")
            accelerator.load_state(str(best))
        metrics = run_metrics(self.config, progress, self.book.final_eval_results(), plan=self.plan,
                              num_processes=accelerator.num_processes, precision=self.built.precision,
                              device=accelerator.device, model=self.built.model, eval_runtime=self.book.eval_runtime,
                              process_start=self.process_start)
        if self.resume_from is not None:
            metrics["resumed_from"] = str(self.resume_from)
        write_outputs(self.built.engine, self.built.model, self.built.tokenizer, self.config, self.recipe, metrics,
                      writes=self.book.writes)
        if self.hub is not None:
            self.hub.at_end(self.output_dir)
        return metrics
