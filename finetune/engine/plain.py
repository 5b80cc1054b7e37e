"""The plain engine: one process or DDP. The FSDP and DeepSpeed engines inherit what they share with it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from finetune.engine.precision import effective_mixed_precision
from finetune.errors import FinetuneError
from finetune.models.lora import is_peft_model, save_adapter, save_pretrained_here

# transformers' get_scheduler is imported where a schedule is built: its module (transformers.optimization) imports
# transformers.trainer_utils, which imports peft, seconds that the batch planner's probes do not need.


def parameter_groups(model, config, shape=lambda param: param.shape) -> list[dict]:
    """``Trainer``'s two AdamW groups: trainable parameters with ``config.weight_decay``, biases and norm weights
    (1-D or named "norm") with none. ``shape(param)``: the true shape, for engines that partition parameters."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if len(shape(param)) < 2 or "norm" in name.lower() else decay).append(param)
    return [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model, config, groups: list[dict] | None = None) -> torch.optim.Optimizer:
    """AdamW over ``groups`` (default ``parameter_groups``) as Trainer builds it for ``--optim`` (transformers 5.24
    ``trainer_optimizer.py``): torch's, fused for ``adamw_torch_fused``; bitsandbytes' ``AdamW`` with 8-bit moments
    for ``adamw_bnb_8bit``, paged (``is_paged``) for ``paged_adamw_8bit``/``paged_adamw_32bit``. bitsandbytes keeps
    the moments of a tensor under 4096 elements in 32 bits whatever ``optim_bits`` says (its ``min_8bit_size``)."""
    groups = groups if groups is not None else parameter_groups(model, config)
    options = dict(lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon)
    if config.optim in ("adamw_torch", "adamw_torch_fused"):
        return torch.optim.AdamW(groups, fused=config.optim == "adamw_torch_fused" or None, **options)
    from bitsandbytes.optim import AdamW  # lazy: only these optimizers need bitsandbytes (the qlora extra)

    return AdamW(groups, optim_bits=8 if config.optim.endswith("8bit") else 32, is_paged=config.optim.startswith("paged"),
                 **options)


@dataclass
class Prepared:
    """What an engine's ``prepare`` returns (``PlainEngine.prepare``, and its subclasses'): the prepared objects and
    the run's ``window.StepPlan``."""

    model: object
    optimizer: object
    scheduler: object
    train_dataloader: object
    eval_dataloader: object
    plan: object  # window.StepPlan: the run's length in optimizer steps


def _whole(tensor):
    """A ``DTensor`` (FSDP2's shard) gathered whole (collective); any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class PlainEngine:
    """One process or DDP: gradients all-reduced on a window's last micro-batch, weights whole on every rank."""

    name = "plain"  # what reports call the engine ("DDP" with several processes)

    sync_each_batch = False  # gradients synchronised on every micro-batch of a window (FSDP) or on its last
    generation_synced = False  # the weights are whole on every rank: each generates alone
    eval_may_split_batch = True  # no collective inside the forward: a rank may retry half a batch alone
    # every process must run as many micro-batches in a window (a collective in each forward or backward): a
    # packed window keeps its N micro-batches (finetune.data.packing), or processes would wait on each other forever
    lockstep_windows = False
    local_backward = True  # a backward runs on one process alone, no collective inside (verify's determinism check)
    shards_weights = False  # the engine places and shards the model itself (Trainer leaves it where it was loaded)
    holds_quantized_base = True  # trains adapters on a bitsandbytes 4-bit/8-bit base (--load_in_4bit/--load_in_8bit)

    @classmethod
    def label(cls, num_processes: int) -> str:
        """What reports call the engine on ``num_processes`` processes: "plain", "DDP", "FSDP", "DeepSpeed"."""
        return "DDP" if cls.name == "plain" and num_processes > 1 else cls.name

    def resume_on_another_count(self, before: int, now: int, path) -> str | None:
        """Whether this engine's checkpoint at ``path``, written by ``before`` processes, resumes on ``now`` (the
        caller asks only where they differ): the banner's line where the state is resharded, None where nothing
        is to say (whole weights and optimizer state on every rank: any process count). Raises
        ``FinetuneError`` (one line naming the fix) where it cannot."""
        return None

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.note: str | None = None  # a banner line, set by configure/prepare

    def configure(self, config, per_machine: bool = False) -> None:
        """Before the model is built: adapt Accelerate's plugin to the run's flags. ``per_machine``: each machine
        keeps its own copy of the run's files (no shared filesystem, ``distributed.plan_storage``)."""

    def configure_trainer(self) -> None:
        """For the Trainer backend, once ``Trainer`` has built its ``Accelerator`` and before it prepares the
        model: adapt its plugin as ``configure`` does ours (nothing to do without sharding)."""

    def precision(self) -> str:
        """The precision the run trains in ("fp16", "bf16" or "no"), measured under autocast."""
        return effective_mixed_precision(self.accelerator)

    def prepare(self, config, model, train_dataloader, eval_dataloader, plan_for) -> Prepared:
        """``accelerator.prepare`` model, AdamW and dataloaders; the schedule sized in optimizer steps by
        ``plan_for(micro_batches_per_epoch)`` (the backend's ``window.plan_steps`` for its config: micro-batches
        per process, as the prepared dataloader yields them)."""
        from transformers import get_scheduler  # lazy: see the top

        accelerator = self.accelerator
        optimizer = build_optimizer(model, config)
        model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader)
        plan = plan_for(len(train_dataloader))
        # not prepared: Accelerate's wrapper would step it once per process per call
        scheduler = get_scheduler(config.lr_scheduler_type, optimizer.optimizer, num_warmup_steps=plan.steps(config.warmup_steps),
                                  num_training_steps=plan.max_steps)
        accelerator.register_for_checkpointing(scheduler)  # not prepared, so registered by hand
        return Prepared(model, optimizer, scheduler, train_dataloader, eval_dataloader, plan)

    def eval_model(self, model):
        """The module evaluation calls: under DDP the module it wraps, so no forward of DDP's runs outside
        training (its first forward after a training step broadcasts the buffers, and a retry of half a batch
        on one rank after out-of-memory would broadcast them again there alone: torch 2.13
        ``nn/parallel/distributed.py`` ``_pre_forward``/``_post_forward``, ``require_forward_param_sync``)."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    @contextlib.contextmanager
    def generation_model(self, model):
        """A context manager giving the module to call ``generate`` on: the model unwrapped
        (``accelerator.unwrap_model``; ``generate`` is the underlying model's method). Collective where the engine
        shards the weights (every process enters it)."""
        yield self.accelerator.unwrap_model(model)

    def learning_rate(self, optimizer, scheduler) -> float:
        """The learning rate the next optimizer step uses."""
        return scheduler.get_last_lr()[0]

    def chunked_loss_refusal(self, model) -> str | None:
        """Why the chunked loss cannot use ``model``'s output embedding outside its forward, or None."""
        return None

    def full_parameters(self, model) -> dict:
        """Every parameter whole, as fp32 CPU copies: name -> tensor (the weights the optimizer updates). Under
        FSDP2 a parameter is a ``DTensor`` shard: ``full_tensor()`` all-gathers it (collective: every process
        calls this)."""
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        return {name: _whole(param).detach().float().cpu().clone() for name, param in unwrapped.named_parameters()}

    def full_buffers(self, model) -> dict:
        """Every floating-point buffer (BatchNorm's running statistics, ...) as fp32 CPU copies: name -> tensor."""
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        return {name: _whole(buf).detach().float().cpu().clone() for name, buf in unwrapped.named_buffers()
                if buf.is_floating_point()}

    def save_model(self, model, tokenizer, output_dir: Path, config, writes: bool) -> None:
        """Write the model (safetensors) and tokenizer, or with ``--use_peft`` an adapter (``lora.save_adapter``).
        Collective: every process calls it; those with ``writes`` write (global rank 0, or one per machine)."""
        accelerator = self.accelerator
        accelerator.wait_for_everyone()
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        # a torch.compile'd model names every tensor "_orig_mod.<name>": from_pretrained needs the plain names
        gathered = accelerator.get_state_dict(model)
        if gathered is None:  # ZeRO-3 consolidates the 16-bit weights on global rank 0 only
            if writes:
                raise FinetuneError("the final model's weights were gathered on global rank 0 only, but this process "
                                    "must write a copy: give every machine one shared --output_dir.")
            return
        state_dict = {name.removeprefix("_orig_mod."): tensor for name, tensor in gathered.items()}
        if is_peft_model(unwrapped):
            save_adapter(unwrapped, state_dict, tokenizer, output_dir, config.model_name_or_path, writes,
                         merge=config.merge_adapter)
            return
        if writes:  # global rank 0, or a machine's local main process writing that machine's copy
            save_pretrained_here(unwrapped, output_dir, state_dict=state_dict)
            tokenizer.save_pretrained(output_dir)
