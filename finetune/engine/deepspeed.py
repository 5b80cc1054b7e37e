"""The DeepSpeed engine: the same loop through Accelerate's DeepSpeed integration, whose ``backward`` runs
DeepSpeed's (loss / N, clipping, optimizer step, overflow skip). Sources: accelerate 1.15 ``accelerator.py``,
``utils/deepspeed.py``; DeepSpeed 0.19 ``runtime/engine.py``. Details: docs/multi-node.md#deepspeed."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

from finetune.engine.plain import PlainEngine, Prepared, build_optimizer, parameter_groups
from finetune.errors import FinetuneError


def parameter_numel(param) -> int:
    """A parameter's true element count, also where ZeRO-3 left an empty placeholder (``ds_numel``) or
    bitsandbytes packed two 4-bit weights a byte (``Params4bit``: its ``quant_state.shape`` is the weight's)."""
    state = getattr(param, "quant_state", None)
    if state is not None and getattr(state, "shape", None) is not None:
        return torch.Size(state.shape).numel()
    return getattr(param, "ds_numel", param.numel())


def parameter_shape(param) -> tuple:
    """A parameter's true shape, also where ZeRO-3 left a 1-D placeholder (``ds_shape``)."""
    return tuple(getattr(param, "ds_shape", param.shape))


class DeepSpeedEngine(PlainEngine):
    """DeepSpeed (ZeRO 1-3) through Accelerate: flags written into its config, the settings read back after."""

    holds_quantized_base = False  # not yet: a quantized base is refused (engine.check_quantized_base)

    name = "DeepSpeed"
    generation_synced = True  # ZeRO-3 gathers partitions in every forward: ranks generate in lockstep
    eval_may_split_batch = False  # ZeRO-3 gathers partitions inside the forward
    lockstep_windows = True  # its backward reduces (and steps) inside: every process runs as many
    local_backward = False
    shards_weights = True

    def resume_on_another_count(self, before: int, now: int, path) -> str | None:
        """Refused on another process count: ZeRO partitions the optimizer states per rank, and DeepSpeed's way
        across counts is its universal checkpoint, which finetune does not load yet. Raises ``FinetuneError``."""
        raise FinetuneError(
            f"cannot resume a DeepSpeed checkpoint written by {before} processes on {now}: ZeRO partitions the "
            f"optimizer states per rank. Resume on {before} processes (the micro-batch and accumulation may change, "
            "B must not); DeepSpeed's own way across process counts is its universal checkpoint (python "
            "deepspeed/checkpoint/ds_to_universal.py --input_folder CKPT/pytorch_model --output_folder OUT), which "
            "finetune does not load yet.")

    @property
    def ds_config(self) -> dict:
        return self.accelerator.state.deepspeed_plugin.deepspeed_config

    def configure(self, config, per_machine: bool = False) -> None:
        """Write the flags into the config (``deepspeed_config_updates``); ``FinetuneError`` on a contradiction.
        ``per_machine``: DeepSpeed writes its model states on each machine's local rank 0
        (``checkpoint.use_node_local_storage``, what Trainer sets for ``save_on_each_node``: transformers 5.23
        ``integrations/deepspeed.py``); refused under ZeRO-3, whose 16-bit weights are gathered on rank 0 only."""
        self.ds_config.update(deepspeed_config_updates(
            self.ds_config, max_grad_norm=config.max_grad_norm, micro_batch=config.per_device_train_batch_size,
            accumulation_steps=config.gradient_accumulation_steps))
        if per_machine:
            if (self.ds_config.get("zero_optimization") or {}).get("stage") == 3:
                raise FinetuneError("DeepSpeed ZeRO-3 over machines needs one shared --output_dir: the final model's "
                                    "weights are gathered on global rank 0 only. Give every machine the same directory "
                                    "on a shared filesystem, or use ZeRO stage 1 or 2.")
            self.ds_config.setdefault("checkpoint", {})["use_node_local_storage"] = True

    def precision(self) -> str:
        """``deepspeed_precision`` of the config: DeepSpeed casts the model, autocast would report fp32."""
        return deepspeed_precision(self.ds_config)

    def prepare(self, config, model, train_dataloader, eval_dataloader, plan_for) -> Prepared:
        """One ``accelerator.prepare`` (``deepspeed.initialize``), the schedule sized from each process's
        micro-batches (``plan_for``, as ``PlainEngine.prepare``), known before the dataloader is prepared. Raises
        ``RuntimeError`` if the engine runs other settings than asked."""
        from transformers import get_scheduler  # lazy: as in engine/plain.py (it imports peft)

        accelerator, ds_config = self.accelerator, self.ds_config
        # micro-batches per process as Accelerate's sharded dataloader will yield them (window.micro_batches_per_process)
        rounds = math.ceil(len(train_dataloader.dataset) / config.per_device_train_batch_size)
        plan = plan_for(math.ceil(rounds / accelerator.num_processes))
        warmup = plan.steps(config.warmup_steps)

        def make_schedule(optimizer):
            return get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                                 num_training_steps=plan.max_steps)

        # DeepSpeed drops an empty parameter group (no biases or norms under LoRA): a schedule built before that
        # would hold one learning rate too many, so empty groups are left out first.
        groups = [group for group in parameter_groups(model, config, shape=parameter_shape) if group["params"]]
        optimizer, scheduler = deepspeed_optimizer_and_scheduler(
            groups, config, plan.max_steps, warmup, ds_config, accelerator.num_processes,
            make_optimizer=lambda: build_optimizer(model, config, groups), make_schedule=make_schedule)
        model, optimizer, train_dataloader, eval_dataloader, scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, scheduler)
        if len(train_dataloader) != plan.micro_batches_per_epoch:
            raise RuntimeError(f"DeepSpeed: the schedule was sized for {plan.micro_batches_per_epoch} micro-batches "
                               f"per process per epoch, but the prepared dataloader has {len(train_dataloader)}")
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None:
            settings = deepspeed_engine_settings(wrapped.engine)
            check_deepspeed_engine(settings, max_grad_norm=config.max_grad_norm, precision=self.precision(),
                                   micro_batch=config.per_device_train_batch_size,
                                   accumulation_steps=config.gradient_accumulation_steps)
            self.note = deepspeed_note(settings, ds_config)
        return Prepared(model, optimizer, scheduler, train_dataloader, eval_dataloader, plan)

    def eval_model(self, model):
        """The engine itself: ZeRO-3's partition hooks run in its forward."""
        return model

    def learning_rate(self, optimizer, scheduler) -> float:
        """From the optimizer: a DeepSpeed-config schedule may not answer ``get_last_lr`` before a step."""
        return optimizer.param_groups[0]["lr"]

    def full_parameters(self, model) -> dict:
        """The fp32 master weights whole, name -> CPU tensor: ``deepspeed.utils.safe_get_full_fp32_param`` (ZeRO
        1-3; deepspeed 0.19 ``utils/tensor_fragment.py``), not the 16-bit module weights. Collective under
        ZeRO-3 (every process calls this)."""
        from deepspeed.utils import safe_get_full_fp32_param  # only importable where deepspeed is installed

        return {name: safe_get_full_fp32_param(param).detach().float().cpu().clone()
                for name, param in model.module.named_parameters()}

    def chunked_loss_refusal(self, model) -> str | None:
        if any(hasattr(param, "ds_id") for param in model.parameters()):
            return "the lm_head weight is partitioned by DeepSpeed ZeRO-3 and not whole outside its forward"
        return None


def _is_auto(value) -> bool:
    return value is None or (isinstance(value, str) and value.lower() == "auto")


def deepspeed_config_updates(ds_config: Mapping, *, max_grad_norm: float, micro_batch: int,
                             accumulation_steps: int) -> dict:
    """New top-level DeepSpeed config values (``gradient_clipping``, ``gradient_accumulation_steps``,
    ``train_micro_batch_size_per_gpu``) for each key missing or ``auto``, so DeepSpeed runs the flags. Raises
    ``FinetuneError`` naming each explicit value that contradicts the flags (see docs/multi-node.md#deepspeed)."""
    wanted = {
        "gradient_clipping": (float(max_grad_norm) if max_grad_norm > 0 else 0.0, "--max_grad_norm"),
        "gradient_accumulation_steps": (int(accumulation_steps), "--gradient_accumulation_steps"),
        "train_micro_batch_size_per_gpu": (int(micro_batch), "--per_device_train_batch_size"),
    }
    updates, conflicts = {}, []
    for key, (value, flag) in wanted.items():
        current = ds_config.get(key)
        if _is_auto(current):
            updates[key] = value
            continue
        try:
            same = math.isclose(float(current), value, rel_tol=1e-9, abs_tol=0.0)
        except (TypeError, ValueError):
            same = False
        if not same:
            conflicts.append(f"{key}: {current!r} in the DeepSpeed config, but {flag} is {value!r}")
    if conflicts:
        raise FinetuneError(
            "the DeepSpeed config contradicts the run's flags (" + "; ".join(conflicts) + "). DeepSpeed would use "
            "its own values (clipping inside its optimizer step, its own loss division for accumulation). Set "
            "these keys to `auto` or remove them from the DeepSpeed config, or pass the flags with the config's "
            "values.")
    return updates


def deepspeed_precision(ds_config: Mapping) -> str:
    """"fp16", "bf16" or "no" from the config's ``fp16``/``bf16`` ``enabled`` (bool or "true"/"false"), which
    Accelerate fills from ``--mixed_precision`` (``DeepSpeedPlugin.set_mixed_precision``)."""
    def enabled(section: str) -> bool:
        value = (ds_config.get(section) or {}).get("enabled", False)
        return value is True or str(value).lower() == "true"

    if enabled("fp16"):
        return "fp16"
    if enabled("bf16"):
        return "bf16"
    return "no"


def deepspeed_owns(ds_config: Mapping) -> tuple[bool, bool]:
    """(the config has an ``optimizer`` section, it has a ``scheduler`` section)."""
    return "optimizer" in ds_config, "scheduler" in ds_config


def deepspeed_optimizer_and_scheduler(parameter_groups: list[dict], config, max_steps: int, warmup_steps: int,
                                      ds_config: Mapping, num_processes: int, make_optimizer, make_schedule):
    """The (optimizer, scheduler) for ``accelerator.prepare``: ours, or ``DummyOptim``/``DummyScheduler`` where
    the config owns them (accelerate ``utils/deepspeed.py``). ``max_steps``, ``warmup_steps``: optimizer steps.
    Raises nothing itself; the three cases: docs/multi-node.md#deepspeed."""
    owns_optimizer, owns_scheduler = deepspeed_owns(ds_config)
    if owns_optimizer:
        optimizer = DummyOptim(parameter_groups, lr=config.learning_rate, weight_decay=config.weight_decay)
    else:
        optimizer = make_optimizer()
    if owns_scheduler:
        # Accelerate divides total_num_steps by the processes (it assumes unsharded batches): land on max_steps
        scheduler = DummyScheduler(optimizer, total_num_steps=max_steps * num_processes, warmup_num_steps=warmup_steps)
    elif owns_optimizer:
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=make_schedule)
    else:
        scheduler = make_schedule(optimizer)
    return optimizer, scheduler


def deepspeed_engine_settings(engine) -> dict:
    """What a prepared DeepSpeed engine runs, from its getters: ZeRO stage, clipping (L2 norm; 0 = none),
    accumulation steps, micro-batch (samples), precision."""
    return {"zero_stage": engine.zero_optimization_stage(), "gradient_clipping": float(engine.gradient_clipping()),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
            "precision": "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "no"}


def check_deepspeed_engine(settings: Mapping, *, max_grad_norm: float, micro_batch: int, accumulation_steps: int,
                           precision: str) -> None:
    """Raise ``RuntimeError`` if ``settings`` differ from the flags and the reported ``precision``."""
    wanted = {"gradient_clipping": float(max_grad_norm) if max_grad_norm > 0 else 0.0,
              "gradient_accumulation_steps": accumulation_steps, "train_micro_batch_size_per_gpu": micro_batch,
              "precision": precision}
    wrong = {k: (settings.get(k), v) for k, v in wanted.items() if settings.get(k) != v}
    if wrong:
        raise RuntimeError("DeepSpeed runs other settings than the run asked for (engine, asked): "
                           + ", ".join(f"{k} {got!r} vs {want!r}" for k, (got, want) in wrong.items()))


def deepspeed_note(settings: Mapping, ds_config: Mapping) -> str:
    """One banner line: ZeRO stage, clipping, accumulation, who owns optimizer and schedule."""
    clip = settings["gradient_clipping"]
    owns_optimizer, owns_scheduler = deepspeed_owns(ds_config)
    clipping = f"gradient clipping at norm {clip:g}" if clip else "no gradient clipping"
    return (f"DeepSpeed ZeRO stage {settings['zero_stage']} (as the engine reports it): {clipping} "
            f"(--max_grad_norm), applied inside DeepSpeed's optimizer step; accumulation "
            f"{settings['gradient_accumulation_steps']} x micro-batch {settings['train_micro_batch_size_per_gpu']}; "
            f"optimizer from {'the DeepSpeed config' if owns_optimizer else 'the run (AdamW)'}, LR schedule "
            f"from {'the DeepSpeed config' if owns_scheduler else 'the run (--lr_scheduler_type)'}")
