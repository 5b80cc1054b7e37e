"""One resolution of a run: what ``train``, ``compare``, ``verify`` and ``plan`` do between parsing the flags and
their own work, in this order, on every process.

1. the recipe loaded and the config validated;
2. the process group started with the run's collective timeout (``--ddp_timeout``), where the launcher asked for
   several processes; on a CPU, a requested fp16 turned into what the bf16 measurements for the recipe decide
   (``engine.cpu_bf16.choose``: bf16 where it was measured faster with the metric held, else fp32, as Accelerate runs);
3. for a command that writes a run (``train``, ``compare``): the output directory checked
   (``output.check_output_dir``), ``--push_to_hub`` checked (``hub.prepare``), and under
   ``--resume_from_checkpoint auto`` a finished run found (``metrics.json``: nothing to do), each agreed over the
   processes (``distributed.agree``) so every process goes on or stops together;
4. the torch threads this process may use (``use_available_cpu_cores``);
5. the batch plan (``--total_batch_size``: ``planner.plan_for``) applied to the config (``planner.apply_plan``),
   for the commands that run it (``plan`` prints the planner's table instead).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch

from finetune import distributed
from finetune.engine import cpu_bf16
from finetune.lifecycle.output import check_output_dir, finished_metrics
from finetune.outputs import hub
from finetune.planner import apply_plan, plan_for
from finetune.recipes import load_recipe
from finetune.signals import launched_by_accelerate


@dataclass(frozen=True)
class Resolution:
    """A resolved run: ``config`` (planned: the micro-batch and accumulation the run uses), its ``recipe``
    module, ``hub`` (``hub.prepare``'s ``HubPush`` on the main process under ``--push_to_hub``, else None) and
    ``finished`` (under ``--resume_from_checkpoint auto``, the metrics of the finished run already in
    ``--output_dir``: there is nothing to do, and the process group has been left; else None)."""

    config: object
    recipe: ModuleType
    hub: object | None = None
    finished: dict | None = None


def use_available_cpu_cores() -> str | None:
    """Undo ``accelerate launch``'s ``OMP_NUM_THREADS=1`` default on a CPU (accelerate 1.15 ``commands/launch.py``):
    torch threads = this process's cores / local processes. Returns the note printed, or None if unchanged."""
    if not launched_by_accelerate() or os.environ.get("OMP_NUM_THREADS") != "1" or torch.cuda.is_available():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = cores // distributed.local_process_count()
    if threads <= 1:
        return None
    torch.set_num_threads(threads)
    note = (f"Using {threads} CPU threads per process (accelerate launch defaults to OMP_NUM_THREADS=1 on a CPU; "
            "pass --num_cpu_threads_per_process N to choose).")
    if distributed.is_main_process():
        print(note)
    return note


def _finished_run(config) -> dict | None:
    """``--resume_from_checkpoint auto`` over a finished run: its metrics, agreed over the processes (on machines
    of their own each has its own copy), said once, and the process group left; None where there is work."""
    finished = finished_metrics(config.output_dir)
    if distributed.all_reduce_max(distributed.distributed_state())(float(finished is None)):
        return None
    if distributed.world_size() <= 1 or distributed.process_state().is_main_process:
        print(f"--resume_from_checkpoint auto: {config.output_dir} holds a finished run (metrics.json); "
              "nothing to do.")
    distributed.leave()
    return finished


def resolve(config, *, writes_run: bool = True, plans: bool = True) -> Resolution:
    """Resolve the parsed ``config`` (steps 1-5 of the module docstring). ``writes_run``: step 3 (False for
    ``verify`` and ``plan``, which check their own output directory or write none); ``plans``: step 5. Collective
    with several processes: every process must call it. Raises ``FinetuneError`` (bad flags, an output directory
    that holds another run, a push that cannot happen, a batch that has no exact plan)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we never tokenize inside forked workers
    recipe = load_recipe(config.recipe)
    config.validate()
    if distributed.world_size() > 1:  # the process group starts here, with the run's collective timeout
        distributed.process_state(timeout_seconds=config.ddp_timeout)
    # on a CPU, a requested fp16 becomes what the bf16 measurements for the recipe decide, before the output dir is
    # compared with a previous run's (which recorded the precision it trained in) and before the plan's probes
    state = distributed.process_state()
    chosen = distributed.agree(lambda: cpu_bf16.choose(config, recipe, state.device.type), state)
    if state.num_processes > 1:  # one precision for every process, whatever CPU each machine has
        chosen = cpu_bf16.agreed(config, chosen, distributed.all_reduce_max(state))
    config = chosen
    push = None
    if writes_run:
        # the same outcome on every process: on machines of their own, one output dir can fail alone
        distributed.agree(lambda: check_output_dir(config))
        # --push_to_hub: offline, no token, a namespace it cannot write: one error line now, before any work
        push = distributed.agree(lambda: hub.prepare(config))
        if config.resume_from_checkpoint == "auto" and (finished := _finished_run(config)) is not None:
            return Resolution(config, recipe, finished=finished)
    use_available_cpu_cores()
    if plans and (plan := plan_for(config, recipe)) is not None:
        config = apply_plan(config, plan)
    return Resolution(config, recipe, hub=push)
