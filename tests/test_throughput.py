"""Throughput counted honestly: per step, padded, input and trained tokens and their rates are consistent with
the counts and the step time in ``log.jsonl``; the run's rates leave the warm-up step out; the FLOPs formula
6 N + 12 L d T (PaLM appendix B), with LoRA's 4 N + 2 N_trainable and activation checkpointing's recompute."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from helpers import read_log, run_in_process
from transformers import AutoModelForCausalLM

from finetune.outputs.flops import matmul_parameters, training_flops_per_token


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_token_rates_match_the_counts_in_the_log(tmp_path, tiny_llama, clm_texts, backend):
    train, valid = clm_texts
    metrics, out = run_in_process(tmp_path, backend, recipe="bbc-news-clm", model_name_or_path=tiny_llama,
                                  train_file=train, validation_file=valid, per_device_train_batch_size=4,
                                  gradient_accumulation_steps=2, max_steps=4, max_length=64, eval_strategy="no",
                                  backend=backend, mixed_precision="no")
    steps = [r for r in read_log(out) if "loss" in r]
    assert len(steps) == 4 and steps[0]["warmup"] is True and not any(r.get("warmup") for r in steps[1:])
    for r in steps:
        assert r["input_tokens"] <= r["padded_tokens"] and r["trained_tokens"] < r["input_tokens"]
        for kind in ("padded", "input", "trained"):
            assert r[f"{kind}_tokens_per_second"] == pytest.approx(r[f"{kind}_tokens"] / r["step_seconds"], rel=1e-3)
    timed = steps[1:]
    seconds = sum(r["step_seconds"] for r in timed)
    for kind in ("padded", "input", "trained"):
        assert metrics[f"train_{kind}_tokens"] == sum(r[f"{kind}_tokens"] for r in steps)
        assert metrics[f"train_{kind}_tokens_per_second"] == pytest.approx(
            sum(r[f"{kind}_tokens"] for r in timed) / seconds, rel=1e-3)
    assert metrics["throughput_steps"] == 3 and metrics["throughput_excludes_warmup"] is True
    assert metrics["train_padded_tokens"] > metrics["train_input_tokens"]  # variable lengths: padding exists
    assert metrics["model_flops_per_second"] > 0 and "mfu" not in metrics  # a CPU has no datasheet peak
    # but a measured one (outputs/peak.py), and the achieved FLOP/s as shares of it
    peak = metrics["measured_peak_flops_per_second"]
    source = metrics["measured_peak_source"]
    assert peak > 1e8 and source.startswith("1 x measured: ") and "a 2048^2 float32 matmul on " in source
    assert metrics["hfu_of_measured_peak"] == pytest.approx(metrics["hardware_flops_per_second"] / peak, abs=1e-4)
    assert metrics["mfu_of_measured_peak"] == pytest.approx(metrics["model_flops_per_second"] / peak, abs=1e-4)


def test_flops_per_token(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    total, trainable = matmul_parameters(model)
    embedding = model.get_input_embeddings().weight.numel()
    # tied embeddings: the table is a lookup and also the head's matmul, so every parameter counts once
    assert total == trainable == sum(p.numel() for p in model.parameters())
    layers, width = model.config.num_hidden_layers, model.config.hidden_size
    flops, formula = training_flops_per_token(model, context=10.0)
    assert flops == pytest.approx(6 * total + 12 * layers * width * 10.0)
    assert formula.startswith("6 N + 12 L d T") and f"N = {total:,}" in formula
    recomputed, _ = training_flops_per_token(model, context=10.0, recompute=True)
    assert recomputed == pytest.approx(flops + 2 * total + 4 * layers * width * 10.0)
    for p in model.parameters():  # frozen weights: no weight gradients (LoRA-like)
        p.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True) if not model.config.tie_word_embeddings else None
    frozen, _ = training_flops_per_token(model, context=10.0)
    assert frozen == pytest.approx(4 * total + 2 * matmul_parameters(model)[1] + 12 * layers * width * 10.0)
    assert embedding > 0


# ------------------------------------------------------------------ MFU over every process; whole parameters; d
def _tiny_causal_lm(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides}))


def test_mfu_is_per_gpu_the_same_at_any_process_count(monkeypatch):
    """The same speed on each GPU is the same MFU on 1 or 2 processes: the counts are over all processes, so
    they are divided by num_processes x one GPU's peak (before the fix: P = 2 reported twice P = 1's)."""
    from finetune.config import TrainConfig
    from finetune.lifecycle.checkpoint import RunProgress
    from finetune.outputs import reporting

    # a CUDA device whose peak is 1e8 FLOP/s (a CPU has none): scaled to the tiny model, so MFU is far from 0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(reporting, "peak_flops", lambda name, override=None: (1e8, "a 1e8 FLOP/s GPU"))
    monkeypatch.setattr(reporting, "peak_memory", lambda device: (0, "not measured"))
    monkeypatch.setattr(reporting, "matmul_peak", lambda device, precision, refresh=False: None)  # no GPU to measure
    model = _tiny_causal_lm()
    config = TrainConfig(recipe="bbc-news-clm", output_dir="unused", report_to="none")
    per_process = dict(timed_steps=3, timed_seconds=2.0, timed_samples=8, timed_padded_tokens=640,
                       timed_input_tokens=512, timed_trained_tokens=500)
    results = {}
    for processes in (1, 2):
        state = RunProgress(step=4, num_processes=processes, train_runtime=2.5, samples_seen=10 * processes,
                            **{k: v * processes if k != "timed_seconds" and k != "timed_steps" else v
                               for k, v in per_process.items()})
        results[processes] = reporting.run_metrics(
            config, state, {}, plan=SimpleNamespace(epoch_fraction=lambda step: 1.0), num_processes=processes,
            precision="no", device=torch.device("cuda"), model=model, eval_runtime=0.0, process_start=None)
    per_token, _ = training_flops_per_token(model, 512 / 8)
    expected = per_token * 512 / 2.0 / 1e8  # one process's FLOP/s over one device's peak
    assert 0.1 < expected < 1 and results[1]["mfu"] == pytest.approx(expected, abs=1e-4)
    assert results[2]["mfu"] == results[1]["mfu"] and results[2]["hfu"] == results[1]["hfu"]
    assert results[2]["model_flops_per_second"] == pytest.approx(2 * results[1]["model_flops_per_second"])
    assert results[2]["mfu_peak_source"].startswith("2 x ")


def test_a_run_of_a_minute_or_more_measures_the_peak_again(monkeypatch):
    """The run's share is over the best peak measured on the machine; a run whose timed steps took
    ``REMEASURE_AFTER`` seconds or more measures it again (the cache keeps the best), a shorter one reads the cache."""
    from finetune.config import TrainConfig
    from finetune.lifecycle.checkpoint import RunProgress
    from finetune.outputs import reporting

    asked = []
    monkeypatch.setattr(reporting, "matmul_peak", lambda device, precision, refresh=False: asked.append(refresh) or (
        1e9, "a 1 GFLOP/s CPU"))
    model = _tiny_causal_lm()
    config = TrainConfig(recipe="bbc-news-clm", output_dir="unused", report_to="none")
    for seconds in (reporting.REMEASURE_AFTER - 1, reporting.REMEASURE_AFTER):
        state = RunProgress(step=4, train_runtime=seconds + 1, samples_seen=10, timed_steps=3, timed_seconds=seconds,
                            timed_samples=8, timed_padded_tokens=640, timed_input_tokens=512, timed_trained_tokens=500)
        metrics = reporting.throughput(state, seconds + 1, model, config, torch.device("cpu"))
        assert metrics["hfu_of_measured_peak"] == pytest.approx(metrics["hardware_flops_per_second"] / 1e9, abs=1e-4)
    assert asked == [False, True]


def test_zero3_placeholders_count_whole():
    """A ZeRO-3 partitioned parameter is an empty tensor with its true size in ``ds_numel``: DeepSpeed
    (deepspeed/runtime/zero/partition_parameters.py) sets ``param.ds_numel = param.numel()`` in
    ``_convert_to_deepspeed_param`` and then ``free_param`` sets ``param.data = torch.empty(0, ...)``. The matmul
    count must be the whole model's, not 0 (before the fix ``p.numel()`` counted 0 for each)."""
    model = _tiny_causal_lm()
    whole = matmul_parameters(model)
    embedding = model.get_input_embeddings().weight.numel()
    assert whole[0] == sum(p.numel() for p in model.parameters()) - embedding + 64 * 32  # the tied head's matmul
    for p in model.parameters():  # as DeepSpeed's partitioning leaves them (ds_numel first, then freed)
        p.ds_numel, p.ds_shape = p.numel(), p.shape
        p.data = torch.empty(0, dtype=p.dtype)
    assert all(p.numel() == 0 for p in model.parameters())
    assert matmul_parameters(model) == whole
    flops, formula = training_flops_per_token(model, context=8.0)
    assert f"N = {whole[0]:,}" in formula and flops == pytest.approx(6 * whole[0] + 12 * 2 * 32 * 8.0)


def test_attention_width_is_heads_times_head_dim():
    """PaLM's d in 12 L d T is the attention width, heads x head_dim: a config whose head_dim is not
    hidden_size / heads (as Qwen3's and Gemma-7B's) uses 4 x 16 = 64, not hidden_size 32."""
    model = _tiny_causal_lm(head_dim=16)
    assert model.config.hidden_size // model.config.num_attention_heads == 8  # the config really differs
    total, _ = matmul_parameters(model)
    flops, formula = training_flops_per_token(model, context=10.0)
    assert flops == pytest.approx(6 * total + 12 * 2 * (4 * 16) * 10.0)
    assert "d = 64" in formula
    plain = _tiny_causal_lm()  # head_dim = hidden_size / heads: the same either way
    assert training_flops_per_token(plain, context=10.0)[0] == pytest.approx(
        6 * matmul_parameters(plain)[0] + 12 * 2 * 32 * 10.0)


def _fsdp1_counts(rank: int, port: int, use_orig_params: bool, out: str) -> None:
    import json
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    from finetune.engine import parameter_counts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = FullyShardedDataParallel(_tiny_causal_lm(), device_id=torch.device("cpu"), use_orig_params=use_orig_params,
                                     sharding_strategy=ShardingStrategy.FULL_SHARD)
    local = sum(p.numel() for p in model.parameters())
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"matmul": matmul_parameters(model), "counts": parameter_counts(model), "local": local}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_shards_count_whole(tmp_path, use_orig_params):
    """Under FSDP1 (2 gloo ranks, FULL_SHARD) each rank holds half of each flat parameter: ``p.numel()`` is the
    shard (use_orig_params=False: the FlatParameter; True: a 1-D view of its part, torch 2.13
    ``distributed/fsdp/_flat_param.py`` ``_use_sharded_views``). The counts must be the whole model's on each rank."""
    import json

    import torch.multiprocessing as mp

    from finetune.engine import parameter_counts

    whole = _tiny_causal_lm()
    expected = {"matmul": list(matmul_parameters(whole)), "counts": list(parameter_counts(whole))}
    port = 29500 + (os.getpid() % 400) + (1 if use_orig_params else 0)
    mp.spawn(_fsdp1_counts, args=(port, use_orig_params, str(tmp_path / "counts")), nprocs=2, join=True)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"counts.{rank}").read_text())
        assert seen["local"] < sum(p.numel() for p in whole.parameters())  # really sharded
        assert {"matmul": seen["matmul"], "counts": seen["counts"]} == expected


def test_the_matmul_peak_is_measured_once_per_machine_precision_and_threads(tmp_path, monkeypatch):
    """matmul_peak measures on the first call for a (device, dtype, threads, torch) key and reads the cache after;
    the measurement draws nothing from the global generators; fp16 on a CPU has no peak (it does not run there);
    the run summary prints the achieved share."""
    from finetune.outputs import peak
    from finetune.outputs.reporting import format_summary

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    calls = []
    original = peak.measure_matmul
    monkeypatch.setattr(peak, "measure_matmul", lambda device, dtype, size: calls.append(dtype) or original(
        device, dtype, 256))
    state = torch.get_rng_state()
    first = peak.matmul_peak(torch.device("cpu"), "no")
    assert torch.equal(torch.get_rng_state(), state)
    assert peak.matmul_peak(torch.device("cpu"), "no") == first and len(calls) == 1 and first[0] > 0
    assert peak.matmul_peak(torch.device("cpu"), "fp16") is None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        peak.matmul_peak(torch.device("cpu"), "no")
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2 and f"{threads} threads" in first[1]
    # refresh measures again and keeps the best: a slower measurement (the cores shared) leaves the peak as it was,
    # a faster one replaces it
    for factor, expected in ((0.5, first[0]), (2.0, 2 * first[0])):
        monkeypatch.setattr(peak, "measure_matmul", lambda device, dtype, size, factor=factor: factor * first[0])
        again = peak.matmul_peak(torch.device("cpu"), "no", refresh=True)
        assert again[0] == expected
    assert "the best of 3 measurements" in again[1]
    cached = json.loads(peak.cache_path().read_text())
    entry = next(v for k, v in cached.items() if k.endswith(f"| float32 | {threads} threads | torch {torch.__version__}"))
    assert entry["measurements"] == 3 and entry["last_flops_per_second"] == 2 * first[0]
    summary = format_summary({"mixed_precision": "no", "num_processes": 2, "hardware_flops_per_second": 3.0e10,
                              "model_flops_per_second": 2.5e10, "measured_peak_flops_per_second": 2.0e10,
                              "hfu_of_measured_peak": 0.75}, "out")
    assert "achieved FLOP/s            30.0 G (model 25.0 G) = 75% of the best measured fp32 matmul peak (2 x 20.0 G)" \
        in summary
