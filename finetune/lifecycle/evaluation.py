"""Evaluation, shared by both backends so their metrics are defined identically (docs/backends.md#evaluation)."""

from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from pathlib import Path

import torch
from accelerate.utils import gather_object
from accelerate.utils.memory import should_reduce_batch_size

from finetune.data import packing
from finetune.data.chat import generate_completions, score_completions
from finetune.engine import engine_for
from finetune.errors import FinetuneError
from finetune.tasks import split_labels

BENCHMARKS_RUNTIME = "eval_benchmarks_runtime"  # seconds the --eval_tasks benchmarks of one evaluation took
# How long the other processes wait for the main process's --eval_tasks benchmarks: lm-eval's own bound for its
# distributed runs (lm_eval/models/huggingface.py: InitProcessGroupKwargs(timeout=timedelta(weeks=52))), not
# --ddp_timeout, which bounds the training's collectives (a benchmark of hundreds of generations takes minutes)
BENCHMARK_WAIT = timedelta(weeks=52)
GENERATIONS_FILE = "generations.jsonl"  # in the output dir: generated completions beside the references


def check_eval_set(num_samples: int, config) -> None:
    """Raise ``FinetuneError`` naming the fixes, before training, if the run must evaluate on 0 validation
    samples (``num_samples``, after tokenization; e.g. a text shorter than one ``--block_size`` block)."""
    if num_samples == 0 and config.eval_strategy != "no":
        raise FinetuneError("the validation set is empty after tokenization"
                            + (f" (no text fills one --block_size {config.block_size} block)" if config.block_size else "")
                            + ". Give more validation data (--validation_file), a smaller --block_size, or "
                              "--eval_strategy no.")


def check_benchmark_tasks(config, task) -> None:
    """Raise ``FinetuneError`` before anything is built where ``--eval_tasks`` cannot run: a task lm-eval does not
    know (the shipped ones and lm-eval's own; ``benchmarks.task_manager``), or a model that is not a causal LM."""
    if not config.eval_tasks:
        return
    if task.pipeline_tag != "text-generation":
        raise FinetuneError(f"--eval_tasks scores causal language models; this run trains a {task.pipeline_tag} "
                            "model. Drop --eval_tasks (the recipe's own metrics are evaluated).")
    from finetune.config.cadence import task_names
    from finetune.outputs.lm_eval import task_manager

    try:
        task_manager(task_names(config.eval_tasks))
    except FinetuneError as err:
        raise FinetuneError(f"--eval_tasks: {err}") from None


def evaluate(accelerator, model, dataloader, task, metric_specs: dict, pack=None) -> dict:
    """Evaluate on every process, gather per-sample outputs (``gather_for_metrics``, which drops Accelerate's
    padding repeats) and score once with ``task.eval_metrics``: e.g. ``eval_loss`` (per sample, or per token for
    causal LM), the metrics, ``eval_samples``; ``{"eval_samples": 0}`` for an empty set. ``pack``: the run's
    ``packing.Packer``, if any: each batch then runs padding-free, as one row (``--padding_free``, or a packer that
    runs one row per micro-batch) or in rows of its ``row_length`` (``--packing``), with the same per-sample
    outputs (``packing.eval_outputs``)."""
    was_training = model.training
    model.eval()
    parts = []
    engine = engine_for(accelerator)
    splittable = engine.eval_may_split_batch  # no collective inside the forward
    forward = engine.eval_model(model)
    for batch in dataloader:
        if pack is not None:
            inputs, labels = split_labels(batch)
            outputs = packing.eval_outputs(forward, inputs, labels, task, pack.eval_row_length)
        else:
            outputs = _eval_outputs(forward, batch, task, splittable)
        parts.append([t.cpu() for t in accelerator.gather_for_metrics(outputs)])
    model.train(was_training)
    if not parts:
        return {"eval_samples": 0}
    return task.eval_metrics([torch.cat(columns) for columns in zip(*parts)], metric_specs)


def _eval_outputs(model, batch: dict, task, splittable: bool) -> tuple:
    """The task's per-sample outputs for one batch (``task.eval_outputs``); on out-of-memory
    (``should_reduce_batch_size``) a ``splittable`` batch is retried in halves, recursively. The training
    micro-batch never changes."""
    try:
        with torch.no_grad():
            return task.eval_outputs(model, batch)
    except Exception as err:  # noqa: BLE001 - OOM types differ by backend
        size = task.samples(batch)
        if not splittable or not should_reduce_batch_size(err) or size == 1:
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    half = size // 2
    first = _eval_outputs(model, {k: v[:half] for k, v in batch.items()}, task, splittable)
    second = _eval_outputs(model, {k: v[half:] for k, v in batch.items()}, task, splittable)
    return tuple(torch.cat([a, b]) for a, b in zip(first, second))


def generation_eval(accelerator, model, tokenizer, rows, recipe, config, task) -> tuple[dict, list[str]]:
    """``(metrics, predictions)`` of greedy completions for the first ``GENERATION["num_samples"]`` raw ``rows``
    (each row's prompt and reference: ``task.prompt_and_reference``, ``task`` the run's),
    scored with the recipe's ``METRICS``; ``({}, [])`` without it. Every process generates its share (rows r,
    r + P, ...; as many prompts on each, synced where the engine shards) on the model the engine gives for
    generation (``generation_model``: unwrapped, with whole weights where the engine shards them), and
    the completions are gathered in row order, so every rank scores the same figures."""
    spec = dict(getattr(recipe, "GENERATION", None) or {})
    if not spec or rows is None:
        return {}, []
    count = spec.pop("num_samples", None)
    if count is not None:
        rows = rows.select(range(min(count, len(rows)))) if hasattr(rows, "select") else rows[:count]
    pairs = [task.prompt_and_reference(row, f"row {i}") for i, row in enumerate(rows)]
    rank, processes = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(pairs), processes))
    share = math.ceil(len(pairs) / processes)
    padded = mine + [mine[-1] if mine else 0] * (share - len(mine))
    completions = []
    engine = engine_for(accelerator)
    if padded:  # as many on every process (share), so a sharded engine's collectives match
        with engine.generation_model(model) as generator:  # unwrapped, its weights whole
            completions = generate_completions(generator, tokenizer, [pairs[i][0] for i in padded],
                                               max_length=config.max_length, synced_gpus=engine.generation_synced,
                                               **spec)
    own = list(zip(mine, completions))
    gathered = gather_object(own) if processes > 1 else own
    predictions = [text for _, text in sorted(gathered)]
    return score_completions(predictions, [reference for _, reference in pairs], recipe.METRICS), predictions


def benchmark_eval(accelerator, model, tokenizer, config, output_dir: Path, step: int) -> dict:
    """``--eval_tasks``: lm-evaluation-harness on the model being trained (``benchmarks.run_benchmarks``; eval mode
    during, its mode restored after), on the main process, on the model the engine gives for generation (whole
    weights where it shards them; every process enters that collectively), its figures broadcast so that every rank
    logs and decides on the same ones. The other processes wait for them in a group of their own
    (``benchmark_wait_group``), not bounded by ``--ddp_timeout``: a benchmark may take longer than any collective
    should. Returns ``eval_<task>_<metric>`` values and standard errors, and ``eval_benchmarks_runtime`` (seconds,
    on the main process) ({} without ``--eval_tasks``); the main process writes lm-eval's per-document records to
    ``<output_dir>/benchmarks/step_<step>/samples_<task>.jsonl``. Raises ``FinetuneError`` naming the tasks where the
    figures do not reach every process (a process ended during the benchmark)."""
    if not config.eval_tasks:
        return {}
    from finetune.config.cadence import task_names
    from finetune.outputs.lm_eval import flat_metrics, run_benchmarks, write_samples

    limit = config.eval_limit
    limit = int(limit) if limit is not None and limit >= 1 else limit
    tasks = task_names(config.eval_tasks)
    flat = [None]
    group = benchmark_wait_group() if accelerator.num_processes > 1 else None  # before the main process starts
    with engine_for(accelerator).generation_model(model) as scored:
        if accelerator.is_main_process:  # lm-eval returns its results on global rank 0 only (evaluator.py)
            start = time.perf_counter()
            results = run_benchmarks(scored, tokenizer, tasks, limit=limit, num_fewshot=config.eval_num_fewshot,
                                     device=accelerator.device, seed=config.seed)
            write_samples(results, Path(output_dir) / "benchmarks" / f"step_{step:08d}")
            flat = [{**flat_metrics(results), BENCHMARKS_RUNTIME: time.perf_counter() - start}]
        if group is not None:  # inside the context: its exit may be collective under --ddp_timeout
            _share_from_main(flat, group, tasks)
    return flat[0]


def benchmark_wait_group():
    """A new gloo group of every process whose collectives time out after ``BENCHMARK_WAIT`` instead of
    ``--ddp_timeout`` (the default group's): where the other processes wait while the main one runs the benchmarks.
    Collective (``torch.distributed.new_group``): every process calls it at the same point; the caller destroys it
    (``destroy_process_group(group)``) when done."""
    return torch.distributed.new_group(backend="gloo", timeout=BENCHMARK_WAIT)


def _share_from_main(flat: list, group, tasks: list[str]) -> None:
    """``flat`` (a one-item list) broadcast from the main process over ``group``, which is then destroyed. Raises
    ``FinetuneError`` naming ``tasks`` where the broadcast fails (a process ended, or ``BENCHMARK_WAIT`` passed)."""
    try:
        torch.distributed.broadcast_object_list(flat, src=0, group=group)
    except RuntimeError as err:  # gloo's errors (DistBackendError among them) are RuntimeErrors
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise FinetuneError(f"--eval_tasks {','.join(tasks)}: the benchmark's figures did not reach every process "
                            f"({first}). The main process runs the benchmark while the others wait for it, not "
                            "bounded by --ddp_timeout; a process that ended has its own error above.") from None
    torch.distributed.destroy_process_group(group)


def write_generations(output_dir: Path, rows, predictions: list[str], task) -> None:
    """``generations.jsonl``: ``{"generated", "reference"}`` per row of the latest evaluation (its reference:
    ``task.prompt_and_reference``)."""
    with open(Path(output_dir) / GENERATIONS_FILE, "w", encoding="utf-8") as f:
        for i, (row, generated) in enumerate(zip(rows, predictions)):
            f.write(json.dumps({"generated": generated, "reference": task.prompt_and_reference(row, f"row {i}")[1]}) + "\n")
