"""Accumulated training equals large-batch training: exact-parameter regression tests on a tiny BERT.

Run through the real engine (``finetune.backends.accelerate.train``) in fp32 with dropout off. The sampler order depends
only on the seed, so micro-batch 8 x accumulation 1 and micro-batch 2 x accumulation 4 see the same 8
samples in every window.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import load_params, run_in_process, train_steps

COMMON = dict(disable_dropout=True, max_length=32, learning_rate=1e-3, warmup_steps=0, weight_decay=0.01,
              max_eval_samples=8, eval_strategy="no", seed=3)


def assert_same_params(a: dict, b: dict, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")  # noqa: B023 - the lambda runs inside this iteration


def max_param_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference_8x1(tmp_path_factory, tiny_bert):
    """The large-batch run (micro-batch 8 x accumulation 1, 4 optimizer steps) and the untrained weights."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    root = tmp_path_factory.mktemp("reference")
    metrics, ref_dir = run_in_process(root, "ref", model_name_or_path=tiny_bert, max_train_samples=32,
                                      per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                      num_train_epochs=1, **COMMON)
    initial = run_in_process(root, "zero", model_name_or_path=tiny_bert, max_train_samples=32,
                             per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=1,
                             learning_rate=1e-12, **{k: v for k, v in COMMON.items() if k != "learning_rate"})[1]
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    return metrics, ref_dir, load_params(initial)


@pytest.mark.parametrize("micro,accum", [(2, 4), (4, 2)])
def test_accumulation_equals_large_batch(tmp_path, tiny_bert, reference_8x1, micro, accum):
    """K=4 optimizer steps of 8 samples: every (micro, accumulation) split gives the 8 x 1 parameters."""
    reference, ref_dir, initial = reference_8x1
    metrics, out = run_in_process(tmp_path, "acc", model_name_or_path=tiny_bert, max_train_samples=32,
                                  per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                                  num_train_epochs=1, **COMMON)
    assert metrics["optimizer_steps"] == reference["optimizer_steps"] == 4
    assert metrics["effective_batch_size"] == 8
    assert_same_params(load_params(out), load_params(ref_dir))
    ref_losses = [r["loss"] for r in train_steps(ref_dir)]
    losses = [r["loss"] for r in train_steps(out)]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_param_diff(initial, load_params(out)) > 1e-4  # the model did move: the test could fail


def test_partial_last_window_weighted_by_true_size(tmp_path, tiny_bert):
    """20 samples, micro 2 x accumulation 4: windows of 8, 8 and 4 samples (the last has 2 micro-batches),
    over 2 epochs. Equal to batches of 8, 8, 4 at accumulation 1."""
    ref, ref_dir = run_in_process(tmp_path, "ref", model_name_or_path=tiny_bert, max_train_samples=20,
                                  per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                  num_train_epochs=2, **COMMON)
    acc, acc_dir = run_in_process(tmp_path, "acc", model_name_or_path=tiny_bert, max_train_samples=20,
                                  per_device_train_batch_size=2, gradient_accumulation_steps=4,
                                  num_train_epochs=2, **COMMON)
    steps = train_steps(acc_dir)
    assert acc["optimizer_steps"] == ref["optimizer_steps"] == 2 * math.ceil(math.ceil(20 / 2) / 4) == 6
    assert [r["samples"] for r in steps] == [8, 8, 4, 8, 8, 4]
    assert [r["micro_batches"] for r in steps] == [4, 4, 2, 4, 4, 2]
    assert_same_params(load_params(acc_dir), load_params(ref_dir))
    assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in train_steps(ref_dir)], rel=1e-5)


def test_schedule_sized_in_optimizer_steps(tmp_path, tiny_bert, monkeypatch):
    """The linear schedule warms up over `warmup_steps` optimizer steps and reaches 0 after the last one."""
    # The lr after the last step is in no log (each record holds the lr its step used), so keep the
    # scheduler itself: transformers' schedules are LambdaLR instances, whatever imports them.
    schedulers = []
    original_init = torch.optim.lr_scheduler.LambdaLR.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        schedulers.append(self)

    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "__init__", recording_init)
    metrics, out = run_in_process(tmp_path, "sched", model_name_or_path=tiny_bert, max_train_samples=36,
                                  per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                  num_train_epochs=2, **{**COMMON, "warmup_steps": 2})
    steps = train_steps(out)
    total = 2 * math.ceil(math.ceil(36 / 4) / 2)  # 9 micro-batches -> 5 steps per epoch
    assert metrics["optimizer_steps"] == len(steps) == total == 10
    lrs = [r["learning_rate"] for r in steps]
    peak = COMMON["learning_rate"]
    # transformers' linear schedule: lr_k = peak*k/w during warmup, then peak*(T-k)/(T-w)
    expected = [peak * k / 2 if k < 2 else peak * (total - k) / (total - 2) for k in range(total)]
    assert lrs == pytest.approx(expected, rel=1e-6)
    assert lrs[-1] > 0  # the last step still learns
    # ... and the schedule reaches 0 after it: stepped once per optimizer step, sized for exactly `total`
    (scheduler,) = schedulers
    assert scheduler.last_epoch == total
    groups = scheduler.optimizer.param_groups  # with and without weight decay
    assert scheduler.get_last_lr() == [0.0] * len(groups) and [g["lr"] for g in groups] == [0.0] * len(groups)


def test_grad_norm_clipped_only_on_sync_steps(tmp_path, tiny_bert):
    """With max_grad_norm tiny, the logged grad norm is the pre-clip norm of the whole window's gradient:
    equal for 2 x 4 and 8 x 1 (so it was computed once per window, on the sync step)."""
    kw = dict(model_name_or_path=tiny_bert, max_train_samples=16, num_train_epochs=1, max_grad_norm=0.01, **COMMON)
    _, a = run_in_process(tmp_path, "a", per_device_train_batch_size=8, gradient_accumulation_steps=1, **kw)
    _, b = run_in_process(tmp_path, "b", per_device_train_batch_size=2, gradient_accumulation_steps=4, **kw)
    norms_a = [r["grad_norm"] for r in train_steps(a)]
    norms_b = [r["grad_norm"] for r in train_steps(b)]
    assert len(norms_b) == 2 and all(n > 0.01 for n in norms_b)
    assert norms_b == pytest.approx(norms_a, rel=1e-4)
    assert_same_params(load_params(a), load_params(b))
