"""The benchmark scripts in bench/: each one's --smoke mode end to end (real CLI runs in subprocesses, tiny
models), and the MFU arithmetic. These check the pipeline and the report; they time nothing."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from faults.finetune_faults import FAULTS_DIR, OVERFLOW_STEPS_ENV
from helpers import REPO

BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))


def run_bench(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python bench/SCRIPT ARGS``; returns the CompletedProcess (text), asserting exit 0."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                            timeout=timeout, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def run_bench_in_process(capsys, script: str, *args: str) -> str:
    """``python bench/SCRIPT ARGS`` run in this process (the script's ``main`` as its ``__main__`` runs it): its
    stdout, asserting exit 0. For what starts no run (``--dry_run``, nothing left to run): an interpreter less."""
    import importlib

    from benchlib import main_guard

    module = importlib.import_module(script.removesuffix(".py"))
    capsys.readouterr()
    assert main_guard(lambda: module.main(list(args))) == 0
    return capsys.readouterr().out


def table_row(stdout: str, first_cell: str) -> list[str]:
    """The cells of the Markdown table row whose first cell is ``first_cell`` (asserts there is one)."""
    for line in stdout.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] == first_cell:
                return cells
    raise AssertionError(f"no table row {first_cell!r} in:\n{stdout}")


def positive(cell: str) -> float:
    """A table cell as a finite positive number (a leading sign and a trailing unit are allowed)."""
    match = re.match(r"^[+]?(\d+(\.\d+)?)", cell)
    assert match, cell
    value = float(match.group(1))
    assert math.isfinite(value) and value > 0, cell
    return value


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def check_header(stdout: str) -> None:
    assert "- Machine: " in stdout and "logical cores" in stdout and "- GPU: " in stdout and "torch " in stdout
    assert "SMOKE" in stdout


@pytest.mark.integration
def test_bench_backends_smoke(tmp_path, tiny_bert):
    md, js = tmp_path / "backends.md", tmp_path / "backends.json"
    out = run_bench("bench_backends.py", "--smoke", "--model_name_or_path", tiny_bert, "--markdown", str(md),
                    "--json", str(js)).stdout
    check_header(out)
    for backend in ("accelerate", "trainer"):
        cells = table_row(out, backend)
        positive(cells[1]), positive(cells[2]), positive(cells[3])  # samples/s, train_runtime, peak MiB
        assert cells[5] == "no"  # precision ran
    ratio = positive(table_row(out, "samples/s ratio accelerate / trainer")[1])
    table_row(out, "peak memory difference accelerate - trainer MiB")
    assert ">= 1.10" in out and "process max RSS" in out
    assert md.read_text().strip() == out.strip()

    data = json.loads(js.read_text())
    assert data["benchmark"] == "backends" and data["mode"] == "smoke"
    assert {"cpu", "cpu_cores", "gpu", "torch"} <= set(data["machine"])
    assert set(data["configs"]) == {"accelerate", "trainer"}
    for config in data["configs"].values():
        assert len(config["runs"]) == 1 and config["median"]["train_samples_per_second"] > 0
        assert config["runs"][0]["peak_memory_bytes"] > 50 * 2**20
    results = data["results"]
    r = results["samples_per_second_ratio_accelerate_over_trainer"]
    assert finite(r) and r > 0 and r == pytest.approx(ratio, abs=1e-3)
    assert finite(results["peak_memory_ratio_accelerate_over_trainer"])
    assert isinstance(results["peak_memory_difference_bytes_accelerate_minus_trainer"], int)


@pytest.mark.integration
def test_bench_accumulation_smoke(tmp_path, tiny_bert):
    js = tmp_path / "accumulation.json"
    out = run_bench("bench_accumulation.py", "--smoke", "--model_name_or_path", tiny_bert, "--json", str(js)).stdout
    check_header(out)
    steps = {}
    for label in ("8x4", "32x1", "8x1"):
        cells = table_row(out, label)
        steps[label] = int(cells[3])
        assert cells[4] == "64"  # every configuration trains on the same samples
        positive(cells[5]), positive(cells[6]), positive(cells[8])  # samples/s, ms per sample, peak MiB
    assert steps == {"8x4": 2, "32x1": 2, "8x1": 8}
    positive(table_row(out, "time per sample ratio 8x4 / 32x1")[1])
    positive(table_row(out, "peak memory ratio 8x4 / 8x1")[1])
    positive(table_row(out, "peak memory ratio 8x4 / 32x1")[1])
    table_row(out, "peak memory difference 8x4 - 8x1 MiB")
    table_row(out, "peak memory difference 8x4 - 32x1 MiB")
    assert "<= 1.03" in out and "<= 1.05" in out and "process max RSS" in out
    positive(table_row(out, "bare PyTorch loop: time per sample ratio 8x4 / 32x1")[1])
    positive(table_row(out, "engine / bare loop, time per sample at 8x4")[1])

    data = json.loads(js.read_text())
    assert data["benchmark"] == "accumulation" and set(data["configs"]) == {"8x4", "32x1", "8x1"}
    results = data["results"]
    assert results["samples_processed"] == {"8x4": [64], "32x1": [64], "8x1": [64]}
    for key in ("time_per_sample_ratio_accumulated_over_large_batch", "peak_memory_ratio_accumulated_over_small_batch",
                "peak_memory_ratio_accumulated_over_large_batch"):
        assert finite(results[key]) and results[key] > 0, key
    for label, seconds in results["time_per_sample_seconds"].items():
        assert finite(seconds) and seconds > 0, label
    tps = results["time_per_sample_seconds"]
    assert results["time_per_sample_ratio_accumulated_over_large_batch"] == pytest.approx(tps["8x4"] / tps["32x1"])
    floor = results["bare_loop_time_per_sample_seconds"]
    assert set(floor) == {"8x4", "32x1"} and all(finite(t) and t > 0 for t in floor.values())
    assert results["engine_over_bare_loop_time_per_sample_accumulated"] == pytest.approx(tps["8x4"] / floor["8x4"])


@pytest.mark.integration
def test_bench_precision_smoke(tmp_path):
    js = tmp_path / "precision.json"
    out = run_bench("bench_precision.py", "--smoke", "--json", str(js)).stdout
    check_header(out)
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in ("bbc-news", "bbc-news-clm"):
            rows[(cells[0], cells[1])] = cells
    assert set(rows) == {(r, p) for r in ("bbc-news", "bbc-news-clm") for p in ("fp32", "fp16", "bf16")}
    for (_recipe, requested), cells in rows.items():
        # what ran on a CPU: fp16 is not run (recorded as "no"), bf16 autocast is
        assert cells[2] == {"fp32": "no", "fp16": "no", "bf16": "bf16"}[requested], cells
        positive(cells[3]), positive(cells[4]), positive(cells[5]), positive(cells[6])
        assert cells[9] == "not computed (CPU)"
    assert "MFU is not computed on CPU" in out and "fp16 does not run on CPU" in out

    data = json.loads(js.read_text())
    assert data["benchmark"] == "precision" and data["results"]["skipped"] == {}
    configs = data["results"]["configs"]
    assert len(configs) == 6
    for label, row in configs.items():
        assert row["mixed_precision"] == ("bf16" if label.endswith("bf16") else "no"), label
        assert row["num_parameters"] > 100_000 and finite(row["tokens_per_second"]) and row["mfu"] is None
        assert finite(row["samples_per_second_vs_fp32"]) and row["samples_per_second_vs_fp32"] > 0
        assert row["model_flops_per_second"] == pytest.approx(6 * row["num_parameters"] * row["tokens_per_second"])
    assert configs["bbc-news-clm fp32"]["tokens_per_second_how"].startswith("trained (label) tokens")
    assert configs["bbc-news fp32"]["tokens_per_second_how"].startswith("upper bound")


@pytest.mark.integration
def test_bench_precision_skips_a_missing_clm_model(tmp_path, capsys):
    missing = tmp_path / "absent.gguf"
    out = run_bench_in_process(capsys, "bench_precision.py", "--recipes", "bbc-news-clm", "--clm_model_name_or_path",
                               str(missing), "--json", str(tmp_path / "p.json"))  # nothing to run: no run starts
    assert f"bbc-news-clm skipped: its model file {missing} is missing" in out
    assert "finetune.fetch smollm2-gguf" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["results"]["configs"] == {} and "bbc-news-clm" in data["results"]["skipped"]


@pytest.mark.integration
def test_bench_speed_options_smoke(tmp_path, tiny_bert):
    js = tmp_path / "speed.json"
    out = run_bench("bench_speed_options.py", "--smoke", "--model_name_or_path", tiny_bert, "--json", str(js)).stdout
    check_header(out)
    labels = ("baseline", "group_by_length", "fused_adamw", "workers_2")
    for label in labels:
        cells = table_row(out, label)
        positive(cells[2]), positive(cells[3]), positive(cells[6]), positive(cells[7])  # samples/s, ratio, s, MiB
        assert 0.0 <= float(cells[5]) < 1.0  # padding fraction
        assert cells[8] == "no" and cells[9] in (("-",) if label == "baseline" else ("helps", "does not help"))
    assert table_row(out, "baseline")[3] == "1.000"
    assert "torch_compile" not in [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert "--train_sampling_strategy group_by_length" in table_row(out, "group_by_length")[1]

    data = json.loads(js.read_text())
    assert data["benchmark"] == "speed_options" and set(data["configs"]) == set(labels)
    options = data["results"]["options"]
    base = options["baseline"]["samples_per_second"]
    for label in labels[1:]:
        r = options[label]
        assert r["samples_per_second_ratio_over_baseline"] == pytest.approx(r["samples_per_second"] / base)
        assert isinstance(r["helps"], bool) and len(r["ratio_per_round"]) == 1
    assert data["configs"]["group_by_length"]["runs"][0]["train_padding_fraction"] is not None


def test_bench_packing_smoke(capsys, tmp_path, tiny_llama, clm_texts):
    """bench_packing on the tiny Llama, 3 steps of 4 x 2: every mode trains the same tokens (equal per-step
    losses), packing computes fewer positions than padding, and throughput is samples over the summed per-step
    times (a median over steps would drop the costly steps of long samples)."""
    import importlib.util

    modes = ["padded", "padding_free", "packed", "packed_rows"]
    if importlib.util.find_spec("trl") is not None:  # in [test] from Python 3.11 (trl 1.16 needs it)
        modes += ["trl_padding_free", "trl_bfd"]
    js = tmp_path / "packing.json"
    out = run_bench_in_process(capsys, "bench_packing.py", "--steps", "3", "--modes", ",".join(modes), "--out",
                               str(js), "--recipe", "bbc-news-clm", "--model_name_or_path", tiny_llama,
                               "--train_file", clm_texts[0], "--validation_file", clm_texts[1], "--max_length", "64",
                               "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")
    data = json.loads(js.read_text())
    assert data["steps"] == 3 and list(data["modes"]) == modes
    padded = data["modes"]["padded"]
    for mode in modes:
        r = data["modes"][mode]
        assert len(r["step_seconds"]) == 3 and r["losses"] == pytest.approx(padded["losses"], rel=1e-4), mode
        assert r["seconds_per_step"] == pytest.approx(sum(r["step_seconds"]) / 3, rel=1e-3), mode
        assert r["samples_per_s"] * sum(r["step_seconds"]) == pytest.approx(3 * 4 * 2, rel=1e-3), mode
        positive(table_row(out, mode)[2])
    assert padded["padding_fraction"] > 0.2
    cost = data["layout_cost"]  # measured on the model; each step of "packed" in the layout it predicts fastest
    assert len(cost["probes"]) == 5 and min(cost["per_micro_batch"], cost["per_position"], cost["per_score"]) >= 0
    assert len(data["packed_layouts"]) == 3 and set(data["packed_layouts"]) <= {"rows", "one_row", "padding_free", "padded"}
    assert "layout per step: " + ", ".join(data["packed_layouts"]) in out
    for mode in modes[1:]:
        if mode == "packed":  # the measured cost may keep a step padded (on this tiny model): never more positions
            assert data["modes"][mode]["padding_fraction"] <= padded["padding_fraction"] + 1e-12
            continue
        assert data["modes"][mode]["padding_fraction"] < padded["padding_fraction"] / 2, mode
        assert data["modes"][mode]["padded_tokens_per_s"] / data["modes"][mode]["input_tokens_per_s"] < \
            padded["padded_tokens_per_s"] / padded["input_tokens_per_s"], mode


def test_bench_dpo_peer_quick(capsys, tmp_path):
    """bench_dpo_peer --quick: ours and TRL's DPOTrainer on the tiny chat Llama, ABBA with a frozen and a
    precomputed reference: both sides' per-step losses agree (the same pairs from the same weights), every
    configuration runs twice, the rates and ratios are what the table prints, the precomputation is timed."""
    pytest.importorskip("trl", reason="bench_dpo_peer compares against TRL's DPOTrainer: pip install -e '.[test]'")
    js = tmp_path / "dpo.json"
    out = run_bench_in_process(capsys, "bench_dpo_peer.py", "--quick", "--work_dir", str(tmp_path / "work"),
                               "--out", str(js))
    data = json.loads(js.read_text())
    assert data["quick"] and data["max_loss_relative_difference"] < 1e-5
    for name in ("frozen", "precomputed"):
        row = data["results"][name]
        assert len(row["ours"]["runs"]) == len(row["trl"]["runs"]) == 2
        assert row["ratio"] == pytest.approx(row["ours"]["pairs_per_second"] / row["trl"]["pairs_per_second"])
        assert float(table_row(out, name)[3]) == pytest.approx(row["ratio"], abs=0.006)
        positive(table_row(out, name)[1])
    precomputed = data["results"]["precomputed"]
    assert precomputed["ours"]["precompute_seconds"] > 0 and precomputed["trl"]["precompute_seconds"] > 0



def test_bench_grpo_peer_quick(capsys, tmp_path):
    """bench_grpo_peer --quick: ours and TRL's GRPOTrainer on the tiny chat Llama, ABBA generating and replaying:
    on the replayed completions both sides' per-step losses agree, every configuration runs twice, the rates and
    ratios are what the table prints, both sides' completions are of the same mean length when replayed."""
    pytest.importorskip("trl", reason="bench_grpo_peer compares against TRL's GRPOTrainer: pip install -e '.[test]'")
    js = tmp_path / "grpo.json"
    out = run_bench_in_process(capsys, "bench_grpo_peer.py", "--quick", "--work_dir", str(tmp_path / "work"),
                               "--out", str(js))
    data = json.loads(js.read_text())
    assert data["quick"] and data["replay_loss_difference"] < 1e-6
    assert data["lengths"]["ours replay"] == pytest.approx(data["lengths"]["trl replay"])
    for mode in ("generate", "replay"):
        row = data["results"][mode]
        assert len(row["ours"]["runs"]) == len(row["trl"]["runs"]) == 2
        assert row["ratio"] == pytest.approx(row["ours"]["completions_per_second"] / row["trl"]["completions_per_second"])
        assert float(table_row(out, mode)[3]) == pytest.approx(row["ratio"], abs=0.006)
        positive(table_row(out, mode)[1])

@pytest.mark.integration
def test_verify_mutants_smoke(tmp_path):
    """bench/verify_mutants.py --smoke: the clean engine exact with the threshold it printed (1% / 1.5%), and the
    small last-window mutant (1.5%) caught, in the table."""
    result = run_bench("verify_mutants.py", "--smoke", "--work_dir", str(tmp_path), timeout=600)
    lines = result.stdout.splitlines()
    assert "| clean | exact |" in lines and "| last-window-1.5% | caught |" in lines, result.stdout[-2000:]
    assert "| threshold printed (micro-batch / last window) | 1% / 1.5% |" in lines
    assert "2 verify runs" in result.stdout and "0 missed or failed" in result.stdout


def test_gloo_teardown_smoke():
    """One trial per way (two 2-process torchrun launches): both ways counted, and leave() let its launch end."""
    out = run_bench("gloo_teardown.py", "--trials", "1", "--delay", "0.2", timeout=120).stdout
    counts = dict(re.findall(r"^(without|with) leave\(\): (\d+ of 1 launches failed, \d+ with the teardown abort)$",
                             out, re.M))
    assert set(counts) == {"without", "with"}, out
    assert counts["with"] == "0 of 1 launches failed, 0 with the teardown abort"


@pytest.mark.integration
def test_stop_under_load_smoke():
    """One 2-process launch stopped by SIGTERM after its second step: both workers stopped themselves (exit 143
    after their checkpoint) and the launch ended well within torchrun's 30 s grace."""
    out = run_bench("stop_under_load.py", "--smoke", timeout=300).stdout
    ended = re.search(r"^trial 1/1: ended ([\d.]+) s after SIGTERM \(2 of 2 workers stopped themselves\)$", out, re.M)
    assert ended and float(ended.group(1)) < 25, out
    assert re.search(r"^0 of 1 launches hung \(> 25 s after SIGTERM\) with 0 busy processes;", out, re.M), out


@pytest.mark.integration
def test_full_mode_commands(capsys):
    """--dry_run prints the full-mode run.py commands: the recipe's model, the sizes and the same samples."""
    lines = run_bench_in_process(capsys, "bench_accumulation.py", "--dry_run").splitlines()
    commands = {line.split(":", 1)[0]: line for line in lines if line.startswith(("8x4:", "32x1:", "8x1:"))}
    assert set(commands) == {"8x4", "32x1", "8x1"}
    for label, steps in (("8x4", 12), ("32x1", 12), ("8x1", 48)):
        micro, accum = label.split("x")
        assert f"--per_device_train_batch_size {micro} --gradient_accumulation_steps {accum} --max_steps {steps}" \
            in commands[label]
        assert "--max_train_samples 384" in commands[label] and "--model_name_or_path" not in commands[label]
        assert "--eval_strategy epoch --max_eval_samples 8" in commands[label]
    assert "3 repeat(s)" in lines[-1] and "1 warm-up" in lines[-1]
    out = run_bench_in_process(capsys, "bench_backends.py", "--dry_run")
    for backend in ("accelerate", "trainer"):
        assert re.search(rf"^{backend}: .*--per_device_train_batch_size 8 --gradient_accumulation_steps 4 "
                         rf"--mixed_precision no .*--backend {backend}$", out, re.MULTILINE), out


def test_peak_flops_table_and_mfu():
    from bench_precision import mfu, model_flops_per_second, peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3")[0] == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe")[0] == 756e12
    assert peak_flops("NVIDIA H200")[0] == 989.4e12
    assert peak_flops("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert "datasheet" in peak_flops("NVIDIA A100 80GB PCIe")[1]
    assert peak_flops("NVIDIA A10G") is None and peak_flops(None) is None  # unknown: no MFU
    assert peak_flops("NVIDIA A10G", override_tflops=70)[0] == 70e12
    assert model_flops_per_second(1_000_000, 2_000.0) == 1.2e10
    assert mfu(135_000_000, 100_000.0, 989.4e12) == pytest.approx(6 * 135e6 * 1e5 / 989.4e12)
    assert mfu(135_000_000, 100_000.0, None) is None


def test_safetensors_parameter_count(tmp_path):
    import torch
    from benchlib import count_safetensors_params
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    assert count_safetensors_params(tmp_path) == 17
    assert count_safetensors_params(tmp_path / "nothing") is None


# ------------------------------------------------------------------------------------------ GPU acceptance
def test_gpu_acceptance_smoke(tmp_path):
    """The acceptance script's CPU side on fabricated outputs: commands, parsing, checks and the report."""
    md, js = tmp_path / "gpu.md", tmp_path / "gpu.json"
    out = run_bench("gpu_acceptance.py", "--smoke", "--markdown", str(md), "--json", str(js), timeout=120).stdout
    report = md.read_text()
    assert out.strip() == report.strip()
    assert report.startswith("# GPU acceptance (SMOKE") and "- Device: **SMOKE (no GPU run)**" in report
    for heading in ("## 1. bbc-news main job: fp32, fp16, bf16", "## 2. fp16 overflow path",
                    "## 3. Sharded configs with one process", "## 4. bbc-news-clm", "## 5. accelerate vs Trainer",
                    "## 6. --auto_find_batch_size on CUDA"):
        assert heading in report, heading
    assert "UNTESTED with one GPU" in report and "sync_each_batch" in report and "agreement" in report
    assert re.search(r"Checks: \d+ passed, 0 failed, 0 not run", report)
    assert table_row(report, "bbc-news fp16")[1] == "fp16"
    assert table_row(report, "the schedule holds on a skipped step")[1] == "pass"
    assert "ratio accelerate / trainer 1.100 (goal >= 1.10: met)" in report

    data = json.loads(js.read_text())
    runs = {r["key"]: r for r in data["runs"]}
    assert len(runs) == 13 and all(c["ok"] is True for r in runs.values() for c in r["checks"])
    for config in ("fsdp2.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"):
        assert (REPO / "accelerate_configs" / config).is_file()
        command = runs[f"sharded-{config.removesuffix('.yaml')}"]["command"]
        assert command.startswith(f"python -m finetune.cli train --config_file accelerate_configs/{config} "
                                  "--num_processes 1 --recipe bbc-news"), command
        assert "--max_grad_norm 0.5" in command and "--output_dir $WORKDIR/sharded-" in command
    # the overflow is forced by the tests' fault injector, through the run's PYTHONPATH (tests/faults)
    assert runs["overflow-fp16"]["command"].startswith(
        f"PYTHONPATH=tests/faults {OVERFLOW_STEPS_ENV}=2,3 python -m finetune.run ")
    assert "--backend trainer" in runs["backends-trainer-r1"]["command"]
    assert "--auto_find_batch_size True" in runs["autobatch"]["command"]


def test_gpu_acceptance_forces_the_overflow_through_the_fault_injector(tmp_path):
    """The overflow run's environment: the fault injector's folder first on PYTHONPATH (before the carried
    packages and the repository), and the steps to overflow; no other run gets either."""
    import gpu_acceptance as ga

    runs = ga.build_runs(tmp_path, tmp_path / "clm", 1)
    env = ga.child_env(next(r for r in runs if r.section == "overflow").env)
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert paths[0] == FAULTS_DIR and paths[1:4] == [str(ga.SITE), str(ga.PYLIB), str(REPO)]
    assert env[OVERFLOW_STEPS_ENV] == "2,3"
    for run in runs:
        if run.section != "overflow":
            env = ga.child_env(run.env)
            assert OVERFLOW_STEPS_ENV not in env and FAULTS_DIR not in env["PYTHONPATH"].split(os.pathsep)


def _acceptance_run(section: str, tmp_path):
    import gpu_acceptance as ga

    run = next(r for r in ga.build_runs(tmp_path, tmp_path / "clm", 1) if r.section == section)
    ga.fabricate(run)
    return ga, run


def test_gpu_acceptance_overflow_checks_catch_a_schedule_that_advances_on_a_skip(tmp_path):
    ga, run = _acceptance_run("overflow", tmp_path)
    assert all(c.ok for c in ga.check_run(run))
    bad = [dict(r, learning_rate=1e-4 / r["step"]) for r in ga._steps(run)]  # the lr moves on every step
    checks = {c.name: c.ok for c in ga.overflow_checks(run.metrics, bad)}
    assert checks["the schedule holds on a skipped step"] is False
    assert checks["steps 2, 3 skipped"] is True
    unskipped = [dict(r, skipped=False) for r in ga._steps(run)]
    checks = {c.name: c.ok for c in ga.overflow_checks(dict(run.metrics, skipped_optimizer_steps=0), unskipped)}
    assert checks["steps 2, 3 skipped"] is False and checks["skipped_optimizer_steps counts them"] is False


def test_gpu_acceptance_sharded_checks_need_the_note_and_the_precision(tmp_path):
    ga, run = _acceptance_run("sharded", tmp_path)
    assert all(c.ok for c in ga.check_run(run))
    run.output = "Run summary\n"  # no engine note printed
    run.metrics["mixed_precision"] = "no"  # e.g. fp16 DeepSpeed reported as fp32
    failed = {c.name for c in ga.check_run(run) if c.ok is False}
    assert failed == {"engine note printed", "ran in the precision requested"}
    assert ga._verdict(ga.check_run(run)).startswith("FAIL: ")


def test_gpu_acceptance_skips_what_the_budget_cannot_fit(tmp_path):
    import gpu_acceptance as ga

    run = ga.build_runs(tmp_path, tmp_path / "clm", 1)[0]
    ga.execute(run, seconds_left=10)
    assert run.returncode is None and [c.ok for c in ga.check_run(run)] == [None]
    assert ga._verdict(ga.check_run(run)) == "not run"
    with pytest.raises(SystemExit):
        ga.parse_args(["--only", "precision,nonsense"])


def test_gpu_acceptance_needs_the_engines_stage_and_clipping(tmp_path):
    import gpu_acceptance as ga

    run = next(r for r in ga.build_runs(tmp_path, tmp_path / "clm", 1) if r.key == "sharded-deepspeed_zero3")
    ga.fabricate(run)
    assert all(c.ok for c in ga.check_run(run))
    assert "DeepSpeed ZeRO stage 3 (as the engine reports it): gradient clipping at norm 0.5" in run.output
    run.output = run.output.replace("at norm 0.5", "at norm 1")  # Accelerate's `auto` 1.0 would be caught
    assert {c.name: c.ok for c in ga.check_run(run)}["engine note printed"] is False


def test_gpu_acceptance_names_why_a_run_failed():
    import gpu_acceptance as ga

    assert ga.failure_reason("Training: 1/6\rTraining: 2/6\nerror: non-finite loss at step 2\n") == \
        "error: non-finite loss at step 2"
    assert ga.failure_reason("Traceback\nValueError: bad value\n[timed out after 30 s]\n") == "ValueError: bad value"
    assert ga.failure_reason("") == "no output"


def test_profile_step_smoke(capsys, tmp_path, tiny_bert, monkeypatch):
    """profile_step on the tiny BERT, one optimizer step of 2 micro-batches: the shares it prints are shares (the
    matmul share within (0, 1], the operators' shares summing to at most 1), its FLOP rate is the profiler's FLOP
    count over the matmul kernels' time, set against the measured peak (a cache of this test's own)."""
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    out = run_bench_in_process(capsys, "profile_step.py", "--steps", "1", "--recipe", "bbc-news",
                               "--model_name_or_path", tiny_bert, "--max_length", "32",
                               "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")
    assert "micro-batch 4 x 32 tokens x 2 micro-batches per step, fp32, adamw_torch_fused, dropout off" in out  # the recipe's
    share = float(out.split("self CPU time in matmul kernels: ")[1].split("%")[0]) / 100
    assert 0 < share <= 1
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| aten::") or line.startswith("| Opt")]
    assert rows and sum(float(r[2].rstrip("%")) for r in rows) <= 100.5
    assert "GFLOP/s while in them; measured peak" in out


def test_bench_bf16_recipes_plans_abba_skips_what_is_recorded_and_summarizes_per_cpu_kind():
    """bench_bf16_recipes: the runs still missing, in ABBA order per seed; the per-seed ratio's median and the
    metric's mean and spread per CPU kind; a seed measured in one precision only is not in the ratio."""
    import bench_bf16_recipes as b

    todo = b.plan(["a", "b"], [1, 2], ["no", "bf16"], done={("a", 1, "no")})
    assert todo == [("a", 1, "bf16"), ("b", 1, "bf16"), ("b", 1, "no"), ("a", 2, "no"), ("a", 2, "bf16"),
                    ("b", 2, "bf16"), ("b", 2, "no")]

    def rec(kind, seed, precision, speed, acc):
        return {"cpu_kind": kind, "recipe": "bbc-news", "seed": seed, "precision_requested": precision,
                "precision_ran": precision, "train_samples_per_second": speed, "metric": "eval_accuracy",
                "metric_value": acc, "hfu_of_measured_peak": None, "extra_args": []}

    records = [rec("X", 1, "no", 10.0, 0.97), rec("X", 1, "bf16", 15.0, 0.96), rec("X", 2, "no", 12.0, 0.98),
               rec("X", 2, "bf16", 24.0, 0.97), rec("X", 3, "no", 11.0, 0.99), rec("Y", 1, "no", 5.0, 0.5)]
    table = b.summarize(records)
    row = table["X"]["bbc-news"]
    assert row["seeds_both"] == [1, 2] and row["ratios"] == [1.5, 2.0] and row["ratio_bf16_fp32"] == 1.75
    assert row["fp32"]["samples_per_second"] == 11.0 and row["fp32"]["metric_mean"] == pytest.approx(0.98)
    assert row["fp32"]["metric_stdev"] == pytest.approx(0.01) and row["bf16"]["metric_mean"] == pytest.approx(0.965)
    assert table["Y"]["bbc-news"]["ratio_bf16_fp32"] is None and table["Y"]["bbc-news"]["bf16"]["metric_mean"] is None
    text = b.render(table)
    assert "## X" in text and "## Y" in text
    cells = table_row(text, "bbc-news")
    assert cells[1] == "2" and cells[4] == "1.75x" and cells[6].startswith("0.9800 ± 0.0100 (n=3)")
    # with the records: the per-seed ratios, and what an fp16 request runs (two seeds decide nothing; a third does)
    assert table_row(b.render(table, records), "bbc-news")[8:10] == ["1.50, 2.00", "not decided (fewer than 3 seeds)"]
    three = records + [rec("X", 3, "bf16", 16.5, 0.985)]
    assert table_row(b.render(b.summarize(three), three), "bbc-news")[8:10] == ["1.50, 2.00, 1.50", "bf16"]


def test_bench_bf16_recipes_smoke(tmp_path):
    """bench_bf16_recipes --smoke, one seed, then again: the second call finds both runs recorded and runs none;
    the records say which precision ran (bf16 asked on a CPU runs bf16 autocast, fp32 runs "no")."""
    records, md = tmp_path / "r.json", tmp_path / "t.md"
    args = ("--smoke", "--seeds", "42", "--records", str(records), "--markdown", str(md))
    run_bench("bench_bf16_recipes.py", *args)
    data = json.loads(records.read_text())
    assert [(r["seed"], r["precision_requested"], r["precision_ran"]) for r in data] == [(42, "no", "no"),
                                                                                       (42, "bf16", "bf16")]
    assert all(finite(r["train_samples_per_second"]) and 0 <= r["metric_value"] <= 1 for r in data)
    again = run_bench("bench_bf16_recipes.py", *args)
    assert "0 run(s) to do, 2 recorded" in again.stderr and json.loads(records.read_text()) == data
    cells = table_row(md.read_text(), "bbc-news")
    assert cells[1] == "1" and positive(cells[4]) == pytest.approx(
        data[1]["train_samples_per_second"] / data[0]["train_samples_per_second"], abs=0.006)
