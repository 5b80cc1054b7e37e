"""dpo: preference tuning of your model on your pairs, as ``trl dpo`` does: TRL's ``prompt``/``chosen``/``rejected``
rows (explicit or implicit prompt), a frozen reference (or the adapter disabled under ``--use_peft``), DPOConfig's
losses. Eval: the preference metrics of the loss pass (``rewards/*``)."""

from __future__ import annotations

from finetune.recipes.your_data import NEEDS_HUB, YOUR_DATA, load_raw_datasets  # noqa: F401 - the recipe contract

NAME = "dpo"
DESCRIPTION = "Your preference pairs (prompt, chosen, rejected) on your model, as trl dpo."
TASK = "preference"
DATASET = "yours (--train_file or --dataset_name)"
TEXT_COLUMNS = ("prompt", "chosen", "rejected")
METRICS: dict = {}
# trl 1.16 DPOConfig's defaults where ours differ (dpo_config.py: learning_rate line 156, disable_dropout 185,
# max_length 195; optim: transformers 5.24 TrainingArguments' on torch >= 2.8, training_args.py line 811)
DEFAULTS = {"max_length": 1024, "learning_rate": 1e-6, "optim": "adamw_torch_fused", "disable_dropout": True}
