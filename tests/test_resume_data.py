"""A resume is bound to the data it was trained on: another training set (rows added, removed, reordered, or the
held-out split moved by --validation_file) is refused by name before anything is touched, in both backends; another
split of the same effective batch B still resumes; --ignore_checkpoint_mismatch says what it lets through."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from test_small_train_file import run_main, sport_business, write_csv
from tiny_models import build_tiny_chat_llama

# 30 rows, 20% held out (stratified): 24 training samples; B = 4 x 1: 6 optimizer steps per epoch, 2 epochs
FLAGS = ["--max_length", "16", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
         "--num_train_epochs", "2",
         "--save_steps", "2", "--eval_strategy", "no", "--learning_rate", "1e-3", "--seed", "3"]


def snapshot(folder: Path) -> dict:
    """Every file under ``folder``: (size, mtime in ns)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def train(tmp_path, tiny_bert, capsys, backend: str, train_file: str, *extra: str):
    args = ["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(tmp_path / "out"),
            "--backend", backend, "--train_file", train_file, *FLAGS, *extra]
    return run_main(args, capsys)


def checkpoint(tmp_path, backend: str, step: int) -> str:
    name = f"step_{step:08d}" if backend == "accelerate" else f"checkpoint-{step}"
    return str(tmp_path / "out" / "checkpoints" / name)


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_a_resume_on_another_training_set_is_refused_before_anything_is_touched(tmp_path, tiny_bert, capsys,
                                                                               backend):
    train_file = write_csv(tmp_path / "train.csv", sport_business(15))
    first = train(tmp_path, tiny_bert, capsys, backend, train_file)
    assert first.returncode == 0, first.stderr[-2000:]
    before = snapshot(tmp_path / "out")
    resume = ["--resume_from_checkpoint", checkpoint(tmp_path, backend, 2)]

    # 1. the 20% held out is now trained on: --validation_file added
    dev = write_csv(tmp_path / "dev.csv", [("a goal late on", "sport"), ("profits rose", "business")])
    result = train(tmp_path, tiny_bert, capsys, backend, train_file, "--validation_file", dev, *resume)
    assert result.returncode == 2, result.stderr[-2000:]
    error = next(line for line in result.stderr.splitlines() if line.startswith("error: "))
    assert "another training set: 30 training samples, 24 in the checkpoint's run" in error, error
    assert f"--validation_file: checkpoint None, now {dev!r}" in error, error
    assert "--ignore_checkpoint_mismatch" in error, error
    assert snapshot(tmp_path / "out") == before

    # 2. the same --train_file path, cut to 15 rows (12 training samples)
    write_csv(tmp_path / "train.csv", sport_business(15)[:15])
    result = train(tmp_path, tiny_bert, capsys, backend, train_file, *resume)
    assert result.returncode == 2, result.stderr[-2000:]
    error = next(line for line in result.stderr.splitlines() if line.startswith("error: "))
    assert "12 training samples, 24 in the checkpoint's run" in error, error
    assert f"the data of --train_file {train_file!r} changed" in error, error
    assert snapshot(tmp_path / "out") == before

    # 3. as many rows, their texts edited: the count holds, the fingerprint does not
    write_csv(tmp_path / "train.csv", [(f"{text} again", label) for text, label in sport_business(15)])
    result = train(tmp_path, tiny_bert, capsys, backend, train_file, *resume)
    assert result.returncode == 2, result.stderr[-2000:]
    error = next(line for line in result.stderr.splitlines() if line.startswith("error: "))
    assert "24 training samples as in the checkpoint's run, but other ones (fingerprint" in error, error
    assert snapshot(tmp_path / "out") == before

    # 4. --resume_from_checkpoint auto, as a requeued job starts (a run without metrics.json is unfinished)
    (tmp_path / "out" / "metrics.json").unlink()
    before = snapshot(tmp_path / "out")
    result = train(tmp_path, tiny_bert, capsys, backend, train_file, "--resume_from_checkpoint", "auto")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "this launch trains on another training set" in result.stderr, result.stderr[-2000:]
    assert snapshot(tmp_path / "out") == before


def test_another_split_of_b_still_resumes_and_the_override_says_what_it_changes(tmp_path, tiny_bert, capsys):
    train_file = write_csv(tmp_path / "train.csv", sport_business(15))
    assert train(tmp_path, tiny_bert, capsys, "accelerate", train_file).returncode == 0
    resume = ["--resume_from_checkpoint", checkpoint(tmp_path, "accelerate", 2)]
    # the same training set, B = 4 split 2 x 2: an elastic resume, accepted
    result = train(tmp_path, tiny_bert, capsys, "accelerate", train_file, *resume,
                   "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "skipping 4 micro-batches of it (same data order)" in result.stdout, result.stdout[-3000:]
    assert "warning: resuming despite" not in result.stdout

    # the held-out rows trained on, let through by the override: what changes is said, and no "same data order"
    dev = write_csv(tmp_path / "dev.csv", [("a goal late on", "sport"), ("profits rose", "business")])
    result = train(tmp_path, tiny_bert, capsys, "accelerate", train_file, "--validation_file", dev, *resume,
                   "--ignore_checkpoint_mismatch", "True")
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("warning: resuming despite --ignore_checkpoint_mismatch: training set: 30 training samples, 24 in the "
            "checkpoint's run") in result.stdout, result.stdout[-3000:]
    assert "the schedule is re-sized from 12 to 16 optimizer steps (6 -> 8 per epoch)" in result.stdout
    assert "(same data order)" not in result.stdout


def test_the_identity_sees_row_order_and_every_change():
    """The order fingerprint changes when rows swap places (the epoch's seeded order is a permutation of row
    positions), across the 8192-row batches it is computed in too; the set fingerprint does not (it names the
    change); both change with every edit of a row's content."""
    from finetune.data.loading import training_set_identity

    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]], "labels": [0, 1, 1],
                                       "__row__": ["a", "b", "c"]})
    same = training_set_identity(rows)
    assert set(same) == {"samples", "fingerprint", "order_fingerprint"} and same["samples"] == 3
    assert training_set_identity(rows.remove_columns("__row__")) == same  # row names are not data
    assert training_set_identity(rows.select([0, 1, 2])) == same
    for order in ([2, 1, 0], [1, 0, 2], [0, 2, 1]):
        moved = training_set_identity(rows.select(order))
        assert moved["fingerprint"] == same["fingerprint"], order  # the same rows
        assert moved["order_fingerprint"] != same["order_fingerprint"], order  # in another order
    changed = [
        rows.select([0, 1]),  # a row removed
        rows.select([0, 1, 2, 2]),  # a row repeated
        datasets.Dataset.from_dict({"input_ids": [[1, 3, 2], [4, 5], [6]], "labels": [0, 1, 1]}),  # order in a row
        datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]], "labels": [0, 1, 0]}),  # a label
        datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4, 5], [6]], "labels": [0, 1, 1]}),  # a row boundary
    ]
    for key in ("fingerprint", "order_fingerprint"):
        fingerprints = {training_set_identity(ds)[key] for ds in changed}
        assert same[key] not in fingerprints and len(fingerprints) == len(changed), key
    # two rows swapped across the first 8192-row batch boundary
    many = datasets.Dataset.from_dict({"input_ids": [[i, i + 1] for i in range(9000)]})
    swapped = list(range(9000))
    swapped[5], swapped[8500] = 8500, 5
    a, b = training_set_identity(many), training_set_identity(many.select(swapped))
    assert a["fingerprint"] == b["fingerprint"] and a["order_fingerprint"] != b["order_fingerprint"]


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


def headline_rows(n: int) -> list[dict]:
    words = "the market rose as shares in the bank fell after the match ended with a late goal".split()
    return [{"prompt": " ".join(words[(i + k) % len(words)] for k in range(4 + i % 5)),
             "completion": " ".join(words[(3 * i + k) % len(words)] for k in range(1 + i % 3))} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_a_resume_after_the_rows_were_reordered_is_refused_by_name(tmp_path, chat_llama, capsys, backend):
    """bbc-headlines, 10 rows, B = 2, checkpoints every 2 steps; the training file reversed in place: the resume
    from step 2 would deal other rows at each position of the epoch's seeded order (rows trained twice, others
    never), so it is refused before anything is touched, naming the file and the changed order, exit 2;
    --ignore_checkpoint_mismatch lets it through with a warning instead of "(same data order)"."""
    rows = headline_rows(10)
    train_file = write_jsonl(tmp_path / "train.jsonl", rows)
    valid_file = write_jsonl(tmp_path / "valid.jsonl", headline_rows(12)[10:])
    args = ["--recipe", "bbc-headlines", "--model_name_or_path", chat_llama, "--output_dir", str(tmp_path / "out"),
            "--backend", backend, "--train_file", train_file, "--validation_file", valid_file, "--max_length", "96",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--num_train_epochs", "1",
            "--save_steps", "2", "--eval_strategy", "no", "--learning_rate", "1e-3", "--seed", "3"]
    first = run_main(args, capsys)
    assert first.returncode == 0, first.stderr[-2000:]
    before = snapshot(tmp_path / "out")
    resume = ["--resume_from_checkpoint", checkpoint(tmp_path, backend, 2)]

    write_jsonl(tmp_path / "train.jsonl", rows[::-1])  # the same rows, reversed in place
    result = run_main(args + resume, capsys)
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    error = next(line for line in result.stderr.splitlines() if line.startswith("error: "))
    assert "the same 10 training samples as in the checkpoint's run, in another order" in error, error
    assert f"the data of --train_file {train_file!r} changed" in error, error
    assert "re-sized" not in error, error  # as many samples: the schedule holds
    assert snapshot(tmp_path / "out") == before

    if backend == "accelerate":
        result = run_main(args + resume + ["--ignore_checkpoint_mismatch", "True"], capsys)
        assert result.returncode == 0, result.stderr[-2000:]
        assert ("warning: resuming despite --ignore_checkpoint_mismatch: training set: the same 10 training "
                "samples as in the checkpoint's run, in another order") in result.stdout, result.stdout[-3000:]
        assert "(same data order)" not in result.stdout


def test_a_checkpoint_from_before_the_record_still_resumes():
    from finetune.errors import FinetuneError
    from finetune.lifecycle.elastic import check_training_set

    now = {"training_set": {"samples": 5, "fingerprint": "00", "order_fingerprint": "01", "validation_file": None}}
    assert check_training_set({}, now, "ckpt", allow=False) is None
    # recorded before the order fingerprint: its rows are still compared, as a set
    saved = {"training_set": {"samples": 5, "fingerprint": "00", "validation_file": None}}
    assert check_training_set(saved, now, "ckpt", allow=False) is None
    with pytest.raises(FinetuneError, match="but other ones"):
        check_training_set({"training_set": {**saved["training_set"], "fingerprint": "02"}}, now, "ckpt", allow=False)
