"""Speed options change speed, not results; the MFU arithmetic and its sources."""

from __future__ import annotations

import pytest
from helpers import run_in_process, train_steps


def test_dataloader_workers_give_identical_training(tmp_path, tiny_bert):
    kw = dict(model_name_or_path=tiny_bert, max_train_samples=24, max_eval_samples=8, per_device_train_batch_size=4,
              gradient_accumulation_steps=2, num_train_epochs=1, max_length=32, eval_strategy="no")
    base, a = run_in_process(tmp_path, "base", **kw)
    workers, b = run_in_process(tmp_path, "workers", dataloader_num_workers=2, **kw)
    assert [r["loss"] for r in train_steps(b)] == [r["loss"] for r in train_steps(a)]
    assert workers["train_input_tokens"] == base["train_input_tokens"] > 0
    # both are rounded (runtime to 1 ms): compare in absolute seconds, not relative to a tiny runtime
    assert base["train_seconds_per_step"] == pytest.approx(base["train_runtime"] / base["optimizer_steps"], abs=2e-3)
    assert "mfu" not in base  # no peak for a CPU: not made up


def test_mfu_formula_and_named_peaks():
    from finetune.outputs.flops import model_flops_utilization, peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3")[0] == 989.4e12
    assert "datasheet" in peak_flops("NVIDIA H200")[1]
    assert peak_flops("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert peak_flops("cpu") is None and peak_flops(None) is None
    mfu, source = model_flops_utilization(100_000_000, 10_000, "NVIDIA A100-SXM4-40GB")
    assert mfu == pytest.approx(6 * 1e8 * 1e4 / 312e12) and "A100" in source


def test_length_grouped_sampler_is_a_seeded_permutation_sorted_within_mega_batches():
    from accelerate.data_loader import SeedableRandomSampler

    from finetune.lifecycle.window import EpochSeededLengthGroupedSampler

    lengths = [(i * 37) % 101 + 1 for i in range(400)]
    sampler = EpochSeededLengthGroupedSampler(8, lengths, seed=5)
    first = list(sampler)
    assert sorted(first) == list(range(400))  # every sample once per epoch
    assert list(sampler) == first  # same seed, same epoch: same order (resume, other processes)
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first and sorted(second) == list(range(400))
    sampler.set_epoch(0)
    assert list(sampler) == first
    # mega-batches of min(400 // (8 * 4), 50) x 8 = 96 samples, each sorted longest first (the longest
    # sample of all is swapped to the front, so an OOM shows in the first step)
    for start in range(0, 400, 96):
        chunk = [lengths[i] for i in first[start:start + 96]]
        assert chunk[1:] == sorted(chunk[1:], reverse=True)
    assert lengths[first[0]] == max(lengths)
    # nothing to group (equal lengths): exactly Accelerate's seeded random order, so the option changes nothing
    equal = EpochSeededLengthGroupedSampler(8, [16] * 50, seed=5)
    accelerate_order = SeedableRandomSampler(range(50), data_seed=5)
    assert list(equal) == list(accelerate_order)


def test_group_by_length_pads_less_and_trains_on_the_same_samples(tmp_path, tiny_llama, clm_texts):
    """160 texts of 2-55 words, micro-batch 4 x 2: length-grouped batches (4 mega-batches of 5 windows:
    transformers' ``get_length_grouped_indices`` takes min(160 // (4 x 8), 50) windows) need far less padding than
    a random order, and each epoch still trains on every sample and label token once. (320 texts, mega-batches of
    10 windows, doubled the test's time and tested nothing more.)"""
    from tiny_models import write_variable_length_texts

    train_file = write_variable_length_texts(tmp_path / "train.jsonl", 160, seed=4)
    kw = dict(model_name_or_path=tiny_llama, train_file=train_file, validation_file=clm_texts[1],
              recipe="bbc-news-clm", num_train_epochs=1, max_train_samples=160, max_length=64, per_device_train_batch_size=4,
              gradient_accumulation_steps=2, eval_strategy="no", disable_dropout=True)
    random_order, a = run_in_process(tmp_path, "random", **kw)
    grouped, b = run_in_process(tmp_path, "grouped", train_sampling_strategy="group_by_length", **kw)
    assert grouped["train_samples"] == random_order["train_samples"] == 160
    assert grouped["train_trained_tokens"] == random_order["train_trained_tokens"] > 0
    assert grouped["train_input_tokens"] == random_order["train_input_tokens"]
    assert random_order["train_padding_fraction"] > 0.3
    assert grouped["train_padding_fraction"] < random_order["train_padding_fraction"] / 3
    # within a window, micro-batches differ little in length: its steps' label tokens vary, the order does
    assert [r["trained_tokens"] for r in train_steps(b)] != [r["trained_tokens"] for r in train_steps(a)]
    assert (b / "run_config.json").read_text().count('"group_by_length"') == 1


def test_torch_compile_trains_the_same_model(tmp_path, tiny_bert):
    """torch.compile (inductor, CPU) through Accelerate's dynamo plugin: the same losses and the same saved
    weights as eager (fp32, dropout off), and the saved model has plain (uncompiled) parameter names."""
    import torch
    from helpers import load_params
    from transformers import AutoModelForSequenceClassification

    # all 24 articles truncate to 32 tokens and 24 = 3 windows of 4 x 2: one shape, one compilation
    kw = dict(model_name_or_path=tiny_bert, max_train_samples=24, max_eval_samples=8, per_device_train_batch_size=4,
              gradient_accumulation_steps=2, num_train_epochs=1, max_length=32, eval_strategy="epoch",
              disable_dropout=True, per_device_eval_batch_size=8)
    eager, a = run_in_process(tmp_path, "eager", **kw)
    compiled, b = run_in_process(tmp_path, "compiled", torch_compile=True, **kw)
    eager_losses = [r["loss"] for r in train_steps(a)]
    assert [r["loss"] for r in train_steps(b)] == pytest.approx(eager_losses, rel=1e-5)
    assert compiled["eval_loss"] == pytest.approx(eager["eval_loss"], rel=1e-5)
    ours, theirs = load_params(b), load_params(a)
    assert ours.keys() == theirs.keys() and not any("_orig_mod" in k for k in ours)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6)
    AutoModelForSequenceClassification.from_pretrained(b)
