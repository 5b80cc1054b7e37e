"""sft: supervised fine-tuning of your chat or instruction model on your data, as ``trl sft`` does: TRL's
``messages`` (or ShareGPT ``conversations``) or ``prompt``/``completion`` rows through the chat template, the loss on
the completions only. Eval loss per completion token and perplexity."""

from __future__ import annotations

from finetune.recipes.your_data import NEEDS_HUB, YOUR_DATA, load_raw_datasets  # noqa: F401 - the recipe contract

NAME = "sft"
DESCRIPTION = "Your chat/instruction data (messages, prompt+completion) on your model, as trl sft; completion-only loss."
TASK = "sft"
DATASET = "yours (--train_file or --dataset_name)"
TEXT_COLUMNS = ("prompt", "completion")
METRICS: dict = {}
DEFAULTS = {"max_length": 1024}  # SFTConfig's max_length
