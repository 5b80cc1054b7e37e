"""Throughput counted honestly: per step, padded, input and trained tokens and their rates are consistent with
the counts and the step time in ``log.jsonl``; the run's rates leave the warm-up step out; the FLOPs formula
6 N + 12 L d T (PaLM appendix B), with LoRA's 4 N + 2 N_trainable and activation checkpointing's recompute."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from finetune.flops import matmul_parameters, training_flops_per_token
from helpers import read_log, run_in_process


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
    assert metrics["model_flops_per_second"] > 0 and "mfu" not in metrics  # a CPU has no known peak


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
