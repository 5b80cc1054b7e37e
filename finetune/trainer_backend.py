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
import torch.nn.functional as F

from transformers import Trainer, TrainerCallback

from finetune.train import effective_mixed_precision, run_banner, run_metrics


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
        eval_strategy="epoch" if config.eval_strategy == "epoch" else "no",
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=1,
        logging_nan_inf_filter=False,
        report_to="none",
        dataloader_drop_last=False,
        average_tokens_across_devices=True,
    )


class TrueLossCallback(TrainerCallback):
    """Writes ``log.jsonl`` like the accelerate engine: one record per optimizer step with the mean loss
    per sample over the window (summed over processes), the learning rate used in the step and the
    pre-clip grad norm (both as Trainer reports them), Trainer's own logged loss for reference, and each
    evaluation. Times evaluation so ``train_runtime`` excludes it, as in the other engine."""

    def __init__(self, log_path: Path | None, steps_per_epoch: int):
        self.log_file = open(log_path, "w", encoding="utf-8") if log_path else None
        self.steps_per_epoch = steps_per_epoch
        self.accelerator = None  # set once the Trainer exists
        self.window_loss, self.window_count, self.micro_batches = None, 0, 0
        self.losses, self.skipped_steps, self.samples = [], 0, 0
        self.eval_results, self.eval_runtime = {}, 0.0
        self.pending = None

    def compute_loss(self, outputs, labels, num_items_in_batch=None):
        """Trainer's ``compute_loss_func``: the micro-batch's summed cross-entropy (fp32) divided by the
        window's sample count ``num_items_in_batch`` (all processes; Trainer passes it), or by the batch
        size in evaluation. ``outputs.logits``: (batch, num_labels); ``labels``: (batch,)."""
        loss_sum = F.cross_entropy(outputs.logits.float(), labels, reduction="sum")
        if num_items_in_batch is None or not torch.is_grad_enabled():  # evaluation (Trainer passes a count there too)
            return loss_sum / labels.shape[0]
        self.window_loss = loss_sum.detach() if self.window_loss is None else self.window_loss + loss_sum.detach()
        self.window_count = int(num_items_in_batch)
        self.micro_batches += 1
        return loss_sum / num_items_in_batch

    def _write(self, record):
        if self.log_file:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()

    def on_step_end(self, args, state, control, **kwargs):
        loss = (self.accelerator.reduce(self.window_loss, "sum") / self.window_count).item()
        skipped = self.accelerator.optimizer_step_was_skipped
        self.skipped_steps += int(skipped)
        self.samples += self.window_count
        self.losses.append(loss)
        self.pending = {"step": state.global_step, "epoch": round(state.global_step / self.steps_per_epoch, 4),
                        "loss": loss, "samples": self.window_count, "micro_batches": self.micro_batches}
        if skipped:
            self.pending["skipped"] = True
        self.window_loss, self.micro_batches = None, 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self.pending is not None and "loss" in logs:
            record, self.pending = self.pending, None
            grad_norm = logs.get("grad_norm")
            record.update(learning_rate=logs.get("learning_rate"),
                          grad_norm=float(grad_norm) if grad_norm is not None else None,
                          trainer_logged_loss=logs["loss"])
            self._write(record)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics = dict(metrics or {})
        self.eval_runtime += metrics.pop("eval_runtime", 0.0)
        for key in ("eval_samples_per_second", "eval_steps_per_second", "epoch"):
            metrics.pop(key, None)
        self.eval_results = metrics
        self._write({"step": state.global_step, "epoch": round(state.global_step / self.steps_per_epoch, 4),
                     **metrics})

    def close(self):
        """Close ``log.jsonl``."""
        if self.log_file:
            self.log_file.close()


def compute_metrics_fn(metric_specs: dict):
    """A Trainer ``compute_metrics`` using our shipped evaluate modules: ``EvalPrediction`` with logits
    (n, num_labels) and labels (n,) -> ``{"accuracy": ..., "f1": ...}`` (Trainer adds the ``eval_`` prefix)."""
    from finetune.metrics import load_metric

    def compute(prediction):
        logits, labels = prediction.predictions, prediction.label_ids
        predictions = logits.argmax(axis=-1)
        results = {}
        for name, kwargs in metric_specs.items():
            results.update(load_metric(name).compute(predictions=predictions, references=labels, **kwargs))
        return results

    return compute


def train(config, recipe, process_start: float | None = None) -> dict:
    """Fine-tune ``recipe`` with ``transformers.Trainer``; write the same outputs as the accelerate
    engine (model directory, ``metrics.json``, ``log.jsonl``, ``run_config.json``); return the metrics.
    Units as in ``finetune.train.train``."""
    from finetune.data import build_components

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
    callback = TrueLossCallback(output_dir / "log.jsonl" if args.process_index == 0 else None, steps_per_epoch)
    trainer = Trainer(model=model, args=args, train_dataset=datasets["train"], eval_dataset=datasets["validation"],
                      data_collator=collator, processing_class=tokenizer, compute_loss_func=callback.compute_loss,
                      compute_metrics=compute_metrics_fn(recipe.METRICS), callbacks=[callback])
    callback.accelerator = trainer.accelerator
    precision = effective_mixed_precision(trainer.accelerator)
    if args.process_index == 0:
        print(run_banner(config, processes, micro_batches, steps_per_epoch, max_steps,
                         math.ceil(max_steps / steps_per_epoch), precision, trainer.accelerator.device.type))
    try:
        start = time.perf_counter()
        trainer.train()
        train_runtime = time.perf_counter() - start - callback.eval_runtime
        if not callback.eval_results:  # eval_strategy "no": evaluate once at the end, like the other engine
            trainer.evaluate()
        trainer.save_model(str(output_dir))
        eval_results = {**callback.eval_results, "eval_samples": len(datasets["validation"])}
        metrics = run_metrics(
            config, eval_results, step_losses=callback.losses, skipped_steps=callback.skipped_steps,
            steps_per_epoch=steps_per_epoch, train_samples=callback.samples, num_processes=processes,
            precision=precision, device=trainer.accelerator.device, train_runtime=train_runtime,
            eval_runtime=callback.eval_runtime, process_start=process_start)
        if args.process_index == 0:
            (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    finally:
        callback.close()
    return metrics
