"""What the sharded engines (FSDP, DeepSpeed) need beyond data parallelism, as functions of plain values so
they are tested on a CPU (where Accelerate 1.15 runs neither: it turns them into MULTI_CPU).

Sources: Accelerate 1.15 ``accelerator.py`` (``accumulate``, ``_prepare_deepspeed``, ``clip_grad_norm_``,
``backward``), ``utils/deepspeed.py`` (``DeepSpeedEngineWrapper``, ``DeepSpeedOptimizerWrapper``,
``DeepSpeedSchedulerWrapper``, ``DummyOptim``, ``DummyScheduler``), ``utils/dataclasses.py``
(``GradientAccumulationPlugin``, ``DeepSpeedPlugin``); DeepSpeed 0.19 ``runtime/engine.py``
(``backward``, ``_take_model_step``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from accelerate.utils import DistributedType, GradientAccumulationPlugin

from finetune.errors import FinetuneError


# ------------------------------------------------------------------------------------------ FSDP
def sync_each_batch(distributed_type) -> bool:
    """Whether gradients are synchronised on every micro-batch of an accumulation window (True) or only on
    its last one (False), for an Accelerate ``DistributedType``.

    True under FSDP (versions 1 and 2): skipping the sync (``no_sync``) keeps every rank's full, unsharded
    gradients alive for the first N-1 micro-batches, so FULL_SHARD saves no gradient memory at all while
    accumulating. With a sync each micro-batch the gradient is reduce-scattered at once and each rank keeps
    only its shard. Exactness is unchanged: each micro-batch's gradient is averaged over the ranks and summed
    into the shard, and a sum of averages is the average of the sums (linear), so the window's gradient is
    the same (up to floating-point summation order); only the communication happens N times instead of once.
    False everywhere else (DDP keeps replicated gradients anyway, so one all-reduce per window is cheaper;
    DeepSpeed manages its own accumulation boundary).
    """
    return distributed_type == DistributedType.FSDP


def accumulation_plugin(num_steps: int, distributed_type) -> GradientAccumulationPlugin:
    """Accelerate's ``GradientAccumulationPlugin`` for ``num_steps`` micro-batches per optimizer step: the
    engine aligns the windows to the data itself (``sync_with_dataloader=False``), and ``sync_each_batch``
    follows ``sync_each_batch(distributed_type)``."""
    return GradientAccumulationPlugin(num_steps=num_steps, sync_with_dataloader=False,
                                      sync_each_batch=sync_each_batch(distributed_type))


# ------------------------------------------------------------------------------------------ DeepSpeed
def _is_auto(value) -> bool:
    return value is None or (isinstance(value, str) and value.lower() == "auto")


def deepspeed_config_updates(ds_config: Mapping, *, max_grad_norm: float, micro_batch: int,
                             accumulation_steps: int) -> dict:
    """The top-level DeepSpeed config values that make DeepSpeed run what the flags say, to apply before
    ``accelerator.prepare``: ``{"gradient_clipping": ..., "gradient_accumulation_steps": ...,
    "train_micro_batch_size_per_gpu": ...}`` for each key that is missing or ``auto``. Pure: reads
    ``ds_config``, returns a new dict.

    - ``gradient_clipping`` = ``max_grad_norm`` (``--max_grad_norm``, an L2 norm; <= 0 means no clipping,
      which DeepSpeed spells 0.0). DeepSpeed clips inside its own optimizer step, which Accelerate runs
      inside ``accelerator.backward``; ``accelerator.clip_grad_norm_`` only reports the norm. Left ``auto``,
      Accelerate would fill in 1.0 whatever ``--max_grad_norm`` says.
    - ``gradient_accumulation_steps`` = N (micro-batches per optimizer step). DeepSpeed divides each loss
      by its own value, and Accelerate replaces ours by it on a mismatch (with a warning): the exact
      window scaling in ``train.py`` would be wrong.
    - ``train_micro_batch_size_per_gpu`` = ``micro_batch`` (samples). Left ``auto``, Accelerate takes the
      smaller of the training and evaluation batch sizes.

    Raises ``FinetuneError`` naming every explicit value in ``ds_config`` that contradicts the flags (the
    fix: set it to ``auto`` or remove it, or pass the matching flag): an explicit value is never
    overridden and never silently ignored.
    """
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
    """The precision a DeepSpeed run trains in: "fp16", "bf16" or "no", from the DeepSpeed config's
    ``fp16.enabled`` / ``bf16.enabled`` (booleans, or "true"/"false"), which Accelerate fills from
    ``--mixed_precision`` (``DeepSpeedPlugin.set_mixed_precision``) unless the config sets them. Under
    DeepSpeed Accelerate turns its own autocast off (``AcceleratorState.mixed_precision`` is "no") and
    DeepSpeed casts the model itself, so measuring ``accelerator.autocast()`` would report fp32."""
    def enabled(section: str) -> bool:
        value = (ds_config.get(section) or {}).get("enabled", False)
        return value is True or str(value).lower() == "true"

    if enabled("fp16"):
        return "fp16"
    if enabled("bf16"):
        return "bf16"
    return "no"


def deepspeed_owns(ds_config: Mapping) -> tuple[bool, bool]:
    """(the DeepSpeed config defines the optimizer, it defines the LR scheduler): its ``optimizer`` and
    ``scheduler`` sections."""
    return "optimizer" in ds_config, "scheduler" in ds_config


def deepspeed_optimizer_and_scheduler(parameter_groups: list[dict], config, max_steps: int, warmup_steps: int,
                                      ds_config: Mapping, num_processes: int, make_optimizer, make_schedule):
    """The (optimizer, scheduler) pair to hand to ``accelerator.prepare`` together with the model under
    DeepSpeed, as Accelerate's DeepSpeed integration documents it:

    - neither in the config: ours (``make_optimizer()``, AdamW; ``make_schedule(optimizer)``, a torch
      schedule sized in optimizer steps). Accelerate wraps the schedule in ``AcceleratedScheduler``; the
      Accelerator is built with ``step_scheduler_with_optimizer=False`` so each call of its ``step()`` is
      one step (with True it would step ``num_processes`` times per call), and the engine calls it only
      after a real optimizer step, never after an fp16 overflow skip.
    - optimizer in the config, not the schedule: ``DummyOptim(parameter_groups, lr, weight_decay)`` and
      ``DummyScheduler(lr_scheduler_callable=make_schedule)``: DeepSpeed builds our schedule on its
      optimizer and steps it inside its optimizer step, only when the step was applied (not on overflow).
      Accelerate's ``DeepSpeedSchedulerWrapper.step()`` is a no-op, so the engine's call does nothing.
    - schedule in the config: ``DummyScheduler(optimizer, total_num_steps, warmup_num_steps)`` (with
      ``DummyOptim`` if the optimizer is in the config too); ``auto`` values are filled by Accelerate.
      Accelerate divides ``total_num_steps`` by the number of processes (it assumes a count of
      unsharded batches), so ``max_steps x num_processes`` is passed to land on ``max_steps``.

    ``max_steps``, ``warmup_steps``: optimizer steps. Returns the pair; raises nothing itself.
    """
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    owns_optimizer, owns_scheduler = deepspeed_owns(ds_config)
    if owns_optimizer:
        optimizer = DummyOptim(parameter_groups, lr=config.learning_rate, weight_decay=config.weight_decay)
    else:
        optimizer = make_optimizer()
    if owns_scheduler:
        scheduler = DummyScheduler(optimizer, total_num_steps=max_steps * num_processes, warmup_num_steps=warmup_steps)
    elif owns_optimizer:
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=make_schedule)
    else:
        scheduler = make_schedule(optimizer)
    return optimizer, scheduler


def deepspeed_engine_settings(engine) -> dict:
    """What a prepared DeepSpeed engine (``accelerator.deepspeed_engine_wrapped.engine``) really runs, from
    its own getters: ZeRO stage, gradient clipping (L2 norm; 0 = none), accumulation steps, micro-batch
    (samples) and precision ("fp16", "bf16" or "no")."""
    return {"zero_stage": engine.zero_optimization_stage(), "gradient_clipping": float(engine.gradient_clipping()),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
            "precision": "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "no"}


def check_deepspeed_engine(settings: Mapping, *, max_grad_norm: float, micro_batch: int, accumulation_steps: int,
                           precision: str) -> None:
    """Raise ``RuntimeError`` if the engine (``deepspeed_engine_settings``) runs something other than the flags
    and the reported ``precision`` say: the values written before ``prepare`` (``deepspeed_config_updates``)
    must be the ones DeepSpeed took, or the run's report would be wrong."""
    wanted = {"gradient_clipping": float(max_grad_norm) if max_grad_norm > 0 else 0.0,
              "gradient_accumulation_steps": accumulation_steps, "train_micro_batch_size_per_gpu": micro_batch,
              "precision": precision}
    wrong = {k: (settings.get(k), v) for k, v in wanted.items() if settings.get(k) != v}
    if wrong:
        raise RuntimeError("DeepSpeed runs other settings than the run asked for (engine, asked): "
                           + ", ".join(f"{k} {got!r} vs {want!r}" for k, (got, want) in wrong.items()))


def deepspeed_note(settings: Mapping, ds_config: Mapping) -> str:
    """One banner line from the engine's own settings (``deepspeed_engine_settings``): the ZeRO stage, the
    clipping DeepSpeed applies, and who owns optimizer and schedule (``ds_config``)."""
    clip = settings["gradient_clipping"]
    owns_optimizer, owns_scheduler = deepspeed_owns(ds_config)
    clipping = f"gradient clipping at norm {clip:g}" if clip else "no gradient clipping"
    return (f"DeepSpeed ZeRO stage {settings['zero_stage']} (as the engine reports it): {clipping} "
            f"(--max_grad_norm), applied inside DeepSpeed's optimizer step; accumulation "
            f"{settings['gradient_accumulation_steps']} x micro-batch {settings['train_micro_batch_size_per_gpu']}; "
            f"optimizer from {'the DeepSpeed config' if owns_optimizer else 'the run (AdamW)'}, LR schedule "
            f"from {'the DeepSpeed config' if owns_scheduler else 'the run (--lr_scheduler_type)'}")


def grad_norm_value(grad_norm) -> float | None:
    """A gradient norm as a float for the log: a tensor (most engines), a float (DeepSpeed's
    ``get_global_grad_norm``), or None (DeepSpeed with gradient-norm computation off) -> None."""
    return None if grad_norm is None else float(grad_norm)
