"""The micro-batch loss both engines train on: the task's summed loss, or for causal LM the chunked loss."""

from __future__ import annotations

from finetune.chunked_loss import causal_lm_hidden_and_head, chunked_causal_lm_loss_sum
from finetune.engine import engine_for
from finetune.errors import FinetuneError
from finetune.tasks import CausalLM

DEFAULT_LOSS_CHUNK_SIZE = 1024  # label tokens per chunk on a CPU (measured: docs/benchmarks.md)


def loss_function(task, config, accelerator):
    """``summed_loss(model, batch, labels)``: the micro-batch's loss summed over its items (samples, or label
    tokens), which the loop divides by the window's items. Causal LM with ``--loss_chunk_size`` > 0 (default on
    a CPU): ``finetune.chunked_loss`` under ``accelerator.autocast()``; a model it cannot serve falls back to the
    plain loss, or raises ``FinetuneError`` if ``--loss_chunk_size`` was given."""
    chunk = config.loss_chunk_size
    if chunk is None:
        chunk = DEFAULT_LOSS_CHUNK_SIZE if accelerator.device.type == "cpu" else 0
    if not chunk or not isinstance(task, CausalLM):
        return lambda model, batch, labels: task.loss_sum(model(**batch).logits, labels)
    strict, fallback, engine = config.loss_chunk_size is not None, [], engine_for(accelerator)

    def summed_loss(model, batch, labels):
        if not fallback:
            try:
                if (refusal := engine.chunked_loss_refusal(model)) is not None:
                    raise ValueError(f"{refusal}, so the chunked loss cannot use it.")
                hidden, head = causal_lm_hidden_and_head(model, batch)
                with accelerator.autocast():
                    return chunked_causal_lm_loss_sum(hidden, head, labels, chunk)
            except ValueError as err:
                if strict:
                    raise FinetuneError(f"--loss_chunk_size {chunk}: {err} Use --loss_chunk_size 0.") from None
                fallback.append(str(err))
                if accelerator.is_main_process:
                    print(f"note: the chunked loss cannot serve this model ({err}); using the plain loss.")
        return task.loss_sum(model(**batch).logits, labels)

    return summed_loss
