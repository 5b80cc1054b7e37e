"""The comparison through the CLI: both backends, one report."""

from __future__ import annotations

import json

import pytest
from helpers import launch

pytestmark = pytest.mark.integration


def test_compare_writes_report_json_and_plot(tmp_path, tiny_bert):
    out = tmp_path / "cmp"
    result = launch(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out),
                     "--max_train_samples", "22", "--max_eval_samples", "8", "--per_device_train_batch_size", "2",
                     "--gradient_accumulation_steps", "4", "--num_train_epochs", "2", "--disable_dropout",
                     "--max_length", "32", "--learning_rate", "2e-3", "--warmup_steps", "1"], module="finetune.commands.compare")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "comparison.json").read_text())
    assert set(summary["backends"]) == {"accelerate", "trainer"}
    for backend, figures in summary["backends"].items():
        assert (out / backend / "model.safetensors").is_file()
        for key in ("eval_accuracy", "eval_f1", "final_train_loss", "optimizer_steps", "train_samples_per_second",
                    "wall_time", "peak_memory_bytes"):
            assert figures[key] is not None, (backend, key)
        assert figures["optimizer_steps"] == 6 and figures["peak_memory_bytes"] > 50 * 2**20
    assert summary["steps_compared"] == 6
    assert summary["max_abs_step_loss_diff"] < 1e-4
    ratio = summary["samples_per_second_ratio_accelerate_over_trainer"]
    a, t = (summary["backends"][b]["train_samples_per_second"] for b in ("accelerate", "trainer"))
    assert ratio == pytest.approx(a / t)
    curves = summary["loss_curves"]
    assert len(curves["accelerate"]) == len(curves["trainer"]) == 6
    markdown = (out / "comparison.md").read_text()
    assert "| eval_accuracy |" in markdown and "loss_curves.png" in markdown and "Speed ratio" in markdown

    from PIL import Image

    with Image.open(out / "loss_curves.png") as image:
        image.load()
        assert image.size[0] > 400 and image.size[1] > 300
        # two coloured curves were drawn: blue (accelerate) and orange (trainer) pixels are present
        pixels = list(image.convert("RGB").getdata())
    blue = sum(1 for r, g, b in pixels if b > 150 and r < 80 and g < 150)
    orange = sum(1 for r, g, b in pixels if r > 200 and 100 < g < 170 and b < 60)
    assert blue > 100 and orange > 50


def test_finetune_train_refuses_compare_naming_the_command(tmp_path, capsys):
    """``finetune compare`` is the one way to compare: the training entry point has no alias for it (one ``error:``
    line naming the command, nothing written)."""
    from test_small_train_file import run_main

    result = run_main(["--recipe", "bbc-news", "--output_dir", str(tmp_path / "out"), "--compare", "True"], capsys)
    assert result.returncode == 2
    assert "error: --compare is its own command: run `finetune compare` with the same flags" in result.stderr
    assert not (tmp_path / "out").exists()
