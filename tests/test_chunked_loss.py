"""finetune.tasks.chunked_loss: the chunked causal-LM loss equals the plain path (full logits ->
CausalLM.loss_sum) in value and in every parameter's gradient, saves far less for backward, and the model
helper returns the hidden states and head of bare, peft-, Accelerate- and DDP-wrapped models."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import REPO

from finetune.planner.probes import saved_tensor_bytes
from finetune.tasks import IGNORE_INDEX, CausalLM
from finetune.tasks.chunked_loss import METHODS, causal_lm_hidden_and_head, chunked_causal_lm_loss_sum

VOCAB = 211  # prime: no chunk size divides it, nor the label-token counts below


def tiny_llama(tie=True, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, pad_token_id=0, **overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.train()
    return model


def make_batch(batch=3, seq=19, seed=1):
    """Right-padded rows (row 1 ends in padding), labels -100 on padding, in the middle of row 0 (a masked
    prompt) and at the end of row 2 (masked after some tokens): 37 label tokens."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (batch, seq), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 12:] = 0
    input_ids[1, 12:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[0, 4:9] = IGNORE_INDEX
    labels[2, 14:] = IGNORE_INDEX
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def loss_and_grads(model, compute):
    """(loss, {name: grad}) after back-propagating ``compute()`` x 0.37 (a scale, as the engine applies)."""
    model.zero_grad(set_to_none=True)
    loss = compute()
    (loss * 0.37).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def plain(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return CausalLM().loss_from_logits(model(**inputs).logits, batch["labels"])


def chunked(model, batch, chunk_size=7, method=None):
    hidden, head = causal_lm_hidden_and_head(model, batch)
    return chunked_causal_lm_loss_sum(hidden, head, batch["labels"], chunk_size, method=method)


def assert_same(reference, result, rtol=1e-5, atol_frac=1e-6):
    """Loss to ``rtol``; each gradient to ``rtol`` plus an absolute floor of ``atol_frac`` x its largest
    element (elements near zero carry rounding of the large ones)."""
    (loss_ref, grads_ref), (loss, grads) = reference, result
    torch.testing.assert_close(loss, loss_ref, rtol=rtol, atol=0)
    assert grads.keys() == grads_ref.keys()
    for name, grad_ref in grads_ref.items():
        atol = atol_frac * grad_ref.abs().max().item()
        torch.testing.assert_close(grads[name], grad_ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------------ equal to the plain path
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 1000])
def test_matches_plain_path_tied(method, chunk_size):
    model, batch = tiny_llama(), make_batch()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert int(CausalLM().count_labels(batch["labels"])) == 37  # prime: 5 and 16 do not divide it; 1000 exceeds it
    reference = loss_and_grads(model, lambda: plain(model, batch))
    result = loss_and_grads(model, lambda: chunked(model, batch, chunk_size, method))
    assert "model.embed_tokens.weight" in result[1]  # the tied weight: embedding + head gradients summed
    assert len(result[1]) == len(list(model.parameters()))
    assert_same(reference, result)


@pytest.mark.parametrize("method", METHODS)
def test_matches_plain_path_untied_with_bias(method):
    """An untied head with a bias, given as a Linear and as a bare weight (no bias)."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 19, 32, requires_grad=True)
    head = torch.nn.Linear(32, VOCAB, bias=True)
    labels = make_batch()["labels"]
    params = {"hidden": hidden, "weight": head.weight, "bias": head.bias}

    def run(compute):
        for p in params.values():
            p.grad = None
        loss = compute()
        (loss * 0.37).backward()
        return loss.detach(), {name: p.grad.clone() for name, p in params.items() if p.grad is not None}

    reference = run(lambda: CausalLM().loss_from_logits(head(hidden), labels))
    assert_same(reference, run(lambda: chunked_causal_lm_loss_sum(hidden, head, labels, 6, method=method)))
    no_bias = run(lambda: CausalLM().loss_from_logits(hidden @ head.weight.T, labels))
    assert_same(no_bias, run(lambda: chunked_causal_lm_loss_sum(hidden, head.weight, labels, 6, method=method)))


@pytest.mark.parametrize("method", METHODS)
def test_no_label_tokens(method):
    """Every label ignored: loss 0 and zero gradients, as the plain path gives."""
    model, batch = tiny_llama(), make_batch()
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    reference = loss_and_grads(model, lambda: plain(model, batch))
    result = loss_and_grads(model, lambda: chunked(model, batch, 4, method))
    assert result[0].item() == 0.0 and result[0].dtype == torch.float32
    assert_same(reference, result)


def test_without_grad_mode_computes_the_loss_only():
    model, batch = tiny_llama(), make_batch()
    with torch.no_grad():
        expected = plain(model, batch)
        for method in METHODS:
            loss = chunked(model, batch, 5, method)
            assert loss.grad_fn is None
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)


def test_fused_second_backward_raises_instead_of_rescaling():
    """"fused" scales its stored gradients in place: a second backward through the same graph must fail
    (autograd's version check), not return gradients scaled twice."""
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    loss = chunked_causal_lm_loss_sum(hidden, torch.nn.Linear(8, 13), torch.randint(0, 13, (2, 9)), 4)
    loss.backward(torch.tensor(2.0), retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace operation"):
        loss.backward()


def test_frozen_head_gets_no_gradient():
    """LoRA-style training freezes the (tied) head: only the hidden states' gradient is computed."""
    model, batch = tiny_llama(), make_batch()
    model.lm_head.weight.requires_grad_(False)
    reference = loss_and_grads(model, lambda: plain(model, batch))
    for method in METHODS:
        result = loss_and_grads(model, lambda: chunked(model, batch, 5, method))  # noqa: B023 - the lambda runs inside this iteration
        assert "model.embed_tokens.weight" not in result[1]
        assert_same(reference, result)


def assert_close_bf16(reference, result):
    """bf16 autocast: the loss to 1e-3 and each gradient to 2e-2 in relative norm (||g - g_ref|| / ||g_ref||).

    Both paths run the head's matmuls in bf16 (8 significant bits, a relative step of 2**-8 = 3.9e-3) and
    upcast the logits to fp32, but they round at different points: the chunks' matmuls have other shapes than
    the full one (another fp32 accumulation order before the rounding to bf16), the weight's gradient is summed
    over chunks in fp32 rather than produced by one bf16 matmul, and "fused" rounds softmax - one-hot to bf16
    before the incoming gradient scales it (the plain path scales first). So a gradient element can move by a
    few bf16 steps, and an element that is a sum with cancellation (a norm weight's gradient) by more, relative
    to itself: elementwise tolerances would have to be loose everywhere, while the relative norm stays near
    bf16's step (measured <= 7.5e-3 for "fused", bitwise equal for the hidden-state gradients of the other
    two; the plain path's own bf16-vs-fp32 difference is 3e-3 to 1e-2). The fp32 tests check the algebra to
    1e-5."""
    (loss_ref, grads_ref), (loss, grads) = reference, result
    torch.testing.assert_close(loss, loss_ref, rtol=1e-3, atol=0)
    assert grads.keys() == grads_ref.keys()
    for name, grad_ref in grads_ref.items():
        error = ((grads[name] - grad_ref).norm() / grad_ref.norm()).item()
        assert error <= 2e-2, (name, error)


@pytest.mark.parametrize("method", METHODS)
def test_bf16_autocast(method):
    """Under CPU bf16 autocast, with the loss in the same autocast context as the model (see
    ``assert_close_bf16`` for the tolerance)."""
    model, batch = tiny_llama(), make_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = loss_and_grads(model, lambda: plain(model, batch))
        result = loss_and_grads(model, lambda: chunked(model, batch, 5, method))
    assert_close_bf16(reference, result)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the matmul ran in bf16 (not fp32): far from fp32
        hidden, head = causal_lm_hidden_and_head(model, batch)
        in_bf16 = chunked_causal_lm_loss_sum(hidden, head, batch["labels"], 5, method=method)
    in_fp32 = chunked_causal_lm_loss_sum(hidden.float(), head, batch["labels"], 5, method=method)
    assert in_bf16.dtype == in_fp32.dtype == torch.float32 and in_bf16.item() != in_fp32.item()


# ------------------------------------------------------------------------------------------- memory
def test_saves_far_less_for_backward_at_a_large_vocabulary():
    """Vocabulary 49152, 8 x 512 tokens, hidden 16: the plain path saves the fp32 log-probabilities of every
    token (8 x 511 x 49152 x 4 bytes = 767 MiB); the chunked loss saves the hidden states and the weight
    (recompute) or their gradients (fused), a few MiB."""
    torch.manual_seed(0)
    vocab, hidden_size = 49152, 16
    hidden = torch.randn(8, 512, hidden_size, requires_grad=True)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    labels = torch.randint(0, vocab, (8, 512))
    logprob_bytes = 8 * 511 * vocab * 4
    plain_bytes = saved_tensor_bytes(lambda: CausalLM().loss_from_logits(head(hidden), labels))
    assert plain_bytes >= logprob_bytes
    weight_bytes = vocab * hidden_size * 4
    for method in ("fused", "recompute"):
        saved = saved_tensor_bytes(lambda: chunked_causal_lm_loss_sum(hidden, head, labels, 1024, method=method))  # noqa: B023 - the lambda runs inside this iteration
        # weight (recompute) or its gradient (fused), the selected hidden states or their gradient, and per
        # token: its target (int64), log-sum-exp (fp32), and the selection's mask and indices
        assert saved <= weight_bytes + hidden.numel() * 4 + 8 * 512 * 24, (method, saved)
        assert saved * 50 < plain_bytes, (method, saved, plain_bytes)


def test_one_chunk_of_logits_at_a_time():
    """The peak tensor memory of the loss's forward + backward (torch profiler) holds one chunk's fp32 logits,
    not two: each chunk's buffer is freed before the next is allocated, and the softmax runs in place."""
    sys.path.insert(0, str(REPO / "bench"))
    from bench_chunked_loss import peak_allocated_bytes

    torch.manual_seed(0)
    vocab, hidden_size, chunk = 49152, 16, 1024
    hidden = torch.randn(4, 512, hidden_size, requires_grad=True)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    labels = torch.randint(0, vocab, (4, 512))
    chunk_bytes = chunk * vocab * 4  # 192 MiB
    for method in ("fused", "recompute"):
        hidden.grad = head.weight.grad = None
        peak = peak_allocated_bytes(
            lambda: chunked_causal_lm_loss_sum(hidden, head, labels, chunk, method=method).backward())  # noqa: B023 - the lambda runs inside this iteration
        small = 2 * head.weight.numel() * 4 + 4 * hidden.numel() * 4 + 4 * 512 * 32  # gradients, selections
        assert chunk_bytes <= peak <= chunk_bytes + small, (method, peak / 2**20)


# ------------------------------------------------------------------------------------ model wrappers
def test_peft_lora_model():
    """A peft LoRA model: the hidden states come through PeftModel's forward, and the adapters' gradients
    match. With lm_head itself adapted, the head is a LoRA module: it is called (method "checkpoint", the
    default for a module)."""
    peft = pytest.importorskip("peft")
    batch = make_batch()
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                              init_lora_weights=False))
    reference = loss_and_grads(model, lambda: plain(model, batch))
    assert reference[1] and all("lora_" in name for name in reference[1])
    assert_same(reference, loss_and_grads(model, lambda: chunked(model, batch, 5, "fused")))

    model = peft.get_peft_model(tiny_llama(tie=False), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"],
                                                                       init_lora_weights=False))
    hidden, head = causal_lm_hidden_and_head(model, batch)
    assert not isinstance(head, torch.nn.Linear) or type(head) is not torch.nn.Linear
    with pytest.raises(ValueError, match="method='checkpoint'"):
        chunked_causal_lm_loss_sum(hidden, head, batch["labels"], 5, method="fused")
    reference = loss_and_grads(model, lambda: plain(model, batch))
    assert any("lm_head" in name for name in reference[1])
    assert_same(reference, loss_and_grads(model, lambda: chunked(model, batch, 5, None)))  # picks "checkpoint"


def test_accelerate_prepared_model_bf16():
    """``accelerator.prepare`` wraps the forward in autocast and converts its outputs to fp32; the hidden
    states come from inside that wrapper, and the loss runs in ``accelerator.autocast()``."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(tiny_llama())
    batch = make_batch()
    reference = loss_and_grads(model, lambda: plain(model, batch))

    def compute():
        hidden, head = causal_lm_hidden_and_head(model, batch)
        assert hidden.dtype == torch.float32  # the residual stream of an fp32 model stays fp32 under autocast
        with accelerator.autocast():
            return chunked_causal_lm_loss_sum(hidden, head, batch["labels"], 5)

    assert_close_bf16(reference, loss_and_grads(model, compute))


def test_ddp_wrapped_model(tmp_path):
    """DDP (one gloo process): the forward goes through DDP (its reducer is armed), with and without
    find_unused_parameters, and the gradients match."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        for find_unused in (False, True):
            model = DistributedDataParallel(tiny_llama(), find_unused_parameters=find_unused)
            batch = make_batch()
            reference = loss_and_grads(model, lambda: plain(model, batch))  # noqa: B023 - the lambda runs inside this iteration
            for _ in range(2):  # twice: a reducer left unfinished by the first backward would fail the second
                assert_same(reference, loss_and_grads(model, lambda: chunked(model, batch, 5, "fused")))  # noqa: B023 - the lambda runs inside this iteration
    finally:
        dist.destroy_process_group()


def test_refuses_logit_softcapping():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0)
    model = Gemma2ForCausalLM(config)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        causal_lm_hidden_and_head(model, make_batch())


def test_refuses_any_logit_transform_after_the_head():
    """Granite divides its logits by ``logits_scaling``: the check on the returned logits refuses it."""
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, logits_scaling=4.0)
    with pytest.raises(ValueError, match="differ from its output embedding"):
        causal_lm_hidden_and_head(GraniteForCausalLM(config), make_batch())
    config.logits_scaling = 1.0
    hidden, head = causal_lm_hidden_and_head(GraniteForCausalLM(config), make_batch())
    assert hidden.shape == (3, 19, 32) and head.weight.shape == (VOCAB, 32)


def test_refuses_a_compiled_model():
    """A whole-model torch.compile skips the hooks that take the hidden states: refused up front, also inside
    DDP-like and peft wrappers."""
    model = torch.compile(tiny_llama())
    with pytest.raises(ValueError, match="torch.compile"):
        causal_lm_hidden_and_head(model, make_batch())
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    wrapped.base_model.model = torch.compile(wrapped.base_model.model)
    with pytest.raises(ValueError, match="torch.compile"):
        causal_lm_hidden_and_head(wrapped, make_batch())


# --------------------------------------------------------------------------------------------- errors
def test_errors():
    hidden, head, labels = torch.randn(2, 5, 8), torch.nn.Linear(8, 11), torch.zeros(2, 5, dtype=torch.long)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="chunk_size"):
            chunked_causal_lm_loss_sum(hidden, head, labels, bad)
    with pytest.raises(ValueError, match="unknown method"):
        chunked_causal_lm_loss_sum(hidden, head, labels, method="nope")
    with pytest.raises(ValueError, match=r"\(batch, seq, hidden\)"):
        chunked_causal_lm_loss_sum(hidden[0], head, labels)
    with pytest.raises(ValueError, match="labels must be"):
        chunked_causal_lm_loss_sum(hidden, head, labels[:, :4])
    with pytest.raises(ValueError, match="vocab, hidden=8"):
        chunked_causal_lm_loss_sum(hidden, torch.nn.Linear(7, 11), labels)
    with pytest.raises(ValueError, match=r"\[0, 11\)"):
        chunked_causal_lm_loss_sum(hidden, head, labels.masked_fill(labels == 0, 11))
    with pytest.raises(ValueError, match=r"\[0, 11\)"):
        chunked_causal_lm_loss_sum(hidden, head, labels.masked_fill(labels == 0, -5))
    with pytest.raises(TypeError, match="dtype"):
        chunked_causal_lm_loss_sum(hidden.bfloat16(), head, labels)
    with pytest.raises(ValueError, match="output embedding"):
        causal_lm_hidden_and_head(torch.nn.Linear(2, 2), {})


def test_bench_smoke():
    result = subprocess.run([sys.executable, str(REPO / "bench" / "bench_chunked_loss.py"), "--smoke"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[2:]] == ["plain", *(f"{m} 13" for m in METHODS)]


@pytest.mark.parametrize("method", METHODS)
def test_fp16_weight_gradient_does_not_overflow(method):
    """fp16 autocast, 1,025 label tokens of which one differs from the rest, one hidden value of 80: the
    lm_head weight's gradient sums 1,025 tokens' (softmax - one-hot) x hidden, -71,680 on that entry, past
    fp16's 65504. The loss is divided by its tokens, as training does: the plain path's gradients arrive
    scaled by that and stay finite; the fused path summed its unscaled fp16 values in fp16 and got -inf, so
    every fp16 step would be skipped."""
    torch.manual_seed(0)
    vocab, size, tokens = 8, 4, 1025
    head = torch.nn.Linear(size, vocab, bias=False)
    with torch.no_grad():
        head.weight.zero_()
    hidden = torch.zeros(1, tokens + 1, size)
    hidden[..., 0] = 80.0
    labels = torch.zeros(1, tokens + 1, dtype=torch.long)
    labels[0, 5] = 3

    def weight_grad(loss_of):
        head.weight.grad = None
        with torch.autocast("cpu", dtype=torch.float16):
            loss_of().backward()
        return head.weight.grad.clone()

    plain_grad = weight_grad(lambda: CausalLM().loss_from_logits(head(hidden), labels) / tokens)
    chunked_grad = weight_grad(lambda: chunked_causal_lm_loss_sum(hidden, head, labels, 2048, method=method) / tokens)
    assert torch.isfinite(plain_grad).all() and plain_grad.abs().max() * tokens > 65504
    assert torch.isfinite(chunked_grad).all()
    torch.testing.assert_close(chunked_grad, plain_grad, rtol=2e-3, atol=1e-3)
