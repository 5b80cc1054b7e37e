"""Every bad input: a clear error naming the flag or file and the fix, a non-zero exit, no traceback, and
nothing lost: an existing run in --output_dir (model, metrics, checkpoints) is byte-for-byte unchanged,
even with --overwrite_output_dir."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from helpers import run_in_process

from finetune.run import main

TINY = ["--max_train_samples", "16", "--max_eval_samples", "8", "--per_device_train_batch_size", "4",
        "--max_steps", "2", "--max_length", "32"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_bert):
    """A complete tiny run with a checkpoint: the output that bad inputs must not damage."""
    root = tmp_path_factory.mktemp("finished")
    run_in_process(root, "run", model_name_or_path=tiny_bert, max_train_samples=16, max_eval_samples=8,
                   per_device_train_batch_size=4, max_steps=2, max_length=32, checkpointing_steps=1)
    return root / "run"


def digest(path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def write(path, text):
    path.write_text(text)
    return str(path)


def cases(tmp, tiny_bert):
    """(id, extra flags, fragments the error must contain). Flags go after the defaults, so they win."""
    csv_ok = write(tmp / "ok.csv", "text,label\na goal,sport\nshares fell,business\nthe striker,sport\nprofits,business\n")
    return [
        ("unknown-recipe", ["--recipe", "no-such"], ["unknown recipe 'no-such'", "bbc-news"]),
        ("accumulation-0", ["--gradient_accumulation_steps", "0"], ["--gradient_accumulation_steps", "positive integer"]),
        ("accumulation-negative", ["--gradient_accumulation_steps", "-3"], ["--gradient_accumulation_steps"]),
        ("accumulation-not-int", ["--gradient_accumulation_steps", "2.5"], ["--gradient_accumulation_steps", "invalid int"]),
        ("batch-0", ["--per_device_train_batch_size", "0"], ["--per_device_train_batch_size", "positive integer"]),
        ("eval-batch-negative", ["--per_device_eval_batch_size", "-1"], ["--per_device_eval_batch_size"]),
        ("precision", ["--mixed_precision", "fp8"], ["--mixed_precision", "invalid choice"]),
        ("missing-train-file", ["--train_file", str(tmp / "nope.csv")], ["--train_file", "does not exist"]),
        ("empty-train-file", ["--train_file", write(tmp / "empty.csv", "")], ["--train_file", "is empty"]),
        ("no-label-column", ["--train_file", write(tmp / "nolabel.csv", "text,topic\na,b\nc,d\n")],
         ["lacks column(s) label", "needs text, label"]),
        ("unknown-validation-label", ["--train_file", csv_ok, "--validation_file",
                                      write(tmp / "val.csv", "text,label\nnew thing,weather\n")],
         ["--validation_file", "val.csv' line 2: the label 'weather' never appears in --train_file"]),
        ("empty-text", ["--train_file", write(tmp / "blank.csv", "text,label\na goal,sport\n  ,business\nx,business\n")],
         ["blank.csv' line 3: the 'text' column is empty"]),
        ("max-length-too-long", ["--max_length", "4096"], ["--max_length 4096", "position limit of 128"]),
        ("model-not-a-model", ["--model_name_or_path", str(tmp)], ["not a Hugging Face model directory"]),
        ("hub-id-offline", ["--model_name_or_path", "some-org/uncached-model"], ["Hugging Face Hub", "--model_name_or_path DIR"]),
        ("bad-checkpointing-steps", ["--checkpointing_steps", "often"], ["--checkpointing_steps"]),
        ("resume-nothing", ["--resume_from_checkpoint", str(tmp / "nowhere")], ["--resume_from_checkpoint", "not a directory"]),
        ("ddp-timeout-zero", ["--ddp_timeout", "0"], ["--ddp_timeout must be a positive number of seconds"]),
    ]


def test_table_of_bad_inputs(tmp_path, tiny_bert, finished_run, capsys):
    for case_id, flags, fragments in cases(tmp_path, tiny_bert):
        out = tmp_path / f"out-{case_id}"
        shutil.copytree(finished_run, out)
        before = digest(out)
        argv = ["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out),
                "--overwrite_output_dir", *TINY, *flags]
        try:
            code = main(argv)
        except SystemExit as exit_info:  # argparse's own errors
            code = exit_info.code
        err = capsys.readouterr().err
        assert code == 2, (case_id, code, err[-2000:])
        line = next((l for l in err.splitlines() if "error: " in l), "")
        for fragment in fragments:
            assert fragment in line, (case_id, fragment, line)
        assert "Traceback" not in err, case_id
        assert digest(out) == before, f"{case_id}: the existing run was modified"


def test_output_dir_cases(tmp_path, tiny_bert, finished_run, capsys):
    out = tmp_path / "other"
    shutil.copytree(finished_run, out)
    before = digest(out)
    # a different run without --overwrite_output_dir
    assert main(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out), *TINY,
                 "--learning_rate", "0.1"]) == 2
    assert "holds a different run (settings that differ: learning_rate)" in capsys.readouterr().err
    assert digest(out) == before
    # the same run again, without resuming: its checkpoints would be lost
    config = json.loads((out / "run_config.json").read_text())
    same = ["--recipe", "bbc-news", "--output_dir", str(out)] + [
        a for k in ("model_name_or_path", "max_train_samples", "max_eval_samples", "per_device_train_batch_size",
                    "max_steps", "max_length") for a in (f"--{k}", str(config[k]))]
    assert main(same) == 2
    assert "holds checkpoints of this run" in capsys.readouterr().err
    assert digest(out) == before
    # not a directory we can write: its parent is a file
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(blocker / "out"),
                 *TINY]) == 2
    assert "cannot be written" in capsys.readouterr().err
    # a directory holding something else
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(foreign), *TINY]) == 2
    assert "not empty and does not hold a finetune run" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "mine"


def test_different_run_names_the_settings(tmp_path, tiny_bert, finished_run, capsys):
    out = tmp_path / "diff"
    shutil.copytree(finished_run, out)
    code = main(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out), *TINY,
                 "--learning_rate", "0.1", "--resume_from_checkpoint", "latest", "--checkpointing_steps", "1"])
    # resuming with a different learning rate is allowed (it does not change what a step means) ...
    assert code == 0, capsys.readouterr().err[-2000:]
    capsys.readouterr()
    code = main(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out), *TINY,
                 "--weight_decay", "0.3"])
    assert code == 2
    assert "holds a different run (settings that differ: " in capsys.readouterr().err


def test_bf16_on_a_gpu_without_it(monkeypatch):
    import torch

    from finetune.engine.precision import check_precision_supported
    from finetune.errors import FinetuneError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(FinetuneError, match="bf16: this GPU \\(Tesla V100\\) has no bf16 support"):
        check_precision_supported("bf16")
    check_precision_supported("fp16")  # fp16 is fine there


@pytest.mark.parametrize("recipe", ["glue-mrpc", "wikitext-clm"])
def test_hub_recipes_fail_fast_offline_with_the_local_alternative(tmp_path, recipe, capsys):
    import time

    start = time.perf_counter()
    assert main(["--recipe", recipe, "--output_dir", str(tmp_path / recipe)]) == 2
    err = capsys.readouterr().err
    assert "Hugging Face Hub" in err and "--model_name_or_path" in err and "Traceback" not in err
    assert time.perf_counter() - start < 20


def test_another_ranks_write_probe_is_not_foreign_content(tmp_path):
    """Every process of a launch checks --output_dir at once: rank 0's write probe, present for an instant,
    must not make rank 1 see "not empty and does not hold a finetune run" (a flaky 2-process failure)."""
    from finetune.config import parse_config
    from finetune.errors import FinetuneError
    from finetune.lifecycle.output import check_output_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / ".write_test-99999").write_text("ok")  # another process's probe
    check_output_dir(parse_config(["--recipe", "bbc-news", "--output_dir", str(out)]))
    assert sorted(p.name for p in out.iterdir()) == [".write_test-99999"]  # ours was removed, theirs untouched
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FinetuneError, match="not empty"):
        check_output_dir(parse_config(["--recipe", "bbc-news", "--output_dir", str(out)]))
