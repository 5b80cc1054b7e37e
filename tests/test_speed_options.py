"""Speed options change speed, not results; the MFU arithmetic and its sources."""

from __future__ import annotations

import pytest

from helpers import run_in_process, train_steps


def test_dataloader_workers_give_identical_training(tmp_path, tiny_bert):
    kw = dict(model_name_or_path=tiny_bert, max_train_samples=24, max_eval_samples=8, per_device_train_batch_size=4,
              gradient_accumulation_steps=2, num_train_epochs=1, max_length=32, eval_strategy="no")
    base, a = run_in_process(tmp_path, "base", **kw)
    workers, b = run_in_process(tmp_path, "workers", dataloader_num_workers=2, **kw)
    assert [r["loss"] for r in train_steps(b)] == [r["loss"] for r in train_steps(a)]
    assert workers["train_input_tokens"] == base["train_input_tokens"] > 0
    # both are rounded (runtime to 1 ms): compare in absolute seconds, not relative to a tiny runtime
    assert base["train_seconds_per_step"] == pytest.approx(base["train_runtime"] / base["optimizer_steps"], abs=2e-3)
    assert "mfu" not in base  # no peak for a CPU: not made up


def test_mfu_formula_and_named_peaks():
    from finetune.flops import model_flops_utilization, peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3")[0] == 989.4e12
    assert "datasheet" in peak_flops("NVIDIA H200")[1]
    assert peak_flops("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert peak_flops("cpu") is None and peak_flops(None) is None
    mfu, source = model_flops_utilization(100_000_000, 10_000, "NVIDIA A100-SXM4-40GB")
    assert mfu == pytest.approx(6 * 1e8 * 1e4 / 312e12) and "A100" in source
