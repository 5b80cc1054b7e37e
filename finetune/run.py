"""Entry point: ``accelerate launch finetune/run.py --recipe NAME [flags]`` (or ``python finetune/run.py``).

Parses flags into a ``TrainConfig`` (recipe defaults under the flags), then runs the engine. User errors
print one ``error:`` line and exit 2, without a traceback.
"""

from __future__ import annotations

import os
import sys
import time

PROCESS_START = time.time()

if __package__ in (None, ""):  # run as a script: import the package from the repository root, and keep
    # this folder off sys.path, where its modules would shadow top-level packages of the same name
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we never tokenize inside forked workers


def list_recipes() -> str:
    """A table of the registered recipes: name, task, default model, dataset, and hub/offline."""
    from finetune.recipes import RECIPES, load_recipe

    rows = [("name", "task", "model", "dataset", "data source")]
    for name in sorted(RECIPES):
        r = load_recipe(name)
        model = r.DEFAULTS.get("model_name_or_path", "?")
        if os.path.isabs(model):
            model = os.path.basename(os.path.dirname(model)) if os.path.basename(model) == "model" else model
        rows.append((name, r.TASK, model, r.DATASET, "needs hub" if r.NEEDS_HUB else "offline"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_summary(metrics: dict, output_dir: str) -> str:
    """The closing summary: key metrics, one per line, and where the outputs are."""
    keys = ["eval_accuracy", "eval_f1", "eval_loss", "train_loss", "optimizer_steps", "skipped_optimizer_steps",
            "effective_batch_size", "mixed_precision", "train_samples_per_second", "train_runtime", "wall_time"]
    lines = ["", "=" * 60, "Run summary"]
    for key in keys:
        if key in metrics:
            value = metrics[key]
            lines.append(f"  {key:<26} {value:.4f}" if isinstance(value, float) else f"  {key:<26} {value}")
    lines += [f"  outputs in {output_dir}/: model + tokenizer, metrics.json, log.jsonl, run_config.json", "=" * 60]
    return "\n".join(lines)


def use_available_cpu_cores() -> str | None:
    """Undo ``accelerate launch``'s one-thread default on a CPU-only machine.

    Without ``--cpu`` or ``--num_cpu_threads_per_process``, the launcher exports ``OMP_NUM_THREADS=1``
    (accelerate 1.15, ``commands/launch.py``), which halves the speed of a 1-process run on 2 cores. When
    that default is in force, set torch's intra-op threads to the cores available to this process divided
    by the local processes. Returns the note it printed, or None when it changed nothing (a GPU, several
    processes sharing the cores, or a thread count the user chose).
    """
    import torch

    launched = "ACCELERATE_DYNAMO_BACKEND" in os.environ  # set by accelerate launch for its children
    if not launched or os.environ.get("OMP_NUM_THREADS") != "1" or torch.cuda.is_available():
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


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (0 on success, 2 on a user error)."""
    from finetune.config import parse_config
    from finetune.errors import FinetuneError

    try:
        config = parse_config(argv)
        if config.list_recipes:
            print(list_recipes())
            return 0
        config.validate()
        from finetune.output import check_output_dir
        from finetune.recipes import load_recipe

        recipe = load_recipe(config.recipe)
        check_output_dir(config)
        from finetune.train import apply_batch_plan

        use_available_cpu_cores()
        apply_batch_plan(config, recipe)
        if config.compare:
            from finetune.compare import compare

            compare(config, argv if argv is not None else sys.argv[1:])
            return 0
        if config.backend == "trainer":
            from finetune.trainer_backend import train
        else:
            from finetune.train import train
        metrics = train(config, recipe, process_start=PROCESS_START)
    except FinetuneError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(metrics, config.output_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
