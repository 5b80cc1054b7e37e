"""The shared part of the recipes that ship no data (``sft``, ``dpo``, ``clm``, ``classify``): your model and your
data, as ``trl sft``/``trl dpo`` take them (``--model_name_or_path``, ``--dataset_name`` or ``--train_file``). Without
``--recipe``, ``finetune train`` picks one of them from the data's columns (``finetune.config.your_data``)."""

from __future__ import annotations

from finetune.errors import FinetuneError

NEEDS_HUB = False
YOUR_DATA = True  # ships no data and no model: --model_name_or_path and --train_file/--dataset_name are required


def load_raw_datasets(config):
    """Never reached with data given (``--train_file``/``--dataset_name`` are loaded by the task); raises
    ``FinetuneError`` naming the flags otherwise."""
    raise FinetuneError(f"recipe {config.recipe!r} trains your data and ships none: pass --train_file FILE or "
                        "--dataset_name NAME (a save_to_disk folder, a folder of data files, or a Hub dataset).")
