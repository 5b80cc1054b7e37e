"""The model card's report of a run, as TRL's and Axolotl's users expect it (issue 29): framework versions, the
evaluations table from ``log.jsonl``, the tracker's log directory, and ``run_config.json`` in a collapsed block; on
a real tiny run that evaluates every step and logs to TensorBoard, in both backends."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import re
from pathlib import Path

import pytest
from helpers import read_log, run_in_process
from huggingface_hub import ModelCard

import finetune
from finetune.outputs.card import framework_versions

RUN = dict(max_train_samples=24, max_eval_samples=8, per_device_train_batch_size=4, gradient_accumulation_steps=2,
           max_steps=3, max_length=32, eval_strategy="steps", eval_steps=1, report_to="tensorboard")


@pytest.fixture(scope="module", params=["accelerate", "trainer"])
def run(request, tmp_path_factory, tiny_bert) -> Path:
    pytest.importorskip("tensorboard")
    _, out = run_in_process(tmp_path_factory.mktemp("report"), f"card-{request.param}", model_name_or_path=tiny_bert,
                            backend=request.param, **RUN)
    return out


def section(body: str, title: str) -> str:
    match = re.search(rf"\n## {re.escape(title)}\n\n(.*?)(?=\n## |\Z)", body, re.S)
    assert match, title
    return match.group(1)


def test_framework_versions(run):
    body = ModelCard.load(run / "README.md").text
    lines = section(body, "Framework versions").strip().splitlines()
    assert lines[:2] == [f"- Python: {platform.python_version()}", f"- finetune: {finetune.__version__}"]
    for name, distribution in (("PyTorch", "torch"), ("Transformers", "transformers"), ("Accelerate", "accelerate"),
                               ("Datasets", "datasets"), ("PEFT", "peft")):
        assert f"- {name}: {importlib.metadata.version(distribution)}" in lines
    try:
        deepspeed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        deepspeed = None
    assert (f"- DeepSpeed: {deepspeed}" in lines) if deepspeed else not any("DeepSpeed" in line for line in lines)
    assert dict(framework_versions())["Python"] == platform.python_version()


def test_evaluations_table_holds_every_evaluation_of_the_log(run):
    body = ModelCard.load(run / "README.md").text
    table = section(body, "Evaluations during training").strip().splitlines()
    evaluations = [r for r in read_log(run) if "eval_loss" in r]
    assert [r["step"] for r in evaluations] == [1, 2, 3]  # --eval_steps 1, the last one not repeated
    assert table[0] == "| step | epoch | `eval_loss` | `eval_accuracy` | `eval_f1` |"
    assert len(table) == 2 + len(evaluations)
    for row, record in zip(table[2:], evaluations):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells == [str(record["step"]), f"{record['epoch']:.4f}", f"{record['eval_loss']:.4f}",
                         f"{record['eval_accuracy']:.4f}", f"{record['eval_f1']:.4f}"]
    # it comes right after the final results
    titles = re.findall(r"\n## (.+)\n", body)
    assert titles[titles.index("Evaluation results") + 1] == "Evaluations during training"


def test_tracker_log_dir_is_linked(run):
    body = ModelCard.load(run / "README.md").text
    text = section(body, "Experiment tracking")
    events = sorted({p.parent.relative_to(run).as_posix() for p in run.rglob("events.out.tfevents.*")})
    assert events, "TensorBoard wrote no event file"
    if run.name == "card-accelerate":  # Accelerator(project_dir=output_dir).init_trackers("runs")
        assert events[0] == "runs" and all(e.startswith("runs/") for e in events[1:])  # hparams: a subfolder
        assert "TensorBoard: logs in `runs/`" in text and f"tensorboard --logdir {run / 'runs'}" in text
    else:  # Trainer's logging_dir: <its output_dir = our checkpoints/>/runs/<time>_<host>
        assert events[0].startswith("checkpoints/runs/") and all(e.startswith(events[0]) for e in events)
        assert f"TensorBoard: logs in `{events[0]}/`" in text


def test_run_config_in_a_collapsed_block(run):
    body = ModelCard.load(run / "README.md").text
    block = section(body, "Run configuration")
    assert block.startswith("<details>\n<summary><code>run_config.json</code>")
    match = re.search(r"```json\n(.*?)\n```\n\n</details>", block, re.S)
    assert json.loads(match.group(1)) == json.loads((run / "run_config.json").read_text())


def test_a_run_without_tracker_or_evaluation_log_has_neither_section(run, tmp_path):
    from finetune.config import TrainConfig
    from finetune.outputs.card import render_model_card
    from finetune.recipes import load_recipe

    config = TrainConfig(**{**json.loads((run / "run_config.json").read_text()), "report_to": "none"})
    body = ModelCard(render_model_card(config, {}, load_recipe("bbc-news"), "cmd", output_dir=tmp_path)).text
    assert "## Evaluations during training" not in body and "## Experiment tracking" not in body
    assert json.loads(re.search(r"```json\n(.*?)\n```", body, re.S).group(1)) == config.to_dict()
