"""The DeepSpeed engine: the same loop through Accelerate's DeepSpeed integration. ``accelerator.backward``
runs DeepSpeed's backward (which divides by its ``gradient_accumulation_steps``, set to N) and, on the sync
micro-batch, its optimizer step with its clipping (from ``--max_grad_norm``) and its overflow skip;
``optimizer.step()``/``zero_grad()`` are no-ops there, ``clip_grad_norm_`` reports the norm DeepSpeed computed.

Sources: Accelerate 1.15 ``accelerator.py`` (``_prepare_deepspeed``, ``clip_grad_norm_``, ``backward``),
``utils/deepspeed.py`` (``DummyOptim``, ``DummyScheduler``, the wrappers); DeepSpeed 0.19
``runtime/engine.py`` (``backward``, ``_take_model_step``). The functions of plain values are tested on a CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from transformers import get_scheduler

from finetune.engine.plain import PlainEngine, Prepared, build_optimizer, parameter_groups
from finetune.errors import FinetuneError
from finetune.steps import micro_batches_per_process, plan_steps


def parameter_numel(param) -> int:
    """A parameter's true element count, also where ZeRO-3 left an empty placeholder (``ds_numel``)."""
    return getattr(param, "ds_numel", param.numel())


def parameter_shape(param) -> tuple:
    """A parameter's true shape, also where ZeRO-3 partitioned it into a 1-D placeholder at load time
    (``ds_shape``: transformers loads under ``deepspeed.zero.Init`` then)."""
    return tuple(getattr(param, "ds_shape", param.shape))


class DeepSpeedEngine(PlainEngine):
    """DeepSpeed (ZeRO 1-3) through Accelerate: settings written into its config before ``prepare`` and read
    back from the engine after it, so the run reports what DeepSpeed really runs."""

    generation_synced = True  # ZeRO-3 gathers partitions in every forward: ranks generate in lockstep
    eval_may_split_batch = False  # ZeRO-3 gathers partitions inside the forward

    @property
    def ds_config(self) -> dict:
        return self.accelerator.state.deepspeed_plugin.deepspeed_config

    def configure(self, config) -> None:
        """Write ``--max_grad_norm``, N and the micro-batch into the DeepSpeed config (before ``prepare``, which
        hands it to ``deepspeed.initialize``). Raises ``FinetuneError`` where an explicit value contradicts."""
        self.ds_config.update(deepspeed_config_updates(
            self.ds_config, max_grad_norm=config.max_grad_norm, micro_batch=config.per_device_train_batch_size,
            accumulation_steps=config.gradient_accumulation_steps))

    def precision(self) -> str:
        """The precision the DeepSpeed config enables: DeepSpeed casts the model itself and Accelerate's autocast
        is off, so a measurement would say fp32."""
        return deepspeed_precision(self.ds_config)

    def prepare(self, config, model, train_dataloader, eval_dataloader) -> Prepared:
        """Model, optimizer and schedule in one ``accelerator.prepare`` (it runs ``deepspeed.initialize``), the
        schedule sized before the dataloaders are sharded, from the micro-batches Accelerate will give each
        process. Which optimizer and schedule: ``deepspeed_optimizer_and_scheduler``. Raises ``RuntimeError``
        when the engine runs other settings than asked."""
        accelerator, ds_config = self.accelerator, self.ds_config
        plan = plan_steps(micro_batches_per_process(len(train_dataloader.dataset), config.per_device_train_batch_size,
                                                    accelerator.num_processes), config)
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
        """Read from the optimizer: a schedule from the DeepSpeed config may not answer ``get_last_lr`` before
        its first step."""
        return optimizer.param_groups[0]["lr"]

    def chunked_loss_refusal(self, model) -> str | None:
        if any(hasattr(param, "ds_id") for param in model.parameters()):
            return "the lm_head weight is partitioned by DeepSpeed ZeRO-3 and not whole outside its forward"
        return None


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
