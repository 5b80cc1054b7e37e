"""The fault injector of ``tests/faults`` (``finetune_faults``) that forces an overflow on chosen optimizer
steps: how it parses and counts steps, that it reaches the engine's loop at that step in-process (the
``faults`` fixture) and in a launched process (``sitecustomize`` on ``PYTHONPATH``, ``FAULT_OVERFLOW_STEPS``).
On a CPU the run is fp32, so the forced inf must stop it with a NumericalError at that step; the fp16 skip it
exists for (the GradScaler skips, the schedule holds) is checked on a CPU by ``tests/test_fp16.py`` and on a
GPU by ``bench/gpu_acceptance.py``."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from faults.finetune_faults import CPU_FP16_ENV, OVERFLOW_STEPS_ENV, install_on_import, install_overflow, parse_steps
from helpers import REPO, fault_env, run_in_process, run_script, train_steps

RUN = dict(max_steps=3, eval_strategy="no", max_train_samples=16, max_length=32, per_device_train_batch_size=2,
           gradient_accumulation_steps=2)


def test_parsing():
    assert parse_steps("") == frozenset()
    assert parse_steps(" ") == frozenset()
    assert parse_steps("2,3") == {2, 3}
    assert parse_steps("5,") == {5}
    with pytest.raises(ValueError, match="numbered from 1"):
        parse_steps("0")
    with pytest.raises(ValueError):
        parse_steps("two")


class FakeAccelerator:
    """What the overflow wrapper uses of an Accelerator: ``sync_gradients`` and ``backward``."""

    def __init__(self):
        self.sync_gradients, self.losses = False, []

    def backward(self, loss, **kwargs):
        self.losses.append(loss)


def test_steps_are_counted_from_the_micro_batches_that_end_a_window(monkeypatch):
    """Windows of 3, 1 and 2 micro-batches (a short one included): every micro-batch of step 2 gets an
    infinite loss, none of steps 1 and 3; each Accelerator counts from step 1."""
    install_overflow({2}, monkeypatch.setattr, FakeAccelerator)
    accelerator = FakeAccelerator()
    for window in (3, 1, 2):
        for m in range(window):
            accelerator.sync_gradients = m == window - 1
            accelerator.backward(1.0)
    assert accelerator.losses == [1.0, 1.0, 1.0, math.inf, 1.0, 1.0]
    fresh = FakeAccelerator()
    fresh.sync_gradients = True
    fresh.backward(1.0)
    fresh.backward(1.0)
    assert fresh.losses == [1.0, math.inf]
    with pytest.raises(ValueError, match="numbered from 1"):
        install_overflow({0}, monkeypatch.setattr, FakeAccelerator)


def test_only_the_faults_the_environment_asks_for_are_installed():
    """``install_on_import`` (what ``sitecustomize`` runs) hooks the modules each fault wraps, and only
    those the environment asks for; the steps are parsed when accelerate is imported."""

    def hooked(environ):
        names = []
        install_on_import(environ, after=lambda name, callback: names.append(name))
        return names

    assert hooked({}) == [] and hooked({CPU_FP16_ENV: "0", OVERFLOW_STEPS_ENV: " "}) == []
    assert hooked({CPU_FP16_ENV: "1"}) == ["accelerate.accelerator", "finetune.backends.trainer"]
    assert hooked({OVERFLOW_STEPS_ENV: "2,3"}) == ["accelerate.accelerator"]


def test_a_fixed_layout_cost_replaces_the_measurement(monkeypatch):
    """``FAULT_LAYOUT_COST=A,B,C`` hooks ``finetune.data.packing_cost``: its ``measure`` then returns that cost, with
    the key the real one gives, so a launched packed run chooses its layouts the same way on any machine."""
    import torch
    from faults.finetune_faults import LAYOUT_COST_ENV

    from finetune.data import packing_cost

    callbacks = []
    install_on_import({LAYOUT_COST_ENV: "0,1e-6,2"}, after=lambda name, callback: callbacks.append((name, callback)))
    assert [name for name, _ in callbacks] == ["finetune.data.packing_cost"]
    monkeypatch.setattr(packing_cost, "measure", packing_cost.measure)  # undone after the test
    callbacks[0][1](packing_cost)
    model = torch.nn.Linear(2, 2)
    cost = packing_cost.measure(model, None, 64, 128, "bf16")
    assert (cost.per_micro_batch, cost.per_position, cost.per_score) == (0.0, 1e-6, 2.0)
    assert cost.key == packing_cost.cost_key(model, 64, 128, "bf16")


def test_the_fault_reaches_the_loop_at_that_step(tmp_path, tiny_bert, faults):
    from finetune.errors import NumericalError

    faults.overflow({2})
    with pytest.raises(NumericalError, match="optimizer step 2 .*grad norm (nan|inf)"):
        run_in_process(tmp_path, "forced", model_name_or_path=tiny_bert, **RUN)
    assert [r["step"] for r in train_steps(tmp_path / "forced")] == [1]


def test_the_fault_reaches_a_launched_run_at_that_step(tmp_path, tiny_bert):
    """Through ``sitecustomize`` on the launched process's ``PYTHONPATH``: the run stops with the numerical
    error (exit 3) at step 2, keeping only step 1 in its log."""
    out = tmp_path / "forced"
    args = ["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out)]
    for key, value in RUN.items():
        args += [f"--{key}", str(value)]
    result = run_script(args, env=fault_env(overflow_steps={2}))
    assert result.returncode == 3, result.stderr[-4000:]
    assert "non-finite loss or gradient at optimizer step 2" in result.stderr
    assert [r["step"] for r in train_steps(out)] == [1]


def test_sitecustomize_installs_on_import_and_refuses_a_bad_value():
    """Launched with the faults' folder on ``PYTHONPATH``: nothing is imported at start-up (accelerate only
    when the program imports it, and then it is wrapped); a malformed variable fails that import loudly."""
    code = ("import sys; assert 'accelerate' not in sys.modules and 'torch' not in sys.modules\n"
            "import accelerate; A = accelerate.Accelerator\n"
            "print(hasattr(A.backward, '__wrapped__'), hasattr(A.__init__, '__wrapped__'))")
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                        env={**os.environ, **fault_env(overflow_steps={2})})
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stdout.split() == ["True", "False"]  # backward wrapped; __init__ not (no FAULT_CPU_FP16)
    bad = subprocess.run([sys.executable, "-c", "import accelerate"], capture_output=True, text=True, cwd=REPO,
                         timeout=300, env={**os.environ, **fault_env(), OVERFLOW_STEPS_ENV: "0"})
    assert bad.returncode != 0 and "numbered from 1" in bad.stderr, bad.stderr[-3000:]
