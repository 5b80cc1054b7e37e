"""Chunked cross-entropy for causal LMs: the next-token loss from the final hidden states through the
output embedding, ``chunk_size`` label tokens at a time, so the (batch, seq, vocab) logits never exist.
Ideas from torchtune ``LinearCrossEntropyLoss``, TRL ``chunked_nll`` and Liger-Kernel's ``FusedLinearCrossEntropy``
(not their code). Why: docs/design-notes.md#the-chunked-loss; how, and measurements:
docs/speed.md#how-the-chunked-loss-works."""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils.checkpoint import checkpoint

from finetune.tasks import IGNORE_INDEX

# Label tokens per chunk: 1024 x 49152 fp32 logits = 192 MiB. Measured at SmolLM2-135M's shapes on 2 CPU cores
# (bench/bench_chunked_loss.py): 1024 ran in 0.93x the plain loss's time, 512 in 0.97x with 30% less peak
# memory, 256 in 1.06x (each chunk re-reads the vocab x hidden weight gradient, so small chunks cost time).
DEFAULT_CHUNK_SIZE = 1024
METHODS = ("fused", "recompute", "checkpoint")


# --------------------------------------------------------------------------------------------- loss
def chunked_causal_lm_loss_sum(hidden_states: torch.Tensor, lm_head, labels: torch.Tensor,  # noqa: C901 - over the budget; to split
                               chunk_size: int = DEFAULT_CHUNK_SIZE, *, method: str | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy over label tokens: a 0-d fp32 tensor in nats (0 with zero gradients if
    there are none), equal to float rounding, gradients included, to ``CausalLM().loss_from_logits(lm_head(hidden_states),
    labels)`` without the (batch, seq, vocab) logits.

    ``hidden_states``: (batch, seq, hidden), the input of ``lm_head`` (after the final norm). ``lm_head``: a
    ``torch.nn.Linear``, its (vocab, hidden) weight, or another (n, hidden) -> (n, vocab) module (peft wrapper,
    quantized linear: "checkpoint" only). ``labels``: (batch, seq) token ids, unshifted, ``IGNORE_INDEX`` skipped.
    ``chunk_size``: label tokens per chunk (chunk_size x vocab fp32 logits at a time). ``method``: "fused" (default
    for a Linear or weight), "recompute" or "checkpoint" (default for a module):
    docs/speed.md#how-the-chunked-loss-works.
    Call inside the model's autocast context to match its matmul dtype; the cross-entropy runs in fp32.

    Raises ``ValueError`` on inconsistent shapes, a ``chunk_size`` that is not a positive int, an unknown or
    inapplicable ``method``, or a label outside [0, vocab) other than ``IGNORE_INDEX``; ``TypeError`` if the
    hidden states' and the weight's dtypes differ outside autocast."""
    if not (isinstance(chunk_size, numbers.Integral) and not isinstance(chunk_size, bool) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be a positive int (label tokens per chunk), got {chunk_size!r}")
    if method is not None and method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be (batch, seq, hidden), got shape {tuple(hidden_states.shape)}")
    if labels.shape != hidden_states.shape[:2]:
        raise ValueError(f"labels must be (batch, seq) = {tuple(hidden_states.shape[:2])} like hidden_states, got "
                         f"{tuple(labels.shape)}")
    weight, bias, module = _head_parts(lm_head, hidden_states.shape[-1])
    if method is None:
        method = "fused" if module is None else "checkpoint"
    if module is not None and method != "checkpoint":
        raise ValueError(f"lm_head is a {type(module).__name__}, not a plain torch.nn.Linear or weight: only "
                         f"method='checkpoint' (which calls the module) applies to it")

    # Shift (position t predicts label t + 1) and keep the label tokens only, before any matmul.
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    hidden = hidden_states[:, :-1][keep]  # (n, hidden): a gather; its backward scatters into zeros
    targets = targets[keep]  # (n,)
    vocab = weight.shape[0] if weight is not None else None
    if targets.numel():
        low, high = torch.stack(torch.aminmax(targets)).tolist()
        if low < 0 or (vocab is not None and high >= vocab):
            raise ValueError(f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX}, got values in "
                             f"[{low}, {high}]")

    if module is not None:
        return _checkpointed(hidden, targets, chunk_size, module, None, None)
    compute_dtype = _compute_dtype(hidden, weight)
    if method == "checkpoint":
        return _checkpointed(hidden, targets, chunk_size, None, weight, bias)
    if method == "fused":
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (hidden, weight, bias))
        if not needs_grad:
            with torch.no_grad():
                return _forward_chunks(hidden, weight, bias, targets, chunk_size, compute_dtype)
        return _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_size, compute_dtype)
    return _RecomputeLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_size, compute_dtype)


def _head_parts(lm_head, hidden_size: int):
    """(weight, bias, None) for a plain Linear or a weight tensor; (None, None, module) for another module."""
    if isinstance(lm_head, torch.Tensor):
        weight, bias = lm_head, None
    elif type(lm_head) is torch.nn.Linear:  # exactly: subclasses (e.g. quantized linears) may not use .weight as is
        weight, bias = lm_head.weight, lm_head.bias
    elif isinstance(lm_head, torch.nn.Module):
        return None, None, lm_head
    else:
        raise ValueError(f"lm_head must be a torch.nn.Linear, a weight tensor or a module, got {type(lm_head).__name__}")
    if weight.dim() != 2 or weight.shape[1] != hidden_size:
        raise ValueError(f"lm_head weight must be (vocab, hidden={hidden_size}), got shape {tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"lm_head bias must be (vocab={weight.shape[0]},), got shape {tuple(bias.shape)}")
    return weight, bias, None


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` would compute in here: autocast's, else the (common) input dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and weight.is_floating_point():
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden_states ({hidden.dtype}) and the lm_head weight ({weight.dtype}) differ in dtype and "
                        f"autocast is off: run the loss in the model's autocast context, or cast one of them")
    return weight.dtype


def _chunk_logits(hidden_chunk, weight_c, bias_c) -> torch.Tensor:
    """fp32 logits (chunk, vocab) of one chunk; inputs already in the compute dtype."""
    if bias_c is None:
        logits = hidden_chunk @ weight_c.T
    else:
        logits = torch.addmm(bias_c, hidden_chunk, weight_c.T)
    return logits.float()


def _cast(tensor, dtype):
    return None if tensor is None else tensor.to(dtype)


def _forward_chunks(hidden, weight, bias, targets, chunk_size, compute_dtype, grads=None, need=(False,) * 3):
    """The summed loss (0-d fp32) over chunks; with ``grads``, also accumulates the gradients ``need`` asks for."""
    weight_c, bias_c = _cast(weight, compute_dtype), _cast(bias, compute_dtype)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, hidden.shape[0], chunk_size):
            hidden_chunk = hidden[start:start + chunk_size].to(compute_dtype)
            target_chunk = targets[start:start + chunk_size]
            probs = _chunk_logits(hidden_chunk, weight_c, bias_c)
            lse, target_logits = _softmax_(probs, target_chunk)
            total += (lse - target_logits).sum()
            if grads is not None:
                _chunk_grads(probs, target_chunk, hidden_chunk, weight_c, start, grads, need, None)
            del probs  # else it lives on while the next chunk's logits are allocated: two chunks at the peak
    return total


def _softmax_(logits: torch.Tensor, target_chunk: torch.Tensor):
    """Overwrites ``logits`` (fp32, chunk x vocab) with their softmax in place; returns each row's log-sum-exp
    and target logit, (chunk,) fp32."""
    target_logits = logits.gather(1, target_chunk[:, None]).squeeze(1)
    top = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(top).exp_()
    total = probs.sum(dim=1, keepdim=True)
    probs.div_(total)
    return (top + total.log()).squeeze(1), target_logits


def _chunk_grads(probs, target_chunk, hidden_chunk, weight_c, start, grads, need, scale) -> None:
    """Turns ``probs`` (softmax, overwritten) into d(loss)/d(logits) = scale x (softmax - one-hot) and
    accumulates the chunk's gradients into ``grads`` (grad_hidden rows from ``start``) where ``need`` says."""
    grad_hidden, grad_weight, grad_bias = grads
    rows = torch.arange(probs.shape[0], device=probs.device)
    probs[rows, target_chunk] -= 1.0
    if scale is not None:
        probs.mul_(scale)
    grad_logits = probs.to(weight_c.dtype)  # autocast's linear backward runs in its compute dtype too
    if need[0]:
        grad_hidden[start:start + probs.shape[0]] = grad_logits @ weight_c
    if need[1]:
        if grad_weight.dtype == grad_logits.dtype:
            grad_weight.addmm_(grad_logits.T, hidden_chunk)
        elif grad_logits.dtype == torch.float16:
            # unscaled (softmax - one-hot) summed over the chunk's tokens overflows fp16's 65504 where the
            # plain path's scaled gradients would not (a hidden value of 80 over 1,025 tokens): sum in fp32
            grad_weight.addmm_(probs.T, hidden_chunk.float())
        else:
            grad_weight += grad_logits.T @ hidden_chunk
    if need[2]:
        grad_bias += grad_logits.sum(0)


def _grad_buffers(hidden, weight, bias, need):
    """Zero buffers for the needed gradients: hidden's in its dtype, weight's and bias's in fp32 (fp64 stays)."""
    acc = lambda t: torch.zeros(t.shape, dtype=torch.float32 if t.dtype != torch.float64 else t.dtype,  # noqa: E731
                                device=t.device)
    return (torch.empty_like(hidden) if need[0] else None,
            acc(weight) if need[1] else None,
            acc(bias) if bias is not None and need[2] else None)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Loss and gradients in one pass over the chunks; backward scales the stored gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, compute_dtype):
        need = ctx.needs_input_grad[:3]
        grads = _grad_buffers(hidden, weight, bias, need)
        total = _forward_chunks(hidden, weight, bias, targets, chunk_size, compute_dtype, grads, need)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(*(g if g is not None else None for g in grads))
        return total

    @staticmethod
    def backward(ctx, grad_output):
        # Scaled in place: the buffers are this node's own. A second backward through the same graph
        # (retain_graph=True) fails autograd's version check instead of returning wrong gradients.
        results = []
        for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes):
            if grad is None:
                results.append(None)
                continue
            grad.mul_(grad_output)
            results.append(grad.to(dtype))
        return (*results, None, None, None)


class _RecomputeLinearCrossEntropy(torch.autograd.Function):
    """Loss only in forward (keeping each token's log-sum-exp); backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, compute_dtype):
        lse_all = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        weight_c, bias_c = _cast(weight, compute_dtype), _cast(bias, compute_dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                target_chunk = targets[start:start + chunk_size]
                logits = _chunk_logits(hidden[start:start + chunk_size].to(compute_dtype), weight_c, bias_c)
                lse, target_logits = _softmax_(logits, target_chunk)
                lse_all[start:start + chunk_size] = lse
                total += (lse - target_logits).sum()
                del logits  # before the next chunk's logits are allocated
        ctx.chunk_size, ctx.compute_dtype = chunk_size, compute_dtype
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, bias, targets, lse_all = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        grads = _grad_buffers(hidden, weight, bias, need)
        weight_c, bias_c = _cast(weight, ctx.compute_dtype), _cast(bias, ctx.compute_dtype)
        scale = grad_output.float()
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                hidden_chunk = hidden[start:start + ctx.chunk_size].to(ctx.compute_dtype)
                probs = _chunk_logits(hidden_chunk, weight_c, bias_c)
                probs.sub_(lse_all[start:start + ctx.chunk_size, None]).exp_()
                _chunk_grads(probs, targets[start:start + ctx.chunk_size], hidden_chunk, weight_c, start, grads, need,
                             scale)
                del probs  # before the next chunk's logits are allocated
        dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return (*(None if g is None else g.to(d) for g, d in zip(grads, dtypes)), None, None, None)


def _chunk_loss_linear(hidden_chunk, weight, bias, target_chunk):
    logits = F.linear(hidden_chunk, weight, bias)  # autocast applies as in the plain path's lm_head
    return F.cross_entropy(logits.float(), target_chunk, reduction="sum")


def _chunk_loss_module(hidden_chunk, target_chunk, module):
    return F.cross_entropy(module(hidden_chunk).float(), target_chunk, reduction="sum")


def _checkpointed(hidden, targets, chunk_size, module, weight, bias) -> torch.Tensor:
    """Sum of per-chunk losses, each chunk's (matmul + cross-entropy) under non-reentrant checkpointing."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    if hidden.shape[0] == 0:  # keep the graph connected, as the plain path's empty cross-entropy does
        return total + hidden.sum() * 0.0
    for start in range(0, hidden.shape[0], chunk_size):
        hidden_chunk, target_chunk = hidden[start:start + chunk_size], targets[start:start + chunk_size]
        if module is not None:
            loss = checkpoint(_chunk_loss_module, hidden_chunk, target_chunk, module, use_reentrant=False)
        else:
            loss = checkpoint(_chunk_loss_linear, hidden_chunk, weight, bias, target_chunk, use_reentrant=False)
        total = total + loss
    return total


# ------------------------------------------------------------------------------------- model side
def causal_lm_hidden_and_head(model: torch.nn.Module, batch: dict,
                              outputs_seen: list | None = None) -> tuple[torch.Tensor, torch.nn.Module]:
    """Run a causal LM's forward on ``batch`` (``labels`` ignored) and return ``(hidden_states, lm_head)``: the
    (batch, seq, hidden) input of ``get_output_embeddings()`` and that module, for ``chunked_causal_lm_loss_sum``.
    ``model``: a transformers causal LM, bare or wrapped by peft, ``accelerator.prepare``, DDP or DataParallel; the
    forward runs through the outermost wrapper, and a pre-hook hands the head the last position only (see
    docs/speed.md#how-the-chunked-loss-works). Raises ``ValueError`` if there is no output embedding, the model is
    ``torch.compile``'d as a whole, transforms logits after its head (Gemma ``final_logit_softcapping``, Cohere
    ``logit_scale``, ...), or does not call its head exactly once on (batch, seq, hidden) hidden states.
    ``outputs_seen``: a list the forward's outputs are appended to (a mixture-of-experts model's ``aux_loss``)."""
    inner = _unwrap(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no output embedding (get_output_embeddings() is None): not a "
                         f"causal LM with an lm_head")
    _refuse_unsupported(model, inner, head)
    if any(isinstance(m, OptimizedModule) for m in _wrapper_chain(model)):
        raise ValueError("the model is torch.compile'd as a whole: its compiled forward would not run the hooks that "
                         "take the hidden states. Compile the decoder layers only, or use the plain loss.")

    seen = []

    def take_hidden(module, args, kwargs):
        hidden = args[0] if args else kwargs["input"]
        seen.append({"hidden": hidden})
        if hidden.dim() != 3:
            return None  # refused below; let the forward finish
        if args:
            return (hidden[:, -1:], *args[1:]), kwargs
        return args, {**kwargs, "input": hidden[:, -1:]}

    def take_logits(module, args, kwargs, output):
        seen[-1]["logits"] = output

    handles = [head.register_forward_pre_hook(take_hidden, with_kwargs=True),
               head.register_forward_hook(take_logits, with_kwargs=True)]
    try:
        outputs = model(**{key: value for key, value in batch.items() if key != "labels"})
    finally:
        for handle in handles:
            handle.remove()
    if len(seen) != 1 or seen[0]["hidden"].dim() != 3:
        raise ValueError(f"{type(inner).__name__}'s forward called its output embedding {len(seen)} time(s)"
                         + (f" on a {seen[0]['hidden'].dim()}-d input" if len(seen) == 1 else "")
                         + "; the chunked loss needs exactly one call, on (batch, seq, hidden) hidden states, "
                         "through the module (not its weight)")
    if outputs_seen is not None:
        outputs_seen.append(outputs)
    returned = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    head_logits = seen[0]["logits"]
    if returned.shape != head_logits.shape or not torch.equal(returned.detach().float(), head_logits.detach().float()):
        raise ValueError(f"{type(inner).__name__} returns logits that differ from its output embedding's output (a "
                         f"logit transform after lm_head, such as softcapping or scaling): the chunked loss would "
                         f"train without it. Use the plain loss for this model.")
    return seen[0]["hidden"], head


def _wrapper_chain(model: torch.nn.Module) -> list:
    """``model`` and what it wraps, outermost first (``.module``, ``._orig_mod``, peft's ``get_base_model()``)."""
    chain = [model]
    while len(chain) < 16:
        m = chain[-1]
        inner = (m.__dict__.get("_modules", {}).get("module") or m.__dict__.get("_modules", {}).get("_orig_mod")
                 or (m.get_base_model() if hasattr(m, "get_base_model") else None))
        if inner is None or inner is m:
            break
        chain.append(inner)
    return chain


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside parallel, torch.compile and peft wrappers."""
    # keep_fp32_wrapper=True: unwrapping must not strip Accelerate's autocast forward from the model in place.
    inner = extract_model_from_parallel(model, keep_fp32_wrapper=True, keep_torch_compile=False)
    if hasattr(inner, "get_base_model"):  # peft PeftModel: the transformers model it adapts
        inner = extract_model_from_parallel(inner.get_base_model(), keep_fp32_wrapper=True, keep_torch_compile=False)
    return inner


def _refuse_unsupported(model, inner, head) -> None:
    softcap = getattr(getattr(inner, "config", None), "final_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(f"{type(inner).__name__} caps its final logits (final_logit_softcapping={softcap}): the "
                         f"chunked loss computes plain logits. Use the plain loss, or set final_logit_softcapping "
                         f"to None in the model config if training without the cap is intended.")
