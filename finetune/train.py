"""The accelerate engine: one visible ``train()`` loop with exact gradient accumulation inline.

Exactness rules (tested in ``tests/test_accumulation.py``):

- An accumulation window is up to N = ``gradient_accumulation_steps`` micro-batches; an epoch of M
  micro-batches has ceil(M / N) optimizer steps; the last window may be partial.
- Every micro-batch's loss is the *sum* of its per-sample losses divided by the number of samples in
  the whole window, counted across all processes. So each window's gradient is the mean over exactly
  the samples it holds, and a partial last window is weighted by its true size (Accelerate's own
  ``accelerator.backward`` divides by N, which under-weights it; we multiply N back in).
- Gradients are clipped only on the sync (last) micro-batch of a window; the LR schedule is sized in
  optimizer steps and advances only when the optimizer really stepped (fp16 overflow skips do not).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from finetune.errors import FinetuneError, NumericalError, TrainingStopped


from finetune.precision import PRECISION_NAMES, check_precision_supported, effective_mixed_precision


def run_banner(config, num_processes: int, micro_batches_per_epoch: int, steps_per_epoch: int, max_steps: int,
               num_epochs: int, precision: str, device_type: str) -> str:
    """What the run will do, printed at start: the effective batch size (micro-batch x accumulation x
    processes, in samples), the optimizer steps, and the precision that really runs, with a plain note
    when it is not the one requested (fp16 on a CPU)."""
    n = config.gradient_accumulation_steps
    effective = config.per_device_train_batch_size * n * num_processes
    options = [name for name, on in (("torch.compile (inductor)", config.torch_compile),
                                     ("length-grouped batches", config.train_sampling_strategy == "group_by_length"))
               if on]
    text = (f"Effective batch size: {config.per_device_train_batch_size} (micro-batch) x {n} (accumulation) x "
            f"{num_processes} (processes) = {effective} samples per optimizer step\n"
            f"Optimizer steps: {steps_per_epoch} per epoch ({micro_batches_per_epoch} micro-batches per process), "
            f"{max_steps} in total over {num_epochs} epoch(s) [{config.backend} backend]\n"
            + (f"Speed options: {', '.join(options)}\n" if options else "")
            + f"Precision: {PRECISION_NAMES[precision]} on {device_type}")
    if precision != config.mixed_precision:
        text += (f" -- NOTE: mixed_precision={config.mixed_precision!r} was requested, but {device_type} autocast "
                 f"does not run it, so this run is {PRECISION_NAMES[precision]}")
    return text


def make_accelerator(config):
    """An ``Accelerator`` for ``config``: N-step accumulation that we align to our windows ourselves
    (``sync_with_dataloader=False``), and a seeded sampler so every process and every resume sees the
    same data order. Raises ``FinetuneError`` for bf16 on a device without bf16."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

    check_precision_supported(config.mixed_precision)
    log_with = None if config.report_to == "none" else config.report_to
    if log_with not in (None, "all"):
        import importlib.util

        module = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}[log_with]
        if importlib.util.find_spec(module) is None and not (module == "tensorboard" and
                                                             importlib.util.find_spec("tensorboardX")):
            raise FinetuneError(f"--report_to {log_with}: the {module} package is not installed "
                                f"(pip install {module}), or use --report_to none.")
    compile_options = {}
    if config.torch_compile:  # Accelerator.prepare wraps the model in torch.compile
        from accelerate.utils import TorchDynamoPlugin

        compile_options["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor", mode=config.torch_compile_mode)
    try:
        accelerator = Accelerator(
            **compile_options,
            log_with=log_with,
            project_dir=config.output_dir,
            mixed_precision=config.mixed_precision,
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=config.gradient_accumulation_steps, sync_with_dataloader=False
            ),
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        )
    except ValueError as err:
        if "bf16" in str(err):
            raise FinetuneError(f"--mixed_precision bf16 is not supported on this device ({err}). "
                                "Use --mixed_precision fp16 (GPU) or no.") from None
        raise
    return accelerator


# ------------------------------------------------------------------------------------------ batching
def iter_windows(dataloader, gradient_accumulation_steps: int):
    """Group a dataloader's micro-batches into accumulation windows: lists of N micro-batches, the
    last one possibly shorter. Prefetching a window lets us count its samples before any backward."""
    window = []
    for batch in dataloader:
        window.append(batch)
        if len(window) == gradient_accumulation_steps:
            yield window
            window = []
    if window:
        yield window


def length_grouped_sampler(dataset, batch_size: int, seed: int):
    """A ``transformers.trainer_pt_utils.LengthGroupedSampler`` (what ``TrainingArguments(
    train_sampling_strategy="group_by_length")`` uses) whose order depends on the seed and the epoch only.

    Each epoch: a seeded permutation, cut into mega-batches of ``50 x batch_size`` samples (fewer on small
    data), each sorted by length, longest first. ``batch_size`` is the global effective batch (samples per
    optimizer step), as in Trainer, so every window holds samples of similar length. Lengths are
    ``len(input_ids)`` in tokens. ``set_epoch`` (called by Accelerate's dataloader) reseeds, so a resumed run
    and every process replay the same order.
    """
    from transformers.trainer_pt_utils import LengthGroupedSampler

    class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
        def __init__(self, lengths):
            super().__init__(batch_size, lengths=lengths, generator=torch.Generator())
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            self.generator.manual_seed(seed + self.epoch)
            return super().__iter__()

    return EpochSeededLengthGroupedSampler([len(ids) for ids in dataset["input_ids"]])


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
    max_steps: int
    steps_per_epoch: int
    num_epochs: int
    precision: str
    task: object = None
    metrics: dict = field(default_factory=dict)


def build_optimizer(model, config) -> torch.optim.AdamW:
    """AdamW with weight decay on every parameter except biases and normalisation weights (the
    Transformers ``Trainer`` grouping), so both engines optimise the same thing. ``optim`` picks the
    implementation as ``TrainingArguments.optim`` does: "adamw_torch" or "adamw_torch_fused"."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_epsilon, fused=config.optim == "adamw_torch_fused" or None)


def plan_steps(micro_batches_per_epoch: int, config) -> tuple[int, int, int]:
    """(optimizer steps per epoch, total optimizer steps, epochs to run).

    Steps per epoch = ceil(micro-batches per process / N); total = ``max_steps`` if > 0, else
    ceil(``num_train_epochs`` x steps per epoch). Raises ``FinetuneError`` if there is no data.
    """
    if micro_batches_per_epoch == 0:
        raise FinetuneError("the training set is empty after --max_train_samples; use more samples.")
    steps_per_epoch = math.ceil(micro_batches_per_epoch / config.gradient_accumulation_steps)
    if config.max_steps > 0:
        max_steps = config.max_steps
    else:
        max_steps = math.ceil(config.num_train_epochs * steps_per_epoch)
    return steps_per_epoch, max_steps, math.ceil(max_steps / steps_per_epoch)


def apply_batch_plan(config, recipe) -> None:
    """With ``--total_batch_size``, set ``config.per_device_train_batch_size`` and
    ``config.gradient_accumulation_steps`` from the batch planner before either engine builds anything
    (Accelerate fixes the accumulation steps when the Accelerator is created). Called once by
    ``run.main``; the plan is printed. Raises ``FinetuneError`` as ``resolve_batch_plan``."""
    if not config.total_batch_size:
        return
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from finetune.batch_plan import resolve_batch_plan

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    plan = resolve_batch_plan(config, recipe, state.num_processes, state.device)
    config.per_device_train_batch_size = plan.per_device_train_batch_size
    config.gradient_accumulation_steps = plan.gradient_accumulation_steps
    if state.is_main_process:
        print(f"Batch plan for --total_batch_size {config.total_batch_size}: {plan}")


def setup(config, recipe) -> Setup:
    """Build accelerator, tokenizer, datasets, model, optimizer and schedule for ``train()``."""
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    from finetune.data import build_components
    from finetune.tasks import get_task

    accelerator = make_accelerator(config)
    precision = effective_mixed_precision(accelerator)
    tokenizer, datasets, _, model, collator = build_components(
        config, recipe, precision, accelerator.main_process_first)
    # Own generators: otherwise every new iterator (each epoch, each evaluation, a resume's skip) draws a
    # seed from the global RNG, and a resumed run's dropout masks would drift from the uninterrupted run's.
    # The order itself comes from Accelerate's seeded sampler (data_seed + epoch).
    # pinned host memory only helps copies to a GPU; workers collate in parallel (tokenizing is done already)
    loader_options = dict(collate_fn=collator, num_workers=config.dataloader_num_workers,
                          pin_memory=config.dataloader_pin_memory and accelerator.device.type == "cuda")
    if config.train_sampling_strategy == "group_by_length":
        order = dict(sampler=length_grouped_sampler(datasets["train"], config.per_device_train_batch_size *
                                                    config.gradient_accumulation_steps * accelerator.num_processes,
                                                    config.seed))
    else:  # Accelerate swaps this RandomSampler for its seedable one (data_seed + epoch)
        order = dict(shuffle=True)
    train_dataloader = DataLoader(datasets["train"], batch_size=config.per_device_train_batch_size,
                                  generator=torch.Generator().manual_seed(config.seed), **order, **loader_options)
    eval_dataloader = DataLoader(datasets["validation"], shuffle=False, batch_size=config.per_device_eval_batch_size,
                                 generator=torch.Generator().manual_seed(config.seed), **loader_options)
    optimizer = build_optimizer(model, config)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    steps_per_epoch, max_steps, num_epochs = plan_steps(len(train_dataloader), config)
    # Not passed to accelerator.prepare: its wrapper steps the schedule once per process per call and
    # assumes a schedule sized for that. Ours is sized in optimizer steps and stepped by hand.
    scheduler = get_scheduler(config.lr_scheduler_type, optimizer.optimizer, num_warmup_steps=config.warmup_steps,
                              num_training_steps=max_steps)
    return Setup(accelerator, model, tokenizer, optimizer, scheduler, train_dataloader, eval_dataloader,
                 max_steps, steps_per_epoch, num_epochs, precision, task=get_task(recipe.TASK),
                 metrics=recipe.METRICS)


# ------------------------------------------------------------------------------------------ evaluation
def evaluate(accelerator, model, dataloader, task, metric_specs: dict) -> dict:
    """Evaluate on every process: the task's per-sample outputs are gathered with
    ``gather_for_metrics`` (which drops the samples Accelerate repeats to even out the last batch), then
    scored once. Both engines call this, so their eval metrics are defined identically.

    ``task``: a ``finetune.tasks`` task; ``metric_specs``: shipped metric name -> compute kwargs.
    Returns e.g. ``{"eval_loss", "eval_accuracy", "eval_f1", "eval_samples"}`` (classification) or
    ``{"eval_loss" (per token), "eval_perplexity", "eval_tokens", "eval_samples"}`` (causal LM).
    """
    was_training = model.training
    model.eval()
    parts = []
    for batch in dataloader:
        labels = batch.pop("labels")
        outputs = _eval_outputs_splitting_on_oom(model, batch, labels, task)
        parts.append([t.cpu() for t in accelerator.gather_for_metrics(outputs)])
    model.train(was_training)
    gathered = [torch.cat(columns) for columns in zip(*parts)] if parts else [torch.zeros(0)] * 3
    return task.eval_metrics(gathered, metric_specs)


def _eval_outputs_splitting_on_oom(model, batch: dict, labels, task) -> tuple:
    """The task's per-sample eval outputs for one batch; on out-of-memory (Accelerate's
    ``should_reduce_batch_size``) the batch is split in halves and each half retried, recursively. Only
    evaluation shrinks: the training micro-batch, and so the optimisation, never changes."""
    from accelerate.utils.memory import should_reduce_batch_size

    try:
        with torch.no_grad():
            return task.eval_outputs(model(**batch).logits, labels)
    except Exception as err:  # noqa: BLE001 - OOM types differ by backend
        size = labels.shape[0]
        if not should_reduce_batch_size(err) or size == 1:
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    half = size // 2
    first = _eval_outputs_splitting_on_oom(model, {k: v[:half] for k, v in batch.items()}, labels[:half], task)
    second = _eval_outputs_splitting_on_oom(model, {k: v[half:] for k, v in batch.items()}, labels[half:], task)
    return tuple(torch.cat([a, b]) for a, b in zip(first, second))


# ------------------------------------------------------------------------------------------ outputs
class RunLog:
    """``log.jsonl`` in the output directory: one JSON object per line, written by the main process
    and flushed at once so a run that dies keeps its log."""

    def __init__(self, path: Path, enabled: bool, append: bool = False):
        self.file = open(path, "a" if append else "w", encoding="utf-8") if enabled else None

    def write(self, record: dict) -> None:
        """Append ``record`` as one line."""
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        """Close the file."""
        if self.file:
            self.file.close()


def save_model(s: Setup, output_dir: Path) -> None:
    """Write the model (safetensors) and tokenizer with ``save_pretrained``: a Hugging Face model
    directory that ``AutoModelForSequenceClassification.from_pretrained(output_dir)`` loads."""
    accelerator = s.accelerator
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(s.model, keep_torch_compile=False)
    # a torch.compile'd model names every tensor "_orig_mod.<name>": from_pretrained needs the plain names
    state_dict = {name.removeprefix("_orig_mod."): tensor for name, tensor in accelerator.get_state_dict(s.model).items()}
    unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, state_dict=state_dict)
    if accelerator.is_main_process:
        s.tokenizer.save_pretrained(output_dir)


# ------------------------------------------------------------------------------------------ the loop
class GracefulStop:
    """SIGINT/SIGTERM handling: the first signal sets ``signum`` (the loop finishes the optimizer step in
    progress, writes a checkpoint and exits); a second one exits at once."""

    def __init__(self):
        self.signum = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.signum is not None:
            print(f"\n{signal.Signals(signum).name} again: exiting now, without a checkpoint.", file=sys.stderr)
            os._exit(128 + signum)
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this optimizer step, then saving a checkpoint "
              "(send it again to exit at once).", file=sys.stderr)


def _restore_log(path: Path, step: int) -> list[dict]:
    """On resume: keep the log records up to the checkpoint's step (optimizer-step records up to and
    including it, evaluations before it), drop what a killed run wrote after it; return them."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["step"] < step or (record["step"] == step and "loss" in record):
            kept.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def train(config, recipe, process_start: float | None = None) -> dict:
    """Fine-tune ``recipe`` with ``config``; write the model, ``metrics.json``, ``log.jsonl`` and
    ``run_config.json`` into ``config.output_dir``; return the metrics.

    Units in the metrics: ``train_loss`` is the mean over optimizer steps of each step's mean loss per
    item (sample, or label token for causal LM; nats), ``*_runtime`` seconds, ``*_per_second`` samples per
    second, ``optimizer_steps`` counts optimizer steps (fp16 skips included, also in ``skipped_optimizer_steps``).

    Checkpoints (``--checkpointing_steps``) are taken after an optimizer step, never inside a window.
    Raises ``TrainingStopped`` after SIGINT/SIGTERM (checkpoint written, resume command in the message),
    ``NumericalError`` on a non-finite loss or gradient (fp32/bf16) or too many fp16 skips in a row, and
    ``FinetuneError`` for a checkpoint that cannot be resumed or written.
    """
    from tqdm.auto import tqdm

    from finetune import checkpoint as ckpt

    s = setup(config, recipe)
    accelerator, model, optimizer, scheduler = s.accelerator, s.model, s.optimizer, s.scheduler
    N, P = config.gradient_accumulation_steps, accelerator.num_processes
    output_dir = Path(config.output_dir)
    accelerator.register_for_checkpointing(scheduler)  # not prepared (see setup), so registered by hand
    meaning = ckpt.step_meaning(config, P)
    state = ckpt.TrainerState(num_processes=P, step_meaning=meaning)
    resume_from = ckpt.find_resume_checkpoint(output_dir, config.resume_from_checkpoint) \
        if config.resume_from_checkpoint else None
    if resume_from is not None:
        loaded = ckpt.read_state(resume_from)
        ckpt.check_compatible(loaded, meaning, resume_from, config.ignore_checkpoint_mismatch)
        try:
            accelerator.load_state(str(resume_from))
        except Exception as err:  # torch/safetensors raise many types for damaged files
            raise FinetuneError(f"checkpoint {resume_from} is corrupt and cannot be loaded ({type(err).__name__}: "
                                f"{err}). Resume from another checkpoint (--resume_from_checkpoint PATH).") from None
        state = loaded
        state.step_meaning = meaning
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        if config.overwrite_output_dir and resume_from is None:
            shutil.rmtree(ckpt.checkpoints_dir(output_dir), ignore_errors=True)
        (output_dir / "run_config.json").write_text(config.to_json() + "\n")
        if resume_from is not None:
            _restore_log(output_dir / "log.jsonl", state.step)
    accelerator.wait_for_everyone()
    log = RunLog(output_dir / "log.jsonl", accelerator.is_main_process, append=resume_from is not None)

    accelerator.print(run_banner(config, P, len(s.train_dataloader), s.steps_per_epoch, s.max_steps, s.num_epochs,
                                 s.precision, accelerator.device.type))
    if resume_from is not None:
        accelerator.print(f"Resuming from {resume_from}: optimizer step {state.step}, epoch {state.epoch}, "
                          f"skipping {state.micro_batches_done} micro-batches of it (same data order).")

    if config.report_to != "none":
        # hyperparameters as the trackers accept them (no None), under <output_dir>/runs for TensorBoard
        hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                   for k, v in config.to_dict().items() if v is not None}
        accelerator.init_trackers("runs", config=hparams)

    task = s.task
    eval_results, eval_runtime = {}, 0.0
    every = int(config.checkpointing_steps) if str(config.checkpointing_steps).isdigit() else None

    def run_evaluation():
        nonlocal eval_results, eval_runtime
        eval_start = time.perf_counter()
        eval_results = evaluate(accelerator, model, s.eval_dataloader, task, s.metrics)
        eval_runtime += time.perf_counter() - eval_start
        log.write({"step": state.step, "epoch": round(_epoch_fraction(state.step, s), 4), **eval_results})
        accelerator.log({f"eval/{k.removeprefix('eval_')}": v for k, v in eval_results.items()}, step=state.step)
        accelerator.print(f"eval at step {state.step} (epoch {_epoch_fraction(state.step, s):.2f}): " + ", ".join(
            f"{k}={v:.4f}" for k, v in eval_results.items() if isinstance(v, float)))

    def save(reason: str) -> Path:
        state.train_runtime = runtime_before + time.perf_counter() - train_start - eval_runtime
        path = ckpt.save_checkpoint(accelerator, output_dir, state, config.save_total_limit)
        accelerator.print(f"checkpoint ({reason}): {path}")
        return path

    progress = tqdm(total=s.max_steps, initial=state.step, desc="Training", unit="step",
                    disable=not accelerator.is_local_main_process)
    model.train()
    runtime_before, train_start, samples_at_start = state.train_runtime, time.perf_counter(), state.samples_seen
    if config.eval_on_start and state.step == 0:
        run_evaluation()
    with GracefulStop() as stop:
        while state.epoch < s.num_epochs and state.step < s.max_steps:
            s.train_dataloader.set_epoch(state.epoch)  # the shuffle order depends on the seed and the epoch only
            batches = s.train_dataloader
            if state.micro_batches_done:  # resuming mid-epoch: the same order, minus what was already trained
                batches = accelerator.skip_first_batches(s.train_dataloader, state.micro_batches_done)
            for window in iter_windows(batches, N):
                first_micro_batch = state.micro_batches_done
                # The window's loss items (samples, or label tokens for causal LM) over all processes, known
                # before any backward: each item's loss is divided by it, so the window's gradient is the
                # exact mean over its items. One reduction per window (a sync point), with the sample count.
                local = torch.stack([sum(task.count(b["labels"]) for b in window),
                                     torch.tensor(sum(b["labels"].shape[0] for b in window), device=accelerator.device),
                                     sum(b["attention_mask"].sum() for b in window),
                                     torch.tensor(sum(b["attention_mask"].numel() for b in window), device=accelerator.device)])
                window_items, window_samples, window_input_tokens, window_padded_tokens = \
                    accelerator.reduce(local, "sum").tolist()
                # Align Accelerate's micro-batch counter so the window's last micro-batch is the sync step,
                # also for a short last window (it syncs when its counter reaches a multiple of N).
                accelerator.step = N - len(window)
                window_loss = torch.zeros((), device=accelerator.device)
                for batch in window:
                    with accelerator.accumulate(model):
                        labels = batch.pop("labels")
                        logits = model(**batch).logits
                        loss_sum = task.loss_sum(logits, labels)
                        # accelerator.backward divides by N and DDP averages over P processes: undo both, so
                        # the summed gradient is sum(per-item gradients) / window_items.
                        accelerator.backward(loss_sum * (N * P / window_items))
                        window_loss += loss_sum.detach()
                        if accelerator.sync_gradients:
                            max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
                            # fp16 overflows are the GradScaler's to skip; elsewhere a non-finite gradient
                            # (from a non-finite loss) must not reach the weights (a sync point per step).
                            if s.precision != "fp16" and not torch.isfinite(grad_norm).item():
                                raise NumericalError(
                                    f"non-finite loss or gradient at optimizer step {state.step + 1} (epoch "
                                    f"{state.epoch}, micro-batches {first_micro_batch}-{first_micro_batch + len(window) - 1} "
                                    f"of the epoch, per process): grad norm {float(grad_norm)}. Nothing after the "
                                    "last checkpoint was saved. Lower --learning_rate, set --max_grad_norm, or check "
                                    "those samples; resume with --resume_from_checkpoint latest.")
                        learning_rate = scheduler.get_last_lr()[0]
                        optimizer.step()  # a no-op until the sync micro-batch
                        if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                            scheduler.step()
                        optimizer.zero_grad()

                skipped = accelerator.optimizer_step_was_skipped
                state.step += 1
                state.micro_batches_done += len(window)
                state.samples_seen += window_samples
                state.input_tokens_seen += window_input_tokens
                state.padded_tokens_seen += window_padded_tokens
                state.skipped_steps += int(skipped)
                state.consecutive_skipped = state.consecutive_skipped + 1 if skipped else 0
                # One more reduction per optimizer step: the window's loss, and whether any process was
                # signalled (every process must stop at the same step).
                loss_sum_all, stop_votes = accelerator.reduce(
                    torch.stack([window_loss, torch.tensor(float(stop.signum is not None), device=accelerator.device)]),
                    "sum").tolist()
                loss = loss_sum_all / window_items
                state.losses.append(loss)
                record = {"step": state.step, "epoch": round(_epoch_fraction(state.step, s), 4), "loss": loss,
                          "learning_rate": learning_rate, "grad_norm": float(grad_norm), "samples": window_samples,
                          "micro_batches": len(window)}
                if task.name == "causal-lm":
                    record["label_tokens"] = window_items
                    state.tokens_seen += window_items
                if skipped:
                    record["skipped"] = True
                log.write(record)
                elapsed = time.perf_counter() - train_start - eval_runtime
                accelerator.log({"train/loss": loss, "train/learning_rate": learning_rate, "train/grad_norm": record["grad_norm"],
                                 "train/samples_per_second": (state.samples_seen - samples_at_start) / max(elapsed, 1e-9),
                                 "train/epoch": record["epoch"]}, step=state.step)
                progress.update(1)
                progress.set_postfix(loss=f"{loss:.4f}", lr=f"{learning_rate:.2e}")
                if state.consecutive_skipped > config.max_skipped_steps:
                    raise NumericalError(
                        f"fp16 loss scaling skipped {state.consecutive_skipped} optimizer steps in a row (up to step "
                        f"{state.step}): the loss or gradients overflow fp16. Nothing after the last checkpoint was "
                        "saved. Use --mixed_precision bf16 or no, or lower --learning_rate; raise "
                        "--max_skipped_steps to tolerate more.")
                if stop_votes > 0:
                    path = save("stopped by signal")
                    signum = stop.signum or signal.SIGTERM
                    raise TrainingStopped(
                        f"stopped by {signal.Signals(signum).name} after optimizer step {state.step}; checkpoint: "
                        f"{path}. Resume with:\n    {_resume_command(config, recipe, P)}", signum)
                if every and state.step % every == 0 and state.step < s.max_steps:
                    save(f"every {every} steps")
                if state.step >= s.max_steps:
                    break
            if state.step >= s.max_steps or config.eval_strategy == "epoch" or state.epoch == s.num_epochs - 1:
                run_evaluation()
            if state.step < s.max_steps:
                state.epoch, state.micro_batches_done = state.epoch + 1, 0
                if config.checkpointing_steps == "epoch":
                    save("end of epoch")
    progress.close()
    train_runtime = runtime_before + time.perf_counter() - train_start - eval_runtime

    save_model(s, output_dir)
    metrics = run_metrics(
        config, eval_results, step_losses=state.losses, skipped_steps=state.skipped_steps,
        steps_per_epoch=s.steps_per_epoch, train_samples=state.samples_seen, train_tokens=state.tokens_seen,
        train_input_tokens=state.input_tokens_seen, train_padded_tokens=state.padded_tokens_seen, num_parameters=sum(p.numel() for p in model.parameters()),
        num_processes=P, precision=s.precision, device=accelerator.device, train_runtime=train_runtime,
        eval_runtime=eval_runtime, process_start=process_start)
    if resume_from is not None:
        metrics["resumed_from"] = str(resume_from)
    if accelerator.is_main_process:
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        from finetune.model_card import config_argv, reproduce_command, write_model_card

        write_model_card(output_dir, config, metrics, recipe, reproduce_command(
            config_argv(config, recipe), num_processes=metrics["num_processes"], device=metrics.get("device")))
    log.close()
    accelerator.end_training()
    return metrics


def _resume_command(config, recipe, num_processes: int) -> str:
    """The command that continues this run from its newest checkpoint."""
    from finetune.model_card import config_argv, reproduce_command

    argv = [a for a in config_argv(config, recipe)]
    if "--output_dir" not in argv:
        argv += ["--output_dir", str(config.output_dir)]
    if "--resume_from_checkpoint" in argv:
        i = argv.index("--resume_from_checkpoint")
        del argv[i:i + 2]
    return reproduce_command(argv + ["--resume_from_checkpoint", "latest"], num_processes=num_processes)


def peak_memory(device) -> tuple[int, str]:
    """(bytes, what was measured): ``torch.cuda.max_memory_allocated`` on a CUDA device, else the
    process's peak resident set size (``getrusage`` ``ru_maxrss``, KiB on Linux, returned in bytes)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_max_rss"


def run_metrics(config, eval_results: dict, *, step_losses: list, skipped_steps: int, steps_per_epoch: int,
                train_samples: int, train_tokens: int = 0, train_input_tokens: int = 0, train_padded_tokens: int = 0,
                num_parameters: int = 0,
                num_processes: int, precision: str, device, train_runtime: float,
                eval_runtime: float, process_start: float | None) -> dict:
    """The ``metrics.json`` dict, the same for both engines.

    ``step_losses``: mean loss per item (sample, or label token) of each optimizer step.
    ``train_tokens``: label tokens trained on (causal LM; 0 leaves the token figures out).
    ``train_input_tokens``: non-padding input tokens over all processes, for ``train_input_tokens_per_second``
    and, on a CUDA device with a known peak, ``mfu`` = 6 x ``num_parameters`` x tokens/s / peak FLOP/s
    (``finetune.flops``; the peak's source is recorded as ``mfu_peak_source``). ``train_padded_tokens``: input
    positions including padding (0 leaves ``train_padding_fraction`` = padding / positions out; the Trainer
    engine, whose loop we do not see, leaves it out). ``train_runtime`` and ``eval_runtime``
    in seconds (training excludes evaluation); ``train_samples`` counts samples over all processes.
    """
    effective_batch_size = config.per_device_train_batch_size * config.gradient_accumulation_steps * num_processes
    memory, memory_kind = peak_memory(device)
    metrics = {
        **eval_results,
        "train_loss": sum(step_losses) / max(len(step_losses), 1),
        "final_train_loss": step_losses[-1] if step_losses else float("nan"),
        "optimizer_steps": len(step_losses),
        "skipped_optimizer_steps": skipped_steps,
        "epochs": round(len(step_losses) / steps_per_epoch, 4),
        "train_samples": train_samples,
        "effective_batch_size": effective_batch_size,
        "per_device_train_batch_size": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "num_processes": num_processes,
        "mixed_precision": precision,
        "mixed_precision_requested": config.mixed_precision,
        "backend": config.backend,
        "device": device.type,
        "train_runtime": round(train_runtime, 3),
        "train_samples_per_second": round(train_samples / train_runtime, 3) if train_runtime > 0 else 0.0,
        **({"train_tokens": train_tokens,
            "train_tokens_per_second": round(train_tokens / train_runtime, 3) if train_runtime > 0 else 0.0}
           if train_tokens else {}),
        "train_input_tokens": train_input_tokens,
        "train_input_tokens_per_second": round(train_input_tokens / train_runtime, 3) if train_runtime > 0 else 0.0,
        **({"train_padding_fraction": round(1 - train_input_tokens / train_padded_tokens, 4)}
           if train_padded_tokens else {}),
        "train_seconds_per_step": round(train_runtime / len(step_losses), 4) if step_losses else 0.0,
        "eval_runtime": round(eval_runtime, 3),
        "peak_memory_bytes": memory,
        "peak_memory_kind": memory_kind,
    }
    if device.type == "cuda" and train_runtime > 0:
        from finetune.flops import model_flops_utilization

        mfu = model_flops_utilization(num_parameters, train_input_tokens / train_runtime,
                                      torch.cuda.get_device_name(device))
        if mfu is not None:
            metrics["mfu"], metrics["mfu_peak_source"] = round(mfu[0], 4), mfu[1]
    if process_start is not None:
        metrics["wall_time"] = round(time.time() - process_start, 3)
    return metrics


def _epoch_fraction(step: int, s: Setup) -> float:
    """Epochs completed after ``step`` optimizer steps (a float, e.g. 1.5)."""
    return step / s.steps_per_epoch
