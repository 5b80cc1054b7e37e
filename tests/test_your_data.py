"""Your model, your data: TRL's precision switches, a recipe's row caps kept off data it did not ship, ``--help``
showing the recipe's effective defaults, every Accelerate tracker (MLflow read back through its own client), and an
install name that is this project's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_log, run_in_process, train_steps

from finetune.config import parse_config
from finetune.errors import FinetuneError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags, expected", [
    (["--bf16"], "bf16"),
    (["--fp16", "true"], "fp16"),
    (["--bf16=True"], "bf16"),
    (["--bf16", "false"], "no"),  # TRL's configs default to bf16: false alone means fp32
    (["--bf16", "--output_dir", "x"], "bf16"),  # a bare switch takes no value
    (["--bf16", "--mixed_precision", "bf16"], "bf16"),
])
def test_trl_precision_switches_set_mixed_precision(flags, expected):
    assert parse_config(["--recipe", "bbc-news", *flags]).mixed_precision == expected


@pytest.mark.parametrize("flags, fragment", [
    (["--bf16", "--fp16"], "both true"),
    (["--bf16", "--mixed_precision", "fp16"], "disagree"),
    (["--fp16=maybe"], "expected true or false"),
])
def test_conflicting_precision_switches_are_one_error(flags, fragment):
    with pytest.raises(FinetuneError, match=fragment):
        parse_config(["--recipe", "bbc-news", *flags])


def test_a_trl_yaml_bf16_key_sets_mixed_precision_and_the_command_line_wins(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("bf16: true\nlearning_rate: 2.0e-5\n")
    assert parse_config(["--recipe", "bbc-news", "--config", str(path)]).mixed_precision == "bf16"
    assert parse_config(["--recipe", "bbc-news", "--config", str(path), "--mixed_precision", "no", "--max_length", "64"]).mixed_precision == "no"
    path.write_text("bf16: true\nmixed_precision: fp16\n")
    with pytest.raises(FinetuneError, match="disagree"):
        parse_config(["--recipe", "bbc-news", "--config", str(path)])


def test_a_recipes_row_caps_never_apply_to_your_data(tmp_path):
    """bbc-headlines caps its own corpus at 256/100 rows; a --train_file or --dataset_name (flag or file key) trains
    every row unless a limit is given by the user."""
    assert parse_config(["--recipe", "bbc-headlines"]).max_train_samples == 256
    mine = ["--recipe", "bbc-headlines", "--train_file", str(tmp_path / "mine.jsonl")]
    config = parse_config(mine)
    assert (config.max_train_samples, config.max_eval_samples) == (None, None)
    assert parse_config([*mine, "--max_train_samples", "7"]).max_train_samples == 7
    path = tmp_path / "c.yaml"
    path.write_text(f"dataset_name: {tmp_path}\nmax_eval_samples: 9\n")
    config = parse_config(["--recipe", "bbc-headlines", "--config", str(path)])
    assert (config.max_train_samples, config.max_eval_samples) == (None, 9)


def test_help_shows_the_recipes_effective_defaults():
    def default(*args):
        out = subprocess.run([sys.executable, "-m", "finetune.cli", "train", *args, "--help"], capture_output=True,
                             text=True, cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return re.search(r"\n  --max_train_samples MAX_TRAIN_SAMPLES[^\n]*\n[^\n]*\(default: (\w+)\)", out.stdout, re.S).group(1)

    assert default("--recipe", "bbc-headlines", "--num_processes", "1") == "256"  # a launcher flag beside it
    assert default("--recipe", "bbc-headlines", "--train_file", "mine.jsonl") == "None"


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    from tiny_models import build_tiny_chat_llama

    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


def _run_without_recipe(argv: list[str]) -> dict:
    """``finetune train`` in this process with ``argv`` as given (no ``--recipe`` added)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from finetune.run import run

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    return run(parse_config(argv))


def test_a_thousand_rows_of_yours_train_a_thousand_rows_per_epoch(tmp_path, chat_llama, capsys):
    """No recipe: 1,000 ``messages`` rows on a tiny chat Llama train as SFT (the banner says so and from which
    column), every row per epoch (no recipe's cap leaks: no 'Data: the first' line); a recipe's own data still
    prints its cap with the rows kept of how many."""
    rows = [{"messages": [{"role": "user", "content": f"headline for story {i}"},
                          {"role": "assistant", "content": f"story {i % 7}"}]} for i in range(1000)]
    train, valid = tmp_path / "rows.jsonl", tmp_path / "valid.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    valid.write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    out = tmp_path / "mine"
    _run_without_recipe(["--model_name_or_path", chat_llama, "--train_file", str(train), "--validation_file",
                         str(valid), "--output_dir", str(out), "--per_device_train_batch_size", "50",
                         "--gradient_accumulation_steps", "2", "--max_steps", "1", "--eval_strategy", "no",
                         "--mixed_precision", "no", "--max_length", "64"])
    printed = capsys.readouterr().out
    assert f"Recipe: sft, chosen from the column(s) messages of --train_file {train}" in printed, printed[-3000:]
    assert "Optimizer steps: 10 per epoch (20 micro-batches per process)" in printed, printed[-3000:]
    assert "Data: the first" not in printed
    assert "Loss on: all tokens (TRL's default; --assistant_only_loss for the assistant turns)" in printed
    assert train_steps(out)[0]["samples"] == 100
    assert json.loads((out / "run_config.json").read_text())["recipe"] == "sft"

    from finetune.recipes import load_recipe
    from finetune.tasks import run_task
    from finetune.tasks.builders import raw_datasets

    recipe = load_recipe("bbc-headlines")
    config = parse_config(["--recipe", "bbc-headlines", "--max_eval_samples", "3"])
    raw = raw_datasets(recipe, config, run_task(recipe, config), check=False)
    assert (len(raw["train"]), len(raw["validation"])) == (256, 3)
    printed = capsys.readouterr().out
    assert re.search(r"Data: the first 256 of [\d,]+ training rows \(--max_train_samples 256: the recipe's default",
                     printed), printed
    assert re.search(r"Data: the first 3 of [\d,]+ validation rows \(--max_eval_samples 3: yours", printed), printed


@pytest.mark.parametrize("row, flags, recipe", [
    ({"messages": []}, [], "sft"),
    ({"conversations": []}, [], "sft"),
    ({"prompt": "p", "completion": "c"}, [], "sft"),
    ({"prompt": "p", "chosen": "a", "rejected": "b"}, [], "dpo"),
    ({"chosen": [], "rejected": []}, [], "dpo"),  # implicit prompt
    ({"text": "t"}, [], "clm"),
    ({"text": "t", "label": 1}, [], "clm"),  # as trl sft reads imdb-like rows
    ({"text": "t", "label": 1}, ["--task", "sequence-classification"], "classify"),
    ({"text": "t", "label": 1}, ["--task", "causal-lm"], "clm"),
])
def test_the_recipe_follows_from_the_columns(tmp_path, row, flags, recipe):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    config = parse_config(["--model_name_or_path", "m", "--train_file", str(path), *flags])
    assert config.recipe == recipe and config.recipe_source.startswith("from ")
    assert parse_config(["--recipe", "bbc-news", "--train_file", str(path)]).recipe_source is None


@pytest.mark.parametrize("row, flags, fragment", [
    ({"text": "t", "messages": []}, [], r"several formats \(messages \(sft\); text \(clm\)\): pass --task"),
    ({"prompt": "p"}, [], "prompt-only rows"),
    ({"question": "q"}, [], "columns question, none of TRL's formats"),
    ({"text": "t"}, ["--task", "poetry"], "invalid choice|unknown"),
])
def test_columns_that_fit_no_format_are_one_error(tmp_path, row, flags, fragment):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises((FinetuneError, SystemExit)) as raised:
        parse_config(["--model_name_or_path", "m", "--train_file", str(path), *flags])
    if raised.type is FinetuneError:
        assert re.search(fragment, str(raised.value)), raised.value


def test_a_recipe_of_yours_needs_your_model_and_data(tmp_path):
    with pytest.raises(FinetuneError, match="pass --model_name_or_path and --train_file or --dataset_name"):
        parse_config(["--recipe", "sft"])
    with pytest.raises(FinetuneError, match="--task causal-lm and --recipe sft .* disagree"):
        parse_config(["--recipe", "sft", "--task", "causal-lm", "--model_name_or_path", "m", "--train_file", "x"])


def test_report_to_takes_every_tracker_accelerate_knows():
    import typing

    from accelerate.utils import LoggerType

    from finetune.config.cadence import CadenceArguments

    choices = set(typing.get_args(typing.get_type_hints(CadenceArguments)["report_to"]))
    assert choices == {t.value for t in LoggerType} | {"none"}


def test_mlflow_run_holds_the_logged_metrics(tmp_path, tiny_bert, monkeypatch):
    """--report_to mlflow with no MLFLOW_TRACKING_URI: a local store in <output_dir>/mlruns whose run, read back by
    MLflow's own client, holds every step's train/loss of log.jsonl, the hyperparameters and the final eval."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # unset for the run; restored afterwards
    metrics, out = run_in_process(tmp_path, "mlf", model_name_or_path=tiny_bert, report_to="mlflow",
                                  max_train_samples=24, max_eval_samples=8, per_device_train_batch_size=4,
                                  gradient_accumulation_steps=2, num_train_epochs=1, max_length=32)
    store = out / "mlruns" / "mlflow.db"
    assert store.is_file()
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{store}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    steps = train_steps(out)
    assert [m.step for m in history] == [r["step"] for r in steps]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    assert run.data.params["learning_rate"] == str(json.loads((out / "run_config.json").read_text())["learning_rate"])
    assert run.data.metrics["eval/accuracy"] == pytest.approx(metrics["eval_accuracy"])
    assert read_log(out)  # the log the tracker mirrors
    assert "tracking URI `sqlite:///" in (out / "README.md").read_text()


def test_no_page_installs_the_unrelated_finetune_distribution():
    """``finetune`` on PyPI is another project: the distribution is ``finetune-accelerate``, and no page or message
    tells a user to ``pip install finetune``."""
    assert re.search(r'^name = "finetune-accelerate"', (REPO / "pyproject.toml").read_text(), re.M)
    wrong = re.compile(r"pip install\s+['\"]?finetune(?![-\w])")
    pages = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "finetune").rglob("*.py")]
    found = [f"{p.relative_to(REPO)}:{i}" for p in pages for i, line in enumerate(p.read_text().splitlines(), 1)
             if wrong.search(line)]
    assert found == []


SHAREGPT = [{"conversations": [{"from": "user", "value": f"what is story {i} about?"},
                               {"from": "assistant", "value": f"topic {i % 5}, in {i % 3 + 1} words"}]}
            for i in range(24)]
# ChatML that writes the row's tools into a system turn (as tool-calling templates do), so that passing them shows
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_sharegpt_rows_convert_as_trl_converts_them():
    import copy

    trl = pytest.importorskip("trl")
    from finetune.data.formats import to_chatml

    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "id": 3}
    assert to_chatml(row) == trl.maybe_convert_to_chatml(copy.deepcopy(row))
    assert to_chatml(row)["messages"][1] == {"role": "gpt", "content": "hello"}  # roles kept, as TRL keeps them


def test_a_rows_tools_reach_the_chat_template(chat_llama):
    """``tools`` (a list, or a JSON string as TRL parses it) are rendered by the template exactly as
    ``apply_chat_template(messages, tools=...)`` renders them (TRL 1.16 sft_trainer.py tokenize_fn); the labels
    still cover the assistant turn alone."""
    from transformers import AutoTokenizer

    from finetune.data.chat import encode_row
    from finetune.tasks import IGNORE_INDEX

    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find a story",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "find story 3"}, {"role": "assistant", "content": "story 3 is sport"}]
    expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
    for given in (tools, json.dumps(tools)):
        encoded = encode_row(tokenizer, {"messages": messages, "tools": given}, max_length=512)
        assert encoded["input_ids"] == list(expected)
    plain = encode_row(tokenizer, {"messages": messages}, max_length=512)
    assert len(plain["input_ids"]) < len(expected)
    trained = [t for t in encoded["labels"] if t != IGNORE_INDEX]
    assert trained == [t for t in plain["labels"] if t != IGNORE_INDEX]  # the same assistant tokens either way


def test_sharegpt_data_without_a_recipe_trains_as_its_messages_do(tmp_path, chat_llama):
    """No recipe, ShareGPT rows: SFT chosen from ``conversations``, and every step's loss equal to the same rows
    written as ``messages`` (bit for bit: one conversion, the same tokens)."""
    from finetune.data.formats import to_chatml

    losses = {}
    for form, rows in (("sharegpt", SHAREGPT), ("messages", [to_chatml(r) for r in SHAREGPT])):
        path = tmp_path / f"{form}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = tmp_path / form
        _run_without_recipe(["--model_name_or_path", chat_llama, "--train_file", str(path), "--output_dir", str(out),
                             "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                             "--max_steps", "2", "--eval_strategy", "no", "--mixed_precision", "no",
                             "--max_length", "64", "--learning_rate", "1e-3"])
        assert json.loads((out / "run_config.json").read_text())["recipe"] == "sft"
        losses[form] = [r["loss"] for r in train_steps(out)]
    assert len(losses["sharegpt"]) == 2 and losses["sharegpt"] == losses["messages"]
