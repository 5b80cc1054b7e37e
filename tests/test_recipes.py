"""The recipe registry: every recipe imports and resolves; unknown names list the known ones."""

from __future__ import annotations

import dataclasses

import pytest

from finetune.config import TrainConfig, parse_config
from finetune.errors import FinetuneError
from finetune.recipes import RECIPES, REQUIRED_ATTRIBUTES, load_recipe


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_resolves(name):
    recipe = load_recipe(name)
    for attribute in REQUIRED_ATTRIBUTES:
        assert hasattr(recipe, attribute)
    assert recipe.NAME == name
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(recipe.DEFAULTS) <= fields
    yours = ["--model_name_or_path", "m", "--train_file", "d.jsonl"] if getattr(recipe, "YOUR_DATA", False) else []
    config = parse_config(["--recipe", name, *yours])
    config.validate()
    for key, value in recipe.DEFAULTS.items():
        assert getattr(config, key) == value, key


def test_flags_override_recipe_defaults():
    config = parse_config(["--recipe", "bbc-news", "--gradient_accumulation_steps", "2", "--learning_rate", "3e-5"])
    assert config.gradient_accumulation_steps == 2
    assert config.learning_rate == 3e-5
    assert config.per_device_train_batch_size == load_recipe("bbc-news").DEFAULTS["per_device_train_batch_size"]
    assert config.output_dir == "outputs/bbc-news"


def test_unknown_recipe_lists_known_ones():
    with pytest.raises(FinetuneError) as err:
        parse_config(["--recipe", "no-such-recipe"])
    message = str(err.value)
    assert "no-such-recipe" in message
    for name in RECIPES:
        assert name in message


def test_recipe_from_path(tmp_path):
    path = tmp_path / "my_recipe.py"
    path.write_text((load_recipe("bbc-news").__file__ and open(load_recipe("bbc-news").__file__).read())
                    .replace('NAME = "bbc-news"', 'NAME = "mine"'))
    recipe = load_recipe(str(path))
    assert recipe.NAME == "mine"
    with pytest.raises(FinetuneError, match="does not exist"):
        load_recipe(str(tmp_path / "missing.py"))


def test_bbc_news_split_is_stratified_80_20_without_duplicates():
    recipe = load_recipe("bbc-news")
    raw = recipe.load_raw_datasets(parse_config(["--recipe", "bbc-news"]))
    # 2,225 articles, 98 of them byte-identical (after strip) to an earlier one: 2,127 distinct, split 80/20
    assert len(raw["train"]) == 1701 and len(raw["validation"]) == 426
    names = raw["train"].features["label"].names
    assert names == ["business", "entertainment", "politics", "sports", "tech"]
    from collections import Counter

    train, val = Counter(raw["train"]["label"]), Counter(raw["validation"]["label"])
    for label in range(5):
        assert abs(val[label] / 426 - train[label] / 1701) < 0.01
    # no validation article is also a training article (the corpus duplicates used to leak 32 of 445)
    train_texts = set(raw["train"]["text"])
    assert not [t for t in raw["validation"]["text"] if t in train_texts]
    assert len(train_texts) == 1701 and len(set(raw["validation"]["text"])) == 426
    again = recipe.load_raw_datasets(parse_config(["--recipe", "bbc-news", "--seed", "7"]))
    assert list(again["validation"]["text"]) == list(raw["validation"]["text"])  # split independent of --seed


def test_bbc_news_keeps_the_first_of_each_duplicate_in_sorted_file_order():
    from finetune.recipes.bbc_news import _articles, corpus_dir

    root = corpus_dir()
    files = [(topic, path) for topic in sorted(p.name for p in root.iterdir() if p.is_dir())
             for path in sorted((root / topic).glob("*.txt"))]
    assert len(files) == 2225
    first = {}
    for topic, path in files:
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            text = raw.decode("latin-1").strip()
        first.setdefault(text, topic)
    rows = list(_articles(str(root)))
    assert [(r["text"], r["label"]) for r in rows] == list(first.items())
    assert len(rows) == 2127


def test_bbc_news_cache_key_follows_the_generator_code(monkeypatch):
    """``datasets`` hashes an importable generator by name, so a changed ``_articles`` would silently reuse
    the arrow file of the old code (it did: the deduplicated recipe kept loading 2,225 articles)."""
    import datasets

    from finetune.recipes import bbc_news

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["a", "b"])})
    before = bbc_news._fingerprint("/data", features)
    assert bbc_news._fingerprint("/data", features) == before
    assert bbc_news._fingerprint("/other", features) != before

    def _articles(data_dir):  # same name, other code
        yield {"text": data_dir, "label": "a"}

    monkeypatch.setattr(bbc_news, "_articles", _articles)
    assert bbc_news._fingerprint("/data", features) != before
