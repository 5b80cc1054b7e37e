"""The ``finetune`` console command (``pip install .`` puts it on the PATH; works from any directory).

    finetune train [accelerate launcher flags] --recipe NAME [training flags]
    finetune recipes [--copy NAME [DEST]]
    finetune env
    finetune predict --model DIR TEXT ...
    finetune compare --recipe NAME [training flags]
    finetune verify [accelerate launcher flags] --recipe NAME [training flags] [--verify_steps K]
    finetune plan [accelerate launcher flags] --recipe NAME --total_batch_size B [training flags] [--time]
    finetune check-data --recipe NAME [data flags] [--samples K] [--accept_problems]

Each subcommand hands its arguments to the module that owns it; imports are lazy so that ``finetune
--help`` and ``finetune recipes`` start in well under a second, without importing torch's launcher.
"""

from __future__ import annotations

import sys

from finetune import __version__

USAGE = f"""usage: finetune COMMAND [ARGS]   (finetune {__version__})

commands:
  train     train a recipe: finetune train --recipe bbc-news [flags]. Takes Accelerate's launcher flags
            (--config_file FILE, --num_processes N, --multi_gpu, --num_machines, --machine_rank, ...) and the
            training flags (finetune train --help); passes SIGTERM/SIGINT on to the training processes
  recipes   list the recipes and the shipped Accelerate configs (--config_file NAME takes one by name);
            finetune recipes --copy NAME [DEST] writes recipe NAME to DEST (default ./<name>.py) to edit and run
            with --recipe DEST
  env       this machine's versions, CPU, GPUs and Accelerate config, to paste into an issue
  predict   predict with a trained model: finetune predict --model DIR "some text" (finetune predict --help)
  compare   run the accelerate and Trainer engines side by side: finetune compare --recipe NAME [flags]
  verify    prove that accumulation trains what the large batch trains, on this model, precision, engine and
            launch: finetune verify [launcher flags] --recipe NAME [flags] [--verify_steps K] (exit 0: exact)
  plan      the batch planner's table without training: every exact plan of --total_batch_size under every
            lever, its memory (weights, gradients, optimizer state, activations) and whether it fits; --time
  check-data  the data as training sees it, without the model's weights: samples with the trained tokens
            marked, lengths, truncation, padding, labels, and problems (leakage between the splits, empty
            completions, an untrained end-of-turn token); exit 1 on a problem that makes the run wrong
"""


def recipes_command(argv: list[str]) -> int:
    """``finetune recipes``: the recipes and the shipped Accelerate configs; ``--copy NAME [DEST]``: the recipe's file
    written to DEST (``recipes.copy_recipe``). Returns the exit code (2, with one ``error:`` line, for bad input)."""
    from finetune.errors import FinetuneError
    from finetune.launch_configs import list_configs  # lazy, and light: no torch
    from finetune.recipes import copy_recipe, list_recipes

    if not argv:
        print(list_recipes())
        print("\nAccelerate configs (finetune train --config_file NAME [flags]; or a path to your own):\n")
        print(list_configs())
        return 0
    if argv[0] != "--copy" or len(argv) not in (2, 3):
        print(f"error: finetune recipes takes no arguments, or --copy NAME [DEST]; got {' '.join(argv)!r}.",
              file=sys.stderr)
        return 2
    try:
        path = copy_recipe(argv[1], argv[2] if len(argv) == 3 else None)
    except FinetuneError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    print(f"wrote {path}: edit it, then run it with: finetune train --recipe {path}")
    return 0


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - over the budget; to split
    """Dispatch ``finetune COMMAND ARGS``; returns the exit code (2 for a usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        if any(a in ("-h", "--help") for a in rest):
            from finetune.run import main as run_main  # lazy: see the module docstring

            return run_main(["--help"])
        from finetune.launch import train_command  # lazy: `finetune --help` and `recipes` start without torch

        return train_command(rest)
    if command == "recipes":
        return recipes_command(rest)
    if command == "env":
        from finetune.env import main as env_main  # lazy: see the module docstring

        return env_main(rest)
    if command == "predict":
        from finetune.predict import main as predict_main  # lazy: `finetune --help` and `recipes` start without torch

        return predict_main(rest)
    if command == "compare":
        from finetune.run import main as run_main  # lazy: `finetune --help` and `recipes` start without torch

        return run_main([*rest, "--compare", "True"])
    if command == "check-data":
        from finetune.check_data import main as check_data_main  # lazy: see the module docstring

        return check_data_main(rest)
    if command == "plan":
        if any(a in ("-h", "--help") for a in rest):
            from finetune.plan import main as plan_main  # lazy: see the module docstring

            return plan_main(["--help"])
        from finetune.launch import PLAN_MODULE, train_command  # lazy: see the module docstring

        return train_command(rest, module=PLAN_MODULE)
    if command == "verify":
        if any(a in ("-h", "--help") for a in rest):
            from finetune.verify import main as verify_main  # lazy: see the module docstring

            return verify_main(["--help"])
        from finetune.launch import VERIFY_MODULE, train_command  # lazy: see the module docstring

        return train_command(rest, module=VERIFY_MODULE)
    print(f"error: unknown command {command!r}. Commands: train, recipes, env, predict, compare, verify, plan, "
          "check-data (finetune --help).",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
