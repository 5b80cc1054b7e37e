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


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
def test_max_skipped_steps_stops_both_engines_alike(tmp_path, tiny_bert, backend):
    """--max_skipped_steps through the shared bookkeeping: fp16 overflows forced on steps 2 and 3 are two
    skips in a row, one more than allowed, so the run stops after step 3 with one error line (exit 3), the
    skipped steps logged as such in log.jsonl."""
    out = tmp_path / "run"
    args = [*ARGS, "--max_steps", "4", "--max_skipped_steps", "1", "--backend", backend]
    result = run_script([*args, "--model_name_or_path", tiny_bert, "--output_dir", str(out)],
                        env=fault_env(cpu_fp16=True, overflow_steps=(2, 3)))
    assert result.returncode == 3, result.stderr[-4000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "skipped 2 optimizer steps in a row (up to step 3)" in errors[0]
    assert "Traceback" not in result.stderr
    steps = train_steps(out)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r.get("skipped", False) for r in steps] == [False, True, True]
    assert [r["loss_scale"] for r in steps] == [65536.0, 32768.0, 16384.0]  # halved by each skip
