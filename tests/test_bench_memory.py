"""bench/bench_memory.py in --smoke mode end to end (tiny models, one fresh worker process per configuration):
the report's and the JSON's structure, the byte accounting's arithmetic, and what must hold whatever the
machine: LoRA trains fewer parameters and holds fewer gradient and AdamW bytes; activation checkpointing saves
fewer bytes for backward at the same micro-batch. Nothing here is timed."""

from __future__ import annotations

import json
import math

import pytest
from test_bench import check_header, positive, run_bench, run_bench_in_process, table_row

BBC = ("32x1", "8x4", "8x4 + checkpointing", "32x1 + checkpointing")
SMOLLM2 = ("plain", "2x4", "checkpointing", "LoRA", "LoRA + checkpointing")  # + CHUNKED where finetune.tasks.chunked_loss exists
CHUNKED = ("chunked loss", "chunked loss + checkpointing", "chunked loss + checkpointing + LoRA")
LORA = ("full", "LoRA")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(stdout, JSON record, Markdown file text) of one ``--smoke`` run over every suite."""
    tmp = tmp_path_factory.mktemp("bench-memory")
    md, js = tmp / "memory.md", tmp / "memory.json"
    out = run_bench("bench_memory.py", "--smoke", "--markdown", str(md), "--json", str(js), timeout=600).stdout
    return out, json.loads(js.read_text()), md.read_text()


def configs_of(data: dict, suite: str) -> dict:
    return {c["name"]: c for c in data["results"]["configs"].values() if c["suite"] == suite}


@pytest.mark.integration
def test_report(smoke):
    out, data, md = smoke
    check_header(out)
    assert md.strip() == out.strip()
    assert "(CPU model, lscpu)" in out and "Worker threads (torch.get_num_threads): 1" in out
    for title in ("## bbc:", "## smollm2:", "## lora:"):
        assert title in out
    for name in BBC + SMOLLM2 + LORA:
        cells = table_row(out, name)
        assert len(cells) == 13, cells
        for cell in cells[3:]:  # saved, of which weights, grads, AdamW, training memory, ratio, RSS, ..., time
            assert cell != "n/a", cells
        positive(cells[3]), positive(cells[7]), positive(cells[9]), positive(cells[11])
    assert table_row(out, "32x1")[1] == "32x1" and table_row(out, "8x4 + checkpointing")[1] == "8x4"
    assert table_row(out, "plain")[1] == "8x1" and table_row(out, "full")[1] == "4x1"
    assert table_row(out, "2x4")[1] == "2x4"  # what checkpointing at 4x the micro-batch competes with
    assert table_row(out, "goal <= 0.6")[1] in ("met", "NOT met")
    positive(table_row(out, "training memory ratio LoRA / full")[1])
    if "chunked loss" not in configs_of(data, "smollm2"):
        assert "the chunked-loss row is skipped: finetune.tasks.chunked_loss" in out


@pytest.mark.integration
def test_json_structure_and_accounting(smoke):
    _, data, _ = smoke
    assert data["benchmark"] == "memory" and data["mode"] == "smoke"
    assert data["machine"]["cpu_lscpu"] or data["machine"]["cpu"]
    assert {"cpu", "cpu_cores", "torch", "gpu"} <= set(data["machine"])
    results = data["results"]
    assert results["failed"] == [] and set(results["suites"]) == {"bbc", "smollm2", "lora"}
    assert set(configs_of(data, "bbc")) == set(BBC) and set(configs_of(data, "lora")) == set(LORA)
    assert set(SMOLLM2) <= set(configs_of(data, "smollm2")) <= set(SMOLLM2) | set(CHUNKED)
    for label, config in results["configs"].items():
        assert len(config["runs"]) == 1 and config["errors"] == [], label
        run = config["runs"][0]
        spec = config["spec"]
        assert spec["max_length"] == 32 and spec["steps"] == 2 and run["torch_threads"] == 1
        trainable = run["trainable_parameters"]
        assert 0 < trainable <= run["total_parameters"]
        assert run["gradient_bytes"] == 4 * trainable and run["adamw_state_bytes"] == 8 * trainable
        # the accounting is what the tensors really held (fp32: 4 bytes a gradient, two 4-byte moments)
        assert run["gradient_bytes_measured"] == run["gradient_bytes"], label
        assert run["adamw_state_bytes_measured"] == run["adamw_state_bytes"], label
        assert run["training_memory_bytes"] == run["saved_tensor_bytes"] + run["gradient_bytes"] + run["adamw_state_bytes"]
        assert run["saved_tensor_bytes_warmup"] == run["saved_tensor_bytes"], label  # same shapes, same bytes
        assert 0 <= run["saved_parameter_bytes"] <= min(run["saved_tensor_bytes"], run["weight_bytes"])
        assert run["peak_rss_bytes"] >= run["max_rss_before_training_bytes"] > 50 * 2**20
        assert run["timed_samples"] == 2 * spec["micro_batch"] * spec["accumulation"]
        assert run["seconds_per_sample"] == pytest.approx(run["seconds"] / run["timed_samples"])
        assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"])  # warm-up + 2 timed
        median = config["median"]
        assert median["activation_bytes"] == run["saved_tensor_bytes"] - run["saved_parameter_bytes"]


@pytest.mark.integration
def test_lora_trains_less(smoke):
    _, data, _ = smoke
    for suite, full_name in (("lora", "full"), ("smollm2", "plain")):
        rows = {name: c["median"] for name, c in configs_of(data, suite).items()}
        full, lora = rows[full_name], rows["LoRA"]
        assert lora["trainable_parameters"] < full["trainable_parameters"] / 10
        assert lora["total_parameters"] > full["total_parameters"]  # the adapters are added, nothing removed
        assert lora["gradient_bytes"] + lora["adamw_state_bytes"] < full["gradient_bytes"] + full["adamw_state_bytes"]
        assert lora["training_memory_bytes"] < full["training_memory_bytes"]
    s = data["results"]["suites"]["lora"]
    rows = {name: c["median"] for name, c in configs_of(data, "lora").items()}
    assert s["training_memory_ratio_lora_over_full"] == pytest.approx(
        rows["LoRA"]["training_memory_bytes"] / rows["full"]["training_memory_bytes"])
    assert s["goal"] == 0.6 and s["goal_met"] == (s["training_memory_ratio_lora_over_full"] <= 0.6)
    assert s["trainable_parameters"] == {"full": rows["full"]["trainable_parameters"],
                                         "LoRA": rows["LoRA"]["trainable_parameters"]}


@pytest.mark.integration
def test_checkpointing_saves_fewer_bytes(smoke):
    _, data, _ = smoke
    bbc, clm = configs_of(data, "bbc"), configs_of(data, "smollm2")
    for configs, plain, checkpointed in ((bbc, "8x4", "8x4 + checkpointing"), (bbc, "32x1", "32x1 + checkpointing"),
                                         (clm, "plain", "checkpointing"), (clm, "LoRA", "LoRA + checkpointing"),
                                         (clm, "chunked loss", "chunked loss + checkpointing")):
        a, b = configs[plain]["median"], configs[checkpointed]["median"]
        assert configs[plain]["micro_batch"] == configs[checkpointed]["micro_batch"]
        assert b["saved_tensor_bytes"] < a["saved_tensor_bytes"], (plain, checkpointed)
        assert b["trainable_parameters"] == a["trainable_parameters"]
    # a smaller micro-batch saves fewer bytes for backward; accumulation does not change what trains
    assert bbc["8x4"]["median"]["saved_tensor_bytes"] < bbc["32x1"]["median"]["saved_tensor_bytes"]
    ratios = data["results"]["suites"]["bbc"]["ratios_over_baseline"]
    assert ratios["32x1"]["training_memory_ratio"] == 1.0 and ratios["8x4"]["training_memory_ratio"] < 1.0


@pytest.mark.integration
def test_dry_run_lists_the_full_configurations(tiny_llama, capsys):
    out = run_bench_in_process(capsys, "bench_memory.py", "--dry_run", "--suite", "bbc,lora", "--clm_model", tiny_llama)
    specs = {line.split(" (x", 1)[0]: json.loads(line.split(": ", 2)[2]) for line in out.splitlines()
             if line.startswith(("bbc: ", "lora: "))}
    assert set(specs) == {f"bbc: {n}" for n in BBC} | {f"lora: {n}" for n in LORA}
    for name in BBC:
        spec = specs[f"bbc: {name}"]
        assert spec["max_length"] == 512 and spec["task"] == "cls" and spec["checkpointing"] == ("checkpointing" in name)
        assert (spec["micro_batch"], spec["accumulation"]) == ((32, 1) if name.startswith("32x1") else (8, 4))
    for name in LORA:
        spec = specs[f"lora: {name}"]
        assert spec["max_length"] == 256 and spec["micro_batch"] == 4 and spec["lora"] == (name == "LoRA")
        assert spec["lora_r"] == 16 and spec["lora_alpha"] == 32 and spec["model"] == tiny_llama
