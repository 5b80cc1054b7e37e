"""The task seam: a training style is one ``Task`` (docs/contributing.md#add-a-task). Everything that differs
between training styles is asked of the task: its data (files, row checks, tokenization, collation), its forward
and summed loss over a micro-batch (``loss_sum(model, batch)``), the items the loop divides by (``count``), its
evaluation, its per-step metrics (``take_metric_sums``), what it derives from the built model (``attach``: a
reference), what ``finetune check-data`` reports of its data (``data_findings``, ``sequences``), and capability
facts (``counts_tokens``, ``packs``, ``chunked_loss``, ``chat``, ``class_labels``, ``peft_task_type``). No module
outside ``finetune/tasks/`` branches on a task's name or class."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from finetune.data.loading import IGNORE_INDEX  # noqa: F401 - the label value every loss skips; re-exported here


@dataclass
class Finding:
    """A problem ``finetune check-data`` looks for in a task's raw rows (``Task.data_findings``): ``name`` (its line
    in the report), the ``rows`` it was found in (file and line, else split and index; the side where it matters),
    ``fatal`` (it makes the run wrong: exit 1 unless ``--accept_problems``) and ``note`` (one line: what it does to
    training, and the fix)."""

    name: str
    rows: list[str] = field(default_factory=list)
    fatal: bool = False
    note: str = ""


class Task(Protocol):
    """What a training style provides. Units: a micro-batch is a dict of tensors ``(batch, ...)`` holding
    ``labels``; items are what the loss is a mean over (samples, label tokens, pairs); counts are 0-d tensors."""

    name: str  # a recipe's TASK
    counts_tokens: bool  # items are label tokens (the log counts trained tokens)
    packs: bool  # --packing/--padding_free may pack its samples (finetune.data.packing)
    no_packing_reason: str  # why not, where it does not (the refusal's words)
    chunked_loss: bool  # --loss_chunk_size may compute its loss in chunks (finetune.tasks.chunked_loss)
    chat: bool  # rows are conversations rendered with the chat template (TRL's formats)
    class_labels: bool  # one class label per sample (stratified hold-out, label names, label counts)
    peft_task_type: str  # peft's ``TaskType`` name for LoRA
    pipeline_tag: str  # the model card's pipeline (the Hub's name: text-classification, text-generation)
    probe_label_names: list[str] | None  # label names of the planner's probe model
    step_metrics: tuple[str, ...]  # names of the per-step metrics take_metric_sums gives, in its order

    def for_run(self, config) -> "Task":
        """The task a run of ``config`` uses (its own instance where the config sets its loss, else ``self``)."""

    def load_model(self, config, label_names): ...

    def load_files(self, train_file: str, validation_file: str | None, text_columns, cache_dir):
        """``--train_file``/``--validation_file`` as a ``DatasetDict`` (train, validation)."""

    def check_rows(self, split) -> None:
        """Raise ``FinetuneError`` naming the first row of ``split`` that cannot be trained on."""

    def tokenize(self, raw, tokenizer, config, text_columns): ...

    def collator(self, tokenizer, pad_to_multiple_of): ...

    def attach(self, model, tokenized, collator, config, main_process_first, device, precision="no"):
        """What the task derives from the built model before training (a preference task's reference); returns the
        tokenized ``DatasetDict`` the run trains on (with precomputed columns, where the task adds any). ``device``:
        where to compute; ``precision``: as the run computes ("no", "fp16", "bf16")."""

    def keep(self, output_dir) -> None:
        """Write what ``attach`` derived for the run's directory (a preference task's precomputed reference
        log-probabilities) into ``output_dir``, once it is prepared (``lifecycle.RunState.open``: after
        ``--overwrite_output_dir`` cleared it), by the processes that write it."""

    def item_lengths(self, dataset) -> list[int]:
        """Tokens per item of a tokenized split, in order (``--train_sampling_strategy group_by_length``)."""

    def card_settings(self, config) -> list[tuple[str, object]]:
        """Rows the model card's hyperparameter table adds for this task ((setting, value) pairs)."""

    def resident_bytes(self) -> int:
        """Bytes the task keeps beside the model while training (a preference task's frozen reference copy), for the
        planner's memory estimate."""

    def take_metric_sums(self) -> torch.Tensor | None:
        """The task's own per-step metric sums over the micro-batches ``loss_sum`` computed since the last call (a 1-d
        float64 tensor the loop sums over processes and divides by the window's items), or None."""

    def count(self, batch: dict) -> torch.Tensor:
        """The micro-batch's items (a 0-d int tensor); rows masked as repeats count 0."""

    def samples(self, batch: dict) -> int:
        """The micro-batch's samples (rows of its ``labels``)."""

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        """Forward ``batch`` through ``model`` and return the loss summed over its items (0-d)."""

    def model_inputs(self, batch: dict) -> dict:
        """The model's forward arguments of a micro-batch (a preference pair's two sides stacked as rows)."""

    def plain_loss_sum(self, model, forward, batch: dict) -> torch.Tensor:
        """``loss_sum`` without gradients' concerns: from ``forward`` (``model`` or its forward without accelerate's
        autocast wrapper), fp32 logits, no auxiliary loss (``finetune verify``'s loss after the last update)."""

    def eval_outputs(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        """Per-sample tensors to gather (no gradients)."""

    def eval_metrics(self, gathered: list[torch.Tensor], metric_specs: dict) -> dict: ...

    def data_findings(self, raw, tokenizer, config) -> tuple[dict, list[Finding]]:
        """``finetune check-data``'s look at the raw splits (a ``DatasetDict``: train, validation) before they are
        tokenized with ``tokenizer`` under ``config``: the splits without the rows training would stop on (each named
        in a fatal finding), and the task's own ``Finding``s, each listed even where no row has it. Raises
        ``FinetuneError`` for a malformed row (as ``check_rows``)."""

    def sequences(self, row: dict) -> dict[str, tuple[list[int], list[bool] | None]]:
        """The token sequences of a tokenized row, by name ("" for a task with one; a pair's "chosen" and
        "rejected"), each as (token ids, which of them the loss trains: None where a label, not a token, is)."""

    def probe_batch(self, micro_batch: int, length: int, vocab: int, device) -> dict:
        """A worst-case micro-batch of ``micro_batch`` rows of ``length`` tokens for the planner's probes."""


class SingleRunTask:
    """The per-run parts of ``Task`` for a task that holds nothing of a run (classification, causal LM, SFT): the
    same object for every run, nothing attached, no per-step metrics of its own, one ``input_ids`` sequence per
    item, no rows of its own in the card; its forward takes the batch less its labels, its loss is the task's
    ``loss_from_logits``."""

    step_metrics: tuple[str, ...] = ()

    def for_run(self, config):
        """The task for a run of ``config``: this one (nothing of it depends on the config)."""
        return self

    def attach(self, model, tokenized, collator, config, main_process_first, device, precision="no"):
        """Nothing to derive from the built model: ``tokenized`` unchanged."""
        return tokenized

    def keep(self, output_dir) -> None:
        """Nothing derived to write."""

    def item_lengths(self, dataset) -> list[int]:
        """Tokens per item of a tokenized split (``--train_sampling_strategy group_by_length``)."""
        return [len(ids) for ids in dataset["input_ids"]]

    def card_settings(self, config) -> list[tuple[str, object]]:
        """Rows the model card's hyperparameter table adds for this task: none."""
        return []

    def resident_bytes(self) -> int:
        """Bytes the task keeps beside the model while training: none."""
        return 0

    def take_metric_sums(self):
        """No per-step metrics of its own: None."""
        return None

    def model_inputs(self, batch: dict) -> dict:
        """The model's forward arguments of a micro-batch: all but its ``labels``."""
        return split_labels(batch)[0]

    def plain_loss_sum(self, model, forward, batch: dict) -> torch.Tensor:
        """The loss summed over the batch's items from ``forward`` (``model``, or its forward without accelerate's
        autocast wrapper), in fp32, without an auxiliary loss (``finetune verify``'s loss after the last update)."""
        inputs, labels = split_labels(batch)
        return self.loss_from_logits(forward(**inputs).logits.float(), labels)


def split_labels(batch: dict) -> tuple[dict, torch.Tensor]:
    """``batch`` without its ``labels`` (a new dict: the model's inputs), and the labels."""
    inputs = dict(batch)
    return inputs, inputs.pop("labels")


def unwrapped(model):
    """``model`` without its wrappers (DDP, accelerate's: each holds the wrapped model as ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def auxiliary_loss_sum(outputs, model, items: torch.Tensor):
    """A mixture-of-experts model's router load-balancing loss for this micro-batch, weighted by its ``items``:
    ``router_aux_loss_coef x aux_loss x items`` (a 0-d tensor), or None where the model returns no ``aux_loss``
    (transformers computes it when the config's ``output_router_logits`` is set) or its coefficient is 0. The
    loop divides by the window's items, so each micro-batch's term counts by its share of the window's items;
    with one micro-batch this is the model's own ``loss = CE + coef x aux_loss`` (transformers 5.23
    ``modeling_mixtral.py`` ``MixtralForCausalLM.forward``)."""
    aux = getattr(outputs, "aux_loss", None)
    if aux is None:
        return None
    coefficient = float(getattr(getattr(unwrapped(model), "config", None), "router_aux_loss_coef", 0.0) or 0.0)
    return coefficient * aux * items if coefficient else None


def with_auxiliary(loss_sum: torch.Tensor, outputs, model, items: torch.Tensor) -> torch.Tensor:
    """``loss_sum`` plus the model's ``auxiliary_loss_sum``, if any."""
    auxiliary = auxiliary_loss_sum(outputs, model, items)
    return loss_sum if auxiliary is None else loss_sum + auxiliary
