"""The Trainer engine: the same recipe, model, data, collator, optimizer and schedule on ``transformers.Trainer``;
only the loop differs. Our loss divides each micro-batch's summed loss by the window's items over all processes
(a plain Trainer with a loss-kwargs model logs and trains N times the mean); records and cadence come from the
shared ``bookkeeping`` through ``BookkeepingCallback``. See docs/design-notes.md#trainer_backend.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
from transformers import ProgressCallback, Trainer, TrainerCallback, TrainingArguments

from finetune import checkpoint as ckpt
from finetune import distributed, packing
from finetune.bookkeeping import Bookkeeping, empty_window_error
from finetune.builders import build_components, get_task
from finetune.engine import engine_for
from finetune.errors import FinetuneError
from finetune.evaluation import check_eval_set, evaluate, generation_eval, write_generations
from finetune.hub import HubCallback
from finetune.loss import loss_function
from finetune.precision import loss_scale, optimizer_step_skipped
from finetune.preemption import SaveBudget
from finetune.reporting import run_banner, run_metrics, write_outputs
from finetune.sampling import mask_repeats, window_repeats
from finetune.steps import micro_batches_per_process, plan_steps
from finetune.tasks import IGNORE_INDEX, CausalLM

STEP_MEANING_FILE = "finetune_step_meaning.json"  # in each Trainer checkpoint


def training_arguments(config, output_dir: str | None = None) -> TrainingArguments:
    """The ``TrainingArguments`` for ``config``, the one place our settings map to Trainer's (same names and
    values; checkpoints under ``<output_dir>/checkpoints``; Trainer's evaluation off: ours runs in the callback;
    fp16 asked for on CUDA only, as a CPU runs fp32 on the accelerate side)."""
    fp16 = config.mixed_precision == "fp16" and torch.cuda.is_available()
    return TrainingArguments(
        output_dir=str(ckpt.checkpoints_dir(output_dir or config.output_dir)),
        per_device_train_batch_size=config.per_device_train_batch_size,
        per_device_eval_batch_size=config.per_device_eval_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        fp16=fp16,
        bf16=config.mixed_precision == "bf16",
        # Without a CUDA device Trainer refuses bf16 unless told it is on the CPU (CPU autocast runs bf16).
        use_cpu=not torch.cuda.is_available(),
        learning_rate=config.learning_rate,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_epsilon=config.adam_epsilon,
        optim=config.optim,
        num_train_epochs=config.num_train_epochs,
        max_steps=config.max_steps,
        lr_scheduler_type=config.lr_scheduler_type,
        warmup_steps=config.warmup_steps,
        max_grad_norm=config.max_grad_norm,
        seed=config.seed,
        data_seed=config.seed,
        # Evaluation runs in BookkeepingCallback through the same evaluate() as the accelerate engine, so both
        # engines define eval_loss alike (Trainer's own averages per-batch means: not per-token exact).
        eval_strategy="no",
        save_strategy=config.save_strategy,
        save_steps=config.save_steps if config.save_steps is not None else 500,
        save_total_limit=config.save_total_limit,
        logging_strategy="steps",
        logging_steps=1,
        logging_nan_inf_filter=False,
        report_to=config.report_to,
        dataloader_drop_last=False,
        train_sampling_strategy=config.train_sampling_strategy,
        torch_compile=config.torch_compile,
        torch_compile_mode=config.torch_compile_mode,
        dataloader_num_workers=config.dataloader_num_workers,
        dataloader_pin_memory=config.dataloader_pin_memory,
        include_num_input_tokens_seen="non_padding",  # the same count as the accelerate engine's
        average_tokens_across_devices=True,
        ddp_timeout=config.ddp_timeout,
    )


class FinetuneTrainer(Trainer):
    """``Trainer`` whose loss is the accelerate engine's (``loss.loss_function``), accounted by
    ``BookkeepingCallback.account`` (Trainer also gets its ``compute_loss_func``, so it neither divides by N nor
    skips averaging ``num_items_in_batch`` over devices), and whose window item count is the task's own
    (``get_batch_samples``)."""

    def __init__(self, account, count_tokens, task, steps_per_epoch: int, begin_window, **kwargs):
        super().__init__(**kwargs)
        self.account, self.count_tokens, self.task = account, count_tokens, task
        self.steps_per_epoch, self.begin_window = steps_per_epoch, begin_window
        self.micro_batch_loss = None  # set once the Trainer's accelerator exists
        self.pack = None  # --padding_free: packing.Packer, set once the model is on its device

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The window's micro-batches (up to ``num_batches``, fewer at the end of an epoch) and its items over
        all processes as the accelerate backend counts them (``train.count_window``), a 0-d tensor on ``device``
        (None for an empty window): rows that repeat samples at the epoch's end (``sampling.mask_repeats``) get
        ``IGNORE_INDEX`` labels, and the items are the task's own count (``task.count``: a classifier's samples,
        a causal LM's shifted label tokens).

        Replaces Trainer's count (transformers 5.24 trainer.py, ``get_batch_samples`` lines 2289-2304 calling
        ``_get_num_items_in_batch`` lines 2306-2367): it counts every row, and ``labels[..., 1:]`` only where
        ``self._loss_shifts_labels``, i.e. ``LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss`` (lines
        543-545), and ``loss_type`` comes from a regex over the class name (modeling_utils.py lines 1277-1285),
        which gives None for ``GPT2LMHeadModel``, ``OpenAIGPTLMHeadModel`` and ``CTRLLMHeadModel`` (8 rows of 64
        tokens: 512 items where the loss sums 504). Summed over the processes as Trainer does under
        ``average_tokens_across_devices`` (lines 2347-2350), which ``compute_loss``'s ``loss * num_processes``
        presumes."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        first = (self.state.global_step % self.steps_per_epoch) * self.args.gradient_accumulation_steps
        processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        masked = list(mask_repeats(batches, first, self.args.per_device_train_batch_size, processes, rank,
                                   len(self.train_dataset), IGNORE_INDEX))
        self.begin_window(window_repeats(first, len(masked), self.args.per_device_train_batch_size, processes, rank,
                                         len(self.train_dataset)))
        if not masked:
            return masked, None
        items = sum(self.task.count(b["labels"]) for b in masked).to(device)
        if processes > 1:  # average_tokens_across_devices: every process's items
            items = self.accelerator.reduce(items, "sum")
        # --padding_free: each micro-batch one row, the same count (Trainer syncs by its micro-batch counter)
        return (self.pack(masked) if self.pack else masked), items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The micro-batch's loss: ``micro_batch_loss(model, inputs, labels)`` / the window's items."""
        if return_outputs:  # Trainer's own prediction path (unused here: evaluation is evaluate())
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        loss = self.account(self.micro_batch_loss(model, inputs, labels), labels, num_items_in_batch,
                            packing.samples(inputs, labels))
        self.count_tokens(inputs)
        if num_items_in_batch is not None and torch.is_grad_enabled():
            # num_items_in_batch counts every process's items and DDP averages the gradients over the processes:
            # undo the average, as Trainer.compute_loss does (transformers 5.23 trainer.py, "loss *= loss_scale");
            # without it every gradient was 1/P of the accelerate engine's (found by finetune verify)
            loss = loss * self.accelerator.num_processes
        return loss


class BookkeepingCallback(TrainerCallback):
    """The shared ``Bookkeeping`` on Trainer: the step records (learning rate and grad norm as Trainer logs them),
    evaluation on the shared cadence, the best model mirrored into Trainer's state (its rotation keeps it,
    ``load_best_model_at_end`` loads it), early stopping, fp16 skips held out of its LR schedule."""

    def __init__(self, config, recipe, task, book: Bookkeeping, raw_validation=None):
        self.config, self.recipe, self.task, self.book = config, recipe, task, book
        self.metric_specs, self.raw_validation = recipe.METRICS, raw_validation
        self.trainer = None  # set once the Trainer exists
        self.window_loss, self.window_items, self.window_samples, self.micro_batches = None, 0, 0, 0
        self.window_tokens = None  # this process's (input, padded) tokens of the window: a tensor
        self.pending = None  # the step's counts, written in on_log with Trainer's learning rate and grad norm
        self.scale_before, self.step_skipped = None, False
        self.budget = SaveBudget(config.preemption_grace_seconds, book.say, active=book.writes)
        self.mark = None  # time.perf_counter() at the start of the step in progress, then of the save's

    def compute_loss(self, outputs, labels, num_items_in_batch=None):
        """Trainer's ``compute_loss_func``: the micro-batch's summed loss (the task's: samples or label tokens)
        divided by the window's item count ``num_items_in_batch`` (all processes, counted by the task:
        ``FinetuneTrainer.get_batch_samples``), or by the batch's own items when there is no window."""
        return self.account(self.task.loss_sum(outputs.logits, labels), labels, num_items_in_batch)

    def count_tokens(self, inputs) -> None:
        """Add a training micro-batch's input tokens (attention mask 1) and input positions (with padding)."""
        if "input_ids" not in inputs or not torch.is_grad_enabled():
            return
        device = inputs["input_ids"].device
        counts = torch.tensor(packing.tokens(inputs), device=device)  # a padding-free row has no mask
        self.window_tokens = counts if self.window_tokens is None else self.window_tokens + counts

    def account(self, loss_sum, labels, num_items_in_batch=None, samples: int | None = None):
        """The loss Trainer back-propagates for a micro-batch whose summed loss is ``loss_sum``: divided by the
        window's items ``num_items_in_batch``; the window's loss, items and samples are counted for the log."""
        if num_items_in_batch is None or not torch.is_grad_enabled():  # evaluation (Trainer passes a count there too)
            return loss_sum / self.task.count(labels).clamp(min=1)
        if int(num_items_in_batch) == 0:  # counted over every process: all raise alike
            raise empty_window_error(labels.shape[0])
        self.window_loss = loss_sum.detach() if self.window_loss is None else self.window_loss + loss_sum.detach()
        self.window_items = int(num_items_in_batch)
        # begin_window took off this window's repeated rows; a padding-free row holds ``samples`` samples
        self.window_samples += labels.shape[0] if samples is None else samples
        self.micro_batches += 1
        return loss_sum / num_items_in_batch

    def begin_window(self, repeats: int) -> None:
        """A window begins: its ``repeats`` rows (``sampling.repeated_rows``) are not counted as samples."""
        self.window_samples = -repeats

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.scale_before = loss_scale(self.trainer.accelerator)

    def on_optimizer_step(self, args, state, control, **kwargs):
        # After optimizer.step(), before Trainer steps the LR schedule unless accelerator.optimizer_step_was_skipped.
        # That flag misses fp16 skips of a fused optimizer (see precision.optimizer_step_skipped): set it then,
        # through the flag Accelerate's optimizer wrapper reads, so the schedule holds as in the accelerate loop.
        accelerator = self.trainer.accelerator
        self.step_skipped = optimizer_step_skipped(accelerator, self.scale_before)
        if self.step_skipped and not accelerator.optimizer_step_was_skipped:
            for optimizer in accelerator._optimizers:
                optimizer._is_overflow = True

    def on_step_end(self, args, state, control, **kwargs):
        seconds = time.perf_counter() - self.mark
        self.budget.step(seconds)
        accelerator = self.trainer.accelerator
        loss = (accelerator.reduce(self.window_loss, "sum") / self.window_items).item()
        tokens = self.window_tokens if self.window_tokens is not None else torch.zeros(2, device=accelerator.device)
        samples, input_tokens, padded = (int(v) for v in accelerator.reduce(torch.cat([torch.tensor(
            [self.window_samples], device=accelerator.device), tokens.to(accelerator.device)]), "sum").tolist())
        self.pending = dict(loss=loss, samples=samples, items=self.window_items, micro_batches=self.micro_batches,
                            loss_scale=loss_scale(accelerator), skipped=self.step_skipped, input_tokens=input_tokens,
                            padded_tokens=padded, seconds=seconds)
        self.window_loss, self.window_samples, self.micro_batches, self.step_skipped = None, 0, 0, False
        self.window_tokens = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self.pending is None or "loss" not in logs:
            return
        pending, self.pending = self.pending, None
        self.book.record_step(**pending, learning_rate=logs.get("learning_rate"), grad_norm=logs.get("grad_norm"),
                              trainer_logged_loss=logs["loss"])
        if self.book.evaluate_after_step(state.global_step):
            self.run_evaluation(state, control, at_epoch_end=False)
        self.mark = time.perf_counter()  # Trainer saves after logging (_maybe_log_save_evaluate), then on_save

    def run_evaluation(self, state, control, at_epoch_end: bool) -> None:
        """Evaluate with the shared ``evaluate()`` on Trainer's prepared eval dataloader; record it; mirror the
        best model and early stopping into Trainer's ``state``/``control``."""
        start, trainer, step = time.perf_counter(), self.trainer, state.global_step
        results = evaluate(trainer.accelerator, trainer.model_wrapped, trainer.get_eval_dataloader(), self.task,
                           self.metric_specs, padding_free=trainer.pack is not None)
        generated, predictions = generation_eval(trainer.accelerator, trainer.model_wrapped, trainer.processing_class,
                                                 self.raw_validation, self.recipe, self.config)
        results.update(generated)
        if predictions and self.book.writes:
            write_generations(Path(self.config.output_dir), self.raw_validation, predictions)
        self.book.record_evaluation(results, time.perf_counter() - start, self._checkpointed(step, at_epoch_end))
        progress = self.book.progress
        if progress.best_step == step and self.book.best_eval_results is results:
            state.best_metric, state.best_global_step = progress.best_metric, step
            state.best_model_checkpoint = str(Path(trainer.args.output_dir) / f"checkpoint-{step}")
        if self.book.stopping_early:
            control.should_training_stop = True

    def _checkpointed(self, step: int, at_epoch_end: bool) -> bool:
        """Whether Trainer keeps the model evaluated after ``step``: it checkpoints every ``save_steps`` and at
        the last step (``save_strategy`` steps), or at every epoch's end (DefaultFlowCallback, transformers
        5.23 ``trainer_callback.py``)."""
        strategy = self.config.save_strategy
        if strategy == "steps":
            return step > 0 and (step % self.book.save_steps == 0 or step >= self.trainer.state.max_steps)
        return strategy == "epoch" and at_epoch_end

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.budget.start(model if model is not None else self.trainer.model, self.config.output_dir)
        if self.config.eval_on_start and state.global_step == 0:
            self.run_evaluation(state, control, at_epoch_end=False)
        self.mark = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self.mark = time.perf_counter()

    def on_epoch_end(self, args, state, control, **kwargs):
        last = state.global_step >= state.max_steps or control.should_training_stop
        if self.book.evaluate_at_epoch_end(state.global_step, last):
            self.run_evaluation(state, control, at_epoch_end=True)

    def on_save(self, args, state, control, **kwargs):
        self.budget.saved(time.perf_counter() - self.mark)
        # what a step means, beside Trainer's checkpoint, so a resume with other settings is refused
        if self.book.writes:
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / STEP_MEANING_FILE
            path.write_text(json.dumps(self.book.progress.step_meaning) + "\n")


def _trainer_checkpoints(root: Path) -> list[Path]:
    """Trainer's ``checkpoint-<step>`` folders under ``root``, oldest first (the names ``get_last_checkpoint``
    matches: transformers 5.24 ``trainer_utils.py`` ``_re_checkpoint``)."""
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if p.is_dir() and (m := re.fullmatch(r"checkpoint-(\d+)", p.name))]
    return [p for _, p in sorted(found)]


def _resume_checkpoint(config, meaning: dict) -> str | None:
    """The Trainer checkpoint to resume from, after checking that it means the same step. ``latest``/``auto``:
    the newest ``checkpoint-N`` under ``<output_dir>/checkpoints`` holding ``trainer_state.json``, which Trainer
    writes last (transformers 5.24 ``trainer.py`` ``_save_checkpoint``), so one without it was interrupted and is
    skipped with a warning; ``auto`` with no checkpoint folder at all is a fresh start (None). Raises
    ``FinetuneError`` when there is none to resume (``auto``: when there are checkpoint folders but none complete,
    naming them: a fresh start would delete or write over them), or it means another step."""
    spec = config.resume_from_checkpoint
    if not spec:
        return None
    root = ckpt.checkpoints_dir(config.output_dir)
    path = None
    if spec in ("latest", "auto"):
        folders = _trainer_checkpoints(root)
        for folder in reversed(folders):
            if Path(folder, "trainer_state.json").is_file():
                path = folder
                break
            print(f"warning: skipping incomplete Trainer checkpoint {folder} (no trainer_state.json: its save was "
                  "interrupted)")
        others = [p.name for p in ckpt.list_checkpoints(config.output_dir)]  # the accelerate backend's
        if path is None and spec == "auto" and (folders or others):
            listed = ", ".join([f"{f.name} (no trainer_state.json: its save was interrupted)" for f in folders]
                               + [f"{name} (written by --backend accelerate)" for name in others])
            raise FinetuneError(f"--resume_from_checkpoint auto: no Trainer checkpoint under {root} can be resumed "
                                f"({listed}), and auto does not start over checkpoints it cannot resume. To start "
                                f"afresh, remove them (rm -r {root}); to resume anyway, pass a checkpoint you trust: "
                                "--resume_from_checkpoint PATH.")
        if path is None and spec == "auto":
            print(f"--resume_from_checkpoint auto: no Trainer checkpoint under {root}; starting a fresh run.")
            return None
    else:
        path = Path(spec)
    if path is None or not Path(path, "trainer_state.json").is_file():
        newest = spec in ("latest", "auto")
        raise FinetuneError(f"--resume_from_checkpoint {spec}: no Trainer checkpoint {'under ' + str(root) if newest else 'there'}"
                            ". Pass a checkpoint-N directory, or start without --resume_from_checkpoint.")
    saved = Path(path, STEP_MEANING_FILE)
    if saved.is_file():
        state = ckpt.RunProgress(step_meaning=json.loads(saved.read_text()))
        ckpt.check_compatible(state, meaning, Path(path), config.ignore_checkpoint_mismatch)
    return str(path)


def _progress_from_log(path: Path, step: int, progress: ckpt.RunProgress, config, save_steps: int | None) -> None:
    """On resume: rebuild the counts up to ``step`` from ``log.jsonl`` (already cut back to it). An evaluation
    before ``step`` was kept by a checkpoint at a ``save_steps`` multiple, or at an epoch's end."""
    if not path.is_file():
        return
    for record in map(json.loads, path.read_text().splitlines()):
        if "loss" in record:
            progress.record_step(record["loss"], record.get("skipped", False))
            progress.samples_seen += record["samples"]
            progress.tokens_seen += int(record.get("trained_tokens", record.get("label_tokens", 0)))  # the older name
            progress.input_tokens_seen += int(record.get("input_tokens", 0))
            progress.padded_tokens_seen += int(record.get("padded_tokens", 0))
            if "step_seconds" in record and not record.get("warmup"):
                progress.timed_steps += 1
                progress.timed_seconds += record["step_seconds"]
                progress.timed_samples += record["samples"]
                progress.timed_padded_tokens += int(record.get("padded_tokens", 0))
                progress.timed_input_tokens += int(record.get("input_tokens", 0))
                progress.timed_trained_tokens += int(record.get("trained_tokens", 0))
        elif config.metric_for_best_model is not None:
            progress.step = record["step"]
            kept = progress.step > 0 and (config.save_strategy == "epoch" or
                                          (config.save_strategy == "steps" and progress.step % save_steps == 0))
            progress.record_evaluation(record.get(config.best_metric_key), config.greater_is_better, kept)
    progress.step = step


def train(config, recipe, process_start: float | None = None, hub=None, observe=None) -> dict:
    """Fine-tune ``recipe`` with ``transformers.Trainer``; write the same outputs as the accelerate engine
    (model directory, ``metrics.json``, ``log.jsonl``, ``run_config.json``, model card); return the metrics.
    Units as in ``finetune.train.train``; ``hub`` (a ``finetune.hub.HubPush`` or None) as there.
    ``observe(trainer)``: called once the Trainer is built, before it trains (``finetune.verify`` reads its
    gradients and final weights)."""
    args = training_arguments(config)
    layout = distributed.plan_storage(args.distributed_state, config.output_dir)
    args.save_on_each_node = layout.per_machine  # each machine's local main process keeps its own copy
    precision_hint = "fp16" if args.fp16 else "bf16" if args.bf16 else "no"
    task = get_task(recipe.TASK)
    tokenizer, datasets, _, model, collator, raw_validation = build_components(
        config, recipe, precision_hint, lambda: args.main_process_first(desc="tokenize"))
    check_eval_set(len(datasets["validation"]), config)
    # the per-sequence check on the model as loaded, before anything is written
    pack = packing.packer_for(config, task, model, args.distributed_state.distributed_type)
    processes = args.world_size
    plan = plan_steps(micro_batches_per_process(len(datasets["train"]), config.per_device_train_batch_size, processes),
                      config)
    progress = ckpt.RunProgress(num_processes=processes, step_meaning=ckpt.step_meaning(config, processes))
    resume_from = _resume_checkpoint(config, progress.step_meaning)
    book = Bookkeeping(config, plan, progress, writes=layout.writes,
                       say=print if args.process_index == 0 else lambda text: None,
                       counts_tokens=isinstance(task, CausalLM))
    resume_step = None
    if resume_from is not None:
        resume_step = json.loads(Path(resume_from, "trainer_state.json").read_text())["global_step"]
    book.open(resume_step)  # a resumed run's log is cut back to its step
    if resume_from is not None:
        args.distributed_state.wait_for_everyone()
        _progress_from_log(Path(config.output_dir) / "log.jsonl", resume_step, progress, config,  # on every rank
                           book.save_steps)
    callback = BookkeepingCallback(config, recipe, task, book, raw_validation)
    trainer = FinetuneTrainer(callback.account, callback.count_tokens, task, plan.steps_per_epoch, callback.begin_window,
                              model=model, args=args,
                              train_dataset=datasets["train"], eval_dataset=datasets["validation"],
                              data_collator=collator, processing_class=tokenizer,
                              compute_loss_func=callback.compute_loss,
                              callbacks=[callback] + ([HubCallback(hub)] if hub is not None else []))
    callback.trainer = trainer
    engine = engine_for(trainer.accelerator)
    engine.configure_trainer()  # before Trainer.train prepares the model (FSDP: fp32 reductions)
    trainer.micro_batch_loss = loss_function(task, config, trainer.accelerator)
    trainer.pack = pack
    if observe is not None:
        observe(trainer)
    # Set after construction: TrainingArguments would insist on its own evaluation for it; ours sets
    # state.best_model_checkpoint, from which Trainer loads the best model at the end.
    trainer.args.load_best_model_at_end = config.load_best_model_at_end
    if config.metric_for_best_model is not None and progress.best_step is not None:
        trainer.state.best_model_checkpoint = str(Path(args.output_dir) / f"checkpoint-{progress.best_step}")
    precision = engine.precision()
    if args.process_index == 0:
        print(run_banner(config, processes, plan, precision, trainer.accelerator.device.type, model))
    try:
        start = time.perf_counter()
        trainer.train(resume_from_checkpoint=resume_from)
        progress.train_runtime = time.perf_counter() - start - book.eval_runtime
        metrics = run_metrics(config, progress, book.final_eval_results(), plan=plan, num_processes=processes,
                              precision=precision, device=trainer.accelerator.device, model=model,
                              eval_runtime=book.eval_runtime, process_start=process_start)
        if resume_from is not None:
            metrics["resumed_from"] = resume_from
        write_outputs(engine, trainer.model_wrapped, tokenizer, config, recipe, metrics, writes=layout.writes)
        if hub is not None:
            hub.at_end(config.output_dir)
    finally:
        book.close()
        for callback in trainer.callback_handler.callbacks:  # an error line must start on a line of its own
            if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.close()
    return metrics
