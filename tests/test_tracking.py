"""Experiment tracking through Accelerate's trackers: TensorBoard event files with the loss and eval scalars."""

from __future__ import annotations

import pytest
from helpers import run_in_process, train_steps


def test_tensorboard_event_files_hold_loss_and_eval(tmp_path, tiny_bert, monkeypatch):
    """... and the trackers end without ``Accelerator.end_training``'s ``destroy_process_group`` (no barrier: a
    process would leave while a peer still writes; ``run.run`` leaves the group with every process)."""
    from accelerate.state import PartialState
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    destroyed = []
    monkeypatch.setattr(PartialState, "destroy_process_group", lambda self, group=None: destroyed.append(group))
    metrics, out = run_in_process(tmp_path, "tb", model_name_or_path=tiny_bert, report_to="tensorboard",
                                  max_train_samples=24, max_eval_samples=8, per_device_train_batch_size=4,
                                  gradient_accumulation_steps=2, num_train_epochs=2, max_length=32)
    event_files = list((out / "runs").rglob("events.out.tfevents.*"))
    assert event_files, list(out.rglob("*"))
    scalars = {}
    for path in event_files:
        accumulator = EventAccumulator(str(path.parent))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars[tag] = [(e.step, e.value) for e in accumulator.Scalars(tag)]
    steps = train_steps(out)
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in steps]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    assert [v for _, v in scalars["train/learning_rate"]] == pytest.approx([r["learning_rate"] for r in steps])
    assert "train/grad_norm" in scalars and "train/samples_per_second" in scalars
    assert scalars["eval/accuracy"][-1] == (metrics["optimizer_steps"], pytest.approx(metrics["eval_accuracy"]))
    assert len(scalars["eval/loss"]) == 2  # after each epoch
    assert destroyed == []


def test_missing_tracker_package_is_a_clear_error(tmp_path, tiny_bert):
    import importlib.util

    from finetune.errors import FinetuneError

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(FinetuneError, match="--report_to wandb: the wandb package is not installed"):
        run_in_process(tmp_path, "wandb", model_name_or_path=tiny_bert, report_to="wandb", max_steps=1,
                       max_train_samples=8, max_eval_samples=4, max_length=16)
