"""finetune/model_card.py: the README.md model card of a real tiny run, and the reproduce command."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from finetune.config import TrainConfig, parse_config
from finetune.model_card import config_argv, render_model_card, reproduce_command, write_model_card
from helpers import run_in_process
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


def split_front_matter(text: str) -> tuple[str, str]:
    """(YAML front matter, Markdown body) of a model card."""
    assert text.startswith("---\n")
    end = text.index("\n---\n", 4)
    return text[4:end], text[end + 5:]


def parse_front_matter(front: str) -> dict:
    """The front matter as a dict: with PyYAML if installed, else its top-level ``key: value`` lines and
    top-level lists (enough for library_name, pipeline_tag, tags, base_model)."""
    try:
        import yaml
    except ImportError:
        meta, key = {}, None
        for line in front.splitlines():
            if not line.startswith((" ", "-")) and ":" in line:
                key, _, value = line.partition(":")
                meta[key] = value.strip().strip('"') or []
            elif line.startswith("- ") and isinstance(meta.get(key), list):
                meta[key].append(line[2:].strip().strip('"'))
        return meta
    return yaml.safe_load(front)


def test_model_card_of_a_real_run(run):
    config, metrics = load_run(run)
    recipe = load_recipe(config.recipe)
    command = reproduce_command(config_argv(config, recipe), num_processes=metrics["num_processes"],
                                device=metrics["device"])
    path = write_model_card(run, config, metrics, recipe, command)
    assert path == run / "README.md" and path.is_file()
    front, body = split_front_matter(path.read_text())

    meta = parse_front_matter(front)
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-classification"
    assert "finetune" in meta["tags"]
    assert "base_model" not in meta  # the base model is a local directory, not a hub id

    # the effective batch size, as it ran: 4 x 2 x 1
    assert metrics["effective_batch_size"] == 8
    assert "effective batch size" in body and "**8** = 4 x 2 x 1" in body
    # every eval metric of metrics.json, with its value
    evals = {k: v for k, v in metrics.items() if k.startswith("eval_")}
    assert {"eval_accuracy", "eval_f1", "eval_loss"} <= evals.keys()
    for key, value in evals.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        assert f"| `{key}` | {shown} |" in body, key
    # the precision as it ran, and the one requested
    assert metrics["mixed_precision"] == "no" and metrics["mixed_precision_requested"] == "fp16"
    assert "This run trained in **fp32" in body and "`mixed_precision: no`" in body
    assert "--mixed_precision fp16` was requested" in body and "fp16 does not run on CPU" in body
    # the reproduce command, in a code block
    assert f"```bash\n{command}\n```" in body
    assert command.startswith("accelerate launch finetune/run.py --recipe bbc-news")
    # speed and usage
    assert f"| `train_samples_per_second` (samples/s) | {metrics['train_samples_per_second']} |" in body
    assert f"| `train_runtime` (s) | {metrics['train_runtime']} |" in body
    assert "AutoModelForSequenceClassification.from_pretrained" in body and 'pipeline("text-classification"' in body
    for name in ("business", "entertainment", "politics", "sports", "tech"):
        assert f"`{name}`" in body  # labels from the saved config.json


def test_model_index_holds_the_exact_eval_metrics(run):
    yaml = pytest.importorskip("yaml")
    config, metrics = load_run(run)
    recipe = load_recipe(config.recipe)
    text = render_model_card(config, metrics, recipe, "accelerate launch finetune/run.py", output_dir=run)
    meta = yaml.safe_load(split_front_matter(text)[0])
    (entry,) = meta["model-index"]
    assert entry["name"] == "tiny run"
    (result,) = entry["results"]
    assert result["task"]["type"] == "text-classification"
    assert result["dataset"]["name"] == recipe.DATASET
    values = {m["type"]: m["value"] for m in result["metrics"]}
    assert values == {"accuracy": metrics["eval_accuracy"], "f1": metrics["eval_f1"], "loss": metrics["eval_loss"]}
    f1 = next(m for m in result["metrics"] if m["type"] == "f1")
    assert f1["args"] == {"average": "macro"}


def test_hub_base_model_and_hub_dataset(run):
    yaml = pytest.importorskip("yaml")
    _, metrics = load_run(run)
    recipe = load_recipe("glue-mrpc")
    config = parse_config(["--recipe", "glue-mrpc", "--output_dir", str(run)])
    meta = yaml.safe_load(split_front_matter(render_model_card(config, metrics, recipe, "cmd", output_dir=run))[0])
    assert meta["base_model"] == "bert-base-cased"
    assert meta["datasets"] == ["nyu-mll/glue"]
    dataset = meta["model-index"][0]["results"][0]["dataset"]
    assert (dataset["type"], dataset["config"], dataset["split"]) == ("nyu-mll/glue", "mrpc", "validation")


def test_same_precision_has_no_mismatch_sentence(run):
    config, metrics = load_run(run)
    config.mixed_precision = "no"
    metrics = {**metrics, "mixed_precision_requested": "no"}
    body = render_model_card(config, metrics, load_recipe("bbc-news"), "cmd", output_dir=run)
    assert "This run trained in **fp32" in body and "was requested" not in body


def test_reproduce_command_quotes_and_round_trips(tmp_path):
    argv = ["--recipe", "bbc-news", "--output_dir", str(tmp_path / "my run's dir"), "--learning_rate", "3e-05"]
    command = reproduce_command(argv)
    assert command.startswith("accelerate launch finetune/run.py --recipe bbc-news --output_dir ")
    assert shlex.split(command)[3:] == argv
    assert reproduce_command(["finetune/run.py", *argv]) == command  # sys.argv works too
    assert reproduce_command(argv, num_processes=2).startswith(
        "accelerate launch --multi_gpu --num_processes 2 finetune/run.py --recipe bbc-news ")
    assert reproduce_command(argv, num_processes=2, device="cpu").startswith(
        "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 finetune/run.py ")


def test_config_argv_rebuilds_the_config(run, tmp_path):
    config, _ = load_run(run)
    recipe = load_recipe(config.recipe)
    argv = config_argv(config, recipe)
    assert "--per_device_train_batch_size" in argv and "--mixed_precision" in argv
    assert "--weight_decay" not in argv  # equal to the recipe default: left out
    assert parse_config(argv) == config
    command = reproduce_command(argv)
    assert parse_config(shlex.split(command)[3:]) == config

    other = parse_config(["--recipe", "bbc-news", "--disable_dropout", "--output_dir", str(tmp_path / "x y"),
                          "--num_train_epochs", "0.5", "--max_eval_samples", "3"])
    assert parse_config(config_argv(other, recipe)) == other


def test_causal_lm_recipe_gets_a_text_generation_card(run):
    from types import SimpleNamespace

    config, metrics = load_run(run)
    recipe = SimpleNamespace(NAME="my-lm", DESCRIPTION="A causal LM.", TASK="causal-lm", DATASET="my texts")
    metrics = {**metrics, "eval_perplexity": float("inf"), "eval_tokens": 100}
    front, body = split_front_matter(render_model_card(config, metrics, recipe, "cmd", output_dir=run))
    meta = parse_front_matter(front)
    assert meta["pipeline_tag"] == "text-generation"
    if "model-index" in meta:  # parsed with PyYAML: only finite quality metrics, as numbers
        types = {m["type"] for m in meta["model-index"][0]["results"][0]["metrics"]}
        assert "perplexity" not in types and "tokens" not in types and "loss" in types
    assert "| `eval_perplexity` | inf |" in body and "per label token" in body
    assert "AutoModelForCausalLM.from_pretrained" in body and 'pipeline("text-generation"' in body
