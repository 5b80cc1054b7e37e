"""classify: sequence classification of your ``text`` + ``label`` rows with your encoder (a classification head on
``--model_name_or_path``). Accuracy and macro-F1."""

from __future__ import annotations

from finetune.recipes.your_data import NEEDS_HUB, YOUR_DATA, load_raw_datasets  # noqa: F401 - the recipe contract

NAME = "classify"
DESCRIPTION = "Your text + label rows on your encoder: sequence classification; accuracy, macro-F1."
TASK = "sequence-classification"
DATASET = "yours (--train_file or --dataset_name)"
TEXT_COLUMNS = ("text",)
METRICS = {"accuracy": {}, "f1": {"average": "macro"}}
DEFAULTS: dict = {}
