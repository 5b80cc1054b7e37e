"""clm: continued pretraining of your causal LM on your ``text`` rows, as ``trl sft`` trains text rows: one text per
sample, ending with the eos token (``--add_eos``; ``--block_size`` to concatenate and cut blocks). Eval loss per token
and perplexity."""

from __future__ import annotations

from finetune.recipes.your_data import NEEDS_HUB, YOUR_DATA, load_raw_datasets  # noqa: F401 - the recipe contract

NAME = "clm"
DESCRIPTION = "Your text rows on your causal LM: continued pretraining; perplexity."
TASK = "causal-lm"
DATASET = "yours (--train_file or --dataset_name)"
TEXT_COLUMNS = ("text",)
METRICS: dict = {}
# `trl sft` on text rows: SFTConfig's defaults where ours differ (as recipes/sft.py), and its add_eos (trl 1.16
# sft_trainer.py lines 1286-1306: every text ends with the eos token)
DEFAULTS = {"max_length": 1024, "learning_rate": 2e-5, "optim": "adamw_torch_fused", "add_eos": True}
