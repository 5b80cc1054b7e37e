"""``finetune env``, ``--config_file NAME`` (a shipped Accelerate config by name) and ``finetune recipes`` (the
shipped configs listed; ``--copy NAME [DEST]``): issue 29."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import REPO, assert_user_error, run_in_process

from finetune.cli import main as cli_main
from finetune.commands import env as finetune_env
from finetune.commands.launch import train_command
from finetune.commands.launch_configs import list_configs, resolve_config_file, shipped_configs, shipped_dir
from finetune.errors import FinetuneError
from finetune.recipes import RECIPES, copy_recipe, load_recipe

CONFIGS = REPO / "accelerate_configs"


def cli(*args: str, cwd, **env) -> subprocess.CompletedProcess:
    """``python -m finetune.cli ARGS`` in ``cwd`` (this checkout first on PYTHONPATH), with ``env`` added."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-m", "finetune.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=full, timeout=300)


# ------------------------------------------------------------------------------------------ finetune env
def test_env_prints_versions_machine_and_accelerate_config(tmp_path):
    """A fresh HF_HOME: no default Accelerate config; then one (accelerate's default_config_file is
    $HF_HOME/accelerate/default_config.yaml, accelerate/commands/config/config_args.py 29-40) and its settings."""
    home = tmp_path / "hf"
    cache = tmp_path / "cache"  # the matmul peaks, as measured earlier (outputs/peak.py): env measures again and
    cache.mkdir()  # keeps the best, here the cached figures, which no CPU reaches
    key = "{} | {} | {} threads | torch {}".format
    (cache / "matmul_peak.json").write_text(json.dumps({
        key(finetune_env.cpu_model(), dtype, threads, torch.__version__): {"flops_per_second": flops, "size": 2048,
                                                                           "measured": "then"}
        for dtype, flops in (("float32", 81.3e15), ("bfloat16", 17.5e15)) for threads in range(1, 257)}))
    from test_cpu_bf16 import records  # this machine's own bf16 measurements: bbc-news 1.5x with the metric held

    from finetune.machine import cpu_kind

    (cache / "bf16_measured.json").write_text(json.dumps(records(kind=cpu_kind())))
    result = cli("env", cwd=tmp_path, HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_TOKEN="", FINETUNE_CACHE=str(cache))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "Copy-and-paste the text below in your GitHub issue"
    assert f"- Python version: {platform.python_version()} ({sys.executable})" in lines
    cuda = f"CUDA build: {torch.version.cuda or 'none'}; CUDA available: {torch.cuda.is_available()}"
    assert f"- PyTorch version: {torch.__version__} ({cuda})" in lines
    import accelerate
    import transformers

    assert f"- Transformers version: {transformers.__version__}" in lines
    assert f"- Accelerate version: {accelerate.__version__}" in lines
    cores = [line for line in lines if line.startswith("- CPU cores: ")]
    assert cores and cores[0].startswith(f"- CPU cores: {os.cpu_count()} logical")
    assert cores[0].endswith(f"; {len(os.sched_getaffinity(0))} usable by this process")
    assert f"- CPU: {finetune_env.cpu_model()}" in lines
    features = next(line for line in lines if line.startswith("- CPU features: "))
    from finetune.machine import bf16_support

    assert features.endswith(f"(bf16 matmul {bf16_support()})")
    bf16 = next(line for line in lines if line.startswith("- bf16 on this CPU: "))  # the cached best peaks' ratio
    assert bf16 == f"- bf16 on this CPU: {bf16_support()}; measured bf16 matmul peak {17.5 / 81.3:.3g}x fp32's (1.75e+07 " \
        "against 8.13e+07 GFLOP/s, outputs/peak.py)"
    if not torch.cuda.is_available():
        peaks = next(line for line in lines if line.startswith("- Matmul peak (best measured): "))
        assert peaks.endswith(": fp32 81300000.0 GFLOP/s, bf16 17500000.0 GFLOP/s (cpu, " + peaks.rsplit("(cpu, ", 1)[1])
        threads = int(peaks.rsplit("(cpu, ", 1)[1].split()[0])
        cached = json.loads((cache / "matmul_peak.json").read_text())
        for dtype, flops in (("float32", 81.3e15), ("bfloat16", 17.5e15)):  # measured now; the best kept
            entry = cached[key(finetune_env.cpu_model(), dtype, threads, torch.__version__)]
            assert entry["flops_per_second"] == flops and entry["measurements"] == 2
            assert 1e8 < entry["last_flops_per_second"] < flops
    fp16 = next(line for line in lines if line.startswith("- fp16 requested on this CPU trains in: "))
    assert "bbc-news bf16 (bf16 1.50x, metric held)" in fp16 and fp16.endswith("other recipes fp32, not measured "
                                                                              "here (docs/precision.md)")
    if not torch.cuda.is_available():
        assert "- GPUs: none" in lines
    assert "- Hugging Face Hub: https://huggingface.co; offline mode: True; token set: False" in lines
    default = home / "accelerate" / "default_config.yaml"
    assert lines[-1].startswith(f"- `Accelerate` default config: not found ({default};")

    default.parent.mkdir(parents=True)
    shutil.copy(CONFIGS / "multi_cpu_2proc.yaml", default)
    lines = cli("env", cwd=tmp_path, HF_HOME=str(home)).stdout.splitlines()
    start = lines.index(f"- `Accelerate` default config ({default}):")
    settings = dict(line.strip("\t- ").split(": ", 1) for line in lines[start + 1:])
    assert settings["distributed_type"] == "MULTI_GPU" and settings["num_processes"] == "2"


def test_env_refuses_arguments(tmp_path):
    result = cli("env", "--all", cwd=tmp_path)
    assert result.returncode == 2
    assert_user_error(result, "finetune env takes no arguments")


def test_gpu_lines(monkeypatch):
    """Each device's name, memory and compute capability, from ``torch.cuda.get_device_properties(i)`` (torch
    2.13 torch/cuda/__init__.py 725-741), whose ``_CudaDeviceProperties`` has ``name``, ``major``, ``minor`` and
    ``total_memory`` in bytes (torch/_C/__init__.pyi 11712-11716); these stand-ins have exactly those fields."""
    h100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=85_045_870_592)
    a10 = SimpleNamespace(name="NVIDIA A10G", major=8, minor=6, total_memory=23_836_098_560)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: [h100, a10][index])
    assert finetune_env.gpus() == ["0: NVIDIA H100 80GB HBM3, 79.2 GiB, compute capability 9.0",
                                   "1: NVIDIA A10G, 22.2 GiB, compute capability 8.6"]


# ------------------------------------------------------------------------------------------ --config_file NAME
def test_shipped_configs_are_the_repository_folder():
    assert shipped_dir() == CONFIGS
    assert set(shipped_configs()) == {p.stem for p in CONFIGS.glob("*.yaml")}
    assert {"multi_gpu", "fsdp2", "deepspeed_zero3", "multi_cpu_2proc"} <= set(shipped_configs())


def test_config_file_resolves_a_shipped_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spelling in ("fsdp2", "fsdp2.yaml", "accelerate_configs/fsdp2.yaml"):
        assert resolve_config_file(spelling) == str(CONFIGS / "fsdp2.yaml")
    # a file of that name here is the user's own and wins
    (tmp_path / "fsdp2.yaml").write_text("distributed_type: 'NO'\n")
    assert resolve_config_file("fsdp2.yaml") == "fsdp2.yaml"
    assert resolve_config_file(str(tmp_path / "fsdp2.yaml")) == str(tmp_path / "fsdp2.yaml")
    with pytest.raises(FinetuneError, match=r"--config_file fsdp3: no such file.*shipped: deepspeed_zero2, "):
        resolve_config_file("fsdp3")
    with pytest.raises(FinetuneError, match="no such file"):  # a path elsewhere is never taken for a name
        resolve_config_file("elsewhere/fsdp2.yaml")


def test_an_unknown_config_file_is_one_error_line_before_launching(capsys):
    assert train_command(["--config_file", "multi_gpux", "--recipe", "bbc-news"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --config_file multi_gpux: no such file")
    assert "multi_gpu" in err[0]


@pytest.mark.integration
def test_train_with_a_shipped_config_by_name_from_another_directory(tmp_path, tiny_bert):
    """``finetune train --config_file multi_cpu_2proc`` from a directory without the file: two gloo processes."""
    out = tmp_path / "ddp"
    result = cli("train", "--config_file", "multi_cpu_2proc", "--main_process_port", "0",  # a port of its own
                 "--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out),
                 "--max_train_samples", "16", "--max_eval_samples", "8",
                 "--per_device_train_batch_size", "2", "--max_steps", "1", "--max_length", "32", cwd=tmp_path,
                 ACCELERATE_USE_CPU="1", HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    accumulation = load_recipe("bbc-news").DEFAULTS["gradient_accumulation_steps"]  # the run does not set it
    assert metrics["num_processes"] == 2 and metrics["effective_batch_size"] == 2 * accumulation * 2


# ------------------------------------------------------------------------------------------ finetune recipes
def test_recipes_lists_the_shipped_configs(tmp_path):
    result = cli("recipes", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in RECIPES:
        assert f"\n{name} " in result.stdout
    table = result.stdout.split("Accelerate configs (finetune train --config_file NAME", 1)[1]
    lines = table.strip().splitlines()
    assert lines[2].split() == ["config", "distributed_type", "processes", "machines", "what"]
    rows = {line.split()[0]: line.split()[1:4] for line in lines[4:]}
    assert set(rows) == set(shipped_configs())
    for name, path in shipped_configs().items():
        settings = yaml.safe_load(path.read_text())
        assert rows[name] == [settings["distributed_type"], str(settings["num_processes"]),
                              str(settings.get("num_machines", 1))]
    assert "multi_gpu        MULTI_GPU         2          1         DDP on every GPU of one machine" in list_configs()


def test_copy_writes_an_editable_recipe_that_runs(tmp_path, tiny_bert, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["recipes", "--copy", "bbc-news"]) == 0
    copied = tmp_path / "bbc_news.py"  # default: ./<module name>.py
    source = Path(load_recipe("bbc-news").__file__).read_text()
    text = copied.read_text()
    assert text.startswith("# Copied from finetune ") and text.endswith(source)
    assert "#     finetune train --recipe bbc_news.py\n" in text
    # edited, then run: the run is the edited recipe's
    copied.write_text(text.replace('"learning_rate": 1e-4', '"learning_rate": 3e-4'))
    metrics, out = run_in_process(tmp_path, "copied", recipe=str(copied), model_name_or_path=tiny_bert,
                                  max_train_samples=16, max_eval_samples=8, max_steps=1, max_length=32)
    assert metrics["optimizer_steps"] == 1
    saved = json.loads((out / "run_config.json").read_text())
    assert saved["recipe"] == str(copied) and saved["learning_rate"] == 3e-4


def test_copy_never_overwrites(tmp_path, capsys):
    dest = tmp_path / "mine.py"
    dest.write_text("# my own recipe\n")
    assert cli_main(["recipes", "--copy", "bbc-news", str(dest)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {str(dest)!r} already exists: it is not overwritten. Copy to another path, or remove it "
                   "first."]
    assert dest.read_text() == "# my own recipe\n"
    assert copy_recipe("glue-mrpc", str(tmp_path)) == tmp_path / "glue_mrpc.py"  # a folder: the file inside it
    for args, message in ((["nope"], "unknown recipe 'nope'"),
                          (["bbc-news", str(tmp_path / "x.txt")], "does not end in .py"),
                          (["bbc-news", str(tmp_path / "no" / "x.py")], "does not exist")):
        assert cli_main(["recipes", "--copy", *args]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x.txt").exists() and not (tmp_path / "no").exists()


def test_both_spellings_of_the_flag_are_resolved_and_other_flags_kept(tmp_path, monkeypatch):
    from finetune.commands.launch_configs import resolve_config_flag

    monkeypatch.chdir(tmp_path)
    assert resolve_config_flag(["--num_processes", "2", "--config_file", "multi_gpu", "--multi_gpu"]) == [
        "--num_processes", "2", "--config_file", str(CONFIGS / "multi_gpu.yaml"), "--multi_gpu"]
    assert resolve_config_flag(["--config_file=deepspeed_zero3.yaml"]) == [
        f"--config_file={CONFIGS / 'deepspeed_zero3.yaml'}"]


def test_a_cpu_run_in_fp32_says_whether_bf16_would_help_from_the_cpu_flags():
    """The banner's note for fp16 asked on a CPU (fp32 runs): native bf16 (AMX, AVX512-BF16) or emulated, from the
    CPU's flags; the banner of such a run carries it."""
    from finetune.outputs.reporting import cpu_bf16_note

    assert cpu_bf16_note(["amx_bf16", "amx_tile", "avx512f"], "DEFAULT").startswith(
        "this CPU has AMX: --mixed_precision bf16")
    assert "AMX and AVX512-BF16" in cpu_bf16_note(["avx512_bf16", "amx_bf16"], "DEFAULT")
    assert cpu_bf16_note(["avx512f", "avx2"], "DEFAULT").startswith(
        "bf16 would not help here: bf16 matmuls are emulated (no avx512_bf16, no AMX) on this CPU")
    assert cpu_bf16_note([], "DEFAULT").startswith("bf16 would not help here")
    assert cpu_bf16_note(["avx512_bf16"], "AVX2").startswith("bf16 would not help here: bf16 matmuls are emulated "
                                                             "(ONEDNN_MAX_CPU_ISA=AVX2 leaves out AVX512-BF16)")
    from finetune.config import parse_config
    from finetune.lifecycle.window import StepPlan
    from finetune.outputs.reporting import run_banner

    # dropout on: with the recipe's --disable_dropout and no model given, the banner ends on "the model was not checked"
    config = parse_config(["--recipe", "bbc-news", "--mixed_precision", "fp16", "--disable_dropout", "False"])
    plan = StepPlan(steps_per_epoch=2, micro_batches_per_epoch=4, max_steps=2, num_epochs=1)
    banner = run_banner(config, 1, plan, "no", "cpu")
    assert banner.endswith("so this run is fp32; " + cpu_bf16_note())
    assert cpu_bf16_note() not in run_banner(config, 1, plan, "fp16", "cuda")
