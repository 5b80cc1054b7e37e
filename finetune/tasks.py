"""The two kinds of task, classification and causal LM: model, tokenization, collation, items, loss, metrics.
``loss_sum`` sums per-item losses; the engine divides by the window's items (docs/design-notes.md#tasks)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import DataCollatorWithPadding

from finetune.data import load_causal_lm, load_classifier, tokenize_datasets, tokenize_for_causal_lm
from finetune.metrics import load_metric

IGNORE_INDEX = -100  # label value that the loss skips (padding, and the prompt where masked)


class SequenceClassification:
    """One label per text. Items = samples. Metrics: the recipe's (accuracy, F1, ...) and eval_loss."""

    name = "sequence-classification"

    def load_model(self, config, label_names):
        """``AutoModelForSequenceClassification`` with named labels (see ``finetune.data.load_classifier``)."""
        return load_classifier(config.model_name_or_path, label_names, disable_dropout=config.disable_dropout,
                               attn_implementation=config.attn_implementation)

    def tokenize(self, raw, tokenizer, config, text_columns):
        """Truncate to ``max_length`` tokens, no padding; columns input_ids, attention_mask, labels."""
        return tokenize_datasets(raw, tokenizer, text_columns, config.max_length)

    def collator(self, tokenizer, pad_to_multiple_of):
        """Dynamic padding per micro-batch."""
        return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """Items in a micro-batch: its samples, less those labelled ``IGNORE_INDEX`` (rows that repeat a sample
        at an epoch's end: ``sampling.mask_repeats``). ``labels``: (batch,). Returns a 0-d int tensor."""
        return (labels != IGNORE_INDEX).sum()

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy (fp32), ``IGNORE_INDEX`` rows skipped. ``logits``: (batch, num_labels);
        ``labels``: (batch,)."""
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def eval_outputs(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-sample tensors to gather: (loss (batch,), prediction (batch,), label (batch,))."""
        return F.cross_entropy(logits.float(), labels, reduction="none"), logits.argmax(dim=-1), labels

    def eval_metrics(self, gathered: list[torch.Tensor], metric_specs: dict) -> dict:
        """``eval_loss`` (mean per sample), ``eval_samples``, and each metric of ``metric_specs`` (name -> kwargs)."""
        losses, predictions, labels = gathered
        results = {"eval_loss": losses.mean().item() if len(losses) else float("nan"), "eval_samples": len(labels)}
        for name, kwargs in metric_specs.items():
            computed = load_metric(name).compute(predictions=predictions.tolist(), references=labels.tolist(), **kwargs)
            results.update({f"eval_{k}": v for k, v in computed.items()})
        return results


class CausalLMCollator:
    """Right-pads ``input_ids``; ``labels`` = ``input_ids`` with ``IGNORE_INDEX`` where ``attention_mask`` is 0."""

    def __init__(self, tokenizer, pad_to_multiple_of=None):
        self.tokenizer, self.pad_to_multiple_of = tokenizer, pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict:
        """[{"input_ids": [int, ...]}, ...] -> tensors (batch, seq): input_ids, attention_mask, labels."""
        # right padding: a token's position does not depend on its batch, which exact accumulation needs
        batch = self.tokenizer.pad({"input_ids": [f["input_ids"] for f in features]}, padding=True,
                                   pad_to_multiple_of=self.pad_to_multiple_of, padding_side="right",
                                   return_tensors="pt")
        # masked by the mask, not pad_token_id: real eos tokens stay in the loss when pad = eos (SmolLM2)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        return batch


class CausalLM:
    """Next-token prediction. Items = label tokens (labels shifted by one, ``IGNORE_INDEX`` skipped)."""

    name = "causal-lm"

    def load_model(self, config, label_names=None):
        """``AutoModelForCausalLM`` from a hub id or model directory, or a de-quantized ``.gguf`` file."""
        return load_causal_lm(config.model_name_or_path, disable_dropout=config.disable_dropout,
                              attn_implementation=config.attn_implementation)

    def tokenize(self, raw, tokenizer, config, text_columns):
        """One sample per text (<= ``max_length`` tokens), or ``block_size``-token blocks of the joined texts."""
        return tokenize_for_causal_lm(raw, tokenizer, text_columns, config.max_length, config.block_size)

    def collator(self, tokenizer, pad_to_multiple_of):
        """Dynamic right padding; ``labels`` = ``input_ids`` with ``IGNORE_INDEX`` on padding."""
        return CausalLMCollator(tokenizer, pad_to_multiple_of)

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """Label tokens the shifted loss covers: ``labels[:, 1:] != IGNORE_INDEX``. ``labels``: (batch, seq)."""
        return (labels[:, 1:] != IGNORE_INDEX).sum()

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed next-token cross-entropy (fp32) over label tokens. ``logits``: (batch, seq, vocab)."""
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    def eval_outputs(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-sample tensors to gather: (summed token loss (batch,), label tokens (batch,))."""
        token_losses = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), labels[:, 1:],
                                       ignore_index=IGNORE_INDEX, reduction="none")  # (batch, seq-1)
        return token_losses.sum(dim=1), (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)

    def eval_metrics(self, gathered: list[torch.Tensor], metric_specs: dict) -> dict:
        """``eval_loss`` (nats per label token, whole set), ``eval_perplexity``, ``eval_tokens``, ``eval_samples``."""
        loss_sums, counts = gathered
        tokens = int(counts.sum().item())
        loss = loss_sums.sum().item() / tokens if tokens else float("nan")
        return {"eval_loss": loss, "eval_perplexity": math.exp(loss) if loss < 700 else float("inf"),
                "eval_tokens": tokens, "eval_samples": len(counts)}
