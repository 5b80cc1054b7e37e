"""DeepSpeed for real, on a CPU, with one process: DeepSpeed runs its CPU accelerator (gloo) there, and
Accelerate takes the DeepSpeed path as long as ACCELERATE_USE_CPU is not set. (Several processes cannot
run this way: Accelerate then reports num_processes 1 on every rank and DeepSpeed's batch check fails;
sharding across ranks needs GPUs, see bench/gpu_acceptance.py.)

Skipped where deepspeed cannot be imported (it is not a dependency; `pip install deepspeed`, which builds
from source). What they show: a ZeRO-2 and a ZeRO-3 run give the plain engine's per-step losses,
learning rates and gradient norms (clipping at --max_grad_norm and a partial last window included) and
its weights; an optimizer and schedule from the DeepSpeed config go through DummyOptim/DummyScheduler;
an overflow forced by the fault injector (tests/faults) and a contradicting DeepSpeed config stop the
run as they should."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, fault_env, run_script, train_steps

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")]

COMMON = ["--recipe", "bbc-news", "--max_train_samples", "44", "--max_eval_samples", "16", "--max_length", "32",
          "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4", "--num_train_epochs", "1",
          "--max_grad_norm", "0.2", "--disable_dropout", "True", "--learning_rate", "1e-3", "--warmup_steps", "1",
          "--seed", "3", "--eval_strategy", "epoch", "--mixed_precision", "no"]  # 11 micro-batches: windows of 4, 4, 3
# (fp32 named: DeepSpeed 0.19.8 refuses fp16 on a CPU, "Type fp16 is not supported on your device")


def deepspeed_train(config_file, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``finetune train --config_file CONFIG --num_processes 1 ARGS`` on the CPU (not ACCELERATE_USE_CPU:
    with it Accelerate would turn DeepSpeed off)."""
    full_env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    full_env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    return subprocess.run([sys.executable, "-m", "finetune.cli", "train", "--config_file", str(config_file),
                           "--num_processes", "1", "--main_process_port", "0", *args],  # a port of its own
                          capture_output=True, text=True, timeout=900, env=full_env, cwd=REPO)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_bert):
    """The plain accelerate engine's run of COMMON (one process, no DeepSpeed)."""
    out = tmp_path_factory.mktemp("plain") / "run"
    result = run_script([*COMMON, "--model_name_or_path", tiny_bert, "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _weights(path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(path)).state_dict()


def _same_steps(a_dir, b_dir, lr_only=False):
    a, b = train_steps(a_dir), train_steps(b_dir)
    assert [r["micro_batches"] for r in a] == [r["micro_batches"] for r in b] == [4, 4, 3]
    for x, y in zip(a, b):
        assert x["learning_rate"] == pytest.approx(y["learning_rate"], rel=1e-12)
        if not lr_only:
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)
            assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_equals_the_plain_engine(tmp_path, tiny_bert, plain, stage):
    out = tmp_path / f"zero{stage}"
    result = deepspeed_train(REPO / "accelerate_configs" / f"deepspeed_zero{stage}.yaml", *COMMON,
                             "--model_name_or_path", tiny_bert, "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    assert (f"DeepSpeed ZeRO stage {stage} (as the engine reports it): gradient clipping at norm 0.2 "
            "(--max_grad_norm)") in result.stdout
    assert max(r["grad_norm"] for r in train_steps(plain)) > 0.2  # clipping did act on some step
    _same_steps(out, plain)
    ours, reference = _weights(out), _weights(plain)
    assert ours.keys() == reference.keys()
    assert max((ours[k] - reference[k]).abs().max().item() for k in reference) < 1e-6
    metrics, expected = (json.loads((d / "metrics.json").read_text()) for d in (out, plain))
    assert metrics["num_parameters"] == expected["num_parameters"]  # counted before ZeRO-3 partitions
    assert metrics["mixed_precision"] == "no"
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-6)


def _config_file(tmp_path, ds_config: dict):
    json_path = tmp_path / "ds.json"
    json_path.write_text(json.dumps(ds_config))
    yaml_path = tmp_path / "ds.yaml"
    yaml_path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                         f"deepspeed_config:\n  deepspeed_config_file: {json_path}\n  zero3_init_flag: false\n"
                         "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 1\nmachine_rank: 0\n"
                         "rdzv_backend: static\nsame_network: true\nuse_cpu: false\n")
    return yaml_path


BASE = {"zero_optimization": {"stage": 2}, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
TORCH_ADAMW = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True,
                                           "betas": [0.9, 0.999], "eps": 1e-8}}


def test_an_optimizer_from_the_deepspeed_config_with_our_schedule(tmp_path, tiny_bert, plain):
    """DummyOptim + DummyScheduler(lr_scheduler_callable): DeepSpeed builds torch's AdamW from its config and
    our schedule on it, and steps the schedule itself: the same learning rates and losses as the plain run."""
    out = tmp_path / "run"
    result = deepspeed_train(_config_file(tmp_path, {**BASE, "optimizer": TORCH_ADAMW}), *COMMON,
                             "--model_name_or_path", tiny_bert, "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "optimizer from the DeepSpeed config, LR schedule from the run" in result.stdout
    _same_steps(out, plain)


def test_optimizer_and_schedule_from_the_deepspeed_config(tmp_path, tiny_bert):
    """DummyOptim + DummyScheduler: DeepSpeed's WarmupDecayLR with Accelerate's `auto` values (warmup_max_lr
    = --learning_rate, warm-up = --warmup_steps, total = our 3 optimizer steps), stepped by DeepSpeed. Its
    own semantics show: a log warm-up over max(2, warmup) steps that starts one step late, so the learning
    rates are 0, 0, then the peak."""
    out = tmp_path / "run"
    scheduler = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto", "total_num_steps": "auto"}}
    result = deepspeed_train(_config_file(tmp_path, {**BASE, "optimizer": TORCH_ADAMW, "scheduler": scheduler}),
                             *COMMON, "--model_name_or_path", tiny_bert, "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "optimizer from the DeepSpeed config, LR schedule from the DeepSpeed config" in result.stdout
    steps = train_steps(out)
    assert [r["learning_rate"] for r in steps] == pytest.approx([0.0, 0.0, 1e-3])


def test_a_forced_overflow_in_fp32_stops_the_run(tmp_path, tiny_bert):
    """The forced overflow (``tests/faults``, through the launched processes' ``PYTHONPATH``) under DeepSpeed:
    ZeRO skips a step with a non-finite gradient norm, and an fp32 run must stop there with the numerical
    error (exit 3), keeping only step 1 in its log."""
    out = tmp_path / "run"
    result = deepspeed_train(REPO / "accelerate_configs" / "deepspeed_zero2.yaml", *COMMON, "--model_name_or_path",
                             tiny_bert, "--output_dir", str(out), env=fault_env(overflow_steps={2}))
    assert result.returncode == 3, result.stderr[-4000:]
    assert "non-finite loss or gradient at optimizer step 2" in result.stderr
    assert [r["step"] for r in train_steps(out)] == [1]


def test_a_deepspeed_config_that_contradicts_max_grad_norm_is_refused(tmp_path, tiny_bert):
    result = deepspeed_train(_config_file(tmp_path, {**BASE, "gradient_clipping": 1.0}), *COMMON,
                             "--model_name_or_path", tiny_bert, "--output_dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr[-4000:]
    assert "error: the DeepSpeed config contradicts the run's flags (gradient_clipping: 1.0 in the DeepSpeed " \
           "config, but --max_grad_norm is 0.2)" in result.stderr
