"""Pieces both engines share: the Accelerator, the optimizer, the step plan, the training order.

Units: batch sizes in samples, steps in optimizer steps unless named micro-batches.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.state import GradientState
from accelerate.utils import DataLoaderConfiguration, DistributedType, TorchDynamoPlugin
from transformers.trainer_pt_utils import LengthGroupedSampler

from finetune.chunked_loss import causal_lm_hidden_and_head, chunked_causal_lm_loss_sum
from finetune.errors import FinetuneError
from finetune.precision import check_precision_supported
from finetune.tasks import CausalLM
from finetune.sharded import accumulation_plugin, sync_each_batch

_TRACKER_MODULES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}


def make_accelerator(config) -> Accelerator:
    """An ``Accelerator`` for ``config``: N-step accumulation that the engine aligns to its windows itself
    (``sync_with_dataloader=False``), and a seeded sampler so every process and every resume sees the
    same data order. Under FSDP, gradients are synchronised on every micro-batch (``sharded.sync_each_batch``).
    Raises ``FinetuneError`` for bf16 on a device without bf16, or a ``--report_to`` tracker whose package is
    not installed."""
    check_precision_supported(config.mixed_precision)
    log_with = None if config.report_to == "none" else config.report_to
    if log_with in _TRACKER_MODULES:
        module = _TRACKER_MODULES[log_with]
        if importlib.util.find_spec(module) is None and not (module == "tensorboard" and
                                                             importlib.util.find_spec("tensorboardX")):
            raise FinetuneError(f"--report_to {log_with}: the {module} package is not installed "
                                f"(pip install {module}), or use --report_to none.")
    compile_options = {}
    if config.torch_compile:  # Accelerator.prepare wraps the model in torch.compile
        compile_options["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor", mode=config.torch_compile_mode)
    try:
        accelerator = Accelerator(
            **compile_options,
            log_with=log_with,
            project_dir=config.output_dir,
            mixed_precision=config.mixed_precision,
            gradient_accumulation_plugin=accumulation_plugin(config.gradient_accumulation_steps, DistributedType.NO),
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
            # The schedule is stepped by hand, once per optimizer step that really happened. Only where
            # Accelerate wraps it (DeepSpeed, see sharded.deepspeed_optimizer_and_scheduler) does this matter:
            # each call then steps once, not once per process.
            step_scheduler_with_optimizer=False,
        )
    except ValueError as err:
        if "bf16" in str(err):
            raise FinetuneError(f"--mixed_precision bf16 is not supported on this device ({err}). "
                                "Use --mixed_precision fp16 (GPU) or no.") from None
        raise
    use_accumulation_plugin(accelerator, config.gradient_accumulation_steps)
    return accelerator


def loss_scale(accelerator: Accelerator) -> float | None:
    """The fp16 GradScaler's current loss scale (a Python float; a device sync), or None when the run has
    no loss scaling (fp32, bf16)."""
    return accelerator.scaler.get_scale() if accelerator.scaler is not None else None


def optimizer_step_skipped(accelerator: Accelerator, scale_before: float | None) -> bool:
    """Whether the optimizer step just taken (on a sync micro-batch) was skipped for an fp16 overflow.
    ``scale_before``: ``loss_scale(accelerator)`` read just before ``optimizer.step()``.

    Two signals, either suffices: Accelerate's ``optimizer_step_was_skipped``, and a drop of the loss scale
    across the step (``AcceleratedOptimizer.step`` calls ``scaler.update()``, which lowers the scale only
    after inf/NaN gradients, i.e. only when ``scaler.step`` skipped the update). Accelerate's flag alone
    misses skips with a fused optimizer (``--optim adamw_torch_fused``): GradScaler then always calls the
    optimizer's ``step``, whose kernel skips the update itself, so the flag stays False (accelerate issue
    4242). Always False without loss scaling.
    """
    if accelerator.optimizer_step_was_skipped:
        return True
    return scale_before is not None and loss_scale(accelerator) < scale_before


def use_accumulation_plugin(accelerator, num_steps: int) -> None:
    """Give ``accelerator`` the accumulation plugin for its distributed type (``sharded.accumulation_plugin``),
    which is known only once the Accelerator exists (FSDP comes from the launcher's environment). Accelerate
    keeps the plugin in the process-wide ``GradientState``, whose constructor replaces a different plugin
    (accelerate 1.15 ``state.py``: "Allow plugin to be updated"); ``accumulate()`` reads ``sync_each_batch``
    from it at every call. Nothing changes where the distributed type does not sync each batch."""
    if sync_each_batch(accelerator.distributed_type):
        GradientState(gradient_accumulation_plugin=accumulation_plugin(num_steps, accelerator.distributed_type))
    if accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False) != sync_each_batch(accelerator.distributed_type):
        raise RuntimeError(f"the gradient accumulation plugin was not updated: {accelerator.gradient_state.plugin_kwargs}")


def build_optimizer(model, config, groups: list[dict] | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on every trainable parameter except biases and normalisation weights (the
    Transformers ``Trainer`` grouping), so both engines optimise the same thing. ``optim`` picks the
    implementation as ``TrainingArguments.optim`` does: "adamw_torch" or "adamw_torch_fused". ``groups``:
    the parameter groups to use instead of ``parameter_groups(model, config)``."""
    return torch.optim.AdamW(groups if groups is not None else parameter_groups(model, config), lr=config.learning_rate,
                             betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
                             fused=config.optim == "adamw_torch_fused" or None)


def parameter_groups(model, config) -> list[dict]:
    """The optimizer's two parameter groups (the Transformers ``Trainer`` grouping): every trainable
    parameter with ``config.weight_decay``, except biases and normalisation weights (1-D or named "norm"),
    which get none. A parameter's shape is its true one also where DeepSpeed ZeRO-3 has partitioned it at
    load time into a 1-D placeholder (``ds_shape``: transformers loads under ``deepspeed.zero.Init`` then)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        ndim = len(getattr(param, "ds_shape", param.shape))
        (no_decay if ndim < 2 or "norm" in name.lower() else decay).append(param)
    return [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclass(frozen=True)
class StepPlan:
    """How long a run is, in optimizer steps.

    ``micro_batches_per_epoch``: per process. ``steps_per_epoch`` = ceil(micro-batches / N) (the last
    window of an epoch may be partial). ``max_steps``: ``--max_steps`` if > 0, else ceil(epochs x steps
    per epoch). ``num_epochs``: epochs started, ceil(max_steps / steps per epoch).
    """

    micro_batches_per_epoch: int
    steps_per_epoch: int
    max_steps: int
    num_epochs: int

    def steps(self, value: float | None) -> int | None:
        """A TrainingArguments step value in optimizer steps: a count (>= 1) as is, a ratio in [0, 1) of
        ``max_steps`` rounded up (``TrainingArguments.get_warmup_steps``'s rule); None stays None."""
        if value is None:
            return None
        return int(value) if value >= 1 else math.ceil(self.max_steps * value)

    def epoch_fraction(self, step: int) -> float:
        """Epochs completed after ``step`` optimizer steps (e.g. 1.5)."""
        return step / self.steps_per_epoch


def plan_steps(micro_batches_per_epoch: int, config) -> StepPlan:
    """The ``StepPlan`` for ``micro_batches_per_epoch`` micro-batches per process per epoch. Raises
    ``FinetuneError`` if there is no data."""
    if micro_batches_per_epoch == 0:
        raise FinetuneError("the training set is empty after --max_train_samples; use more samples.")
    steps_per_epoch = math.ceil(micro_batches_per_epoch / config.gradient_accumulation_steps)
    max_steps = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * steps_per_epoch)
    return StepPlan(micro_batches_per_epoch, steps_per_epoch, max_steps, math.ceil(max_steps / steps_per_epoch))


def micro_batches_per_process(num_samples: int, micro_batch: int, num_processes: int) -> int:
    """Micro-batches each process runs per epoch: ceil(ceil(samples / micro-batch) / processes), as
    Accelerate's sharded dataloader (``even_batches``) yields them."""
    return math.ceil(math.ceil(num_samples / micro_batch) / num_processes)


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """transformers' ``LengthGroupedSampler`` (what ``TrainingArguments(train_sampling_strategy=
    "group_by_length")`` uses) whose order depends on the seed and the epoch only.

    Each epoch: a seeded permutation, cut into mega-batches of ``50 x batch_size`` samples (fewer on small
    data), each sorted by length, longest first. ``batch_size`` is the global effective batch (samples per
    optimizer step), as in Trainer, so every window holds samples of similar length. ``lengths`` in tokens.
    ``set_epoch`` (called by Accelerate's dataloader) reseeds, so a resumed run and every process replay the
    same order.
    """

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        super().__init__(batch_size, lengths=lengths, generator=torch.Generator())
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order ``__iter__`` yields."""
        self.epoch = epoch

    def __iter__(self):
        self.generator.manual_seed(self.seed + self.epoch)
        return super().__iter__()


def iter_windows(dataloader, gradient_accumulation_steps: int):
    """Group a dataloader's micro-batches into accumulation windows: lists of N micro-batches, the
    last one possibly shorter. Prefetching a window lets the engine count its items before any backward."""
    window = []
    for batch in dataloader:
        window.append(batch)
        if len(window) == gradient_accumulation_steps:
            yield window
            window = []
    if window:
        yield window


DEFAULT_LOSS_CHUNK_SIZE = 1024  # label tokens per chunk (bench/bench_chunked_loss.py: 7.2x less, 0.93x time, CPU)


def loss_function(task, config, accelerator):
    """``loss_sum(model, batch, labels)``: the micro-batch's summed loss (the task's convention: a sum over
    its items, which the engine divides by the window's items).

    Causal LM with ``--loss_chunk_size`` > 0 (by default on a CPU, where it was measured faster): the loss
    from the final hidden states through the output embedding, chunk by chunk of label tokens
    (``finetune.chunked_loss``), never materialising the logits, inside ``accelerator.autocast()`` as the
    model's own head would run. A model the chunked path cannot serve (FSDP, ZeRO-3, compiled, a softcapped
    head) falls back to the plain path when the chunked loss was the default, and is refused (``ValueError``
    from ``chunked_loss``) when it was asked for. Otherwise ``task.loss_sum(model(**batch).logits, labels)``.
    """
    chunk = config.loss_chunk_size
    if chunk is None:
        chunk = DEFAULT_LOSS_CHUNK_SIZE if accelerator.device.type == "cpu" else 0
    if not chunk or not isinstance(task, CausalLM):
        return lambda model, batch, labels: task.loss_sum(model(**batch).logits, labels)
    strict, fallback = config.loss_chunk_size is not None, []

    def loss_sum(model, batch, labels):
        if not fallback:
            try:
                hidden, head = causal_lm_hidden_and_head(model, batch)
                with accelerator.autocast():
                    return chunked_causal_lm_loss_sum(hidden, head, labels, chunk)
            except ValueError as err:
                if strict:
                    raise FinetuneError(f"--loss_chunk_size {chunk}: {err} Use --loss_chunk_size 0.") from None
                fallback.append(str(err))
                if accelerator.is_main_process:
                    print(f"note: the chunked loss cannot serve this model ({err}); using the plain loss.")
        return task.loss_sum(model(**batch).logits, labels)

    return loss_sum
