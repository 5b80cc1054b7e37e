"""The recipe registry: plain data, name -> module.

This folder is the repository's top-level ``recipes/``, imported and installed as ``finetune.recipes`` (the
``package-dir`` in pyproject.toml; a source checkout loads it through ``finetune/__init__.py``).

A recipe module defines (see ``recipes/bbc_news.py``):

- ``NAME``, ``DESCRIPTION`` (one line), ``TASK`` ("sequence-classification" or "causal-lm", see
  ``finetune/tasks.py``), ``DATASET``,
  ``NEEDS_HUB`` (bool), ``TEXT_COLUMNS`` (the input column names), ``METRICS`` (shipped metric name -> compute kwargs),
  ``DEFAULTS`` (a dict of ``TrainConfig`` fields);
- ``load_raw_datasets(config) -> datasets.DatasetDict`` with ``train`` and ``validation`` splits holding
  ``TEXT_COLUMNS`` and, for classification, a ``ClassLabel`` ``label`` column;
- optionally ``build_model(config, label_names) -> PreTrainedModel``: a model of the recipe's own (label names
  None for causal LM); without it the task loads ``--model_name_or_path``. A ``transformers`` model whose
  forward takes ``labels``-free inputs and returns ``.logits`` (and, for mixture-of-experts, ``.aux_loss``).

Model, tokenizer and tokenization are shared builders in ``finetune.data``.
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
    "glue-mrpc": "finetune.recipes.glue_mrpc",
    "wikitext-clm": "finetune.recipes.wikitext_clm",
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


def list_recipes() -> str:
    """A table of the registered recipes: name, task, default model, dataset, and hub/offline."""
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
