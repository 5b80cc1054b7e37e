"""Errors that point at the line: every error about a row of a user's data names the file (or dataset and split)
and the row's line or index in it, and what is wrong with that row, for classification and SFT, from a CSV, a
JSON-lines file and a saved dataset: checked before any holdout split or shuffle."""

from __future__ import annotations

import json

import datasets
import pytest
from tiny_models import build_tiny_chat_llama

from finetune.run import main


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]  # (datasets' progress bars aside)
    return errors[0]


def classify(tmp_path, model, *data):
    return main(["--recipe", "bbc-news", "--model_name_or_path", model, "--output_dir", str(tmp_path / "out"),
                 "--max_length", "32", "--max_steps", "1", *data])


def test_a_csv_row_with_an_empty_label(tmp_path, tiny_bert, capsys):
    rows = ["text,label"] + [f"article number {i} about the market,{['sport', 'tech'][i % 2]}" for i in range(9)]
    rows[6] = "an article whose label was left out,"  # line 7 of the file (the header is line 1)
    path = tmp_path / "train.csv"
    path.write_text("\n".join(rows) + "\n")
    assert classify(tmp_path, tiny_bert, "--train_file", str(path)) == 2
    assert error_line(capsys) == f"error: --train_file {str(path)!r} line 7: the label is empty. Fill it in or drop the row."
    assert not (tmp_path / "out").exists()


def test_a_json_lines_row_with_an_empty_text(tmp_path, tiny_bert, capsys):
    path = tmp_path / "valid.jsonl"
    path.write_text(json.dumps({"text": "fine", "label": "sport"}) + "\n\n" + json.dumps({"text": " ", "label": "tech"})
                    + "\n")
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": f"row {i}", "label": ["sport", "tech"][i % 2]}) + "\n" for i in range(8)))
    assert classify(tmp_path, tiny_bert, "--train_file", str(train), "--validation_file", str(path)) == 2
    assert error_line(capsys) == (f"error: --validation_file {str(path)!r} line 3: the 'text' column is empty. Fill it in "
                                  "or drop the row.")


def test_a_saved_dataset_row_with_an_unknown_label_and_an_empty_text(tmp_path, tiny_bert, capsys):
    folder = tmp_path / "saved"
    texts = [f"news item {i}" for i in range(10)]
    texts[4] = ""
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts, "label": ["a", "b"] * 5})}).save_to_disk(
        str(folder))
    assert classify(tmp_path, tiny_bert, "--dataset_name", str(folder)) == 2
    assert error_line(capsys) == (f"error: --dataset_name {folder} split 'train' row 4: the 'text' column is empty. "
                                  "Fill it in or drop the row.")


def sft(tmp_path, model, *data):
    return main(["--recipe", "bbc-headlines", "--model_name_or_path", model, "--output_dir", str(tmp_path / "out"),
                 "--max_length", "96", "--max_steps", "1", "--eval_strategy", "no", *data])


def test_an_sft_row_lacking_its_completion_names_its_line_not_a_shuffled_index(tmp_path, chat_llama, capsys):
    rows = [{"prompt": f"headline for story {i}", "completion": f"story {i}"} for i in range(10)]
    del rows[1]["completion"]  # line 2; the 20% holdout (no --validation_file) shuffles the rows
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sft(tmp_path, chat_llama, "--train_file", str(path)) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: --train_file {str(path)!r} line 2: ") and "completion" in line


def test_an_sft_row_too_long_names_its_line(tmp_path, chat_llama, capsys):
    rows = [{"prompt": f"headline for story {i}", "completion": f"story {i}"} for i in range(10)]
    rows[7]["completion"] = " ".join(["goal"] * 200)  # line 8: more than --max_length, and completions are never cut
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sft(tmp_path, chat_llama, "--train_file", str(path)) == 2
    assert error_line(capsys).startswith(f"error: --train_file {str(path)!r} line 8: the completion and the chat template")


def test_a_saved_sft_dataset_row_with_an_empty_assistant_turn(tmp_path, chat_llama, capsys):
    folder = tmp_path / "saved-sft"
    messages = [[{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}] for i in range(6)]
    messages[3][1]["content"] = " "
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"messages": messages}),
                          "test": datasets.Dataset.from_dict({"messages": messages[:2]})}).save_to_disk(str(folder))
    assert sft(tmp_path, chat_llama, "--dataset_name", str(folder)) == 2
    assert error_line(capsys).startswith(f"error: --dataset_name {folder} split 'train' row 3: assistant turn 1 is empty")
