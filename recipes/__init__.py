"""The recipe registry: plain data, name -> module.

This folder is the repository's top-level ``recipes/``, imported and installed as ``finetune.recipes`` (the
``package-dir`` in pyproject.toml; a source checkout loads it through ``finetune/__init__.py``).

A recipe module defines (see ``recipes/bbc_news.py``):

- ``NAME``, ``DESCRIPTION`` (one line), ``TASK`` (a task's name in ``finetune.tasks.TASKS``:
  "sequence-classification", "causal-lm", "sft", "preference" or "grpo"), ``DATASET``,
  ``NEEDS_HUB`` (bool), ``TEXT_COLUMNS`` (the input column names), ``METRICS`` (shipped metric name -> compute kwargs),
  ``DEFAULTS`` (a dict of ``TrainConfig`` fields);
- ``load_raw_datasets(config) -> datasets.DatasetDict`` with ``train`` and ``validation`` splits holding
  ``TEXT_COLUMNS`` and, for classification, a ``ClassLabel`` ``label`` column;
- optionally ``build_model(config, label_names) -> PreTrainedModel``: a model of the recipe's own (label names
  None for causal LM); without it the task loads ``--model_name_or_path``. A ``transformers`` model whose
  forward takes ``labels``-free inputs and returns ``.logits`` (and, for mixture-of-experts, ``.aux_loss``);
- optionally ``GENERATION`` (a dict: ``max_new_tokens``, ``batch_size``, ``num_samples``): evaluation also
  generates completions for that many validation prompts and scores them with ``METRICS`` (instruction tuning);
- optionally ``HUB_DATASET`` ((name, configuration) on the Hub): the model card names the dataset it came from.

Model, tokenizer and tokenization are shared builders in ``finetune.data.loading``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

from finetune.errors import FinetuneError

RECIPES: dict[str, str] = {
    "bbc-news": "finetune.recipes.bbc_news",
    "bbc-news-clm": "finetune.recipes.bbc_news_clm",
    "bbc-headlines": "finetune.recipes.bbc_headlines",
    "bbc-headlines-dpo": "finetune.recipes.bbc_headlines_dpo",
    "bbc-lead-headlines": "finetune.recipes.bbc_lead_headlines",
    "bbc-topic-grpo": "finetune.recipes.bbc_topic_grpo",
    "glue-mrpc": "finetune.recipes.glue_mrpc",
    "wikitext-clm": "finetune.recipes.wikitext_clm",
    # your model and your data, no data of their own (recipes/your_data.py); picked from the columns without --recipe
    "sft": "finetune.recipes.sft",
    "dpo": "finetune.recipes.dpo",
    "grpo": "finetune.recipes.grpo",
    "clm": "finetune.recipes.clm",
    "classify": "finetune.recipes.classify",
}

REQUIRED_ATTRIBUTES = ("NAME", "DESCRIPTION", "TASK", "DATASET", "NEEDS_HUB", "TEXT_COLUMNS", "METRICS", "DEFAULTS", "load_raw_datasets")


def load_recipe(name_or_path: str) -> ModuleType:
    """Import the recipe registered as ``name_or_path``, or the module at that ``.py`` path.

    Raises ``FinetuneError`` for an unknown name (listing the known ones), a missing file, or a module
    that lacks a required attribute (naming it).
    """
    if name_or_path.endswith(".py"):
        path = Path(name_or_path)
        if not path.is_file():
            raise FinetuneError(f"recipe file {name_or_path!r} does not exist.")
        spec = importlib.util.spec_from_file_location(f"finetune_user_recipe_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    elif name_or_path in RECIPES:
        module = importlib.import_module(RECIPES[name_or_path])
    else:
        raise FinetuneError(
            f"unknown recipe {name_or_path!r}. Known recipes: {', '.join(sorted(RECIPES))} "
            "(or pass a path/to/recipe.py; see --list_recipes)."
        )
    missing = [a for a in REQUIRED_ATTRIBUTES if not hasattr(module, a)]
    if missing:
        raise FinetuneError(f"recipe {name_or_path!r} lacks {', '.join(missing)} (see the contract in {__file__}).")
    return module


def check_task(recipe: ModuleType, name_or_path: str, task: str | None) -> None:
    """Raise ``FinetuneError`` where ``--task`` ``task`` (None: not given) names another task than the recipe's
    ``TASK`` (``recipe``, loaded from ``name_or_path``): the flag is for your data without ``--recipe``."""
    if task is not None and task != recipe.TASK:
        raise FinetuneError(f"--task {task} and --recipe {name_or_path} (task {recipe.TASK}) disagree: pass one of "
                            "them.")


def list_recipes() -> str:
    """A table of the registered recipes: name, task, default model, dataset, and hub/offline."""
    rows = [("name", "task", "model", "dataset", "data source")]
    for name in sorted(RECIPES):
        r = load_recipe(name)
        model = "yours" if getattr(r, "YOUR_DATA", False) else r.DEFAULTS.get("model_name_or_path", "?")
        if os.path.isabs(model):
            model = os.path.basename(os.path.dirname(model)) if os.path.basename(model) == "model" else model
        rows.append((name, r.TASK, model, r.DATASET, "needs hub" if r.NEEDS_HUB else "offline"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def copy_recipe(name: str, dest: str | None = None) -> Path:
    """Write the registered recipe ``name``'s source to ``dest`` (default ``./<its module name>.py``; a directory:
    that file inside it) as an editable file that ``--recipe DEST`` runs (as ``tune cp`` copies a torchtune recipe),
    with a first comment line saying where it came from; returns the path written. Raises ``FinetuneError`` for an
    unknown name, a ``dest`` that does not end in ``.py``, whose folder does not exist, or that exists (it is never
    overwritten)."""
    import importlib.util

    from finetune import __version__

    if name not in RECIPES:
        raise FinetuneError(f"unknown recipe {name!r}. Known recipes: {', '.join(sorted(RECIPES))} (finetune recipes).")
    source = Path(importlib.util.find_spec(RECIPES[name]).origin)
    target = Path(dest) if dest is not None else Path(source.name)
    if target.is_dir() or (dest or "").endswith(("/", os.sep)):
        target = target / source.name
    if target.suffix != ".py":
        raise FinetuneError(f"{str(target)!r} does not end in .py: --recipe runs a path/to/recipe.py. Name the copy "
                            f"{target.name}.py or similar.")
    if not target.parent.is_dir():
        raise FinetuneError(f"the folder {str(target.parent)!r} does not exist. Create it, or copy to another path.")
    header = (f"# Copied from finetune {__version__}'s recipe {name!r} ({RECIPES[name]}). Edit it, then run it with:\n"
              f"#     finetune train --recipe {target}\n")
    try:
        with open(target, "x", encoding="utf-8") as file:  # "x": never overwrite, not even in a race
            file.write(header + source.read_text(encoding="utf-8"))
    except FileExistsError:
        raise FinetuneError(f"{str(target)!r} already exists: it is not overwritten. Copy to another path, or remove "
                            "it first.") from None
    return target
