"""Config validation, precision honesty and the hub check: clear errors, no surprises."""

from __future__ import annotations

import dataclasses
import json

import pytest

from finetune.config import DERIVED_FIELDS, TrainConfig, config_argv, parse_config
from finetune.errors import FinetuneError, HubUnreachableError
from finetune.recipes import load_recipe


@pytest.mark.parametrize("flag,value,fragment", [
    ("gradient_accumulation_steps", "0", "--gradient_accumulation_steps must be a positive integer"),
    ("gradient_accumulation_steps", "-2", "--gradient_accumulation_steps must be a positive integer"),
    ("per_device_train_batch_size", "0", "--per_device_train_batch_size must be a positive integer"),
    ("per_device_eval_batch_size", "-1", "--per_device_eval_batch_size must be a positive integer"),
    ("learning_rate", "0", "--learning_rate must be > 0"),
    ("max_train_samples", "0", "--max_train_samples must be a positive integer"),
])
def test_validate_names_the_flag(flag, value, fragment):
    config = parse_config(["--recipe", "bbc-news", f"--{flag}", value])
    with pytest.raises(FinetuneError, match=fragment):
        config.validate()


def test_argparse_rejects_bad_choices_and_types(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--mixed_precision", "fp8"])
    assert exit_info.value.code == 2
    assert "mixed_precision" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--gradient_accumulation_steps", "2.5"])


def test_config_is_read_only_after_validate():
    """Parsing may normalise, ``validate()`` freezes: assigning or deleting a field afterwards raises
    ``FrozenInstanceError``; a changed run is a ``dataclasses.replace`` copy, writable until it is validated."""
    config = parse_config(["--recipe", "bbc-news", "--per_device_train_batch_size", "4"])
    config.learning_rate = 3e-5  # before validate(): still being resolved
    config.validate()
    with pytest.raises(dataclasses.FrozenInstanceError, match="read-only after validate.*dataclasses.replace"):
        config.per_device_train_batch_size = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_plan = {"per_device_train_batch_size": 2}
    with pytest.raises(dataclasses.FrozenInstanceError):
        del config.seed
    assert config.per_device_train_batch_size == 4 and config.learning_rate == 3e-5
    accumulation = config.gradient_accumulation_steps
    copy = dataclasses.replace(config, per_device_train_batch_size=2)
    copy.gradient_accumulation_steps = accumulation + 1  # a copy starts writable
    copy.validate()
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.gradient_accumulation_steps = 4
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (4, accumulation)


def test_derived_values_are_fields_but_not_flags(monkeypatch):
    """Where the precision came from is a field: in ``to_dict``/``run_config.json``, kept by copies and by a
    config read back from JSON; no flag sets it and ``config_argv`` never emits it."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert parse_config(["--mixed_precision", "bf16"]).precision_source == "--mixed_precision"
    config = parse_config(["--recipe", "bbc-news"])
    assert (config.mixed_precision, config.precision_source) == ("fp16", "the default")
    config.validate()
    saved = json.loads(config.to_json())
    assert saved["precision_source"] == "the default" and saved["batch_plan"] is None
    assert set(DERIVED_FIELDS) <= {f.name for f in dataclasses.fields(TrainConfig)}
    assert dataclasses.replace(config, seed=1).precision_source == "the default"
    assert TrainConfig(**saved) == config and TrainConfig(**saved).precision_source == "the default"
    planned = dataclasses.replace(config, batch_plan={"per_device_train_batch_size": 4})
    argv = config_argv(planned, load_recipe("bbc-news"))
    assert not any(name in " ".join(argv) for name in DERIVED_FIELDS)
    with pytest.raises(FinetuneError, match="unknown flag --precision_source"):
        parse_config(["--precision_source", "the default"])


def test_effective_precision_is_measured():
    """On a CPU, Accelerate accepts fp16 but autocast runs fp32: we must report 'no'."""
    from accelerate import Accelerator

    from finetune.engine.precision import effective_mixed_precision

    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    assert effective_mixed_precision(accelerator) == "no"


def test_offline_hub_model_fails_fast(monkeypatch):
    import time

    from finetune.models.loading import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(HubUnreachableError, match="--model_name_or_path"):
        load_tokenizer("some-org/model-that-is-not-cached")
    assert time.perf_counter() - start < 10


def test_model_path_that_is_not_a_model(tmp_path):
    from finetune.models.loading import load_tokenizer

    with pytest.raises(FinetuneError, match="not a Hugging Face model directory"):
        load_tokenizer(str(tmp_path))


def test_batchnorm_with_accumulation_gets_a_warning():
    import torch

    from finetune.tasks.builders import batchnorm_warning

    with_bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    message = batchnorm_warning(with_bn, 4)
    assert message and "BatchNorm" in message and "'1'" in message and "NOT equivalent" in message
    assert batchnorm_warning(with_bn, 1) is None  # no accumulation, nothing to warn about
    assert batchnorm_warning(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), 4) is None
    assert batchnorm_warning(torch.nn.Sequential(torch.nn.SyncBatchNorm(4)), 2)  # any _BatchNorm
