"""Activation checkpointing recomputes activations in the backward pass: it must not change what is
trained. The same weights as without it (dropout off), for BERT and Llama, with accumulation, both
engines, LoRA, resume, torch.compile, and two gloo processes."""

from __future__ import annotations

import pytest
import torch
from helpers import launch, load_params, run_in_process, train_steps

BERT = dict(max_train_samples=24, max_eval_samples=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_steps=3, max_length=32, disable_dropout=True, learning_rate=2e-3, warmup_steps=0, seed=4,
            eval_strategy="no")


def same_weights(a_dir, b_dir, rtol=1e-5):
    a, b = load_params(a_dir), load_params(b_dir)
    assert a.keys() == b.keys()
    diff = torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)) / torch.sqrt(sum((a[k] ** 2).sum() for k in a))
    assert diff < rtol, diff  # relative norm of the whole difference (see DESIGN: Adam and float noise)


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_bert_same_weights_with_and_without(tmp_path, tiny_bert, backend, shared_runs):
    kw = dict(model_name_or_path=tiny_bert, **BERT, **({"backend": backend} if backend != "accelerate" else {}))
    _, plain = shared_runs.in_process(**kw)  # the accelerate run is also the reference of the two tests below
    _, ckpt = run_in_process(tmp_path, "ckpt", activation_checkpointing=True, **kw)
    same_weights(plain, ckpt)
    assert [r["loss"] for r in train_steps(ckpt)] == pytest.approx([r["loss"] for r in train_steps(plain)], rel=1e-6)


def test_llama_same_weights_and_the_alias(tmp_path, tiny_llama, clm_texts):
    train, valid = clm_texts
    kw = dict(recipe="bbc-news-clm", model_name_or_path=tiny_llama, train_file=train, validation_file=valid,
              per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3, max_length=64,
              disable_dropout=True, learning_rate=3e-3, warmup_steps=0, eval_strategy="no", mixed_precision="no")
    _, plain = run_in_process(tmp_path, "plain", **kw)
    _, ckpt = run_in_process(tmp_path, "ckpt", gradient_checkpointing=True, **kw)  # the deprecated alias
    same_weights(plain, ckpt)


def test_every_n_layers_checkpoints_some_layers_and_trains_the_same(tmp_path, tiny_bert, shared_runs):
    """``--activation_checkpointing_kwargs '{"every_n_layers": 2}'`` (TrainingArguments' key, for
    ``activation_checkpointing_enable``, not for torch's checkpoint): of the tiny BERT's 2 layers only the first is
    checkpointed, so the bytes saved for backward fall between none and all checkpointed; same weights."""
    from types import SimpleNamespace

    from transformers import AutoModelForSequenceClassification

    from finetune.planner.probes import saved_tensor_bytes
    from finetune.tasks.builders import enable_activation_checkpointing

    ids = torch.randint(5, 100, (4, 32))

    def saved(kwargs):
        model = AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=2)
        model.train()
        if kwargs is not None:
            enable_activation_checkpointing(model, SimpleNamespace(activation_checkpointing_kwargs=kwargs,
                                                                   use_peft=False))
        return saved_tensor_bytes(lambda: model(input_ids=ids).logits.sum())

    none, every_2nd, every = saved(None), saved('{"every_n_layers": 2}'), saved("{}")
    assert every < every_2nd < none
    kw = dict(model_name_or_path=tiny_bert, **BERT)
    _, plain = shared_runs.in_process(**kw)
    _, half = run_in_process(tmp_path, "half", activation_checkpointing=True,
                             activation_checkpointing_kwargs='{"every_n_layers": 2}', **kw)
    same_weights(plain, half)


@pytest.mark.parametrize("kwargs, message", [('{"every_n_layers": 0}', "every_n_layers"),
                                             ('{"every_n_layers": true}', "every_n_layers"),
                                             ('{"offload": "yes"}', "offload"), ("[1]", "JSON object")])
def test_bad_activation_checkpointing_kwargs_are_refused(kwargs, message):
    from finetune.config import parse_config
    from finetune.errors import FinetuneError

    with pytest.raises(FinetuneError, match=message):
        parse_config(["--activation_checkpointing", "True", "--activation_checkpointing_kwargs", kwargs]).validate()


def test_resume_under_checkpointing_gives_the_uninterrupted_weights(tmp_path, tiny_bert, capsys):
    """Stopped after optimizer step 2 of 4 and resumed, a checkpointed run ends with the weights and losses of the
    uninterrupted one, which are those of the run without checkpointing."""
    import shutil

    kw = dict(model_name_or_path=tiny_bert, **{**BERT, "max_steps": 4}, save_steps=2, activation_checkpointing=True)
    _, full = run_in_process(tmp_path, "full", **kw)
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["step_00000002"]  # the end saves the model only
    for name in ("model.safetensors", "metrics.json"):
        (resumed / name).unlink()
    capsys.readouterr()
    run_in_process(tmp_path, "resumed", resume_from_checkpoint="latest", **kw)
    assert "optimizer step 2" in capsys.readouterr().out.split("Resuming from ")[1].splitlines()[0]
    same_weights(full, resumed, rtol=1e-6)
    assert [r["loss"] for r in train_steps(resumed)] == [r["loss"] for r in train_steps(full)]
    _, plain = run_in_process(tmp_path, "plain", **{**kw, "activation_checkpointing": False})
    same_weights(plain, resumed)


def test_torch_compile_with_checkpointing_trains_the_same_model(tmp_path, tiny_bert, shared_runs):
    """torch.compile (inductor, CPU) over non-reentrant checkpointed layers: the losses and weights of the eager run
    without checkpointing."""
    kw = dict(model_name_or_path=tiny_bert, **BERT)
    _, eager = shared_runs.in_process(**kw)
    _, compiled = run_in_process(tmp_path, "compiled", torch_compile=True, activation_checkpointing=True, **kw)
    assert [r["loss"] for r in train_steps(compiled)] == pytest.approx([r["loss"] for r in train_steps(eager)],
                                                                         rel=1e-5)
    same_weights(eager, compiled, rtol=1e-4)  # inductor fuses kernels: float sums in another order


def test_lora_gradients_reach_the_adapters(tmp_path, tiny_bert):
    """With a frozen embedding, checkpointed layers would see inputs that need no grad: without
    enable_input_require_grads the adapters would not train. The adapters equal the run without it."""
    from safetensors.torch import load_file

    kw = dict(model_name_or_path=tiny_bert, use_peft=True, lora_r=4, lora_dropout=0.0, **BERT)
    _, plain = run_in_process(tmp_path, "plain", **kw)
    _, ckpt = run_in_process(tmp_path, "ckpt", activation_checkpointing=True, **kw)
    a, b = load_file(str(plain / "adapter_model.safetensors")), load_file(str(ckpt / "adapter_model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7)
    assert any("lora_B" in k and a[k].abs().sum() > 0 for k in a)


@pytest.mark.integration
def test_two_gloo_processes_same_weights(tmp_path, tiny_bert):
    """DDP with non-reentrant checkpointing: the same weights as without it (reentrant would break DDP)."""
    args = ["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--max_train_samples", "24",
            "--max_eval_samples", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--max_steps", "3", "--max_length", "32", "--disable_dropout", "--learning_rate", "2e-3",
            "--warmup_steps", "0", "--eval_strategy", "no", "--mixed_precision", "no"]
    runs = {}
    for name, extra in (("plain", []), ("ckpt", ["--activation_checkpointing"])):
        runs[name] = tmp_path / name
        result = launch(args + ["--output_dir", str(runs[name]), *extra], num_processes=2)
        assert result.returncode == 0, result.stderr[-3000:]
    same_weights(runs["plain"], runs["ckpt"])
