"""The engine's test hook that forces an overflow on chosen optimizer steps
(``FINETUNE_TEST_FORCE_OVERFLOW_STEPS``): how it parses, and that it reaches the loop. On a CPU the run is
fp32, so the forced inf must stop it with a NumericalError at that step; the fp16 skip it exists for (the
GradScaler skips, the schedule holds) is checked on a GPU by ``bench/gpu_acceptance.py``."""

from __future__ import annotations

import pytest

from helpers import run_in_process, train_steps
from finetune.testing import FORCE_OVERFLOW_ENV, forced_overflow_steps


def test_parsing():
    assert forced_overflow_steps({}) == frozenset()
    assert forced_overflow_steps({FORCE_OVERFLOW_ENV: " "}) == frozenset()
    assert forced_overflow_steps({FORCE_OVERFLOW_ENV: "2,3"}) == {2, 3}
    assert forced_overflow_steps({FORCE_OVERFLOW_ENV: "5,"}) == {5}
    with pytest.raises(ValueError, match="numbered from 1"):
        forced_overflow_steps({FORCE_OVERFLOW_ENV: "0"})
    with pytest.raises(ValueError):
        forced_overflow_steps({FORCE_OVERFLOW_ENV: "two"})


def test_the_hook_reaches_the_loop_at_that_step(tmp_path, tiny_bert, monkeypatch):
    from finetune.errors import NumericalError

    monkeypatch.setenv(FORCE_OVERFLOW_ENV, "2")
    with pytest.raises(NumericalError, match="optimizer step 2 .*grad norm (nan|inf)"):
        run_in_process(tmp_path, "forced", model_name_or_path=tiny_bert, max_steps=3, eval_strategy="no",
                       max_train_samples=16, max_length=32, per_device_train_batch_size=2,
                       gradient_accumulation_steps=2)
    assert [r["step"] for r in train_steps(tmp_path / "forced")] == [1]
