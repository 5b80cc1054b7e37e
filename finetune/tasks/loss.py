"""The micro-batch loss both engines train on: the task's summed loss (``task.loss_sum``), or, for a task whose
loss the chunked cross-entropy serves (``task.chunked_loss``), the chunked loss."""

from __future__ import annotations

from finetune.engine import engine_for
from finetune.errors import FinetuneError
from finetune.tasks import split_labels, with_auxiliary
from finetune.tasks.chunked_loss import DEFAULT_CHUNK_SIZE, causal_lm_hidden_and_head, chunked_causal_lm_loss_sum


def loss_function(task, config, accelerator):
    """``summed_loss(model, batch)``: the micro-batch's loss summed over its items (samples, or label tokens;
    ``batch`` holds its ``labels``), which the loop divides by the window's items, plus a mixture-of-experts
    model's auxiliary loss (``tasks.with_auxiliary``). A task with ``chunked_loss`` under ``--loss_chunk_size`` > 0
    (default on a CPU): ``finetune.tasks.chunked_loss`` under ``accelerator.autocast()``; a model it cannot serve falls
    back to ``task.loss_sum``, or raises ``FinetuneError`` if ``--loss_chunk_size`` was given."""
    chunk = config.loss_chunk_size
    if chunk is None:
        chunk = DEFAULT_CHUNK_SIZE if accelerator.device.type == "cpu" else 0  # measured: docs/speed.md
    if not chunk or not task.chunked_loss:
        return task.loss_sum
    strict, fallback, engine = config.loss_chunk_size is not None, [], engine_for(accelerator)

    def summed_loss(model, batch):
        if not fallback:
            try:
                if (refusal := engine.chunked_loss_refusal(model)) is not None:
                    raise ValueError(f"{refusal}, so the chunked loss cannot use it.")
                inputs, labels = split_labels(batch)
                outputs = []
                hidden, head = causal_lm_hidden_and_head(model, inputs, outputs)
                with accelerator.autocast():
                    loss_sum = chunked_causal_lm_loss_sum(hidden, head, labels, chunk)
                return with_auxiliary(loss_sum, outputs[0], model, task.count(batch))
            except ValueError as err:
                if strict:
                    raise FinetuneError(f"--loss_chunk_size {chunk}: {err} Use --loss_chunk_size 0.") from None
                fallback.append(str(err))
                if accelerator.is_main_process:
                    print(f"note: the chunked loss cannot serve this model ({err}); using the plain loss.")
        return task.loss_sum(model, batch)

    return summed_loss
