"""A requeued job that plans ``--total_batch_size`` again (issue 28): before its first checkpoint, the output dir's
``run_config.json`` holds the planned split and the new launch's config the flags before planning; the same B is
the same run, another B is not."""

import dataclasses

import pytest

from finetune.config import TrainConfig
from finetune.errors import FinetuneError
from finetune.lifecycle.output import check_output_dir


def _previous(tmp_path, **values):
    """An output dir holding a run's ``run_config.json`` (no checkpoint yet), and that run's config."""
    out = tmp_path / "run"
    out.mkdir()
    config = dataclasses.replace(TrainConfig(output_dir=str(out)), **values)
    (out / "run_config.json").write_text(config.to_json() + "\n")
    return config


def test_the_same_total_batch_planned_again_is_the_same_run(tmp_path):
    # planned on 4 processes: 4 x 1; the requeue on 1 process has the flags only (8 x 1 before its plan)
    old = _previous(tmp_path, total_batch_size=16, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    activation_checkpointing=True)
    check_output_dir(dataclasses.replace(old, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                         activation_checkpointing=False, resume_from_checkpoint="auto"))


def test_another_total_batch_is_another_run(tmp_path):
    old = _previous(tmp_path, total_batch_size=16, per_device_train_batch_size=4, gradient_accumulation_steps=4)
    with pytest.raises(FinetuneError, match=r"settings that differ: .*total_batch_size"):
        check_output_dir(dataclasses.replace(old, total_batch_size=32, resume_from_checkpoint="auto"))


def test_without_a_planned_batch_the_split_is_the_users_own(tmp_path):
    old = _previous(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=4)
    with pytest.raises(FinetuneError, match=r"settings that differ: gradient_accumulation_steps, "
                                            r"per_device_train_batch_size"):
        check_output_dir(dataclasses.replace(old, per_device_train_batch_size=8, gradient_accumulation_steps=2))
