"""The Trainer backend: the same recipe, model, data, collator, optimizer and schedule on ``transformers.Trainer``;
only the loop differs. Our loss divides each micro-batch's summed loss by the window's items over all processes
(a plain Trainer with a loss-kwargs model logs and trains N times the mean). Everything around the loop is the run
lifecycle both backends share (``lifecycle.RunState``: records, cadence, evaluation, resume, final outputs), to
which ``BookkeepingCallback`` forwards Trainer's events. What is this backend's own: the ``TrainingArguments``
mapping, the window's item count and loss (``FinetuneTrainer``), the fp16 skip held out of Trainer's schedule, and
sealing Trainer's ``checkpoint-N`` folders into our resume format. See docs/backends.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import ProgressCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_pt_utils import LengthGroupedSampler

from finetune import distributed
from finetune.data import packing
from finetune.engine import check_quantized_base, check_tracker, engine_class, engine_for, local_mlflow_store
from finetune.engine.precision import loss_scale, optimizer_step_skipped
from finetune.errors import FinetuneError
from finetune.lifecycle import checkpoint as ckpt
from finetune.lifecycle.evaluation import check_benchmark_tasks, check_eval_set
from finetune.lifecycle.run_state import RunState
from finetune.lifecycle.window import (
    WindowCounts,
    count_window,
    empty_window_error,
    mask_repeats,
    micro_batches_per_process,
    plan_steps,
    window_repeats,
)
from finetune.models.quantization import base_identity
from finetune.tasks import IGNORE_INDEX, run_task
from finetune.tasks.builders import build_components
from finetune.tasks.loss import loss_function


def training_arguments(config, output_dir: str | None = None) -> TrainingArguments:
    """The ``TrainingArguments`` for ``config``, the one place our settings map to Trainer's (same names and
    values; checkpoints under ``<output_dir>/checkpoints``; Trainer's evaluation off: ours runs in the callback;
    fp16 asked for on CUDA only, as a CPU runs fp32 on the accelerate side)."""
    from finetune.config import trainer_arguments  # (to the imports above when this file's restructuring lands)

    return TrainingArguments(
        **trainer_arguments(config),  # each field's own argument(s), as its ``trainer`` role declares them
        # the arguments no single field gives:
        output_dir=str(ckpt.checkpoints_dir(output_dir or config.output_dir)),
        # fp16 on CUDA only: a CPU runs fp32 on the accelerate side (bf16 comes from mixed_precision's role)
        fp16=config.mixed_precision == "fp16" and torch.cuda.is_available(),
        # Without a CUDA device Trainer refuses bf16 unless told it is on the CPU (CPU autocast runs bf16).
        use_cpu=not torch.cuda.is_available(),
        # Evaluation runs in BookkeepingCallback through the same evaluate() as the accelerate backend, so both
        # backends define eval_loss alike (Trainer's own averages per-batch means: not per-token exact).
        eval_strategy="no",
        # one log record per optimizer step, NaN and inf kept: the callback's log.jsonl is built from them
        logging_strategy="steps",
        logging_steps=1,
        logging_nan_inf_filter=False,
        dataloader_drop_last=False,  # the last partial micro-batch trains, as on the accelerate side
        include_num_input_tokens_seen="non_padding",  # the same count as the accelerate backend's
        average_tokens_across_devices=True,
        # every tokenized column is the collator's (a preference pair's rejected_* columns are no forward argument
        # of the model, so Trainer's signature filter would drop them)
        remove_unused_columns=False,
    )


class FinetuneTrainer(Trainer):
    """``Trainer`` built whole for one run: its loss is the accelerate backend's (``loss.loss_function``) divided
    by the window's items, whose counts are the accelerate backend's (``window.count_window``, in
    ``get_batch_samples``); its events go to the run lifecycle (``BookkeepingCallback``, which accounts the loss)."""

    # training_step back-propagates compute_loss's value as it is (ours is divided by the window's items already),
    # not divided again by the accumulation steps: transformers >= 5.19 reads this flag (trainer.py
    # ``loss_is_scaled_for_ga``); earlier versions read ``model_accepts_loss_kwargs``, set in ``__init__``
    loss_is_scaled_for_ga = True

    def __init__(self, config, run: RunState, pack=None, hub=None, **kwargs):
        """``Trainer(**kwargs)`` (model, args, datasets, collator, tokenizer) for ``config``, wired to ``run`` (a
        ``lifecycle.RunState``): its events forwarded there (``BookkeepingCallback``), each checkpoint pushed to
        ``hub`` (a ``hub.HubPush``, or None: ``HubCallback``), ``pack`` (``packing.Packer``, exact, under
        --padding_free/--packing; else None) run on each window, the engine configured before ``Trainer.train``
        prepares the model, and ``run.precision`` the precision Trainer's Accelerator runs."""
        self.task, self.pack, self.steps_per_epoch = run.task, pack, run.plan.steps_per_epoch
        self.bookkeeping = BookkeepingCallback(run, self)
        super().__init__(callbacks=[self.bookkeeping] + ([HubCallback(hub)] if hub is not None else []), **kwargs)
        # compute_loss takes num_items_in_batch: what training_step reads before transformers 5.19 (see above)
        self.model_accepts_loss_kwargs = True
        self.engine = engine_for(self.accelerator)
        self.engine.configure_trainer()  # before Trainer.train prepares the model (FSDP: fp32 reductions)
        self.micro_batch_loss = loss_function(self.task, config, self.accelerator)  # (model, batch) -> summed loss
        # After Trainer's checks: TrainingArguments would insist on its own evaluation for it; ours sets
        # state.best_model_checkpoint, from which Trainer loads the best model at the end.
        self.args.load_best_model_at_end = config.load_best_model_at_end
        # Pruning is the lifecycle's, after a checkpoint is sealed (Trainer's rotation runs before: it could leave
        # no complete checkpoint behind a kill).
        self.args.save_total_limit = None
        run.precision = self.engine.precision()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The window's micro-batches (up to ``num_batches``, fewer at the end of an epoch) and its items over
        all processes as the accelerate backend counts them (``window.count_window``, which also counts its
        samples and tokens, handed to ``BookkeepingCallback.begin_window``), a 0-d tensor on ``device`` (None for
        an empty window): rows that repeat samples at the epoch's end (``window.mask_repeats``) get
        ``IGNORE_INDEX`` labels, and the items are the task's own count (``task.count``: a classifier's samples, a
        causal LM's shifted label tokens).

        Replaces Trainer's count (transformers 5.24 trainer.py, ``get_batch_samples`` lines 2289-2304 calling
        ``_get_num_items_in_batch`` lines 2306-2367): it counts every row, and ``labels[..., 1:]`` only where
        ``self._loss_shifts_labels``, i.e. ``LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss`` (lines
        543-545), and ``loss_type`` comes from a regex over the class name (modeling_utils.py lines 1277-1285),
        which gives None for ``GPT2LMHeadModel``, ``OpenAIGPTLMHeadModel`` and ``CTRLLMHeadModel`` (8 rows of 64
        tokens: 512 items where the loss sums 504). Summed over the processes as Trainer does under
        ``average_tokens_across_devices`` (lines 2347-2350), which ``compute_loss``'s ``loss * num_processes``
        presumes. Raises ``FinetuneError`` (on every process alike) for a window with no item."""
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
        if not masked:
            return masked, None
        repeats = window_repeats(first, len(masked), self.args.per_device_train_batch_size, processes, rank,
                                 len(self.train_dataset))
        # --padding_free/--packing: the window's own samples, in as many micro-batches as it has (Trainer finds the
        # optimizer step by counting micro-batches: trainer.py lines 1895-1899)
        run = self.pack(masked) if self.pack else masked
        counts = count_window(masked, self.task, self.accelerator, repeats, run)
        self.bookkeeping.begin_window(counts)
        return run, torch.tensor(int(counts.items), device=device)

    def log(self, logs: dict, start_time=None) -> None:
        """Trainer's ``log`` (what its trackers, TensorBoard included, and callbacks receive), with the task's own
        metrics of the step just taken (a preference task's ``rewards/*``, ``logs/*``:
        ``BookkeepingCallback.step_metrics``) added to its training record."""
        if "loss" in logs:
            logs = {**logs, **self.bookkeeping.step_metrics()}
        super().log(logs, start_time)

    def _get_train_sampler(self, train_dataset=None):
        """Trainer's sampler (transformers 5.24 trainer.py ``_get_train_sampler``, lines 1071-1105), with
        ``group_by_length`` given the task's own lengths (``task.item_lengths``): Trainer infers them from an
        ``input_ids`` column, which a preference pair's rows do not have (``chosen_input_ids``/``rejected_*``)."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.train_sampling_strategy == "group_by_length" and hasattr(dataset, "column_names"):
            return LengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps,
                                        dataset=dataset, lengths=self.task.item_lengths(dataset))
        return super()._get_train_sampler(train_dataset)

    def _get_output_dir(self, trial) -> str:
        """Where ``_save_checkpoint`` writes ``checkpoint-<step>`` (transformers 5.24 trainer.py line 3375; the only
        other caller, line 2028, rotates under ``save_total_limit`` == 1, which the backend turns off): the
        staging folder (``checkpoint.trainer_staging``), since Trainer writes straight into that folder; the
        lifecycle seals the checkpoint there and renames it into ``args.output_dir`` (``on_save``)."""
        return str(ckpt.trainer_staging(Path(self.args.output_dir).parent))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The micro-batch's loss in ``training_step``: ``micro_batch_loss(model, inputs)`` / the window's items
        (``BookkeepingCallback.account``) x the processes."""
        if return_outputs:  # Trainer's own prediction path (unused here: evaluation is evaluate())
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = self.bookkeeping.account(self.micro_batch_loss(model, dict(inputs)), dict(inputs), num_items_in_batch)
        # num_items_in_batch counts every process's items and DDP averages the gradients over the processes: undo
        # the average, as Trainer.compute_loss does (transformers 5.23 trainer.py, "loss *= loss_scale"); without it
        # every gradient was 1/P of the accelerate backend's (found by finetune verify)
        return loss * self.accelerator.num_processes


class BookkeepingCallback(TrainerCallback):
    """Trainer's events forwarded to the run lifecycle (``lifecycle.RunState``): each step's record (learning rate
    and grad norm as Trainer logs them), evaluation on the shared cadence with the best model mirrored into
    Trainer's state (``load_best_model_at_end`` loads it) and early stopping into its control, each checkpoint
    sealed into the resume format both backends share; fp16 skips held out of Trainer's LR schedule."""

    def __init__(self, run: RunState, trainer: FinetuneTrainer):
        self.run, self.task, self.trainer = run, run.task, trainer
        self.window: WindowCounts | None = None  # the window in progress (FinetuneTrainer.get_batch_samples)
        self.window_loss, self.micro_batches = None, 0
        self.pending = None  # the step's counts, written in on_log with Trainer's learning rate and grad norm
        self.scale_before, self.step_skipped = None, False

    def account(self, loss_sum, batch: dict, num_items_in_batch):
        """The loss of the micro-batch ``batch`` whose summed loss is ``loss_sum``, divided by the window's items
        ``num_items_in_batch`` (all processes: ``FinetuneTrainer.get_batch_samples``); the window's loss is summed
        for the log. Raises ``FinetuneError`` for a window with no item."""
        if int(num_items_in_batch) == 0:  # counted over every process: all raise alike
            raise empty_window_error(self.task.samples(batch))
        self.window_loss = loss_sum.detach() if self.window_loss is None else self.window_loss + loss_sum.detach()
        self.micro_batches += 1
        return loss_sum / num_items_in_batch

    def step_metrics(self) -> dict:
        """The task's own metrics of the step just taken (``task.step_metrics``: reduced in ``on_step_end``), {}
        once logged or for a task without any."""
        return {k: self.pending[k] for k in self.task.step_metrics if self.pending and k in self.pending}

    def begin_window(self, counts: WindowCounts) -> None:
        """A window begins: its counts over all processes (``window.count_window``)."""
        self.window = counts

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.run.layout.writes:  # what killed saves left (a staged checkpoint is never resumed)
            ckpt.clear_leftovers(self.run.output_dir)
        self.trainer.accelerator.wait_for_everyone()
        self._point_at_best(state)  # a resumed TrainerState names the folder it was saved in: the staging one
        self.run.begin_training(model if model is not None else self.trainer.model)
        if self.run.config.eval_on_start and state.global_step == 0:
            self.evaluate(state, control, at_epoch_end=False)
        self.run.mark()

    def on_step_begin(self, args, state, control, **kwargs):
        self.run.mark()

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
        seconds = self.run.step_seconds()
        accelerator, counts = self.trainer.accelerator, self.window
        loss = (accelerator.reduce(self.window_loss, "sum") / counts.items).item()
        self.pending = dict(loss=loss, samples=counts.samples, items=counts.items, micro_batches=self.micro_batches,
                            loss_scale=loss_scale(accelerator), skipped=self.step_skipped,
                            input_tokens=counts.input_tokens, padded_tokens=counts.padded_tokens, seconds=seconds,
                            **self.run.window_metrics(accelerator, self.task.take_metric_sums(), counts.items))
        self.window_loss, self.micro_batches, self.step_skipped = None, 0, False

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self.pending is None or "loss" not in logs:
            return
        pending, self.pending = self.pending, None
        self.run.record_step(**pending, learning_rate=logs.get("learning_rate"), grad_norm=logs.get("grad_norm"),
                             trainer_logged_loss=logs["loss"])
        if self.run.evaluate_after_step(state.global_step):
            self.evaluate(state, control, at_epoch_end=False)
        self.run.mark()  # Trainer saves after logging (_maybe_log_save_evaluate), then on_save

    def on_epoch_end(self, args, state, control, **kwargs):
        last = state.global_step >= state.max_steps or control.should_training_stop
        if self.run.evaluate_at_epoch_end(state.global_step, last):
            self.evaluate(state, control, at_epoch_end=True)

    def on_save(self, args, state, control, **kwargs):
        # Trainer wrote checkpoint-<step> into the staging folder (_get_output_dir); seal it and move it into place,
        # then the hub's callback (after this one) may push it
        staged = ckpt.trainer_staging(self.run.output_dir) / f"checkpoint-{state.global_step}"
        path = self.run.commit_trainer_checkpoint(staged, self.run.layout.writes,
                                                  self.trainer.accelerator.wait_for_everyone)
        self._point_at_best(state)
        self.run.saved(path, self.run.since_mark(), push=False)  # HubCallback pushes it

    def _point_at_best(self, state) -> None:
        """``state.best_model_checkpoint`` (what ``load_best_model_at_end`` loads) from the run's best step, where
        that model is a checkpoint (the final model, if best, is the one in memory)."""
        best = self.run.progress.best_step
        if best is not None and best < self.run.plan.max_steps:
            state.best_model_checkpoint = str(ckpt.checkpoint_path(self.run.output_dir, best, "trainer"))
        elif best is not None:
            state.best_model_checkpoint = None

    def evaluate(self, state, control, at_epoch_end: bool) -> None:
        """Evaluate on Trainer's prepared eval dataloader (``lifecycle.RunState.evaluate``); mirror the best model
        and early stopping into Trainer's ``state``/``control``."""
        trainer, run, step = self.trainer, self.run, state.global_step
        run.evaluate(trainer.accelerator, trainer.model_wrapped, trainer.get_eval_dataloader(),
                     trainer.processing_class, at_epoch_end, pack=trainer.pack)
        if run.new_best:
            state.best_metric, state.best_global_step = run.progress.best_metric, step
            self._point_at_best(state)
        if run.stopping_early:
            control.should_training_stop = True


class HubCallback(TrainerCallback):
    """The Trainer backend's call of ``hub.HubPush.after_save`` (here, not in ``hub.py``: ``TrainerCallback``
    imports peft, which the accelerate backend does not need): ``on_save`` comes once Trainer's checkpoint
    ``<args.output_dir>/checkpoint-<global_step>`` is written (transformers 5.24 ``trainer.py``
    ``_maybe_log_save_evaluate``, lines 2285-2286: ``_save_checkpoint``, then ``callback_handler.on_save``)."""

    def __init__(self, push):
        self.push = push

    def on_save(self, args, state, control, **kwargs):
        self.push.after_save(Path(args.output_dir) / f"checkpoint-{state.global_step}", state.global_step)


def train(config, recipe, process_start: float | None = None, hub=None, observe=None) -> dict:
    """Fine-tune ``recipe`` with ``transformers.Trainer``; write the same outputs as the accelerate backend
    (model directory, ``metrics.json``, ``log.jsonl``, ``run_config.json``, model card); return the metrics.
    Units as in ``finetune.backends.accelerate.train``; ``hub`` (a ``finetune.outputs.hub.HubPush`` or None) as
    there. Resumes from the checkpoints it writes (``checkpoint-<step>`` sealed by
    ``lifecycle.RunState.commit_trainer_checkpoint``), agreed on by every process (``lifecycle.RunState.resume``).
    ``observe(trainer)``: called once the ``FinetuneTrainer`` is built, before it trains (``finetune.commands.verify``
    reads its gradients and final weights). Raises ``FinetuneError`` as the accelerate
    backend does, and for ``--report_to aim`` (transformers 5.24 has no Aim callback)."""
    check_tracker(config.report_to)
    if config.report_to == "aim":
        raise FinetuneError("--report_to aim: transformers' Trainer has no Aim callback; use --backend accelerate "
                            "(Accelerate's AimTracker) or another tracker.")
    local_mlflow_store(config)
    args = training_arguments(config)
    state = args.distributed_state
    layout = distributed.plan_storage(state, config.output_dir)
    args.save_on_each_node = layout.per_machine  # each machine's local main process keeps its own copy
    precision_hint = "fp16" if args.fp16 else "bf16" if args.bf16 else "no"
    engine_kind = engine_class(args.distributed_state.distributed_type)  # its facts; Trainer builds the Accelerator
    check_quantized_base(config, engine_kind)
    task = run_task(recipe, config)
    check_benchmark_tasks(config, task)
    tokenizer, datasets, _, model, collator, raw_validation = build_components(
        config, recipe, precision_hint, lambda: args.main_process_first(desc="tokenize"), task, args.device)
    check_eval_set(len(datasets["validation"]), config)
    # the per-sequence check on the model as loaded, before anything is written, on the device Trainer puts it on
    # (transformers 5.24 trainer.py lines 495-504; under FSDP and DeepSpeed it stays where it was loaded)
    if (config.padding_free or config.packing) and not engine_kind.shards_weights:
        model = model.to(args.device)
    pack = packing.packer_for(config, task, model, engine_kind, exact=True,
                              precision=precision_hint, loss_sum=task.loss_sum)
    processes = args.world_size
    plan = plan_steps(micro_batches_per_process(len(datasets["train"]), config.per_device_train_batch_size, processes),
                      config)
    run = RunState(config, recipe, backend="trainer", plan=plan, num_processes=processes, task=task, layout=layout,
                   precision=precision_hint, say=print if state.is_main_process else lambda text: None,
                   main=state.is_main_process, raw_validation=raw_validation, hub=hub, process_start=process_start,
                   train_dataset=datasets["train"], base=base_identity(model))
    resume_from = run.resume(state)  # Trainer loads the model, optimizer, schedule and RNG in Trainer.train
    run.open()  # a resumed run's log is cut back to its step
    if pack is not None and state.is_main_process:
        pack.keep(config.output_dir)  # the layout cost, for a resume to choose alike
    state.wait_for_everyone()
    trainer = FinetuneTrainer(config, run, pack, hub, model=model, args=args, train_dataset=datasets["train"],
                              eval_dataset=datasets["validation"], data_collator=collator, processing_class=tokenizer)
    if observe is not None:
        observe(trainer)
    try:
        run.announce(model, trainer.accelerator.device.type, pack.note if pack else None, run.task.note())
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
        return run.finish(trainer.engine, model, tokenizer, trainer.accelerator.device, written=trainer.model_wrapped)
    finally:
        run.close()
        for cb in trainer.callback_handler.callbacks:  # an error line must start on a line of its own
            if isinstance(cb, ProgressCallback) and cb.training_bar is not None:
                cb.training_bar.close()
