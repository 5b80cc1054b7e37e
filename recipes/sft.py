"""sft: supervised fine-tuning of your chat or instruction model on your data, as ``trl sft`` does: TRL's
``messages`` (or ShareGPT ``conversations``) or ``prompt``/``completion`` rows through the chat template, the loss on
what trl sft trains: every token of a ``messages`` row, the completion of a prompt-completion row
(``--assistant_only_loss``, ``--completion_only_loss``: TRL's names and defaults). Eval loss per trained token and
perplexity."""

from __future__ import annotations

from finetune.recipes.your_data import NEEDS_HUB, YOUR_DATA, load_raw_datasets  # noqa: F401 - the recipe contract

NAME = "sft"
DESCRIPTION = "Your chat/instruction data (messages, prompt+completion) on your model, trained as trl sft trains it."
TASK = "sft"
DATASET = "yours (--train_file or --dataset_name)"
TEXT_COLUMNS = ("prompt", "completion")
METRICS: dict = {}
# trl 1.16 SFTConfig's defaults where ours differ (sft_config.py: learning_rate line 140, max_length 202; optim:
# transformers 5.24 TrainingArguments' on torch >= 2.8, training_args.py line 811), so that a `trl sft` YAML that
# sets a few keys trains the run `trl sft` trains (tests/test_trl_yaml_peer.py)
DEFAULTS = {"max_length": 1024, "learning_rate": 2e-5, "optim": "adamw_torch_fused"}
