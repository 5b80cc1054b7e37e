"""Parsing: flags (and a ``--config`` file) into a ``TrainConfig``, with ``transformers.HfArgumentParser``.

Precedence: dataclass default < recipe ``DEFAULTS`` < ``--config`` file < command-line flag. ``--help`` lists the
flags under one heading per section (``SECTIONS``, in that order). An unknown or misspelt flag or file key is one
``FinetuneError`` naming the nearest known one.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import sys
import types
from pathlib import Path
from typing import get_type_hints

import yaml
from transformers import HfArgumentParser

from finetune.argv import HELP, given
from finetune.config.flags import ROLES
from finetune.config.train_config import DERIVED_FIELDS, SECTIONS, TrainConfig, roles
from finetune.config.trl_names import file_mixture, file_precision_switches, take_precision_switches
from finetune.config.your_data import check_your_data_recipe, recipe_defaults, recipe_from_data
from finetune.errors import FinetuneError
from finetune.recipes import load_recipe


class _FlagParser(HfArgumentParser):
    """``HfArgumentParser`` over ``TrainConfig`` with each section's flags under its own heading (``SECTIONS``, in
    that order, so ``--help`` reads by section), and without the ``DERIVED_FIELDS``: no flag for them (their
    defaults still reach the dataclass, which ``parse_args_into_dataclasses`` builds from every init field)."""

    def _add_dataclass_arguments(self, dtype) -> None:
        # HfArgumentParser's own puts all of a dataclass's flags in one group; the rest is as it does it
        groups = {}
        for heading, section in SECTIONS.items():
            about = " ".join(section.__doc__.split()).replace("``", "")  # the docstring, as plain text
            group = self.add_argument_group(heading, description=about)
            groups.update(dict.fromkeys((f.name for f in dataclasses.fields(section)), group))
        type_hints = get_type_hints(dtype)
        for field in dataclasses.fields(dtype):
            if field.init:
                field.type = type_hints[field.name]
                self._parse_dataclass_field(groups.get(field.name, self), field)

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field) -> None:
        if field.name in DERIVED_FIELDS:
            parser.set_defaults(**{field.name: field.default})
            return
        # the parser passes a field's metadata on to add_argument: only "help" (and "aliases") belong there
        flag_only = copy.copy(field)
        flag_only.metadata = types.MappingProxyType({k: v for k, v in field.metadata.items() if k != ROLES})
        HfArgumentParser._parse_dataclass_field(parser, flag_only)


def _refuse_unknown_flags(parser: HfArgumentParser, argv: list[str] | None) -> None:
    """Raise ``FinetuneError`` naming the first flag the parser does not know, and the nearest known one
    (``difflib``), instead of ``HfArgumentParser``'s ``ValueError`` traceback."""
    _, remaining = parser.parse_known_args(args=argv)
    if not remaining:
        return
    flag = next((a for a in remaining if a.startswith("-")), remaining[0])
    name = flag.split("=", 1)[0]
    known = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]}?" if close else " See --help for the flags."
    if not flag.startswith("-"):
        raise FinetuneError(f"unexpected argument {flag!r} (every setting is a --flag VALUE pair).{hint}")
    raise FinetuneError(f"unknown flag {name}.{hint}")


# Keys of an Accelerate config file (``accelerate config``'s YAML) that are no training flag
ACCELERATE_CONFIG_KEYS = {"compute_environment", "distributed_type", "num_machines", "machine_rank", "main_process_ip",
                          "main_process_port", "main_training_function", "use_cpu", "downcast_bf16", "rdzv_backend",
                          "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "deepspeed_config",
                          "fsdp_config", "gpu_ids", "dynamo_config", "enable_cpu_affinity"}


def _split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the ``--config FILE`` value or None, argv without it)."""
    rest, path, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def read_config_file(path: str, world_size: int = 1) -> dict:
    """The training flags a ``--config`` file sets (YAML or JSON; keys are the flags' names): a dict for the
    parser's defaults, so flags on the command line override it. A run's own ``run_config.json`` replays that
    run: its output and resume settings are left to the command line, and its recorded batch plan is taken
    as it is (``auto_find_batch_size`` off: never probed again), refusing another process count. Raises
    ``FinetuneError`` for an unreadable file, an Accelerate config file (naming ``--config_file``), an unknown
    key (naming the nearest flag) or a process count other than the recorded plan's."""
    try:
        values = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise FinetuneError(f"--config {path}: cannot read it as YAML or JSON ({err}).") from None
    if not isinstance(values, dict):
        raise FinetuneError(f"--config {path}: expected a mapping of training flags to values (flag: value).")
    accelerate = sorted(set(values) & ACCELERATE_CONFIG_KEYS)
    if accelerate:
        raise FinetuneError(f"--config {path} is an Accelerate config file ({', '.join(accelerate[:3])}): pass it "
                            f"as --config_file {path} (Accelerate's launcher flag); --config takes training flags.")
    replay = "precision_source" in values or Path(path).name == "run_config.json"
    values = file_precision_switches(values, path)
    if isinstance(values.get("dataset_mixture"), (dict, list)):  # TRL's section under its own name
        from finetune.config.data import canonical_mixture

        values["dataset_mixture"] = canonical_mixture(values["dataset_mixture"])
    values = file_mixture(values, path)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = [key for key in values if key not in fields]
    if unknown:  # each named, never silently ignored (a TRL YAML's keys that we do not implement included)
        def hint(key: str) -> str:
            close = difflib.get_close_matches(key, sorted(fields - set(DERIVED_FIELDS)), n=1, cutoff=0.6)
            return f"{key!r}" + (f" (did you mean {close[0]}?)" if close else "")

        raise FinetuneError(f"--config {path}: unknown key{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(hint(k) for k in unknown)}. Keys are the training flags' names "
                            "(finetune train --help; docs/flags.md).")
    if replay:
        values = {k: v for k, v in values.items() if roles(k).replay}  # where it writes, whether it resumes: ours
        plan = values.get("batch_plan")
        if plan:
            if plan.get("num_processes") != world_size:
                raise FinetuneError(f"--config {path} replays a run planned for {plan.get('num_processes')} "
                                    f"process(es), and this launch has {world_size}: a step would mean another "
                                    "batch. Launch as many processes, or start a new run without its batch_plan.")
            values["auto_find_batch_size"] = False  # the plan's micro-batch and levers are in the file already
    return values


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse command-line flags into a ``TrainConfig``: the recipe's defaults, under a ``--config`` file's
    values (``read_config_file``), under the flags.

    Two passes: the first finds ``--recipe`` (from the flags, else the file); its ``DEFAULTS`` and then the
    file become the parser's defaults; the second parses everything. Raises ``FinetuneError`` for an unknown
    or misspelt flag or file key (naming the nearest known one), an unknown recipe (listing the known ones)
    and a recipe default that is not a flag's field; argparse exits 2 on a malformed value.

    TRL's and TrainingArguments' ``bf16``/``fp16`` (flags or file keys) set ``--mixed_precision``. A recipe's data
    limits apply to its own data only (``recipe_defaults``). ``--help`` prints each flag's effective default for
    the run's recipe and file, then exits 0.
    """
    path, argv = _split_config_flag(list(sys.argv[1:] if argv is None else argv))
    helping = any(arg in HELP for arg in argv)
    argv = take_precision_switches([arg for arg in argv if arg not in HELP])
    file_values = {}
    if path:  # here, not at the top: distributed imports torch and accelerate, which parsing flags does not need
        from finetune.distributed import world_size

        file_values = read_config_file(path, world_size())
    derived = {k: file_values.pop(k) for k in DERIVED_FIELDS if k in file_values}
    if "recipe" in file_values and not given(argv, "--recipe"):
        argv = ["--recipe", str(file_values["recipe"]), *argv]
    inferred = None if given(argv, "--recipe") else recipe_from_data(argv, file_values)
    if inferred is not None:
        argv = ["--recipe", inferred[0], *argv]
    parser = _FlagParser(TrainConfig)
    _refuse_unknown_flags(parser, argv)
    (first,) = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    if not first.list_recipes:
        recipe = load_recipe(first.recipe)
        names = {f.name for f in dataclasses.fields(TrainConfig)} - set(DERIVED_FIELDS)
        unknown = set(recipe.DEFAULTS) - names
        if unknown:
            raise FinetuneError(f"recipe {first.recipe!r} sets unknown config fields: {', '.join(sorted(unknown))}")
        parser.set_defaults(**recipe_defaults(recipe, argv, file_values))
        check_your_data_recipe(recipe, first, argv, file_values)
    parser.set_defaults(**file_values)
    if helping:  # the defaults shown are this run's: the recipe's, under the file's
        parser.print_help()
        sys.exit(0)
    (config,) = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    if derived.get("batch_plan") and config.total_batch_size == derived["batch_plan"].get("total_batch_size"):
        config.batch_plan = derived["batch_plan"]  # the replayed run's plan, recorded again
    if config.output_dir is None:
        config.output_dir = f"outputs/{config.recipe.removesuffix('.py').replace('/', '_')}"
    if inferred is not None:
        config.recipe_source = f"from {inferred[1]}"
    return config
