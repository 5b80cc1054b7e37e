"""Config validation, precision honesty and the hub check: clear errors, no surprises."""

from __future__ import annotations

import pytest

from finetune.config import parse_config
from finetune.errors import FinetuneError, HubUnreachableError


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


def test_effective_precision_is_measured():
    """On a CPU, Accelerate accepts fp16 but autocast runs fp32: we must report 'no'."""
    from accelerate import Accelerator

    from finetune.precision import effective_mixed_precision

    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    assert effective_mixed_precision(accelerator) == "no"


def test_offline_hub_model_fails_fast(monkeypatch):
    import time

    from finetune.data import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(HubUnreachableError, match="--model_name_or_path"):
        load_tokenizer("some-org/model-that-is-not-cached")
    assert time.perf_counter() - start < 10


def test_model_path_that_is_not_a_model(tmp_path):
    from finetune.data import load_tokenizer

    with pytest.raises(FinetuneError, match="not a Hugging Face model directory"):
        load_tokenizer(str(tmp_path))


def test_batchnorm_with_accumulation_gets_a_warning():
    import torch

    from finetune.builders import batchnorm_warning

    with_bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    message = batchnorm_warning(with_bn, 4)
    assert message and "BatchNorm" in message and "'1'" in message and "NOT equivalent" in message
    assert batchnorm_warning(with_bn, 1) is None  # no accumulation, nothing to warn about
    assert batchnorm_warning(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), 4) is None
    assert batchnorm_warning(torch.nn.Sequential(torch.nn.SyncBatchNorm(4)), 2)  # any _BatchNorm
