"""A resume is bound to the data it was trained on: another training set (rows added, removed, or the held-out
split moved by --validation_file) is refused by name before anything is touched, in both backends; another split
of the same effective batch B still resumes; --ignore_checkpoint_mismatch says what it lets through."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from test_small_train_file import run_main, sport_business, write_csv

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


def test_the_fingerprint_ignores_row_order_and_sees_every_change():
    from finetune.data.loading import training_set_identity

    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]], "labels": [0, 1, 1],
                                       "__row__": ["a", "b", "c"]})
    same = training_set_identity(rows)
    assert same == {"samples": 3, "fingerprint": same["fingerprint"]}
    assert training_set_identity(rows.shuffle(seed=1)) == same  # another order (another split of B)
    assert training_set_identity(rows.remove_columns("__row__")) == same  # row names are not data
    changed = [
        rows.select([0, 1]),  # a row removed
        rows.select([0, 1, 2, 2]),  # a row repeated
        datasets.Dataset.from_dict({"input_ids": [[1, 3, 2], [4, 5], [6]], "labels": [0, 1, 1]}),  # order in a row
        datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]], "labels": [0, 1, 0]}),  # a label
        datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4, 5], [6]], "labels": [0, 1, 1]}),  # a row boundary
    ]
    fingerprints = {training_set_identity(ds)["fingerprint"] for ds in changed}
    assert same["fingerprint"] not in fingerprints and len(fingerprints) == len(changed)


def test_a_checkpoint_from_before_the_record_still_resumes():
    from finetune.lifecycle.elastic import check_training_set

    now = {"training_set": {"samples": 5, "fingerprint": "00", "validation_file": None}}
    assert check_training_set({}, now, "ckpt", allow=False) is None
