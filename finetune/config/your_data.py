"""Training without a recipe: the recipe (and so the task) follows from the data's columns, as TRL's dataset formats
define them (trl 1.16 ``trl/data_utils.py``: ``is_conversational``, the preference and language-modeling types).

- ``messages`` or ``conversations`` (ShareGPT), or ``prompt`` + ``completion``: ``sft`` (completion-only loss);
- ``chosen`` + ``rejected`` (with ``prompt``, or the prompt implicit in both): ``dpo``;
- ``prompt`` alone (prompt-only rows) with ``--reward_funcs``: ``grpo``;
- ``text``: ``clm`` (with ``label`` too, as ``trl sft`` reads such data: ``--task sequence-classification`` for a
  classifier);
- columns of two formats at once, or of none: one ``error:`` line listing the columns found and the choices.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from finetune.argv import given, take_values
from finetune.errors import FinetuneError
from finetune.recipes import check_task

# --task: a task's name -> the recipe that trains it on your data
TASK_RECIPES = {"sft": "sft", "preference": "dpo", "causal-lm": "clm", "sequence-classification": "classify",
                "grpo": "grpo"}


def first_row_columns(path: str) -> list[str]:
    """The column names of a data file's first row, reading as little as possible: a JSON-lines file's first line,
    a JSON file's first record (an array of records, or a mapping of columns), a CSV file's header. Raises
    ``FinetuneError`` for a missing or unreadable file."""
    file = Path(path)
    if not file.is_file():
        raise FinetuneError(f"--train_file {path}: no such file.")
    try:
        if file.suffix == ".csv":
            with file.open(newline="", encoding="utf-8") as handle:
                return next(csv.reader(handle), [])
        with file.open(encoding="utf-8") as handle:
            first = next((line for line in handle if line.strip()), "")
        try:
            row = json.loads(first)
        except json.JSONDecodeError:  # not JSON lines: one JSON document
            row = json.loads(file.read_text(encoding="utf-8"))
            row = row[0] if isinstance(row, list) and row else row
        if isinstance(row, dict) and isinstance(row.get("data"), list) and row["data"]:  # {"data": [...]} files
            row = row["data"][0]
        return list(row) if isinstance(row, dict) else []
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FinetuneError(f"--train_file {path}: cannot read its first row as CSV or JSON ({err}).") from None


def dataset_columns(name: str, split: str) -> list[str] | None:
    """The columns of ``--dataset_name``'s ``split`` where they can be read locally (a ``save_to_disk`` folder, or
    a folder of data files: its first file's first row); None for a Hub name, whose loader says what it needs."""
    path = Path(name)
    if not path.is_dir():
        return None
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        import datasets  # lazy: flags are parsed without it

        loaded = datasets.load_from_disk(str(path))
        return list((loaded[split] if isinstance(loaded, datasets.DatasetDict) and split in loaded else
                     next(iter(loaded.values())) if isinstance(loaded, datasets.DatasetDict) else loaded).column_names)
    files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json", ".csv") and p.is_file())
    return first_row_columns(str(files[0])) if files else None


def mixture_columns(mixture: str) -> list[str] | None:
    """The columns of a dataset mixture's first source (``--dataset_mixture``'s canonical JSON) where they can be read
    locally: its selected ``columns``, a local ``data_files`` file's first row, or a local folder's; None otherwise."""
    source = json.loads(mixture)["datasets"][0]
    if source.get("columns"):
        return list(source["columns"])
    files = source.get("data_files")
    first = files if isinstance(files, str) else files[0] if isinstance(files, list) and files else None
    if isinstance(files, dict):
        first = next(iter(files.values()), None)
        first = first[0] if isinstance(first, list) else first
    if isinstance(first, str) and Path(first).is_file():
        return first_row_columns(first)
    return dataset_columns(source["path"], source.get("split") or "train")


def recipe_for_columns(columns: list[str], where: str, task: str | None = None,
                       rewards: bool = False) -> tuple[str, str]:
    """(recipe, why) for data with ``columns`` (``where``: the flag and its value, for messages); ``task``: a task's
    name from ``--task`` (``TASK_RECIPES``), which wins; ``rewards``: ``--reward_funcs`` was given, so prompt-only
    rows (``prompt`` and no completion of any format) are GRPO's. Raises ``FinetuneError`` for an unknown task, columns no
    format fits, or ``text`` + ``label`` without ``--task`` (listing the choices)."""
    if task is not None:
        if task not in TASK_RECIPES:
            raise FinetuneError(f"--task {task}: unknown; choose one of {', '.join(TASK_RECIPES)}.")
        return TASK_RECIPES[task], f"--task {task}"
    found = set(columns)
    formats = [(names, recipe) for names, recipe in ((("messages",), "sft"), (("conversations",), "sft"),
                                                       (("chosen", "rejected"), "dpo"), (("prompt", "completion"), "sft"),
                                                       (("text",), "clm")) if set(names) <= found]
    if len({recipe for _, recipe in formats}) > 1:
        shown = "; ".join(" + ".join(names) + f" ({recipe})" for names, recipe in formats)
        raise FinetuneError(f"{where} has columns of several formats ({shown}): pass --task "
                            "sft|preference|causal-lm|sequence-classification or --recipe NAME, or keep one format's "
                            "columns.")
    if formats:
        names, recipe = formats[0]
        why = "the column(s) " + " + ".join(names)
        if recipe == "clm" and "label" in found:
            why += " (label unused: --task sequence-classification trains a classifier)"
        return recipe, why
    if "prompt" in found and rewards:
        return "grpo", "the column prompt alone (prompt-only rows) with --reward_funcs"
    if "prompt" in found:
        raise FinetuneError(f"{where} has prompt-only rows (online RL): pass --reward_funcs module:function to train "
                            "them with GRPO, or add completion (sft) or chosen + rejected (dpo) columns.")
    raise FinetuneError(f"{where} has columns {', '.join(columns) or '(none)'}, none of TRL's formats: messages or "
                        "conversations, prompt + completion (sft); prompt + chosen + rejected (dpo); text (clm); "
                        "text + label with --task sequence-classification. Or pass --recipe NAME.")


# ---- the recipe of a run given your data, as parse_config resolves it
# A recipe's limits on its own data, never applied to data the recipe did not ship (--train_file, --dataset_name)
RECIPE_DATA_LIMITS = ("max_train_samples", "max_eval_samples")


YOUR_DATA_FLAGS = ("train_file", "dataset_name", "dataset_mixture")


def recipe_defaults(recipe, argv: list[str], file_values: dict) -> dict:
    """The recipe's ``DEFAULTS`` for this run: without its data limits (``RECIPE_DATA_LIMITS``) where the run
    trains on data the recipe did not ship (``--train_file``/``--dataset_name``, on the command line or in the
    file): a recipe's row cap is for its own corpus, never a user's."""
    defaults = dict(recipe.DEFAULTS)
    own_data = any(given(argv, f"--{name}") or file_values.get(name) for name in YOUR_DATA_FLAGS)
    if own_data:
        for name in RECIPE_DATA_LIMITS:
            defaults.pop(name, None)
    return defaults


def last_value(argv: list[str], file_values: dict, name: str):
    """A flag's value: the command line's last, else the config file's, else None."""
    values = [v for v in take_values(argv, f"--{name}")[0] if v is not None]
    return values[-1] if values else file_values.get(name)


def check_your_data_recipe(recipe, first, argv: list[str], file_values: dict) -> None:
    """Raise ``FinetuneError`` where a recipe that ships no data (``YOUR_DATA``) lacks the model or the data, or
    ``--task`` names another task than the recipe's (``recipes.check_task``)."""
    check_task(recipe, first.recipe, first.task)
    if not getattr(recipe, "YOUR_DATA", False):
        return
    missing = [f"--{name}" for name in ("model_name_or_path",) if not last_value(argv, file_values, name)]
    if not any(last_value(argv, file_values, name) for name in YOUR_DATA_FLAGS):
        missing.append("--train_file or --dataset_name")
    if missing:
        raise FinetuneError(f"recipe {first.recipe!r} trains your model on your data and ships neither: pass "
                            f"{' and '.join(missing)}.")


def recipe_from_data(argv: list[str], file_values: dict) -> tuple[str, str] | None:
    """(recipe, why) for a run given your data (``--train_file``/``--dataset_name``) and no recipe: from the data's
    columns (``your_data.recipe_for_columns``), or ``--task``; None without data of yours. Raises its
    ``FinetuneError``s."""
    task, train_file, name, mixture = (last_value(argv, file_values, n) for n in ("task", "train_file", "dataset_name",
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
        columns = dataset_columns(name, last_value(argv, file_values, "dataset_train_split") or "train")
        if columns is None and task is None:
            raise FinetuneError(f"{where}: its columns cannot be read without loading it; pass --task "
                                "sft|preference|causal-lm|sequence-classification or --recipe NAME.")
    else:
        return None
    rewards = bool(last_value(argv, file_values, "reward_funcs"))
    recipe, why = recipe_for_columns(columns or [], where, task, rewards)
    return recipe, f"{why} of {where}"
