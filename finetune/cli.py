"""The ``finetune`` console command (``pip install .`` puts it on the PATH; works from any directory).

    finetune train [accelerate launcher flags] --recipe NAME [training flags]
    finetune recipes [--copy NAME [DEST]]
    finetune env
    finetune predict --model DIR TEXT ...
    finetune compare --recipe NAME [training flags]
    finetune verify [accelerate launcher flags] --recipe NAME [training flags] [--verify_steps K]
    finetune plan [accelerate launcher flags] --recipe NAME --total_batch_size B [training flags] [--time]
    finetune check-data --recipe NAME [data flags] [--samples K] [--accept_problems]
    finetune eval --model RUN_DIR --tasks T1,T2 [--limit N] [--num_fewshot k] [--baseline BASE]
    finetune export --model RUN_DIR [--checkpoint step_N] --to merged|gguf [--gguf_outtype T] [--ollama]

The commands are a table (``COMMANDS``: name, entry, launched through ``accelerate launch`` or not, help), from
which ``finetune --help`` is written. Each command hands its arguments to the module that owns it; imports are lazy
so that ``finetune --help`` and ``finetune recipes`` start in well under a second, without importing torch. The
only module that imports the training entry point (``finetune.run``), and only to run it.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Callable

from finetune import __version__
from finetune.argv import wants_help
from finetune.errors import reports_errors


@dataclass(frozen=True)
class Command:
    """One ``finetune`` command: ``name``; ``entry``, ``"module:function"``, the function taking the command's
    arguments and returning the exit code; ``launched``: True when each process of ``accelerate launch --module
    MODULE`` runs the entry (``launch.train_command``: launcher flags mixed with its own, SIGTERM/SIGINT passed on),
    False when it runs in this process; ``help``: its lines in ``finetune --help``."""

    name: str
    entry: str
    launched: bool
    help: str

    @property
    def module(self) -> str:
        return self.entry.split(":")[0]

    def load(self) -> Callable[[list[str]], int]:
        """The entry function, imported now (lazily: ``finetune --help`` and ``recipes`` start without torch)."""
        module, function = self.entry.split(":")
        return getattr(importlib.import_module(module), function)


COMMANDS = (
    Command("train", "finetune.run:main", True,
            """train a recipe: finetune train --recipe bbc-news [flags]. Takes Accelerate's launcher flags
(--config_file FILE, --num_processes N, --multi_gpu, --num_machines, --machine_rank, ...) and the
training flags (finetune train --help); passes SIGTERM/SIGINT on to the training processes"""),
    Command("recipes", "finetune.cli:recipes_command", False,
            """list the recipes and the shipped Accelerate configs (--config_file NAME takes one by name);
finetune recipes --copy NAME [DEST] writes recipe NAME to DEST (default ./<name>.py) to edit and run
with --recipe DEST"""),
    Command("env", "finetune.commands.env:main", False,
            "this machine's versions, CPU, GPUs and Accelerate config, to paste into an issue"),
    Command("predict", "finetune.commands.predict:main", False,
            'predict with a trained model: finetune predict --model DIR "some text" (finetune predict --help)'),
    Command("compare", "finetune.commands.compare:main", False,
            "run the accelerate and Trainer backends side by side: finetune compare --recipe NAME [flags]"),
    Command("verify", "finetune.commands.verify:main", True,
            """prove that accumulation trains what the large batch trains, on this model, precision, engine and
launch: finetune verify [launcher flags] --recipe NAME [flags] [--verify_steps K] (exit 0: exact)"""),
    Command("plan", "finetune.commands.plan:main", True,
            """the batch planner's table without training: every exact plan of --total_batch_size under every
lever, its memory (weights, gradients, optimizer state, activations) and whether it fits; --time"""),
    Command("eval", "finetune.commands.eval:main", False,
            """benchmarks with lm-evaluation-harness, in process: finetune eval --model RUN_DIR|CHECKPOINT|ADAPTER|GGUF
--tasks bbc_topic,bbc_headline [--limit N] [--num_fewshot k] [--baseline BASE] (finetune eval --help)"""),
    Command("export", "finetune.commands.export:main", False,
            """a run's model where it runs, verified against the run: finetune export --model RUN_DIR
[--checkpoint step_N] --to merged|gguf [--gguf_outtype f32|f16|bf16|q8_0] [--ollama] (exit 1: beyond tolerance)"""),
    Command("check-data", "finetune.commands.check_data:main", False,
            """the data as training sees it, without the model's weights: samples with the trained tokens
marked, lengths, truncation, padding, labels, and problems (leakage between the splits, empty
completions, an untrained end-of-turn token); exit 1 on a problem that makes the run wrong"""),
)
BY_NAME = {command.name: command for command in COMMANDS}


def usage() -> str:
    """``finetune --help``: the commands of ``COMMANDS``, each with its help."""
    width = max(len(c.name) for c in COMMANDS) + 2
    lines = [f"usage: finetune COMMAND [ARGS]   (finetune {__version__})", "", "commands:"]
    for command in COMMANDS:
        first, *rest = command.help.splitlines()
        lines.append(f"  {command.name:<{width}}{first}")
        lines += [" " * (width + 2) + line for line in rest]
    return "\n".join(lines) + "\n"


USAGE = usage()


def recipes_command(argv: list[str]) -> int:
    """``finetune recipes``: the recipes and the shipped Accelerate configs; ``--copy NAME [DEST]``: the recipe's file
    written to DEST (``recipes.copy_recipe``). Returns the exit code (2, with one ``error:`` line, for bad input)."""
    from finetune.commands.launch_configs import list_configs  # lazy, and light: no torch
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
    path = copy_recipe(argv[1], argv[2] if len(argv) == 3 else None)  # FinetuneError: main's error line
    print(f"wrote {path}: edit it, then run it with: finetune train --recipe {path}")
    return 0


@reports_errors
def main(argv: list[str] | None = None) -> int:
    """Dispatch ``finetune COMMAND ARGS`` through ``COMMANDS``; returns the exit code (2 for a usage error; a
    ``FinetuneError`` ends as one ``error:`` line). A launched command's ``--help`` is its entry's, in this
    process: nothing is launched (``train --help`` with its training flags, so the defaults shown are the recipe's
    and the config file's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BY_NAME:
        print(f"error: unknown command {name!r}. Commands: {', '.join(BY_NAME)} (finetune --help).", file=sys.stderr)
        return 2
    command = BY_NAME[name]
    if not command.launched:
        return command.load()(rest)
    if wants_help(rest):
        if name != "train":
            return command.load()(["--help"])
        from finetune.commands.launch import split_argv  # lazy, as below

        return command.load()(split_argv(rest)[1])  # the training flags: --help shows their recipe's defaults
    from finetune.commands.launch import train_command  # lazy: `finetune --help` and `recipes` start without torch

    return train_command(rest, module=command.module)


if __name__ == "__main__":
    sys.exit(main())
