"""The Trainer engine: the same recipe, model, data, collator, optimizer settings and schedule, run by
``transformers.Trainer`` so it can be compared with our ``accelerator.accumulate()`` loop.

Only the loop differs. What we add to a plain Trainer:

- ``compute_loss_func`` returns the micro-batch's summed cross-entropy divided by ``num_items_in_batch``
  (the samples of the whole accumulation window, across processes). A plain Trainer with a model that
  accepts loss kwargs (BERT in transformers 5) neither normalises by the window nor divides by the
  accumulation steps, so its gradients and its logged loss are N times the mean (6.43 instead of 1.61 at
  N = 4 on bbc-news).
- ``TrueLossCallback`` (which also provides that loss function) writes our ``log.jsonl``: the mean loss per sample of each optimizer step, the
  learning rate used and the pre-clip grad norm that Trainer reports.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from transformers import Trainer, TrainerCallback

from finetune.train import effective_mixed_precision, evaluate, run_banner, run_metrics


def training_arguments(config, output_dir: str | None = None):
    """The ``TrainingArguments`` for ``config``: the one place our settings map to Trainer's.

    Every shared hyperparameter keeps its name and value (tested in ``tests/test_trainer_backend.py``).
    Checkpointing and external reporting are off (``metrics.json``/``log.jsonl`` are ours); logging is
    every optimizer step. fp16 is asked for only where it can run (a CUDA device), as on the accelerate
    side, where a CPU silently runs fp32.
    """
    from transformers import TrainingArguments

    fp16 = config.mixed_precision == "fp16" and torch.cuda.is_available()
    return TrainingArguments(
        output_dir=output_dir or config.output_dir,
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
        # Evaluation runs in TrueLossCallback through the same evaluate() as the accelerate engine, so both
        # engines define eval_loss alike (Trainer's own averages per-batch means: not per-token exact).
        eval_strategy="no",
        save_strategy="no",
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
    )


class TrueLossCallback(TrainerCallback):
    """Writes ``log.jsonl`` like the accelerate engine: one record per optimizer step with the mean loss
    per item over the window (summed over processes), the learning rate used in the step and the
    pre-clip grad norm (both as Trainer reports them), and Trainer's own logged loss for reference.
    Evaluates at each epoch end (``eval_strategy="epoch"``) and at the end with the shared ``evaluate()``,
    timing it so ``train_runtime`` excludes it, as in the other engine."""

    def __init__(self, config, task, metric_specs: dict, log_path: Path | None, steps_per_epoch: int):
        self.config, self.task, self.metric_specs = config, task, metric_specs
        self.log_file = open(log_path, "w", encoding="utf-8") if log_path else None
        self.steps_per_epoch = steps_per_epoch
        self.trainer = None  # set once the Trainer exists
        self.window_loss, self.window_items, self.window_samples, self.micro_batches = None, 0, 0, 0
        self.losses, self.skipped_steps, self.samples, self.tokens = [], 0, 0, 0
        self.eval_results, self.eval_runtime = {}, 0.0
        self.pending = None

    def compute_loss(self, outputs, labels, num_items_in_batch=None):
        """Trainer's ``compute_loss_func``: the micro-batch's summed loss (fp32; the task's: samples or
        label tokens) divided by the window's item count ``num_items_in_batch`` (all processes; Trainer
        counts it the same way), or by the batch's own items when there is no window."""
        loss_sum = self.task.loss_sum(outputs.logits, labels)
        if num_items_in_batch is None or not torch.is_grad_enabled():  # evaluation (Trainer passes a count there too)
            return loss_sum / self.task.count(labels).clamp(min=1)
        self.window_loss = loss_sum.detach() if self.window_loss is None else self.window_loss + loss_sum.detach()
        self.window_items = int(num_items_in_batch)
        self.window_samples += labels.shape[0]
        self.micro_batches += 1
        return loss_sum / num_items_in_batch

    def _write(self, record):
        if self.log_file:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()

    def on_step_end(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator
        loss = (accelerator.reduce(self.window_loss, "sum") / self.window_items).item()
        samples = int(accelerator.reduce(torch.tensor(self.window_samples, device=accelerator.device), "sum").item())
        skipped = accelerator.optimizer_step_was_skipped
        self.skipped_steps += int(skipped)
        self.samples += samples
        self.losses.append(loss)
        self.pending = {"step": state.global_step, "epoch": round(state.global_step / self.steps_per_epoch, 4),
                        "loss": loss, "samples": samples, "micro_batches": self.micro_batches}
        if self.task.name == "causal-lm":
            self.pending["label_tokens"] = self.window_items
            self.tokens += self.window_items
        if skipped:
            self.pending["skipped"] = True
        self.window_loss, self.window_samples, self.micro_batches = None, 0, 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self.pending is not None and "loss" in logs:
            record, self.pending = self.pending, None
            grad_norm = logs.get("grad_norm")
            record.update(learning_rate=logs.get("learning_rate"),
                          grad_norm=float(grad_norm) if grad_norm is not None else None,
                          trainer_logged_loss=logs["loss"])
            self._write(record)

    def run_evaluation(self, step: int):
        """Evaluate with the shared ``evaluate()`` on Trainer's prepared eval dataloader; log the result."""
        start = time.perf_counter()
        trainer = self.trainer
        self.eval_results = evaluate(trainer.accelerator, trainer.model_wrapped, trainer.get_eval_dataloader(),
                                     self.task, self.metric_specs)
        self.eval_runtime += time.perf_counter() - start
        self._write({"step": step, "epoch": round(step / self.steps_per_epoch, 4), **self.eval_results})
        if trainer.args.process_index == 0:
            print(f"eval at step {step}: " + ", ".join(
                f"{k}={v:.4f}" for k, v in self.eval_results.items() if isinstance(v, float)))

    def on_train_begin(self, args, state, control, **kwargs):
        if self.config.eval_on_start:
            self.run_evaluation(0)

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.config.eval_strategy == "epoch" or state.global_step >= state.max_steps:
            self.run_evaluation(state.global_step)

    def close(self):
        """Close ``log.jsonl``."""
        if self.log_file:
            self.log_file.close()


def train(config, recipe, process_start: float | None = None) -> dict:
    """Fine-tune ``recipe`` with ``transformers.Trainer``; write the same outputs as the accelerate
    engine (model directory, ``metrics.json``, ``log.jsonl``, ``run_config.json``); return the metrics.
    Units as in ``finetune.train.train``."""
    from finetune.data import build_components
    from finetune.errors import FinetuneError
    from finetune.tasks import get_task

    if config.checkpointing_steps or config.resume_from_checkpoint:
        raise FinetuneError("--checkpointing_steps and --resume_from_checkpoint belong to the accelerate backend "
                            "(exact mid-epoch resume); drop them or use --backend accelerate.")
    output_dir = Path(config.output_dir)
    args = training_arguments(config)
    if args.process_index == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "run_config.json").write_text(config.to_json() + "\n")
    precision_hint = "fp16" if args.fp16 else "bf16" if args.bf16 else "no"
    tokenizer, datasets, _, model, collator = build_components(
        config, recipe, precision_hint, lambda: args.main_process_first(desc="tokenize"))

    processes = args.world_size
    micro_batches = math.ceil(math.ceil(len(datasets["train"]) / config.per_device_train_batch_size) / processes)
    steps_per_epoch = math.ceil(micro_batches / config.gradient_accumulation_steps)
    max_steps = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * steps_per_epoch)
    task = get_task(recipe.TASK)
    callback = TrueLossCallback(config, task, recipe.METRICS, output_dir / "log.jsonl" if args.process_index == 0 else None,
                                steps_per_epoch)
    trainer = Trainer(model=model, args=args, train_dataset=datasets["train"], eval_dataset=datasets["validation"],
                      data_collator=collator, processing_class=tokenizer, compute_loss_func=callback.compute_loss,
                      callbacks=[callback])
    callback.trainer = trainer
    precision = effective_mixed_precision(trainer.accelerator)
    if args.process_index == 0:
        print(run_banner(config, processes, micro_batches, steps_per_epoch, max_steps,
                         math.ceil(max_steps / steps_per_epoch), precision, trainer.accelerator.device.type))
    try:
        start = time.perf_counter()
        trainer.train()
        train_runtime = time.perf_counter() - start - callback.eval_runtime
        trainer.save_model(str(output_dir))
        metrics = run_metrics(
            config, callback.eval_results, step_losses=callback.losses, skipped_steps=callback.skipped_steps,
            steps_per_epoch=steps_per_epoch, train_samples=callback.samples, train_tokens=callback.tokens,
            train_input_tokens=int(trainer.state.num_input_tokens_seen),
            num_parameters=sum(p.numel() for p in model.parameters()),
            num_processes=processes,
            precision=precision, device=trainer.accelerator.device, train_runtime=train_runtime,
            eval_runtime=callback.eval_runtime, process_start=process_start)
        if args.process_index == 0:
            (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
            from finetune.model_card import config_argv, reproduce_command, write_model_card

            write_model_card(output_dir, config, metrics, recipe, reproduce_command(
                config_argv(config, recipe), num_processes=metrics["num_processes"], device=metrics.get("device")))
    finally:
        callback.close()
    return metrics
