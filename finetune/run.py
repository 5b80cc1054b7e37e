"""The training entry point (``accelerate launch finetune/run.py --recipe NAME``, ``-m finetune.run``, ``finetune
train``): flags into a ``TrainConfig``, then the engine. User errors print one ``error:`` line and exit 2 (3 for a
numerical failure, 128 + N after signal N)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

PROCESS_START = time.time()

if __package__ in (None, ""):  # run as a script (accelerate launch finetune/run.py): import the package from
    # the repository root, and keep this folder off sys.path, where its modules would shadow top-level packages
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

if __name__ == "__main__":  # before the slow imports: stop with the launcher (see finetune.signals)
    from finetune.signals import watch_launcher

    watch_launcher()

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we never tokenize inside forked workers

import torch  # noqa: E402 - after the path set-up above

from finetune import compare, distributed, hub, trainer_backend  # noqa: E402
from finetune import train as accelerate_engine  # noqa: E402
from finetune.config import parse_config  # noqa: E402
from finetune.errors import FinetuneError  # noqa: E402
from finetune.output import check_output_dir  # noqa: E402
from finetune.planner import BatchPlan, plan_for  # noqa: E402
from finetune.recipes import list_recipes, load_recipe  # noqa: E402
from finetune.reporting import format_summary  # noqa: E402
from finetune.signals import launched_by_accelerate, watch_launcher  # noqa: E402


def use_available_cpu_cores() -> str | None:
    """Undo ``accelerate launch``'s ``OMP_NUM_THREADS=1`` default on a CPU (accelerate 1.15 ``commands/launch.py``):
    torch threads = this process's cores / local processes. Returns the note printed, or None if unchanged."""
    if not launched_by_accelerate() or os.environ.get("OMP_NUM_THREADS") != "1" or torch.cuda.is_available():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if threads <= 1:
        return None
    torch.set_num_threads(threads)
    note = (f"Using {threads} CPU threads per process (accelerate launch defaults to OMP_NUM_THREADS=1 on a CPU; "
            "pass --num_cpu_threads_per_process N to choose).")
    if int(os.environ.get("RANK", "0")) == 0:
        print(note)
    return note


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


def finished_metrics(output_dir) -> dict | None:
    """The metrics of a finished run in ``output_dir`` (``metrics.json`` is written last, after the final
    model), or None."""
    try:
        return json.loads((Path(output_dir) / "metrics.json").read_text())
    except (OSError, ValueError):
        return None


def run(config) -> dict | None:
    """Run a parsed ``config``: check the output dir, plan the batch (``--total_batch_size``: the engines get
    the planned config, ``apply_plan``), then train with its backend (or ``--compare`` both). Returns the
    metrics (None for ``--compare``). Raises ``FinetuneError``."""
    recipe = load_recipe(config.recipe)
    config.validate()
    if distributed.world_size() > 1:  # the process group starts here, with the run's collective timeout
        distributed.process_state(timeout_seconds=config.ddp_timeout)
    # the same outcome on every process: on machines of their own, one output dir can fail alone
    distributed.agree(lambda: check_output_dir(config))
    # --push_to_hub: offline, no token, a namespace it cannot write: one error line now, before any work
    hub_push = distributed.agree(lambda: hub.prepare(config))
    if config.resume_from_checkpoint == "auto":
        finished = finished_metrics(config.output_dir)
        # every process agrees (on machines of their own, each has its own copy), then all leave together
        if not distributed.all_reduce_max(distributed.distributed_state())(float(finished is None)):
            if distributed.world_size() <= 1 or distributed.process_state().is_main_process:
                print(f"--resume_from_checkpoint auto: {config.output_dir} holds a finished run (metrics.json); "
                      "nothing to do.")
            distributed.leave()
            return finished
    use_available_cpu_cores()
    plan = plan_for(config, recipe)
    if plan is not None:
        config = apply_plan(config, plan)
    if config.compare:
        compare.compare(config)
        return None
    engine = trainer_backend if config.backend == "trainer" else accelerate_engine
    return engine.train(config, recipe, process_start=PROCESS_START, hub=hub_push)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0, or ``FinetuneError.exit_code``). The process stops with its
    launcher (``finetune.signals``): a dead launcher's SIGTERM ends it after a checkpoint, exit 143."""
    watch_launcher()
    try:
        config = parse_config(argv)
        if config.list_recipes:
            print(list_recipes())
            return 0
        metrics = run(config)
    except FinetuneError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    if metrics is not None and int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(metrics, config.output_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
