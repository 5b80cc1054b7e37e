"""Instruction tuning (SFT): TRL-format conversations rendered with the chat template (``finetune.data.chat``),
labels masked as TRL's SFTTrainer masks them (``--assistant_only_loss``, ``--completion_only_loss``); the causal-LM
task on them. Items = trained tokens."""

from __future__ import annotations

import math

import datasets
import torch

from finetune.data.chat import (
    check_conversation_rows,
    dropped_by_template,
    empty_completion,
    loss_on,
    rows_to_features,
)
from finetune.data.loading import IGNORE_INDEX, load_conversation_files, rows_named
from finetune.distributed import is_main_process
from finetune.errors import FinetuneError
from finetune.tasks.base import Finding
from finetune.tasks.causal_lm import CausalLM


class SFTCollator:
    """Right-pads ``input_ids`` (pad token) and ``labels`` (``IGNORE_INDEX``) to the micro-batch's longest
    sequence, rounded up to ``pad_to_multiple_of``; right padding keeps positions batch-independent."""

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = None):
        # the pad id's value is irrelevant (masked out of attention and loss); 0 if the tokenizer has none
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[dict]) -> dict:
        """``features``: [{"input_ids": [int] * n_i, "labels": [int] * n_i}, ...] -> int64 tensors of
        shape (batch, seq): input_ids, attention_mask, labels."""
        length = max((len(f["input_ids"]) for f in features), default=0)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(features), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(features), length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(features), length), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            if len(f["labels"]) != n:
                raise ValueError(f"feature {i}: {n} input_ids but {len(f['labels'])} labels")
            input_ids[i, :n] = torch.tensor(f["input_ids"], dtype=torch.long)
            labels[i, :n] = torch.tensor(f["labels"], dtype=torch.long)
            attention_mask[i, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class InstructionCausalLM(CausalLM):
    """The causal-LM task on conversations' labels (``chat.encode_row``): items = trained tokens. Generation metrics
    (ROUGE-L, exact match) come from ``generation_metrics``, which needs the raw prompts."""

    name = "sft"
    chat = True

    def load_files(self, train_file: str, validation_file: str | None, text_columns=None, cache_dir=None):
        """JSON-lines files in TRL's ``prompt``/``completion`` or ``messages`` format
        (``data.load_conversation_files``; ``text_columns`` unused)."""
        return load_conversation_files(train_file, validation_file, cache_dir)

    def check_rows(self, split) -> None:
        """Raise ``FinetuneError`` naming the first row that is in neither TRL format
        (``sft.check_conversation_rows``)."""
        check_conversation_rows(split)

    def for_run(self, config):
        """The task itself; ``FinetuneError`` for ``--add_eos``, which an SFT run cannot apply: its rows are rendered
        with the chat template, which ends each turn itself, and trl sft adds no eos to conversational rows (trl
        1.16 ``SFTTrainer._prepare_dataset``: "Add EOS token if needed: non-conversational only")."""
        if config.add_eos:
            raise FinetuneError("--add_eos is for causal-LM text rows: an SFT run renders every row with the chat "
                                "template, which ends each turn with its own end-of-turn token (trl sft adds no eos "
                                "to conversational rows either). Drop --add_eos.")
        return self

    def tokenize(self, raw, tokenizer, config, text_columns=None):
        """Every split of ``raw`` through ``rows_to_features``, masked under ``--assistant_only_loss`` and
        ``--completion_only_loss`` (``text_columns`` unused); says what the loss is on ("Loss on: ...")."""
        if is_main_process() and "train" in raw:
            trained = loss_on(tokenizer, raw["train"].column_names, config.assistant_only_loss,
                              config.completion_only_loss)
            print(f"Loss on: {trained}")
        return datasets.DatasetDict({split: rows_to_features(ds, tokenizer, config.max_length,
                                                             desc=f"Rendering conversations ({split})",
                                                             assistant_only_loss=config.assistant_only_loss,
                                                             completion_only_loss=config.completion_only_loss)
                                     for split, ds in raw.items()})

    def collator(self, tokenizer, pad_to_multiple_of):
        """``SFTCollator``: right padding, labels padded with ``IGNORE_INDEX``."""
        return SFTCollator(tokenizer, pad_to_multiple_of)

    def eval_metrics(self, gathered: list[torch.Tensor], metric_specs: dict | None = None) -> dict:
        """``eval_loss`` (nats per completion token), ``eval_perplexity``, ``eval_tokens``, ``eval_samples`` from
        the gathered (loss sum, label tokens) per sample; NaN loss and 0 counts for an empty set."""
        if not gathered or not len(gathered[0]):
            return {"eval_loss": float("nan"), "eval_perplexity": float("nan"), "eval_tokens": 0, "eval_samples": 0}
        loss_sums, counts = gathered[0], gathered[1]
        tokens = int(counts.sum().item())
        loss = loss_sums.sum().item() / tokens if tokens else float("nan")
        perplexity = float("nan") if math.isnan(loss) else math.exp(loss) if loss < 700 else float("inf")
        return {"eval_loss": loss, "eval_perplexity": perplexity, "eval_tokens": tokens, "eval_samples": len(counts)}

    def data_findings(self, raw, tokenizer, config) -> tuple:
        """Rows with an empty completion (``chat.empty_completion``; the encoder refuses them) set aside and named
        (fatal: training stops at the first); the other rows checked (``check_conversation_rows``: raises naming
        the first malformed one), then rendered: rows whose chat template drops a turn or a tool
        (``chat.dropped_by_template``; fatal: the model never sees them), each named with what is dropped."""
        kept, empty, turns, tools = datasets.DatasetDict(), [], [], []
        for split, rows in raw.items():
            names = rows_named(rows, split)
            columns = [c for c in ("prompt", "completion", "messages") if c in rows.column_names]
            flags = [empty_completion(row) for row in rows.select_columns(columns)]
            empty += [name for name, flag in zip(names, flags) if flag]
            kept[split] = rows.select([i for i, flag in enumerate(flags) if not flag]) if any(flags) else rows
            check_conversation_rows(kept[split])
            columns = [c for c in ("prompt", "completion", "messages", "conversations", "tools",
                                   "chat_template_kwargs") if c in rows.column_names]
            for name, flag, row in zip(names, flags, rows.select_columns(columns)):
                if flag:
                    continue
                dropped_turns, dropped_tools = dropped_by_template(tokenizer, {k: v for k, v in row.items()
                                                                               if v is not None})
                turns += [f"{name} ({', '.join(dropped_turns)})"] if dropped_turns else []
                tools += [f"{name} ({', '.join(dropped_tools)})"] if dropped_tools else []
        return kept, [Finding("empty completion", empty, fatal=True,
                              note="nothing to learn but the end-of-turn token, and training stops at such a row: "
                                   "fill in the completion or drop the row"),
                      Finding("chat template drops a turn", turns, fatal=True,
                              note="the rendered text lacks the turn's content, so the model never sees it: use a "
                                   "template that renders every role the data has (or merge the turn into another)"),
                      Finding("chat template drops a tool", tools, fatal=True,
                              note="the rendered text lacks the tool's name: the template ignores `tools`; use a "
                                   "tool-calling model's template, or drop the tools column")]

    def sequences(self, row: dict) -> dict:
        """One sequence, its ``input_ids``, trained where ``labels`` is not ``IGNORE_INDEX``."""
        return {"": (row["input_ids"], [label != IGNORE_INDEX for label in row["labels"]])}


SFT_TASK = InstructionCausalLM()
