"""clm: continued pretraining of your causal LM on your ``text`` rows, one text per sample (``--block_size`` to
concatenate and cut blocks). Eval loss per token and perplexity."""

from __future__ import annotations

from finetune.recipes.your_data import NEEDS_HUB, YOUR_DATA, load_raw_datasets  # noqa: F401 - the recipe contract

NAME = "clm"
DESCRIPTION = "Your text rows on your causal LM: continued pretraining; perplexity."
TASK = "causal-lm"
DATASET = "yours (--train_file or --dataset_name)"
TEXT_COLUMNS = ("text",)
METRICS: dict = {}
DEFAULTS = {"max_length": 1024}
