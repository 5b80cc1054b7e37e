"""Evaluation, shared by both engines so their eval metrics are defined identically."""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType
from accelerate.utils.memory import should_reduce_batch_size

from finetune.errors import FinetuneError

# Sharded engines run collectives inside every forward: a rank that retries a forward alone would put
# them out of step (a hang), so evaluation never splits a batch there.
_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED)


def check_eval_set(num_samples: int, config) -> None:
    """Refuse, before any training, a run that must evaluate on an empty validation set (e.g. a causal-LM
    validation text shorter than one ``--block_size`` block). ``num_samples``: validation samples after
    tokenization. Raises ``FinetuneError`` naming the fixes."""
    if num_samples == 0 and config.eval_strategy != "no":
        raise FinetuneError("the validation set is empty after tokenization"
                            + (f" (no text fills one --block_size {config.block_size} block)" if config.block_size else "")
                            + ". Give more validation data (--validation_file), a smaller --block_size, or "
                              "--eval_strategy no.")


def evaluate(accelerator, model, dataloader, task, metric_specs: dict) -> dict:
    """Evaluate on every process: the task's per-sample outputs are gathered with
    ``gather_for_metrics`` (which drops the samples Accelerate repeats to even out the last batch), then
    scored once.

    ``task``: a ``finetune.tasks`` task; ``metric_specs``: shipped metric name -> compute kwargs.
    Returns e.g. ``{"eval_loss", "eval_accuracy", "eval_f1", "eval_samples"}`` (classification) or
    ``{"eval_loss" (per token), "eval_perplexity", "eval_tokens", "eval_samples"}`` (causal LM); an empty
    set gives ``{"eval_samples": 0}``.
    """
    was_training = model.training
    model.eval()
    parts = []
    splittable = accelerator.distributed_type not in _SHARDED
    for batch in dataloader:
        labels = batch.pop("labels")
        outputs = _eval_outputs(model, batch, labels, task, splittable)
        parts.append([t.cpu() for t in accelerator.gather_for_metrics(outputs)])
    model.train(was_training)
    if not parts:
        return {"eval_samples": 0}
    return task.eval_metrics([torch.cat(columns) for columns in zip(*parts)], metric_specs)


def _eval_outputs(model, batch: dict, labels, task, splittable: bool) -> tuple:
    """The task's per-sample eval outputs for one batch; on out-of-memory (Accelerate's
    ``should_reduce_batch_size``) the batch is split in halves and each half retried, recursively, where
    ``splittable``. Only evaluation shrinks: the training micro-batch, and so the optimisation, never
    changes."""
    try:
        with torch.no_grad():
            return task.eval_outputs(model(**batch).logits, labels)
    except Exception as err:  # noqa: BLE001 - OOM types differ by backend
        size = labels.shape[0]
        if not splittable or not should_reduce_batch_size(err) or size == 1:
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    half = size // 2
    first = _eval_outputs(model, {k: v[:half] for k, v in batch.items()}, labels[:half], task, splittable)
    second = _eval_outputs(model, {k: v[half:] for k, v in batch.items()}, labels[half:], task, splittable)
    return tuple(torch.cat([a, b]) for a, b in zip(first, second))
