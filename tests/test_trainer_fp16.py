"""The Trainer backend under the CPU fp16 fault of ``tests/faults``, in a launched process (``sitecustomize``
on its ``PYTHONPATH``, ``FAULT_CPU_FP16=1``): it really runs fp16 (autocast and a GradScaler), as it did under
the old in-package switch; without the fault the same run is fp32 (Accelerate's behaviour on a CPU)."""

from __future__ import annotations

import json

import pytest

from helpers import fault_env, run_script, train_steps

ARGS = ["--recipe", "bbc-news", "--backend", "trainer", "--mixed_precision", "fp16", "--max_train_samples", "16",
        "--max_steps", "2", "--eval_strategy", "no", "--max_length", "32", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "2"]


@pytest.mark.parametrize("fault", [True, False], ids=["fault", "plain"])
def test_trainer_backend_runs_fp16_on_a_cpu_only_under_the_fault(tmp_path, tiny_bert, fault):
    out = tmp_path / "run"
    result = run_script([*ARGS, "--model_name_or_path", tiny_bert, "--output_dir", str(out)],
                        env=fault_env(cpu_fp16=True) if fault else None)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["mixed_precision_requested"] == "fp16"
    assert metrics["mixed_precision"] == ("fp16" if fault else "no")
    assert ("TEST ONLY fp16 autocast and GradScaler on the CPU" in result.stderr) == fault
    scales = [r.get("loss_scale") for r in train_steps(out)]
    assert scales == ([65536.0, 65536.0] if fault else [None, None])  # the GradScaler's, or no loss scaling
