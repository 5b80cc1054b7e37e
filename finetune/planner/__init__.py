"""The batch planner: from a global batch size to a micro-batch and an accumulation count.

The user fixes ``total_batch_size`` B, the samples that make up one optimizer step across all
processes. With P processes, a plan is a micro-batch m (``per_device_train_batch_size``, samples per
process per forward/backward) and N micro-batches per optimizer step (``gradient_accumulation_steps``)
with ``m * N * P == B`` exactly, so the optimisation does not depend on the hardware. Without
``--auto_find_batch_size`` the user's m must be exact; with it, the largest m that fits in memory is found
under each lever setting (activation checkpointing, the loss) and the fitting plans are timed, the fastest
taken.

- ``plans``: the arithmetic (``BatchPlan``, ``valid_plans``, ``plan_batch``, the linear memory model,
  ``choose_plan``, the printed table); no model, no tensor.
- ``probes``: the run's model under one lever setting (``builders.build_model``), asked whether m fits and
  how long a sample takes.
- ``agreement``: every answer agreed over the ranks (``distributed.agreed_max``), so every rank takes the
  same plan.

``plan_for`` is the entry: it returns the plan and edits nothing; ``apply_plan`` builds the run's config from
it (``finetune.lifecycle.resolve`` does both for every command).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import psutil

from finetune.distributed import agreed_max, all_reduce_max, process_state
from finetune.models.quantization import uses_bitsandbytes
from finetune.planner.plans import BatchPlan, Lever, choose_plan, given_plan, plan_table
from finetune.planner.probes import Probe, ProbeTiming, levers

__all__ = ["BatchPlan", "apply_plan", "held_before_probes", "plan_for", "probe_and_choose"]


def plan_for(config, recipe) -> BatchPlan | None:
    """The batch plan of a run with ``--total_batch_size`` (None without it), printed on the main process;
    computed before either backend builds anything, since Accelerate fixes the accumulation steps when the
    Accelerator is created. Edits nothing: the caller applies the plan to a copy of ``config``.

    Without ``--auto_find_batch_size``: ``plans.given_plan`` of the given micro-batch (``lever`` None). With
    it: ``choose_plan`` over the lever settings (``probes.levers``), each probed on every rank and agreed on
    (a plan fits only if it fits on every rank; the slowest rank's time counts), so every rank takes the same
    plan; the chosen lever setting comes back as the plan's ``lever``, after the table of every plan
    considered. Collective with several processes: every process must call it. Raises ``FinetuneError``.
    """
    if not config.total_batch_size:
        return None
    state = process_state()
    if config.resume_from_checkpoint and (recorded := recorded_plan(config, state.num_processes)) is not None:
        if state.is_main_process:
            print(f"Batch plan for --total_batch_size {config.total_batch_size}: {recorded} (the resumed run's, "
                  "from its run_config.json: not planned again)")
        return recorded
    if config.auto_find_batch_size:
        plan = probe_and_choose(config, recipe, state)
    else:
        plan = given_plan(config.per_device_train_batch_size, config.total_batch_size, state.num_processes)
    if state.is_main_process:
        print(f"Batch plan for --total_batch_size {config.total_batch_size}: {plan}"
              + (f"; --packing budget {packing_budget(config, plan)} positions per micro-batch" if config.packing else ""))
    return plan


def apply_plan(config, plan: BatchPlan):
    """``config`` with ``plan``'s micro-batch and accumulation steps and, where the planner chose one
    (``--auto_find_batch_size``), its lever setting (``activation_checkpointing``, ``loss_chunk_size``), the
    plan itself recorded as ``batch_plan`` (``run_config.json``): a new config (``dataclasses.replace``),
    validated, so read-only. Raises ``FinetuneError`` as ``TrainConfig.validate``."""
    levers = plan.lever.config_fields() if plan.lever is not None else {}
    planned = dataclasses.replace(config, per_device_train_batch_size=plan.per_device_train_batch_size,
                                  gradient_accumulation_steps=plan.gradient_accumulation_steps,
                                  batch_plan=plan.to_dict(), **levers)
    planned.validate()
    return planned


def packing_budget(config, plan: BatchPlan) -> int:
    """``--packing``'s positions per micro-batch under ``plan`` (``packing.budget`` with the plan's micro-batch: by
    default m x ``--max_length``, so the memory probed for the plan's micro-batch bounds it)."""
    from finetune.data.packing import budget

    return budget(dataclasses.replace(config, per_device_train_batch_size=plan.per_device_train_batch_size))


def recorded_plan(config, num_processes: int) -> BatchPlan | None:
    """The plan a resumed run was started with (``batch_plan`` in ``<output_dir>/run_config.json``), so a
    resume never re-probes: timing noise could pick another micro-batch, which the resume would then refuse
    as another step. None where nothing was recorded for this effective batch and process count."""
    try:
        recorded = json.loads((Path(config.output_dir) / "run_config.json").read_text()).get("batch_plan")
    except (OSError, ValueError):
        return None
    if not recorded or recorded.get("total_batch_size") != config.total_batch_size \
            or recorded.get("num_processes") != num_processes:
        return None
    lever = recorded.get("lever")
    return BatchPlan(**{**recorded, "lever": Lever(**lever) if lever else None})


def held_before_probes(config) -> int:
    """This process's RSS (bytes) before any probe model exists, with the libraries the run's model and optimizer
    will import loaded first, as a run holds them while it trains: peft under ``--use_peft``, bitsandbytes for a
    quantized base or its optimizers (about 80 and 115 MiB on a CPU; docs/plan.md)."""
    import importlib

    for module, used in (("peft", config.use_peft), ("bitsandbytes", uses_bitsandbytes(config))):
        if used and importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    return psutil.Process().memory_info().rss


def probe_and_choose(config, recipe, state) -> BatchPlan:
    """``--auto_find_batch_size``: ``choose_plan`` over one ``Probe`` per lever setting, each built on every
    rank (a build that fails on one rank fails on all) only once the previous one is freed; print the table. Every
    plan is timed at one sample length (``ProbeTiming``: the run's, or fewer tokens where a timed plan of the
    largest micro-batch would cost over ``probes.PROBE_SECONDS``)."""
    started = time.perf_counter()
    max_over_processes = all_reduce_max(state)
    held = held_before_probes(config)  # before any probe copy of the model exists
    timing = ProbeTiming(config.total_batch_size // state.num_processes, max_over_processes,
                         say=print if state.is_main_process else (lambda *a, **k: None))
    first = {}  # the allocator's and loading's, measured by the first probe (later ones reuse its memory)

    def builder(lever):
        def build() -> Probe:
            made = []

            def attempt() -> int:  # may fail on one rank only (e.g. no room under --max_memory_mb)
                made.append(Probe(config, recipe, state.device, lever, held, timing, **first))
                if not first:
                    first.update(made[-1].first_measurements())
                return 0

            agreed_max(attempt, max_over_processes, "probing the batch size for --auto_find_batch_size")
            return made[0]
        return build

    probes = {lever: builder(lever) for lever in levers(config, recipe, state.device)}
    chosen, candidates = choose_plan(config.total_batch_size, state.num_processes, probes, max_over_processes,
                                     max_over_processes)
    if state.is_main_process:
        print(plan_table(chosen, candidates))
        print(f"Planning took {time.perf_counter() - started:.1f} s (memory probes and timed passes).")
    return dataclasses.replace(chosen.plan, lever=chosen.lever)
