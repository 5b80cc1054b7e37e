"""The real CLI through `accelerate launch` on a tiny model and a small subset of bbc-news."""

from __future__ import annotations

import json
import math
import os

import pytest
from helpers import assert_user_error, host_cpus, launch, read_log, run_script, train_steps

pytestmark = pytest.mark.integration

METRIC_KEYS = {"eval_accuracy", "eval_f1", "train_loss", "optimizer_steps", "effective_batch_size",
               "mixed_precision", "train_samples_per_second", "train_runtime"}


def test_cli_run_writes_a_reloadable_model_and_honest_metrics(tmp_path, tiny_bert):
    out = tmp_path / "run"
    train_samples, micro, accum, epochs = 60, 4, 4, 4
    result = launch(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out),
                     "--max_train_samples", str(train_samples), "--max_eval_samples", "30",
                     "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", str(accum),
                     "--num_train_epochs", str(epochs), "--learning_rate", "1e-2", "--warmup_steps", "0",
                     "--max_length", "64", "--mixed_precision", "fp16"],
                    cpus=host_cpus())  # all of them, also in a pinned parallel worker: the thread count below
    assert result.returncode == 0, result.stderr[-3000:]
    # the requested precision did not run on CPU: say so, and record the truth
    assert "fp16" in result.stdout and "this run is fp32" in result.stdout
    assert "Effective batch size: 4 (micro-batch) x 4 (accumulation) x 1 (processes) = 16" in result.stdout
    assert "Run summary" in result.stdout
    if len(host_cpus()) >= 2:  # the launcher's OMP_NUM_THREADS=1 default is undone
        assert f"Using {len(host_cpus())} CPU threads per process" in result.stdout

    metrics = json.loads((out / "metrics.json").read_text())
    assert METRIC_KEYS <= metrics.keys()
    assert metrics["mixed_precision"] == "no" and metrics["mixed_precision_requested"] == "fp16"
    steps_per_epoch = math.ceil(math.ceil(train_samples / micro) / accum)  # 15 micro-batches -> 4 steps
    steps = train_steps(out)
    assert metrics["optimizer_steps"] == len(steps) == steps_per_epoch * epochs == 16
    assert [r["step"] for r in steps] == list(range(1, 17))
    assert {"step", "epoch", "loss", "learning_rate", "grad_norm"} <= steps[0].keys()
    assert [r["samples"] for r in steps[:4]] == [16, 16, 16, 12]
    assert metrics["effective_batch_size"] == 16
    assert metrics["train_samples"] == train_samples * epochs
    evals = [r for r in read_log(out) if "eval_accuracy" in r]
    assert len(evals) == epochs
    assert metrics["eval_accuracy"] == evals[-1]["eval_accuracy"]
    # the loss decreases: last epoch's mean below the first epoch's
    first, last = steps[:4], steps[-4:]
    assert sum(r["loss"] for r in last) / 4 < sum(r["loss"] for r in first) / 4 - 0.05

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.id2label[3] == "sports"
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "run_config.json").read_text())["gradient_accumulation_steps"] == accum
    logits = model(**tokenizer(["Chelsea won the cup final"], return_tensors="pt")).logits
    assert logits.shape == (1, 5)


def test_cli_list_recipes_and_unknown_recipe(tmp_path):
    result = launch(["--list_recipes"])
    assert result.returncode == 0
    assert "bbc-news" in result.stdout and "glue-mrpc" in result.stdout and "needs hub" in result.stdout
    assert_user_error(launch(["--recipe", "nope", "--output_dir", str(tmp_path / "x")]),
                      "unknown recipe 'nope'", "bbc-news", "glue-mrpc")
    bad = run_script(["--recipe", "nope", "--output_dir", str(tmp_path / "x")])
    assert bad.returncode == 2
    assert_user_error(bad, "unknown recipe 'nope'")


def test_cli_glue_mrpc_offline_fails_fast_with_the_fix(tmp_path):
    import time

    start = time.perf_counter()
    result = launch(["--recipe", "glue-mrpc", "--output_dir", str(tmp_path / "mrpc")])
    assert_user_error(result, "Hugging Face Hub", "--model_name_or_path")
    assert time.perf_counter() - start < 60


def test_cli_own_data_files(tmp_path, tiny_bert):
    import csv

    rows = [("the striker scored twice in the final", "sport"), ("shares fell as profits dropped", "business")] * 12
    for name, part in (("train.csv", rows), ("dev.csv", rows[:6])):
        with open(tmp_path / name, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows(part)
    out = tmp_path / "own"
    result = launch(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out),
                     "--train_file", str(tmp_path / "train.csv"), "--validation_file", str(tmp_path / "dev.csv"),
                     "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                     "--num_train_epochs", "6", "--learning_rate", "1e-2", "--max_length", "16"])
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_samples"] == 6
    assert metrics["eval_accuracy"] == 1.0  # two trivially separable sentences
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out).id2label == {0: "business", 1: "sport"}


# ------------------------------------------------------------------------------- the `finetune` command table
def test_help_and_recipes_start_without_torch():
    """``finetune --help`` and ``finetune recipes`` import neither torch nor accelerate (the table's entries are
    imported when their command runs)."""
    import subprocess
    import sys

    from helpers import REPO

    code = ("import sys; from finetune.cli import main\n"
            "assert main(['--help']) == 0 and main(['recipes']) == 0\n"
            "print(sorted(m for m in ('torch', 'accelerate', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "[]"


def test_the_usage_is_written_from_the_command_table_and_every_entry_loads(capsys):
    from finetune.cli import COMMANDS, USAGE, main

    names = [c.name for c in COMMANDS]
    assert names == ["train", "recipes", "env", "predict", "compare", "verify", "plan", "eval", "export", "check-data"]
    listed = [line.split()[0] for line in USAGE.split("commands:\n", 1)[1].splitlines() if line[:3].strip()]
    assert listed == names
    assert {c.name for c in COMMANDS if c.launched} == {"train", "verify", "plan"}
    for command in COMMANDS:
        assert callable(command.load()), command
    assert {c.name: c.module for c in COMMANDS}["compare"] == "finetune.commands.compare"  # its own entry, not a flag
    assert main(["nope"]) == 2
    assert capsys.readouterr().err == ("error: unknown command 'nope'. Commands: " + ", ".join(names)
                                       + " (finetune --help).\n")


def test_no_module_of_the_package_imports_the_training_entry_point_but_the_cli():
    import ast

    from helpers import REPO

    importers = set()
    for path in (REPO / "finetune").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                     if isinstance(node, ast.ImportFrom) and node.module else [])
            if "finetune.run" in names:
                importers.add(path.relative_to(REPO).as_posix())
    assert importers <= {"finetune/cli.py"}  # cli.py names it in its table; it imports it only to run it


def test_the_argv_reader_keeps_each_command_s_spelling():
    from finetune.argv import given, take_switch, take_values, wants_help

    argv = ["--recipe", "x", "--verify_steps", "4", "--time", "--verify_steps=5", "--output_dir=o", "--verify_steps"]
    assert take_values(argv, "--verify_steps") == (["4", "5", None], ["--recipe", "x", "--time", "--output_dir=o"])
    assert take_values(argv, "--verify_steps", joined=False)[0] == ["4", None]  # --samples: the spaced form only
    assert take_switch(argv, "--time") == (True, [a for a in argv if a != "--time"])
    assert take_switch(argv, "--times") == (False, argv)
    assert given(argv, "--output_dir") and given(argv, "--recipe") and not given(argv, "--output")
    assert wants_help(["--recipe", "x", "-h"]) and not wants_help(["--help_me"])


def test_compare_is_a_command_with_its_own_entry(tmp_path, capsys):
    """``finetune compare`` runs ``finetune.commands.compare.main`` in this process: bad input is one error line, before
    anything is written."""
    from finetune.cli import main

    assert main(["compare", "--recipe", "nope", "--output_dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown recipe 'nope'")
    assert not (tmp_path / "c").exists()
