"""Evaluation, shared by both engines so their eval metrics are defined identically."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from accelerate.utils import gather_object
from accelerate.utils.memory import should_reduce_batch_size

from finetune.engine import engine_for
from finetune.errors import FinetuneError
from finetune.sft import generate_completions, prompt_and_reference, score_completions

GENERATIONS_FILE = "generations.jsonl"  # in the output dir: generated completions beside the references


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
    engine = engine_for(accelerator)
    splittable = engine.eval_may_split_batch  # no collective inside the forward
    forward = engine.eval_model(model)
    for batch in dataloader:
        labels = batch.pop("labels")
        outputs = _eval_outputs(forward, batch, labels, task, splittable)
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


def generation_eval(accelerator, model, tokenizer, rows, recipe, config) -> tuple[dict, list[str]]:
    """For recipes with ``GENERATION`` settings (instruction tuning): greedy completions of the raw
    validation ``rows`` (the first ``GENERATION["num_samples"]`` of them, all if unset), scored with the
    recipe's ``METRICS`` (e.g. ROUGE-L and exact match). Every process generates its share (rows r, r + P,
    ...; as many prompts on each, the last repeated, so a sharded model's collectives stay in step, with
    ``synced_gpus`` where the engine shards), then the completions are gathered in row order, so every rank
    scores the same figures and judges the best model alike. Returns ``(metrics, predictions)``; ``({}, [])``
    for other recipes."""
    spec = dict(getattr(recipe, "GENERATION", None) or {})
    if not spec or rows is None:
        return {}, []
    count = spec.pop("num_samples", None)
    if count is not None:
        rows = rows.select(range(min(count, len(rows)))) if hasattr(rows, "select") else rows[:count]
    pairs = [prompt_and_reference(row, f"row {i}") for i, row in enumerate(rows)]
    rank, processes = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(pairs), processes))
    share = math.ceil(len(pairs) / processes)
    padded = mine + [mine[-1] if mine else 0] * (share - len(mine))
    completions = []
    if padded:
        completions = generate_completions(accelerator.unwrap_model(model), tokenizer, [pairs[i][0] for i in padded],
                                           max_length=config.max_length,
                                           synced_gpus=engine_for(accelerator).generation_synced, **spec)
    own = list(zip(mine, completions))
    gathered = gather_object(own) if processes > 1 else own
    predictions = [text for _, text in sorted(gathered)]
    return score_completions(predictions, [reference for _, reference in pairs], recipe.METRICS), predictions


def write_generations(output_dir: Path, rows, predictions: list[str]) -> None:
    """``generations.jsonl``: one line per evaluated validation row, ``{"generated", "reference"}``, from the
    latest evaluation (the model card shows a few)."""
    with open(Path(output_dir) / GENERATIONS_FILE, "w", encoding="utf-8") as f:
        for i, (row, generated) in enumerate(zip(rows, predictions)):
            f.write(json.dumps({"generated": generated, "reference": prompt_and_reference(row, f"row {i}")[1]}) + "\n")
