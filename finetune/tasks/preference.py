"""Preference tuning (DPO and its per-pair relatives): items are pairs. A micro-batch holds P pairs: the chosen
side as ``input_ids``/``attention_mask``/``labels`` (so the loop's row bookkeeping, repeated rows included, counts
pairs) and the rejected side as ``rejected_*``; both sides run in one forward of 2P rows. The loss is the sum of
per-pair terms (``preference_loss``), which the loop divides by the window's pairs over every process.

The reference's log-probabilities come, in turn, from the batch (``ref_chosen_logps``/``ref_rejected_logps``:
precomputed), a frozen copy of the starting model (``reference_model``), or the policy with its LoRA adapter
disabled (peft's ``disable_adapter``)."""

from __future__ import annotations

import contextlib

import torch

from finetune.data.loading import IGNORE_INDEX
from finetune.errors import FinetuneError
from finetune.tasks.base import unwrapped
from finetune.tasks.causal_lm import CausalLM
from finetune.tasks.preference_loss import PAIR_METRICS, PreferenceLoss, pair_metric_sums
from finetune.tasks.sft import SFTCollator

_CAUSAL_LM = CausalLM()

REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
SIDES = ("input_ids", "attention_mask", "labels")


class PreferenceCollator:
    """Both sides of every pair through ``SFTCollator`` together (right padding, one length: the longest side in
    the micro-batch, rounded up to ``pad_to_multiple_of``), so that they stack into one forward. Precomputed
    reference log-probabilities, where the rows hold them, pass through as float64."""

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = None):
        self.pad = SFTCollator(tokenizer, pad_to_multiple_of)

    def __call__(self, features: list[dict]) -> dict:
        """``features``: rows of ``data.preference.PAIR_COLUMNS`` -> int64 tensors (pairs, seq): ``input_ids``,
        ``attention_mask``, ``labels`` (the chosen side) and ``rejected_input_ids``, ``rejected_attention_mask``,
        ``rejected_labels``; plus (pairs,) float64 ``REFERENCE_COLUMNS`` where present."""
        pairs = len(features)
        padded = self.pad([{"input_ids": f[f"{side}_input_ids"], "labels": f[f"{side}_labels"]}
                           for side in ("chosen", "rejected") for f in features])
        batch = {key: padded[key][:pairs] for key in SIDES}
        batch.update({f"rejected_{key}": padded[key][pairs:] for key in SIDES})
        for column in REFERENCE_COLUMNS:
            if features and column in features[0]:
                batch[column] = torch.tensor([f[column] for f in features], dtype=torch.float64)
        return batch


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its trained tokens (nats, fp32: labels shifted by one,
    ``IGNORE_INDEX`` skipped) and their count: the causal LM's per-sample loss (``CausalLM.eval_from_logits``),
    negated. ``logits``: (rows, seq, vocab); ``labels``: (rows, seq)."""
    loss, tokens = _CAUSAL_LM.eval_from_logits(logits, labels)
    return -loss, tokens


def both_sides(batch: dict) -> dict:
    """The 2P-row forward inputs: the chosen rows, then the rejected rows (``labels`` included)."""
    return {key: torch.cat([batch[key], batch[f"rejected_{key}"]]) for key in SIDES}


class PreferenceTask:
    """Pairwise preference tuning of a causal LM against a reference. ``loss``: the per-pair loss
    (``PreferenceLoss``: ``loss_type``, ``beta``, ``label_smoothing``); ``reference_model``: a frozen copy of the
    starting model, or None (the batch's precomputed columns, else the policy with its adapter disabled)."""

    name = "preference"
    counts_tokens = False
    packs = False
    chunked_loss = False
    chat = True
    class_labels = False
    peft_task_type = "CAUSAL_LM"
    probe_label_names = None

    def __init__(self, loss: PreferenceLoss | None = None, reference_model=None):
        self.loss = loss or PreferenceLoss()
        self.reference_model = reference_model

    def count(self, batch: dict) -> torch.Tensor:
        """Pairs in the micro-batch: rows whose chosen side trains a token (a repeated row, masked by the loop,
        trains none and counts 0). A 0-d int tensor."""
        return (batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=1).sum()

    def samples(self, batch: dict) -> int:
        """Pairs: the rows of ``labels``."""
        return batch["labels"].shape[0]

    def _reference_logps(self, model, inputs: dict, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) reference log-probabilities, (pairs,) each, without gradients: from a frozen copy,
        or from the policy with its LoRA adapter disabled. Raises ``FinetuneError`` where neither is there."""
        labels = inputs["labels"]
        forward = {k: v for k, v in inputs.items() if k != "labels"}
        policy = unwrapped(model)
        if self.reference_model is not None:
            reference, context = self.reference_model, contextlib.nullcontext()
        elif hasattr(policy, "disable_adapter"):  # peft's PeftModel: the base under the adapter
            reference, context = policy, policy.disable_adapter()
        else:
            raise FinetuneError("the preference task has no reference: pass precomputed reference log-probabilities, "
                                "a frozen copy of the starting model, or train a LoRA adapter (--use_peft).")
        with torch.no_grad(), context:
            logps, _ = sequence_logps(reference(**forward).logits, labels)
        return logps[:pairs], logps[pairs:]

    def forward(self, model, batch: dict) -> dict:
        """The policy's and the reference's log-probabilities of both sides, (pairs,) each, and each side's
        trained tokens: ``chosen_logps``, ``rejected_logps``, ``ref_chosen_logps``, ``ref_rejected_logps``,
        ``chosen_tokens``, ``rejected_tokens``; ``real``: 1 for a pair the loop trains, 0 for a repeated one."""
        pairs = batch["labels"].shape[0]
        inputs = both_sides(batch)
        logps, tokens = sequence_logps(model(**{k: v for k, v in inputs.items() if k != "labels"}).logits,
                                       inputs["labels"])
        if all(column in batch for column in REFERENCE_COLUMNS):
            reference = tuple(batch[column].to(logps.dtype) for column in REFERENCE_COLUMNS)
        else:
            reference = self._reference_logps(model, inputs, pairs)
        real = (batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=1).to(logps.dtype)
        return {"chosen_logps": logps[:pairs], "rejected_logps": logps[pairs:], "ref_chosen_logps": reference[0],
                "ref_rejected_logps": reference[1], "chosen_tokens": tokens[:pairs].to(logps.dtype),
                "rejected_tokens": tokens[pairs:].to(logps.dtype), "real": real}

    def _terms(self, out: dict) -> torch.Tensor:
        """The per-pair loss terms (pairs,) of ``forward``'s output."""
        return self.loss(*(out[k] for k in ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps",
                                            "chosen_tokens", "rejected_tokens")))

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        """Forward both sides, then the per-pair loss terms summed over the pairs the loop trains (0-d)."""
        out = self.forward(model, batch)
        return (self._terms(out) * out["real"]).sum()

    def metric_sums(self, model, batch: dict) -> dict[str, float]:
        """TRL's ``rewards/*`` and ``logps/*`` summed over the micro-batch's trained pairs, without gradients
        (``preference_loss.pair_metric_sums``): divided by the window's pairs they are the window's means."""
        with torch.no_grad():
            out = self.forward(model, batch)
        keep = out["real"].bool()
        return pair_metric_sums(self.loss.beta, *(out[k][keep] for k in ("chosen_logps", "rejected_logps",
                                                                          "ref_chosen_logps", "ref_rejected_logps")))

    def eval_outputs(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        """Per pair, to gather: the loss term, the chosen and rejected rewards, and the two log-probabilities."""
        out = self.forward(model, batch)
        beta = self.loss.beta
        return (self._terms(out), beta * (out["chosen_logps"] - out["ref_chosen_logps"]),
                beta * (out["rejected_logps"] - out["ref_rejected_logps"]), out["chosen_logps"], out["rejected_logps"])

    def eval_metrics(self, gathered: list[torch.Tensor], metric_specs: dict | None = None) -> dict:
        """``eval_loss`` (mean over held-out pairs), TRL's ``eval_rewards/*`` and ``eval_logps/*`` means, and
        ``eval_samples`` (pairs); NaN for an empty set."""
        if not gathered or not len(gathered[0]):
            return {"eval_loss": float("nan"), "eval_samples": 0, **{f"eval_{k}": float("nan") for k in PAIR_METRICS}}
        terms, chosen, rejected, chosen_logps, rejected_logps = (t.double() for t in gathered)
        pairs = len(terms)
        values = (chosen, rejected, (chosen > rejected).double(), chosen - rejected, chosen_logps, rejected_logps)
        return {"eval_loss": float(terms.sum()) / pairs, "eval_samples": pairs,
                **{f"eval_{k}": float(v.sum()) / pairs for k, v in zip(PAIR_METRICS, values)}}

    def trained_positions(self, row: dict) -> list[bool]:
        """The chosen side's trained tokens (its completion and end-of-turn token)."""
        return [label != IGNORE_INDEX for label in row["chosen_labels"]]

    def probe_batch(self, micro_batch: int, length: int, vocab: int, device) -> dict:
        """Random pairs: ``micro_batch`` pairs of two ``length``-token sides, every token trained but the first."""
        batch = {}
        for prefix in ("", "rejected_"):
            ids = torch.randint(0, vocab, (micro_batch, length), device=device)
            batch.update({f"{prefix}input_ids": ids, f"{prefix}attention_mask": torch.ones_like(ids),
                          f"{prefix}labels": ids})
        return batch
