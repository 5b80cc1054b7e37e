"""``--dataset_name`` (TRL's flags) on local datasets, offline: a ``save_to_disk`` folder with a ``ClassLabel``
(its names become ``id2label``), a folder of JSON lines for SFT (20% held out without a test split), a missing
column listing the dataset's columns, a Hub name offline failing fast."""

from __future__ import annotations

import json

import datasets
import pytest
from helpers import run_in_process
from tiny_models import build_tiny_chat_llama

from finetune.config import parse_config
from finetune.errors import FinetuneError

WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()


def texts(n, seed=0):
    return [" ".join(WORDS[(i * 7 + k + seed) % len(WORDS)] for k in range(4 + (i + seed) % 9)) for i in range(n)]


@pytest.fixture(scope="module")
def saved_classification(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["markets", "sport", "weather"])})
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": texts(30), "label": [i % 3 for i in range(30)]}, features=features),
        "test": datasets.Dataset.from_dict({"text": texts(9, 5), "label": [i % 3 for i in range(9)]}, features=features)})
    dd.save_to_disk(str(root / "news"))
    return str(root / "news")


def test_a_saved_dataset_trains_a_classifier_with_its_label_names(tmp_path, tiny_bert, saved_classification):
    metrics, out = run_in_process(tmp_path, "cls", model_name_or_path=tiny_bert, dataset_name=saved_classification,
                                  max_length=32, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                                  num_train_epochs=1, eval_strategy="epoch")
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "markets", "1": "sport", "2": "weather"}
    assert metrics["train_samples"] == 30 and metrics["optimizer_steps"] == 8  # all of train, test for validation
    assert 0 <= metrics["eval_accuracy"] <= 1


def test_a_folder_of_json_lines_trains_sft_with_a_holdout(tmp_path):
    model = build_tiny_chat_llama(tmp_path / "chat")
    folder = tmp_path / "sft-data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n"
                                                for p, c in zip(texts(20), texts(20, 3))))
    metrics, _ = run_in_process(tmp_path, "sft", recipe="bbc-headlines", model_name_or_path=str(model),
                                dataset_name=str(folder), max_length=160, per_device_train_batch_size=4,
                                gradient_accumulation_steps=1, num_train_epochs=1, eval_strategy="no")
    assert metrics["train_samples"] == 16  # 20 rows, 20% (4) held out: there is no test split


def test_a_folder_of_preference_pairs_trains_dpo(tmp_path):
    """--dataset_name with TRL's preference columns (prompt, chosen, rejected) on a preference recipe."""
    model = build_tiny_chat_llama(tmp_path / "chat")
    folder = tmp_path / "pairs"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n"
                                                for p, c, r in zip(texts(20), texts(20, 3), texts(20, 5))))
    metrics, _ = run_in_process(tmp_path, "dpo", recipe="bbc-headlines-dpo", model_name_or_path=str(model),
                                dataset_name=str(folder), max_length=160, per_device_train_batch_size=4,
                                gradient_accumulation_steps=1, num_train_epochs=1, eval_strategy="no",
                                eval_on_start=False, max_train_samples=1000)
    assert metrics["train_samples"] == 16  # pairs: 20 rows, 20% held out


def test_a_missing_column_lists_the_datasets_columns(tmp_path, tiny_bert):
    folder = tmp_path / "bad"
    datasets.Dataset.from_dict({"body": texts(10), "label": [0, 1] * 5}).save_to_disk(str(folder))
    config = parse_config(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--dataset_name", str(folder)])
    from finetune.recipes import load_recipe
    from finetune.tasks import get_task
    from finetune.tasks.builders import raw_datasets

    with pytest.raises(FinetuneError, match=r"lacks column\(s\) text \(it has body, label\)"):
        raw_datasets(load_recipe("bbc-news"), config, get_task("sequence-classification"))


def test_a_hub_name_offline_fails_fast(monkeypatch):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from finetune.data.loading import load_named_dataset

    start = time.perf_counter()
    with pytest.raises(FinetuneError, match="--dataset_name someone/news must be downloaded from the Hugging Face Hub"):
        load_named_dataset("someone/news", None, "train", "test", ("text",), class_labels=True, conversations=False)
    assert time.perf_counter() - start < 20


def test_a_missing_local_folder_is_named(tmp_path):
    from finetune.data.loading import load_named_dataset

    with pytest.raises(FinetuneError, match="--dataset_name ./nope: no such folder"):
        load_named_dataset("./nope", None, "train", "test", ("text",), class_labels=True, conversations=False)
