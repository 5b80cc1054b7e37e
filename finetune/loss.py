"""The micro-batch loss both engines train on: the task's summed loss, or for causal LM the chunked loss."""

from __future__ import annotations

from finetune.chunked_loss import DEFAULT_CHUNK_SIZE, causal_lm_hidden_and_head, chunked_causal_lm_loss_sum
from finetune.engine import engine_for
from finetune.errors import FinetuneError
from finetune.tasks import CausalLM


def auxiliary_loss_sum(outputs, model, task, labels):
    """A mixture-of-experts model's router load-balancing loss for this micro-batch, weighted by its items:
    ``router_aux_loss_coef x aux_loss x items`` (a 0-d tensor), or None where the model returns no ``aux_loss``
    (transformers computes it when the config's ``output_router_logits`` is set) or its coefficient is 0. The
    loop divides by the window's items, so each micro-batch's term counts by its share of the window's items;
    with one micro-batch this is the model's own ``loss = CE + coef x aux_loss`` (transformers 5.23
    ``modeling_mixtral.py`` ``MixtralForCausalLM.forward``)."""
    aux = getattr(outputs, "aux_loss", None)
    if aux is None:
        return None
    inner = model
    while hasattr(inner, "module"):  # DDP, accelerate's wrappers
        inner = inner.module
    coefficient = float(getattr(getattr(inner, "config", None), "router_aux_loss_coef", 0.0) or 0.0)
    return coefficient * aux * task.count(labels) if coefficient else None


def _with_auxiliary(loss_sum, outputs, model, task, labels):
    auxiliary = auxiliary_loss_sum(outputs, model, task, labels)
    return loss_sum if auxiliary is None else loss_sum + auxiliary


def loss_function(task, config, accelerator):
    """``summed_loss(model, batch, labels)``: the micro-batch's loss summed over its items (samples, or label
    tokens), which the loop divides by the window's items, plus a mixture-of-experts model's auxiliary loss
    (``auxiliary_loss_sum``). Causal LM with ``--loss_chunk_size`` > 0 (default on a CPU): ``finetune.chunked_loss``
    under ``accelerator.autocast()``; a model it cannot serve falls back to the plain loss, or raises
    ``FinetuneError`` if ``--loss_chunk_size`` was given."""
    chunk = config.loss_chunk_size
    if chunk is None:
        chunk = DEFAULT_CHUNK_SIZE if accelerator.device.type == "cpu" else 0  # measured: docs/benchmarks.md

    def plain(model, batch, labels):
        outputs = model(**batch)
        return _with_auxiliary(task.loss_sum(outputs.logits, labels), outputs, model, task, labels)

    if not chunk or not isinstance(task, CausalLM):
        return plain
    strict, fallback, engine = config.loss_chunk_size is not None, [], engine_for(accelerator)

    def summed_loss(model, batch, labels):
        if not fallback:
            try:
                if (refusal := engine.chunked_loss_refusal(model)) is not None:
                    raise ValueError(f"{refusal}, so the chunked loss cannot use it.")
                outputs = []
                hidden, head = causal_lm_hidden_and_head(model, batch, outputs)
                with accelerator.autocast():
                    loss_sum = chunked_causal_lm_loss_sum(hidden, head, labels, chunk)
                return _with_auxiliary(loss_sum, outputs[0], model, task, labels)
            except ValueError as err:
                if strict:
                    raise FinetuneError(f"--loss_chunk_size {chunk}: {err} Use --loss_chunk_size 0.") from None
                fallback.append(str(err))
                if accelerator.is_main_process:
                    print(f"note: the chunked loss cannot serve this model ({err}); using the plain loss.")
        return plain(model, batch, labels)

    return summed_loss
