"""The chunked loss through both engines: the same training as the plain full-logits loss (rtol 1e-5), for
causal LM and completion-only SFT; and the plain path where it is asked for."""

from __future__ import annotations

import pytest
import torch
from helpers import load_params, run_in_process, train_steps


def same_weights(a_dir, b_dir, rtol=1e-5):
    a, b = load_params(a_dir), load_params(b_dir)
    diff = torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)) / torch.sqrt(sum((a[k] ** 2).sum() for k in a))
    assert diff < rtol, diff  # relative norm of the whole difference (Adam and float noise: see DESIGN)


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_chunked_equals_plain_for_causal_lm(tmp_path, tiny_llama, clm_texts, backend, monkeypatch):
    import finetune.tasks.loss as loss_module

    calls, original = [], loss_module.chunked_causal_lm_loss_sum
    monkeypatch.setattr(loss_module, "chunked_causal_lm_loss_sum",
                        lambda *a, **k: calls.append(a[2].shape) or original(*a, **k))
    train, valid = clm_texts
    kw = dict(recipe="bbc-news-clm", model_name_or_path=tiny_llama, train_file=train, validation_file=valid,
              backend=backend, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
              max_length=64, disable_dropout=True, learning_rate=3e-3, warmup_steps=0, eval_strategy="no",
              mixed_precision="no")
    _, plain = run_in_process(tmp_path, "plain", loss_chunk_size=0, **kw)
    assert not calls  # 0: the plain full-logits loss
    _, chunked = run_in_process(tmp_path, "chunked", loss_chunk_size=16, **kw)  # many chunks per micro-batch
    _, default = run_in_process(tmp_path, "default", **kw)  # on a CPU the default is chunked (1024)
    assert len(calls) == 2 * 3 * 2  # every micro-batch of both chunked runs went through it (no fallback)
    for run in (chunked, default):
        same_weights(plain, run)
        assert [r["loss"] for r in train_steps(run)] == pytest.approx([r["loss"] for r in train_steps(plain)],
                                                                        rel=1e-5)
