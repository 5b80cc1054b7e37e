"""wikitext-clm: causal language modelling of SmolLM2-135M on WikiText-2 (raw), from the hub.

Texts are concatenated and cut into blocks of ``--block_size`` tokens (transformers' ``run_clm.py``
convention); metric: eval loss per token and perplexity. Needs the Hugging Face Hub, or local copies:
``--model_name_or_path DIR --train_file train.jsonl --validation_file valid.jsonl`` (a ``text`` column).
"""

from __future__ import annotations

NAME = "wikitext-clm"
DESCRIPTION = "Causal LM fine-tuning of SmolLM2-135M on WikiText-2 in 512-token blocks; needs the hub."
TASK = "causal-lm"
DATASET = "WikiText-2 raw (Salesforce/wikitext, wikitext-2-raw-v1, from the hub)"
NEEDS_HUB = True
TEXT_COLUMNS = ("text",)
METRICS: dict = {}
HUB_DATASET = ("Salesforce/wikitext", "wikitext-2-raw-v1")

DEFAULTS = {
    "model_name_or_path": "HuggingFaceTB/SmolLM2-135M",
    "block_size": 512,
    "max_length": 512,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 8,
    "per_device_eval_batch_size": 8,
    "learning_rate": 5e-5,
    "num_train_epochs": 1.0,
    "warmup_steps": 20,
    "eval_on_start": True,
}


def load_raw_datasets(config):
    """WikiText-2 raw train/validation from the hub. Raises ``HubUnreachableError`` (fast, with the
    local alternative) when the hub cannot be reached."""
    import datasets

    from finetune.data.loading import require_hub

    require_hub(f"dataset {HUB_DATASET[0]}/{HUB_DATASET[1]}",
                "pass local copies with --train_file train.jsonl --validation_file valid.jsonl (a text column)")
    raw = datasets.load_dataset(*HUB_DATASET, cache_dir=config.cache_dir)
    return datasets.DatasetDict({"train": raw["train"], "validation": raw["validation"]})
