"""Token-level exactness for causal LM: variable-length sequences, the mean over all label tokens of a
window, not the mean of per-micro-batch means (the 2024 Trainer bug, transformers PRs 34191/34283)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_params, run_in_process, train_steps

from finetune.tasks import IGNORE_INDEX, CausalLM

CLM = dict(recipe="bbc-news-clm", num_train_epochs=1, disable_dropout=True, max_length=64, learning_rate=1e-3,
           seed=3, warmup_steps=0, eval_on_start=True)


def _clm(tiny_llama, clm_texts, **kw):
    return dict(model_name_or_path=tiny_llama, train_file=clm_texts[0], validation_file=clm_texts[1], **CLM, **kw)


def test_collator_pads_right_and_masks_padding_only():
    from transformers import AutoTokenizer

    from finetune.recipes.bbc_news import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    tokenizer.padding_side = "left"  # the collator must pad right whatever the tokenizer says
    collate = CausalLM().collator(tokenizer, pad_to_multiple_of=8)
    pad = tokenizer.pad_token_id
    batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [5, pad, 9, 10, 11]}])  # a real pad-id token inside
    assert batch["input_ids"].shape == (2, 8)
    assert batch["input_ids"][0].tolist()[:3] == [5, 6, 7]
    assert batch["labels"][0].tolist() == [5, 6, 7] + [IGNORE_INDEX] * 5
    assert batch["labels"][1].tolist()[:5] == [5, pad, 9, 10, 11]  # masked by attention_mask, not by id
    assert CausalLM().count_labels(batch["labels"]).item() == 2 + 4


def test_window_loss_is_the_token_mean_and_mean_of_means_is_not(tiny_llama, clm_texts):
    """Gradients of one window of 8 variable-length samples: the exact accumulation (sum / window tokens)
    equals the large batch; the naive mean of 4 micro-batch means does not (so this test can fail)."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = [json.loads(line)["text"] for line in open(clm_texts[0])][:8]
    features = [{"input_ids": ids} for ids in tokenizer(texts, truncation=True, max_length=64)["input_ids"]]
    task = CausalLM()
    collate = task.collator(tokenizer, None)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)

    def grads(loss_fn):
        model.zero_grad()
        loss_fn().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def logits_labels(batch):
        batch = dict(batch)
        labels = batch.pop("labels")
        return model(**batch).logits, labels

    full = collate(features)
    micro = [collate(features[i:i + 2]) for i in range(0, 8, 2)]
    counts = [task.count_labels(b["labels"]).item() for b in micro]
    assert len(set(counts)) > 1  # the micro-batches really hold different numbers of tokens
    total = sum(counts)

    g_full = grads(lambda: task.loss_from_logits(*logits_labels(full)) / task.count_labels(full["labels"]))
    g_exact = grads(lambda: sum(task.loss_from_logits(*logits_labels(b)) for b in micro) / total)
    g_naive = grads(lambda: sum(task.loss_from_logits(*logits_labels(b)) / c for b, c in zip(micro, counts)) / 4)
    torch.testing.assert_close(g_exact, g_full, rtol=1e-5, atol=1e-7)
    relative = ((g_naive - g_full).norm() / g_full.norm()).item()
    assert relative > 1e-2, relative


def test_clm_accumulation_equals_large_batch(tmp_path, tiny_llama, clm_texts):
    """48 variable-length texts: micro-batch 2 x accumulation 4 gives the parameters of micro-batch 8 x 1."""
    big_metrics, big = run_in_process(tmp_path, "big", **_clm(tiny_llama, clm_texts, per_device_train_batch_size=8,
                                                              gradient_accumulation_steps=1))
    acc_metrics, acc = run_in_process(tmp_path, "acc", **_clm(tiny_llama, clm_texts, per_device_train_batch_size=2,
                                                              gradient_accumulation_steps=4))
    a, b = load_params(acc), load_params(big)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")  # noqa: B023 - the lambda runs inside this iteration
    steps = train_steps(acc)
    assert len(steps) == 6 and len({r["trained_tokens"] for r in steps}) > 1
    assert [r["trained_tokens"] for r in steps] == [r["trained_tokens"] for r in train_steps(big)]
    assert acc_metrics["train_trained_tokens"] == sum(r["trained_tokens"] for r in steps)
    assert acc_metrics["eval_perplexity"] == pytest.approx(torch.tensor(acc_metrics["eval_loss"]).exp().item())
    evals = [r for r in (acc / "log.jsonl").read_text().splitlines() if "eval_perplexity" in r]
    assert len(evals) == 2  # before (eval_on_start) and after


def test_trainer_clm_losses_equal_accelerate(tmp_path, tiny_llama, clm_texts):
    kw = _clm(tiny_llama, clm_texts, per_device_train_batch_size=2, gradient_accumulation_steps=4,
              max_train_samples=44)  # 22 micro-batches: windows 4,4,4,4,4,2
    _, acc = run_in_process(tmp_path, "acc", **kw)
    _, tr = run_in_process(tmp_path, "tr", backend="trainer", **kw)
    a, t = train_steps(acc), train_steps(tr)
    assert len(a) == len(t) == 6 and t[-1]["micro_batches"] == 2
    for x, y in zip(a, t):
        assert abs(x["loss"] - y["loss"]) < 1e-4, (x, y)
        assert x["trained_tokens"] == y["trained_tokens"]


def test_block_size_groups_texts_into_equal_blocks(tmp_path, tiny_llama, clm_texts):
    metrics, out = run_in_process(tmp_path, "blocks", **_clm(tiny_llama, clm_texts, per_device_train_batch_size=2,
                                                             gradient_accumulation_steps=2, block_size=16))
    steps = train_steps(out)
    assert all(r["trained_tokens"] == r["samples"] * 15 for r in steps)  # every block: 16 tokens, 15 targets


def test_a_window_with_no_trained_token_is_a_clear_error():
    """A window whose labels are all masked (-100: one-token texts, nothing to predict) would divide its loss by
    zero items (NaN weights). Both engines refuse it with one clear error, raised alike on every process (the
    count is summed over the processes first)."""
    from types import SimpleNamespace

    from finetune.backends.trainer import BookkeepingCallback
    from finetune.errors import FinetuneError
    from finetune.lifecycle.window import count_window
    from finetune.tasks import CausalLM

    batch = {"labels": torch.full((2, 5), -100), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    accelerator = SimpleNamespace(device=torch.device("cpu"), reduce=lambda tensor, op: tensor)
    with pytest.raises(FinetuneError, match="no trained tokens"):
        count_window([batch, dict(batch)], CausalLM(), accelerator)
    callback = BookkeepingCallback.__new__(BookkeepingCallback)
    callback.task = CausalLM()
    with pytest.raises(FinetuneError, match="no trained tokens"):
        callback.account(torch.tensor(0.0, requires_grad=True), batch, torch.tensor(0))
