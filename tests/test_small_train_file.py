"""A --train_file too small to hold out a stratified 20% (and no --validation_file): a clear error naming the
file, the label(s) with too few rows and the fix, instead of datasets' "Minimum class count error" traceback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import assert_user_error, launch

from finetune.data.loading import load_data_files
from finetune.errors import FinetuneError

TINY = ["--max_steps", "1", "--max_length", "32", "--per_device_train_batch_size", "2"]


def write_csv(path, rows) -> str:
    path.write_text("text,label\n" + "".join(f"{text},{label}\n" for text, label in rows))
    return str(path)


def sport_business(n_each: int):
    return [(f"{topic} story {i}", topic) for i in range(n_each) for topic in ("sport", "business")]


def run_main(args: list[str], capsys) -> SimpleNamespace:
    """``finetune.run.main(ARGS)`` in this process (the CLI's own error handling): its exit code and what it
    printed, as ``returncode``, ``stdout`` and ``stderr`` (what ``assert_user_error`` reads of a launch)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from finetune.run import main

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    capsys.readouterr()
    code = main(args)
    printed = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=printed.out, stderr=printed.err)


# one case through the real launcher; the other two call the CLI's main in this process (the same error
# handling, without two more launches that only differ in the rows of the file)
@pytest.mark.parametrize("case", ["two-rows", "one-label-with-one-row", "holdout-smaller-than-label-count"])
def test_cli_names_the_file_the_labels_and_the_fix(tmp_path, tiny_bert, case, capsys):
    if case == "two-rows":
        rows, fragments = [("a goal", "sport"), ("shares fell", "business")], ["'business' (1 row)", "'sport' (1 row)"]
    elif case == "one-label-with-one-row":
        rows, fragments = sport_business(5) + [("rain", "weather")], ["'weather' (1 row)"]
    else:  # 2 rows of each of 2 labels: the 20% hold-out is 1 row, which cannot hold both labels
        rows, fragments = sport_business(2), ["4 rows", "hold-out of 1 row", "2 labels", "at least 6 rows"]
    train_file = write_csv(tmp_path / f"{case}.csv", rows)
    args = ["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(tmp_path / "out"),
            "--train_file", train_file, *TINY]
    result = launch(args) if case == "two-rows" else run_main(args, capsys)
    assert "Minimum class count" not in result.stderr and "should be greater or equal" not in result.stderr
    assert_user_error(result, "--train_file", train_file, "too small", "--validation_file", *fragments)
    if case == "one-label-with-one-row":  # only the label that is short is named
        error_line = next(line for line in result.stderr.splitlines() if line.startswith("error: "))
        assert "'sport'" not in error_line and "'business'" not in error_line, error_line


def test_message_lists_only_the_labels_with_too_few_rows(tmp_path):
    train_file = write_csv(tmp_path / "t.csv", sport_business(5) + [("rain", "weather"), ("sun", "climate")])
    with pytest.raises(FinetuneError) as err:
        load_data_files(train_file, None, ("text",))
    message = str(err.value)
    assert "'climate' (1 row)" in message and "'weather' (1 row)" in message
    assert "'sport'" not in message and "'business'" not in message
    assert "at least 2 rows" in message and "--validation_file" in message


def test_smallest_file_that_splits_and_one_row_fewer(tmp_path):
    """k labels need >= 2 rows each and ceil(20% of n) >= k rows held out: n >= 5k - 4 (6 for 2 labels)."""
    ok = write_csv(tmp_path / "ok.csv", sport_business(3))  # 6 rows: 2 held out, 4 trained on
    raw = load_data_files(ok, None, ("text",))
    assert (len(raw["train"]), len(raw["validation"])) == (4, 2)
    assert sorted(raw["validation"]["label"]) == [0, 1]
    small = write_csv(tmp_path / "small.csv", sport_business(3)[:5])  # 5 rows: a 1-row hold-out
    with pytest.raises(FinetuneError, match="at least 6 rows"):
        load_data_files(small, None, ("text",))


def test_a_validation_file_makes_a_tiny_train_file_fine(tmp_path):
    train_file = write_csv(tmp_path / "t.csv", [("a goal", "sport"), ("shares fell", "business")])
    valid_file = write_csv(tmp_path / "v.csv", [("the striker", "sport")])
    raw = load_data_files(train_file, valid_file, ("text",))
    assert (len(raw["train"]), len(raw["validation"])) == (2, 1)


def test_one_row_without_labels_cannot_be_split(tmp_path):
    """Causal LM (no labels): 20% of one row leaves nothing to train on; say so instead of datasets' error."""
    path = tmp_path / "one.jsonl"
    path.write_text('{"text": "only one"}\n')
    with pytest.raises(FinetuneError, match=r"--train_file .*one\.jsonl.* 1 row.*--validation_file"):
        load_data_files(str(path), None, ("text",), with_labels=False)
