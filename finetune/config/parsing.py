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

from finetune.argv import HELP, given, take_values
from finetune.config.flags import ROLES
from finetune.config.train_config import DERIVED_FIELDS, SECTIONS, TrainConfig, roles
from finetune.errors import FinetuneError
from finetune.recipes import check_task, load_recipe


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
    values = _file_precision_switches(values, path)
    if isinstance(values.get("dataset_mixture"), (dict, list)):  # TRL's section under its own name
        from finetune.config.data import canonical_mixture

        values["dataset_mixture"] = canonical_mixture(values["dataset_mixture"])
    values = _file_mixture(values, path)
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


# TrainingArguments' (and TRL's) precision switches, as ``--mixed_precision`` values
_PRECISION_SWITCHES = ("bf16", "fp16")
_TRUE, _FALSE = ("true", "yes", "1", "t", "y"), ("false", "no", "0", "f", "n")
# A recipe's limits on its own data, never applied to data the recipe did not ship (--train_file, --dataset_name)
RECIPE_DATA_LIMITS = ("max_train_samples", "max_eval_samples")
YOUR_DATA_FLAGS = ("train_file", "dataset_name", "dataset_mixture")


def _switch_value(name: str, value, where: str) -> bool:
    """A ``--bf16``/``--fp16`` value (a bool, or true/false text; None: the bare switch) as a bool. Raises
    ``FinetuneError`` for anything else."""
    if value is None or isinstance(value, bool):
        return value is not False
    if str(value).lower() in _TRUE + _FALSE:
        return str(value).lower() in _TRUE
    raise FinetuneError(f"{where}{name}: expected true or false, got {value!r} (or use --mixed_precision no|fp16|bf16).")


def precision_from_switches(switches: dict[str, bool], where: str) -> str | None:
    """TrainingArguments' ``bf16``/``fp16`` booleans (``switches``: the ones given) as a ``--mixed_precision`` value:
    ``bf16``/``fp16`` for the one set true, ``no`` when those given are all false (TRL's configs default to bf16, so
    ``bf16: false`` alone means fp32), None when none is given. Raises ``FinetuneError`` when both are true."""
    if not switches:
        return None
    on = [name for name in _PRECISION_SWITCHES if switches.get(name)]
    if len(on) > 1:
        raise FinetuneError(f"{where}bf16 and fp16 are both true: set one of them (or --mixed_precision bf16|fp16).")
    return on[0] if on else "no"


def _take_precision_switches(argv: list[str]) -> list[str]:
    """``argv`` with ``--bf16``/``--fp16`` (bare, ``--bf16 true``, ``--bf16=false``) turned into
    ``--mixed_precision``. Raises ``FinetuneError`` where they disagree with a ``--mixed_precision`` also given."""
    switches = {}
    for name in _PRECISION_SWITCHES:
        flag_ = f"--{name}"
        if not given(argv, flag_):
            continue
        rest, i, values = [], 0, []
        while i < len(argv):  # the bare switch takes no value unless a boolean word follows it
            arg = argv[i]
            if arg == flag_:
                following = argv[i + 1] if i + 1 < len(argv) else None
                takes = following is not None and following.lower() in _TRUE + _FALSE
                values.append(following if takes else None)
                i += 2 if takes else 1
            elif arg.startswith(flag_ + "="):
                values.append(arg.split("=", 1)[1])
                i += 1
            else:
                rest.append(arg)
                i += 1
        argv = rest
        switches[name] = _switch_value(flag_, values[-1], "")
    mixed = precision_from_switches(switches, "--")
    if mixed is None:
        return argv
    explicit, _ = take_values(argv, "--mixed_precision")
    if explicit and explicit[-1] != mixed:
        raise FinetuneError(f"--mixed_precision {explicit[-1]} and --{'/--'.join(switches)} disagree: pass one of them.")
    return argv if explicit else [*argv, "--mixed_precision", mixed]


def _file_precision_switches(values: dict, path: str) -> dict:
    """A config file's ``bf16``/``fp16`` keys (a TRL or TrainingArguments YAML) as its ``mixed_precision``.
    Raises ``FinetuneError`` where they disagree with a ``mixed_precision`` key of the same file."""
    switches = {name: _switch_value(name, values.pop(name), f"--config {path}: ")
                for name in _PRECISION_SWITCHES if name in values}
    mixed = precision_from_switches(switches, f"--config {path}: ")
    if mixed is not None:
        if values.get("mixed_precision", mixed) != mixed:
            raise FinetuneError(f"--config {path}: mixed_precision {values['mixed_precision']} and "
                                f"{'/'.join(switches)} disagree: keep one of them.")
        values["mixed_precision"] = mixed
    return values


def _file_mixture(values: dict, path: str) -> dict:
    """A config file's TRL ``datasets:`` section (with its ``streaming``/``test_split_size`` keys), or a
    ``dataset_mixture:`` mapping of them, as the file's ``dataset_mixture`` (``data.canonical_mixture`` checks it).
    Raises ``FinetuneError`` for both at once."""
    from finetune.config.data import MIXTURE_KEYS, canonical_mixture

    section = {k: values.pop(k) for k in MIXTURE_KEYS if k in values}
    if not section:
        return values
    if isinstance(values.get("dataset_mixture"), (dict, list)):
        raise FinetuneError(f"--config {path}: both `datasets:` and `dataset_mixture:`; keep one of them.")
    values["dataset_mixture"] = canonical_mixture(section)
    return values


def _recipe_defaults(recipe, argv: list[str], file_values: dict) -> dict:
    """The recipe's ``DEFAULTS`` for this run: without its data limits (``RECIPE_DATA_LIMITS``) where the run
    trains on data the recipe did not ship (``--train_file``/``--dataset_name``, on the command line or in the
    file): a recipe's row cap is for its own corpus, never a user's."""
    defaults = dict(recipe.DEFAULTS)
    own_data = any(given(argv, f"--{name}") or file_values.get(name) for name in YOUR_DATA_FLAGS)
    if own_data:
        for name in RECIPE_DATA_LIMITS:
            defaults.pop(name, None)
    return defaults


def _last(argv: list[str], file_values: dict, name: str):
    """A flag's value: the command line's last, else the config file's, else None."""
    values = [v for v in take_values(argv, f"--{name}")[0] if v is not None]
    return values[-1] if values else file_values.get(name)


def _check_your_data_recipe(recipe, first, argv: list[str], file_values: dict) -> None:
    """Raise ``FinetuneError`` where a recipe that ships no data (``YOUR_DATA``) lacks the model or the data, or
    ``--task`` names another task than the recipe's (``recipes.check_task``)."""
    check_task(recipe, first.recipe, first.task)
    if not getattr(recipe, "YOUR_DATA", False):
        return
    missing = [f"--{name}" for name in ("model_name_or_path",) if not _last(argv, file_values, name)]
    if not any(_last(argv, file_values, name) for name in YOUR_DATA_FLAGS):
        missing.append("--train_file or --dataset_name")
    if missing:
        raise FinetuneError(f"recipe {first.recipe!r} trains your model on your data and ships neither: pass "
                            f"{' and '.join(missing)}.")


def _recipe_from_data(argv: list[str], file_values: dict) -> tuple[str, str] | None:
    """(recipe, why) for a run given your data (``--train_file``/``--dataset_name``) and no recipe: from the data's
    columns (``your_data.recipe_for_columns``), or ``--task``; None without data of yours. Raises its
    ``FinetuneError``s."""
    from finetune.config.your_data import dataset_columns, first_row_columns, mixture_columns, recipe_for_columns

    task, train_file, name, mixture = (_last(argv, file_values, n) for n in ("task", "train_file", "dataset_name",
                                                                            "dataset_mixture"))
    if mixture:
        where = "the dataset mixture's first source"
        columns = mixture_columns(mixture)
        if columns is None and task is None:
            raise FinetuneError(f"{where}: its columns cannot be read without loading it; pass --task "
                                "sft|preference|causal-lm|sequence-classification or --recipe NAME.")
    elif train_file:
        where = f"--train_file {train_file}"
        columns = first_row_columns(train_file)
    elif name:
        where = f"--dataset_name {name}"
        columns = dataset_columns(name, _last(argv, file_values, "dataset_train_split") or "train")
        if columns is None and task is None:
            raise FinetuneError(f"{where}: its columns cannot be read without loading it; pass --task "
                                "sft|preference|causal-lm|sequence-classification or --recipe NAME.")
    else:
        return None
    recipe, why = recipe_for_columns(columns or [], where, task)
    return recipe, f"{why} of {where}"


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse command-line flags into a ``TrainConfig``: the recipe's defaults, under a ``--config`` file's
    values (``read_config_file``), under the flags.

    Two passes: the first finds ``--recipe`` (from the flags, else the file); its ``DEFAULTS`` and then the
    file become the parser's defaults; the second parses everything. Raises ``FinetuneError`` for an unknown
    or misspelt flag or file key (naming the nearest known one), an unknown recipe (listing the known ones)
    and a recipe default that is not a flag's field; argparse exits 2 on a malformed value.

    TRL's and TrainingArguments' ``bf16``/``fp16`` (flags or file keys) set ``--mixed_precision``. A recipe's data
    limits apply to its own data only (``_recipe_defaults``). ``--help`` prints each flag's effective default for
    the run's recipe and file, then exits 0.
    """
    path, argv = _split_config_flag(list(sys.argv[1:] if argv is None else argv))
    helping = any(arg in HELP for arg in argv)
    argv = _take_precision_switches([arg for arg in argv if arg not in HELP])
    file_values = {}
    if path:  # here, not at the top: distributed imports torch and accelerate, which parsing flags does not need
        from finetune.distributed import world_size

        file_values = read_config_file(path, world_size())
    derived = {k: file_values.pop(k) for k in DERIVED_FIELDS if k in file_values}
    if "recipe" in file_values and not given(argv, "--recipe"):
        argv = ["--recipe", str(file_values["recipe"]), *argv]
    inferred = None if given(argv, "--recipe") else _recipe_from_data(argv, file_values)
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
        parser.set_defaults(**_recipe_defaults(recipe, argv, file_values))
        _check_your_data_recipe(recipe, first, argv, file_values)
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
