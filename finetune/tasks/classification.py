"""Sequence classification: one label per text. Items = samples (docs/contributing.md#add-a-task-a-training-style)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DataCollatorWithPadding

from finetune.data.loading import IGNORE_INDEX, tokenize_datasets
from finetune.metrics import load_metric
from finetune.models.loading import load_classifier
from finetune.models.quantization import bnb_config
from finetune.tasks.base import StatelessTask, split_labels


class SequenceClassification(StatelessTask):
    """One label per text. Items = samples (labels that are not ``IGNORE_INDEX``: ``StatelessTask.count_labels``).
    Metrics: the recipe's (accuracy, F1, ...) and eval_loss. Its data, rows and step are ``StatelessTask``'s."""

    name = "sequence-classification"
    loss_name = "cross-entropy per sample"
    counts_tokens = False
    packs = False  # one label per sample: nothing to pack
    no_packing_reason = "one label per sample, nothing to pack"
    chunked_loss = False
    chat = False
    class_labels = True
    peft_task_type = "SEQ_CLS"
    pipeline_tag = "text-classification"  # the model card's (the Hub's pipeline name)
    probe_label_names = ["a", "b"]

    def load_model(self, config, label_names):
        """``AutoModelForSequenceClassification`` with named labels (see ``finetune.models.loading.load_classifier``)."""
        return load_classifier(config.model_name_or_path, label_names, disable_dropout=config.disable_dropout,
                               attn_implementation=config.attn_implementation, quantization=bnb_config(config))

    def tokenize(self, raw, tokenizer, config, text_columns):
        """Truncate to ``max_length`` tokens, no padding; columns input_ids, attention_mask, labels."""
        return tokenize_datasets(raw, tokenizer, text_columns, config.max_length)

    def collator(self, tokenizer, pad_to_multiple_of):
        """Dynamic padding per micro-batch."""
        return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy (fp32), ``IGNORE_INDEX`` rows skipped. ``logits``: (batch, num_labels);
        ``labels``: (batch,)."""
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def eval_outputs(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        """Per-sample tensors to gather: (loss (batch,), prediction (batch,), label (batch,))."""
        inputs, labels = split_labels(batch)
        logits = model(**inputs).logits
        return F.cross_entropy(logits.float(), labels, reduction="none"), logits.argmax(dim=-1), labels

    def eval_metrics(self, gathered: list[torch.Tensor], metric_specs: dict) -> dict:
        """``eval_loss`` (mean per sample), ``eval_samples``, and each metric of ``metric_specs`` (name -> kwargs)."""
        losses, predictions, labels = gathered
        results = {"eval_loss": losses.mean().item() if len(losses) else float("nan"), "eval_samples": len(labels)}
        for name, kwargs in metric_specs.items():
            computed = load_metric(name).compute(predictions=predictions.tolist(), references=labels.tolist(), **kwargs)
            results.update({f"eval_{k}": v for k, v in computed.items()})
        return results

    def sequences(self, row: dict) -> dict:
        """One sequence, its ``input_ids``; trained: None (the label is trained, not a token)."""
        return {"": (row["input_ids"], None)}

    def probe_batch(self, micro_batch: int, length: int, vocab: int, device) -> dict:
        """Random token ids (micro_batch, length), a full attention mask, label 0 per row."""
        ids = torch.randint(0, vocab, (micro_batch, length), device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.zeros(micro_batch, dtype=torch.long, device=device)}
