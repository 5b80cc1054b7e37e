"""Preference tuning (DPO and its per-pair relatives): items are pairs. A micro-batch holds P pairs: the chosen
side as ``input_ids``/``attention_mask``/``labels`` (so the loop's row bookkeeping, repeated rows included, counts
pairs) and the rejected side as ``rejected_*``; both sides run in one forward of 2P rows. The loss is the sum of
per-pair terms (``preference_loss``), which the loop divides by the window's pairs over every process.

The reference's log-probabilities come, in turn, from the batch (``ref_chosen_logps``/``ref_rejected_logps``:
precomputed), a frozen copy of the starting model (``reference_model``), or the policy with its LoRA adapter
disabled (peft's ``disable_adapter``)."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import datasets
import torch

import finetune.tasks.reference as precomputed_reference
from finetune.data.loading import IGNORE_INDEX, load_conversation_files, rows_named
from finetune.data.preference import (
    PAIR_SIDES,
    PairCheck,
    check_pair,
    check_pair_rows,
    pair_prompt_and_reference,
    pairs_to_features,
)
from finetune.errors import FinetuneError
from finetune.models.loading import set_attention
from finetune.models.lora import ADAPTER_CONFIG, load_merged_adapter
from finetune.tasks.base import Finding, refuse_generation_flags, unwrapped
from finetune.tasks.causal_lm import CausalLM
from finetune.tasks.preference_loss import (
    CONSTANT_ON_TIES,
    PAIR_METRICS,
    PreferenceLoss,
    pair_metric_sums,
    pair_metric_vector,
)
from finetune.tasks.sft import SFTCollator

_CAUSAL_LM = CausalLM()

REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the precision as it runs -> the policy's autocast dtype
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


def pair_findings(checks: list[PairCheck], names: list[str], max_length: int, loss_type: str) -> list[Finding]:
    """``finetune check-data``'s preference findings from each row's ``preference.check_pair`` (``checks``) and
    name (``names``: file and line), as a run of ``--max_length`` ``max_length`` (tokens) and ``--loss_type``
    ``loss_type`` would meet them; the rows of a finding that only some sides have name those sides. Fatal: what
    training stops on, and identical sides (no preference to learn; a reward margin fixed at 0)."""
    def rows(test, sided: bool = False) -> list[str]:
        """The names of the rows where ``test(check)`` holds; ``sided``: it gives the sides, named after the row."""
        return [f"{name} ({', '.join(test(check))})" if sided else name
                for check, name in zip(checks, names) if test(check)]

    needed = max((t for c in checks for t in c.no_fit.values()), default=0)
    cut = max((t for c in checks for t in c.prompt_cut.values()), default=0)
    if loss_type in CONSTANT_ON_TIES:
        effect = f"and under --loss_type {loss_type} its gradient is 0: it only dilutes the window's mean"
    else:
        effect = (f"and under --loss_type {loss_type} its gradient is not 0 (the term reads each side's log-ratio), "
                  "yet it carries no preference")
    return [
        Finding("implicit prompt not a common prefix",
                rows(lambda c: c.implicit_prompt and [c.implicit_prompt.reason], sided=True), fatal=True,
                note="without a 'prompt' column the prompt is the turns both sides start with, and training stops at "
                     "such a row: start both sides with the same turns up to the answers, or add a 'prompt' column"),
        Finding("empty completion", rows(lambda c: c.empty, sided=True), fatal=True,
                note="nothing to learn but the end-of-turn token, and training stops at such a row: fill in the side "
                     "or drop the pair"),
        Finding(f"completion does not fit --max_length {max_length}", rows(lambda c: list(c.no_fit), sided=True),
                fatal=True, note=f"even with the prompt's last user turn emptied a side needs up to {needed} tokens; "
                                 f"completions are never cut, so training stops at such a row: raise --max_length to "
                                 f"{needed} or drop the pairs"),
        Finding("chosen equals rejected", rows(lambda c: c.identical), fatal=True,
                note="identical completions: the pair's reward margin is 0 whatever is learnt (rewards/accuracies "
                     f"counts it wrong) {effect}; drop such pairs"),
        Finding("prompt repeated in a response", rows(lambda c: c.repeats_prompt, sided=True),
                note="the prompt's text is inside the response, so the model learns to say the prompt again: keep only "
                     "the answer in 'chosen' and 'rejected'"),
        Finding(f"prompt cut by --max_length {max_length}", rows(lambda c: list(c.prompt_cut), sided=True),
                note=f"the prompt's last user turn is cut to fit (by up to {cut} tokens), the same for both sides: as "
                     "the longer side needs; completions never are"),
    ]


def frozen_copy(model):
    """A copy of ``model`` for the reference: eval mode, every parameter without gradients."""
    reference = copy.deepcopy(model).eval()
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference


def both_sides(batch: dict) -> dict:
    """The 2P-row forward inputs: the chosen rows, then the rejected rows (``labels`` included)."""
    return {key: torch.cat([batch[key], batch[f"rejected_{key}"]]) for key in SIDES}


class PreferenceTask:
    """Pairwise preference tuning of a causal LM against a reference. ``loss``: the per-pair loss
    (``PreferenceLoss``: ``loss_type``, ``beta``, ``label_smoothing``); ``reference_model``: a frozen copy of the
    starting model, or None (the batch's precomputed columns, else the policy with its adapter disabled).
    ``for_run(config)`` gives the run's own instance (its loss from the config); ``attach`` gives it its reference.
    ``loss_sum`` adds each micro-batch's ``PAIR_METRICS`` sums up until ``take_metric_sums`` takes them (per window)."""

    name = "preference"
    counts_tokens = False
    packs = False
    no_packing_reason = ("a pair's two sides are scored as one item; packing pairs is not proven exact here, "
                         "so it is refused")
    chunked_loss = False
    chat = True
    class_labels = False
    peft_task_type = "CAUSAL_LM"
    pipeline_tag = "text-generation"  # the model card's (the Hub's pipeline name)
    probe_label_names = None
    step_metrics = PAIR_METRICS  # take_metric_sums gives their sums (TRL's names)
    generates = False  # the pairs are in the data
    split_dependence = None  # every loss type is a mean over pairs: exact under any split
    mean_of_means = None  # verify's generic control
    forward_rows = 2  # rows a forward computes per item: both sides (the planner's probes)

    def __init__(self, loss: PreferenceLoss | None = None, reference_model=None, precompute: bool = False):
        self.loss = loss or PreferenceLoss()
        self.reference_model = reference_model
        self.precompute = precompute
        self._metric_sums = None  # (6,) float64: the window's PAIR_METRICS sums so far
        self.autocast_dtype = None  # the policy's autocast dtype under fp16/bf16 (attach)
        self.reference_files = {}  # precomputed log-probabilities to write once the output dir is prepared (keep)

    @property
    def loss_name(self) -> str:
        """What the loss is a mean of, for the model card: the run's DPO loss type per pair ("sigmoid DPO loss per
        pair")."""
        return f"{self.loss.loss_type} DPO loss per pair"

    def for_run(self, config) -> "PreferenceTask":
        """A new task for a run of ``config``: its ``--loss_type``, ``--beta``, ``--label_smoothing`` and
        ``--precompute_ref_log_probs`` (``PreferenceLoss`` raises ``FinetuneError`` for a refused combination;
        ``FinetuneError`` for SFT's ``--add_eos``, ``--assistant_only_loss``, ``--completion_only_loss``, which change
        nothing here, and ``base.refuse_generation_flags`` for GRPO's generation flags)."""
        refuse_generation_flags(config, self.name)
        for name in ("add_eos", "assistant_only_loss", "completion_only_loss"):
            if getattr(config, name) is not None and getattr(config, name) is not False:
                raise FinetuneError(f"--{name} has no effect on preference pairs: each side's completion is rendered "
                                    "with the chat template, which ends its turn itself, and all of it after the "
                                    f"prompt is scored (as trl dpo scores conversational pairs). Drop --{name}.")
        return PreferenceTask(PreferenceLoss(config.loss_type, config.beta, config.label_smoothing),
                              precompute=config.precompute_ref_log_probs)

    def load_model(self, config, label_names=None):
        """The causal LM of ``--model_name_or_path`` (``CausalLM.load_model``): a hub id, a model directory (an SFT
        run's, or its merged copy), a de-quantized ``.gguf`` file, or an SFT run's LoRA adapter directory
        (``adapter_config.json``), loaded on its base and merged in (``lora.load_merged_adapter``, peft's
        ``merge_and_unload``): the starting model, and so the reference (its frozen copy, or the base under a new
        ``--use_peft`` adapter), is the SFT model, never the base under its adapter; a new adapter names the SFT
        adapter directory as its base (``lora.load_merged_adapter``), and the run's final adapter the merged SFT model
        written beside it (``lora.save_adapter``). Raises ``FinetuneError`` for an adapter directory whose base
        cannot be loaded."""
        if (Path(config.model_name_or_path) / ADAPTER_CONFIG).is_file():
            try:
                model = load_merged_adapter(config.model_name_or_path)
            except (OSError, ValueError) as err:
                raise FinetuneError(f"--model_name_or_path {config.model_name_or_path} is a LoRA adapter whose base "
                                    f"could not be loaded: {str(err).splitlines()[0]} Point the adapter's "
                                    "base_model_name_or_path at its base, or pass the run's merged model "
                                    "(--merge_adapter writes <output_dir>/merged).") from None
            return set_attention(model, config.attn_implementation)
        return _CAUSAL_LM.load_model(config, label_names)

    def load_files(self, train_file: str, validation_file: str | None, text_columns=None, cache_dir=None):
        """JSON-lines files of TRL's preference rows (``loading.load_conversation_files(preference=True)``)."""
        return load_conversation_files(train_file, validation_file, cache_dir, preference=True)

    def check_rows(self, split) -> None:
        """Raise ``FinetuneError`` naming the first row that is no preference pair (``preference.check_pair_rows``)."""
        check_pair_rows(split)

    def tokenize(self, raw, tokenizer, config, text_columns=None):
        """Every split of ``raw`` through ``preference.pairs_to_features`` (``PAIR_COLUMNS``)."""
        return datasets.DatasetDict({split: pairs_to_features(ds, tokenizer, config.max_length,
                                                              desc=f"Rendering preference pairs ({split})")
                                     for split, ds in raw.items()})

    def collator(self, tokenizer, pad_to_multiple_of):
        """``PreferenceCollator``: both sides right-padded to one length."""
        return PreferenceCollator(tokenizer, pad_to_multiple_of)

    def attach(self, model, tokenized, collator, config, main_process_first, device, precision="no"):
        """Give the run its reference, once the model is built (``builders.build_components``), and return the
        tokenized splits the run trains on. ``--precompute_ref_log_probs``: every pair's reference
        log-probabilities added as ``REFERENCE_COLUMNS`` (``reference.precomputed``: read from
        ``<output_dir>/reference_logps``, or computed once and written there by ``keep``); else under ``--use_peft``
        the policy with its adapter disabled; else a frozen copy of ``model`` (eval mode, no gradients).
        ``precision`` (as it runs: "no", "fp16", "bf16"): the reference's forwards run under the autocast the
        policy's run under, so that at the first step the two compute the same numbers."""
        self.autocast_dtype = AUTOCAST.get(precision)
        if self.precompute:
            tokenized, self.reference_files = precomputed_reference.precomputed(self, model, tokenized, collator,
                                                                                config, device)
            return tokenized
        if not config.use_peft:
            self.reference_model = frozen_copy(model)
        return tokenized

    def keep(self, output_dir) -> None:
        """Write the precomputed reference log-probabilities ``attach`` computed into ``output_dir`` (prepared:
        ``reference.keep``); nothing for another reference."""
        precomputed_reference.keep(output_dir, self.reference_files)

    def note(self) -> str | None:
        """Nothing for the banner (the reference is said in the card)."""
        return None

    def item_lengths(self, dataset) -> list[int]:
        """Tokens per pair: its longer side (what the pair pads its micro-batch to), for group_by_length."""
        return [max(len(c), len(r)) for c, r in zip(dataset["chosen_input_ids"], dataset["rejected_input_ids"])]

    def card_settings(self, config) -> list[tuple[str, object]]:
        """The model card's preference rows: the loss (``--loss_type``, ``--beta``, ``--label_smoothing``) and where
        the reference's log-probabilities came from."""
        reference = ("precomputed before training (--precompute_ref_log_probs)" if config.precompute_ref_log_probs
                     else "the starting model with the LoRA adapter disabled" if config.use_peft
                     else "a frozen copy of the starting model")
        smoothing = f", label_smoothing {config.label_smoothing}" if config.label_smoothing else ""
        return [("preference loss (loss_type, beta)", f"{config.loss_type}, beta {config.beta}{smoothing}"),
                ("reference model", reference), ("items", "preference pairs (micro-batch and effective batch count pairs)")]

    def resident_bytes(self) -> int:
        """The frozen reference copy's parameter and buffer bytes (0 with the disabled adapter or precomputed
        log-probabilities)."""
        if self.reference_model is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (*self.reference_model.parameters(),
                                                           *self.reference_model.buffers()))

    def take_metric_sums(self) -> torch.Tensor | None:
        """The ``PAIR_METRICS`` sums of the micro-batches ``loss_sum`` computed since the last call ((6,) float64,
        this process's trained pairs), and start again; None if none."""
        sums, self._metric_sums = self._metric_sums, None
        return sums

    def rollout(self, model, window: list[dict], step: int) -> list[dict]:
        """The window as it is: the pairs are in the data."""
        return window

    def count(self, batch: dict) -> torch.Tensor:
        """Pairs in the micro-batch: rows whose chosen side trains a token (a repeated row, masked by the loop,
        trains none and counts 0). A 0-d int tensor."""
        return (batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=1).sum()

    def samples(self, batch: dict) -> int:
        """Pairs: the rows of ``labels``."""
        return batch["labels"].shape[0]

    def reference_logps(self, model, batch: dict, starting: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) reference log-probabilities of a micro-batch ``batch``, (pairs,) each, without
        gradients: from the frozen copy, or from the policy with its LoRA adapter disabled; ``starting``: ``model``
        is the starting model (before any step: ``reference.compute``), itself the reference without an adapter.
        Raises ``FinetuneError`` where there is no reference."""
        inputs, pairs = both_sides(batch), batch["labels"].shape[0]
        labels = inputs.pop("labels")
        policy = unwrapped(model)
        if self.reference_model is not None:
            reference, context = self.reference_model, contextlib.nullcontext()
            if next(reference.parameters()).device != labels.device:  # once: the policy was moved by the engine
                reference.to(labels.device)
        elif hasattr(policy, "disable_adapter"):  # peft's PeftModel: the base under the adapter
            reference, context = policy, policy.disable_adapter()
        elif starting:
            reference, context = policy, contextlib.nullcontext()
        else:
            raise FinetuneError("the preference task has no reference: pass precomputed reference log-probabilities, "
                                "a frozen copy of the starting model, or train a LoRA adapter (--use_peft).")
        autocast = torch.autocast(labels.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)
        with torch.no_grad(), context, autocast:
            logps, _ = sequence_logps(reference(**inputs).logits, labels)
        return logps[:pairs], logps[pairs:]

    def model_inputs(self, batch: dict) -> dict:
        """The forward's arguments: both sides stacked as 2P rows (``both_sides``), without labels."""
        inputs = both_sides(batch)
        inputs.pop("labels")
        return inputs

    def forward(self, model, batch: dict, policy=None) -> dict:
        """The policy's and the reference's log-probabilities of both sides, (pairs,) each, and each side's
        trained tokens: ``chosen_logps``, ``rejected_logps``, ``ref_chosen_logps``, ``ref_rejected_logps``,
        ``chosen_tokens``, ``rejected_tokens``; ``real``: 1 for a pair the loop trains, 0 for a repeated one.
        ``policy``: the policy's forward (default ``model``)."""
        pairs = batch["labels"].shape[0]
        logps, tokens = sequence_logps((policy or model)(**self.model_inputs(batch)).logits,
                                       both_sides(batch)["labels"])
        if all(column in batch for column in REFERENCE_COLUMNS):
            reference = tuple(batch[column].to(logps.dtype) for column in REFERENCE_COLUMNS)
        else:
            reference = self.reference_logps(model, batch)
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
        keep = out["real"].bool()
        sums = pair_metric_vector(self.loss.beta, *(out[k][keep] for k in ("chosen_logps", "rejected_logps",
                                                                            "ref_chosen_logps", "ref_rejected_logps")))
        self._metric_sums = sums if self._metric_sums is None else self._metric_sums + sums
        return (self._terms(out) * out["real"]).sum()

    def plain_loss_sum(self, model, forward, batch: dict) -> torch.Tensor:
        """The per-pair terms summed over the trained pairs, the policy's log-probabilities from ``forward``
        (``model`` or its forward without accelerate's autocast wrapper; ``finetune verify``'s loss after the last
        update); the reference as in training."""
        out = self.forward(model, batch, policy=forward)
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

    def prompt_and_reference(self, row: dict, row_name: str = "row") -> tuple[list[dict], str]:
        """(prompt messages, the chosen side's turns joined by newlines) of a raw preference row: what generation
        continues and scores against (``preference.pair_prompt_and_reference``; raises its ``FinetuneError``)."""
        return pair_prompt_and_reference(row, row_name)

    def eval_samples(self) -> list[dict]:
        """No generated completions to show (a pair's sides are the data's): []."""
        return []

    def data_findings(self, raw, tokenizer, config) -> tuple[datasets.DatasetDict, list[Finding]]:
        """Every pair encoded as training encodes it (``preference.check_pair``, ``config.max_length``) and
        ``pair_findings`` reported; the pairs training would stop on (an implicit prompt that is not a common prefix,
        an empty completion, a side that does not fit) set aside. Raises ``FinetuneError`` for a malformed row."""
        checks, names, kept = [], [], datasets.DatasetDict()
        for split, rows in raw.items():
            columns = [c for c in ("prompt", "chosen", "rejected") if c in rows.column_names]
            split_names = rows_named(rows, split)
            split_checks = [check_pair(tokenizer, {k: v for k, v in row.items() if v is not None}, config.max_length,
                                       split_names[i]) for i, row in enumerate(rows.select_columns(columns))]
            refused = [c.refused for c in split_checks]
            kept[split] = rows.select([i for i, r in enumerate(refused) if not r]) if any(refused) else rows
            checks, names = checks + split_checks, names + split_names
        return kept, pair_findings(checks, names, config.max_length, config.loss_type)

    def sequences(self, row: dict) -> dict[str, tuple[list[int], list[bool]]]:
        """Both sides, "chosen" and "rejected": their ids, trained where their labels are not ``IGNORE_INDEX`` (the
        completion and its end-of-turn token)."""
        return {side: (row[f"{side}_input_ids"], [label != IGNORE_INDEX for label in row[f"{side}_labels"]])
                for side in PAIR_SIDES}

    def probe_batch(self, micro_batch: int, length: int, vocab: int, device) -> dict:
        """Random pairs: ``micro_batch`` pairs of two ``length``-token sides, every token trained but the first (two
        sequences per item); with ``--precompute_ref_log_probs`` the reference columns too, else each step runs the
        reference's forward as training does."""
        batch = {}
        for prefix in ("", "rejected_"):
            ids = torch.randint(0, vocab, (micro_batch, length), device=device)
            batch.update({f"{prefix}input_ids": ids, f"{prefix}attention_mask": torch.ones_like(ids),
                          f"{prefix}labels": ids})
        if self.precompute:  # the reference's log-probabilities come with the rows: no reference forward
            batch.update({column: torch.zeros(micro_batch, dtype=torch.float64, device=device)
                          for column in REFERENCE_COLUMNS})
        return batch
