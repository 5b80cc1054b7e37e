"""Causal language modelling: next-token prediction over texts or blocks. Items = label tokens (labels shifted
by one, ``IGNORE_INDEX`` skipped): docs/contributing.md#add-a-task-a-training-style."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from finetune.data.loading import IGNORE_INDEX, tokenize_for_causal_lm
from finetune.errors import FinetuneError
from finetune.models.loading import load_causal_lm
from finetune.models.quantization import bnb_config
from finetune.tasks.base import StatelessTask, split_labels


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


class CausalLM(StatelessTask):
    """Next-token prediction. Items = label tokens (labels shifted by one, ``IGNORE_INDEX`` skipped:
    ``count_labels``). Its files, rows and step are ``StatelessTask``'s."""

    name = "causal-lm"
    loss_name = "cross-entropy per label token"
    counts_tokens = True
    packs = True
    no_packing_reason = ""  # it packs
    chunked_loss = True
    chat = False
    class_labels = False
    peft_task_type = "CAUSAL_LM"
    pipeline_tag = "text-generation"  # the model card's (the Hub's pipeline name)
    probe_label_names = None

    def load_model(self, config, label_names=None):
        """``AutoModelForCausalLM`` from a hub id or model directory, or a de-quantized ``.gguf`` file."""
        return load_causal_lm(config.model_name_or_path, disable_dropout=config.disable_dropout,
                              attn_implementation=config.attn_implementation, quantization=bnb_config(config))

    def for_run(self, config):
        """The task itself; ``FinetuneError`` for ``--assistant_only_loss`` or ``--completion_only_loss true`` on text
        rows, which have no turns or completion (trl 1.16's SFTTrainer raises for both on language-modeling data)."""
        for name in ("assistant_only_loss", "completion_only_loss"):
            if getattr(config, name):
                raise FinetuneError(f"--{name} is for conversational (SFT) rows: a causal-LM run trains text rows, "
                                    "which have no assistant turn or completion (trl sft refuses it too). Drop "
                                    f"--{name}, or train messages or prompt/completion rows.")
        return self

    def tokenize(self, raw, tokenizer, config, text_columns):
        """One sample per text (<= ``max_length`` tokens), or ``block_size``-token blocks of the joined texts;
        under ``--add_eos`` each text ends with the eos token."""
        return tokenize_for_causal_lm(raw, tokenizer, text_columns, config.max_length, config.block_size,
                                      add_eos=config.add_eos)

    def collator(self, tokenizer, pad_to_multiple_of):
        """Dynamic right padding; ``labels`` = ``input_ids`` with ``IGNORE_INDEX`` on padding."""
        return CausalLMCollator(tokenizer, pad_to_multiple_of)

    def count_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Label tokens the shifted loss covers: ``labels[:, 1:] != IGNORE_INDEX``. ``labels``: (batch, seq).
        Returns a 0-d int tensor."""
        return (labels[:, 1:] != IGNORE_INDEX).sum()

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed next-token cross-entropy (fp32) over label tokens. ``logits``: (batch, seq, vocab)."""
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    def eval_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-sample tensors of ``logits`` (batch, seq, vocab): (summed token loss (batch,), label tokens
        (batch,)); ``packing.eval_outputs`` scores each packed sample's cut-out logits with it."""
        token_losses = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), labels[:, 1:],
                                       ignore_index=IGNORE_INDEX, reduction="none")  # (batch, seq-1)
        return token_losses.sum(dim=1), (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)

    def eval_outputs(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        """Per-sample tensors to gather: ``eval_from_logits`` of the forward."""
        inputs, labels = split_labels(batch)
        return self.eval_from_logits(model(**inputs).logits, labels)

    def eval_metrics(self, gathered: list[torch.Tensor], metric_specs: dict) -> dict:
        """``eval_loss`` (nats per label token, whole set), ``eval_perplexity``, ``eval_tokens``, ``eval_samples``."""
        loss_sums, counts = gathered
        tokens = int(counts.sum().item())
        loss = loss_sums.sum().item() / tokens if tokens else float("nan")
        return {"eval_loss": loss, "eval_perplexity": math.exp(loss) if loss < 700 else float("inf"),
                "eval_tokens": tokens, "eval_samples": len(counts)}

    def sequences(self, row: dict) -> dict:
        """One sequence, its ``input_ids``, every token trained but the first (the labels are shifted by one)."""
        return {"": (row["input_ids"], [False] + [True] * (len(row["input_ids"]) - 1))}

    def probe_batch(self, micro_batch: int, length: int, vocab: int, device) -> dict:
        """Random token ids (micro_batch, length), a full attention mask, labels = the ids."""
        ids = torch.randint(0, vocab, (micro_batch, length), device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
