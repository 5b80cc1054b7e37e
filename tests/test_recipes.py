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
    config = parse_config(["--recipe", name])
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


def test_bbc_news_split_is_stratified_80_20():
    recipe = load_recipe("bbc-news")
    raw = recipe.load_raw_datasets(parse_config(["--recipe", "bbc-news"]))
    assert len(raw["train"]) == 1780 and len(raw["validation"]) == 445
    names = raw["train"].features["label"].names
    assert names == ["business", "entertainment", "politics", "sports", "tech"]
    from collections import Counter

    train, val = Counter(raw["train"]["label"]), Counter(raw["validation"]["label"])
    for label in range(5):
        assert abs(val[label] / 445 - train[label] / 1780) < 0.01
    # The corpus holds 98 duplicated articles (2,127 distinct texts); with the 80/20 split of all 2,225,
    # 32 validation articles also appear in train. Kept, as in the published figures; pinned here.
    train_texts = set(raw["train"]["text"])
    assert sum(t in train_texts for t in raw["validation"]["text"]) == 32
    again = recipe.load_raw_datasets(parse_config(["--recipe", "bbc-news", "--seed", "7"]))
    assert list(again["validation"]["text"]) == list(raw["validation"]["text"])  # split independent of --seed
