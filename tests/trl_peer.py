"""Our preference task and its peer, TRL 1.16's ``DPOTrainer``, run on the same tokenised pairs in the same order
from the same initial weights: shared by ``tests/test_dpo_peer.py`` (equal numbers) and ``bench/bench_dpo_peer.py``
(speed). Needs ``trl`` (the test extra pins 1.16.0); tests import it after ``pytest.importorskip("trl")``.

How TRL is given the same run (trl 1.16.0, ``trl/trainer/dpo_trainer.py``):

- the pairs: ``DPOTrainer._prepare_dataset`` (lines 1036-1142) renders and tokenises raw rows and accepts no
  tokenised ones (with no ``prompt`` column it runs ``extract_prompt``, which needs ``chosen``/``rejected``), so
  ``PeerDPOTrainer`` returns our tokenised pairs as they are, cut to the columns its ``DataCollatorForPreference``
  (lines 86-207) reads: ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` (``trl_pair``); its collator pads them;
- the order: ``_get_train_sampler`` (transformers' ``Trainer``) returns the order our run trained the pairs in,
  recorded through the ``build=`` seam of ``finetune.backends.accelerate.train`` (as ``finetune verify`` uses it);
  both record the pairs of every micro-batch they compute (``our_pairs``, ``their_pairs``) for the caller to check;
- the weights: both load the same model directory; both create a LoRA adapter after ``set_seed(seed)`` (ours:
  ``builders.build_components``; TRL: line 559, then ``get_peft_model`` at line 664), which gives the same initial
  adapter (the test checks it);
- the precision: ``DPOConfig`` sets ``bf16=True`` and ``gradient_checkpointing=True`` by default (``base_config.py``
  line 108; ``dpo_config.py``'s notes). bf16 autocast runs on a CPU too: left on, logps/* differ from ours by
  ~1e-5 and the gradient norm by ~1e-3 (relative, measured), so ``trl_config`` sets it off (fp32, as ours);
  checkpointing changes no value here (measured) and is off, as ours;
- what it logs: the loss terms of ``_compute_loss`` (lines 1285-1612: sigmoid 1388, hinge 1391, ipo 1395-1404),
  each micro-batch's mean over its pairs (line 1528) divided by the window's micro-batches (``loss_is_scaled_for_ga
  = False``, line 494; transformers 5.24 ``Trainer.training_step`` divides by ``current_gradient_accumulation_steps``,
  ``trainer.py`` lines 1885 and 2119), summed over the window; ``rewards/*`` and ``logps/*`` each micro-batch's
  mean (lines 1580-1601), averaged over the window's micro-batches by ``log`` (line 1701);
- the precomputed reference: ``_precompute_ref_logps`` (lines 1168-1241), in micro-batches of
  ``precompute_ref_batch_size`` or the training micro-batch, before training (in ``__init__``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trl

IGNORE_INDEX = -100


@dataclass
class Run:
    """One training run of either side."""

    steps: list[dict]  # per optimizer step, its log record: loss, grad_norm, rewards/*, logps/*, ...
    batches: list[list[tuple]]  # per micro-batch: its pairs as (prompt, chosen, rejected) token tuples (if recorded)
    initial: dict  # name -> tensor: the trainable parameters before the first step
    final: dict  # ... after the last
    precomputed: set = field(default_factory=set)  # TRL's: whether its micro-batches held reference log-probabilities
    precompute_seconds: float = 0.0  # TRL's: spent in _precompute_ref_logps


def trainable(model) -> dict:
    """Copies of ``model``'s trainable parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def trl_pair(chosen_ids, chosen_labels, rejected_ids, rejected_labels) -> dict:
    """One of our tokenised pairs (each side's ``input_ids`` and ``labels``, ``IGNORE_INDEX`` outside its trained
    tokens) as the ``prompt_ids``/``chosen_ids``/``rejected_ids`` of TRL's collator, which trains every token after
    the prompt, as ours does (``data.preference._encode_completion``: the "\\n" after ``<|im_end|>`` included).
    Raises ``ValueError`` where the pair does not fit TRL's format: trained tokens that are not one run to the end,
    or prompts that differ between the sides (ours cuts a long prompt per side, to fit its completion)."""
    out = {}
    for side, ids, labels in (("chosen", chosen_ids, chosen_labels), ("rejected", rejected_ids, rejected_labels)):
        ids, labels = list(ids), list(labels)
        trained = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
        if not trained:
            raise ValueError(f"the {side} side trains no token")
        first, last = trained[0], trained[-1]
        if trained != list(range(first, last + 1)) or labels[first:last + 1] != ids[first:last + 1]:
            raise ValueError(f"the {side} side's trained tokens are not one run of its own tokens")
        if last != len(ids) - 1:
            raise ValueError(f"the {side} side has {len(ids) - last - 1} untrained tokens after its completion")
        if out.setdefault("prompt_ids", ids[:first]) != ids[:first]:
            raise ValueError("the sides' prompts differ (a prompt cut to fit --max_length): TRL's rows share one")
        out[f"{side}_ids"] = ids[first:last + 1]
    return out


def key(pair: dict) -> tuple:
    """A ``trl_pair`` as one hashable (prompt, chosen, rejected) tuple of token tuples."""
    return tuple(tuple(pair[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))


def our_pairs(batch: dict) -> list[tuple]:
    """One of our micro-batches (``PreferenceCollator``'s) -> its pairs as ``key`` tuples, padding removed."""
    pairs = []
    for i in range(batch["input_ids"].shape[0]):
        sides = []
        for prefix in ("", "rejected_"):
            keep = batch[f"{prefix}attention_mask"][i].bool()
            sides += [batch[f"{prefix}input_ids"][i][keep].tolist(), batch[f"{prefix}labels"][i][keep].tolist()]
        pairs.append(key(trl_pair(*sides)))
    return pairs


def their_pairs(inputs: dict) -> list[tuple]:
    """One of TRL's micro-batches (its collator's ``input_ids``, ``attention_mask``, ``completion_mask``: the chosen
    rows, then the rejected) -> its pairs as ``key`` tuples."""
    ids, attention, completion = inputs["input_ids"], inputs["attention_mask"].bool(), inputs["completion_mask"].bool()
    half = ids.shape[0] // 2
    return [(tuple(ids[i][attention[i] & ~completion[i]].tolist()), tuple(ids[i][completion[i]].tolist()),
             tuple(ids[half + i][completion[half + i]].tolist())) for i in range(half)]


def reset_accelerate_state() -> None:
    """Accelerate's state is process-wide: every in-process run (ours, TRL's Trainer) starts from a clean one."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def run_ours(argv: list[str], record: bool = True) -> tuple[Run, list[dict]]:
    """Our run of ``argv`` (``finetune train`` flags; the accelerate backend, in this process) and its tokenised
    training pairs as ``trl_pair`` rows, in the dataset's order. The ``build=`` seam of ``train`` keeps the initial
    weights and the model trained and, with ``record``, each micro-batch's pairs (``our_pairs``). Raises
    ``ValueError`` for pairs TRL's format cannot hold (``trl_pair``)."""
    from helpers import train_steps

    from finetune.backends import accelerate as backend
    from finetune.config import parse_config
    from finetune.lifecycle.resolve import resolve

    reset_accelerate_state()
    resolution = resolve(parse_config(argv))
    seen = {"batches": []}

    def build(config, recipe):
        built = backend.setup(config, recipe)
        seen.update(model=built.model, initial=trainable(built.model), dataset=built.train_dataset)
        if not record:
            return built
        loss = built.micro_batch_loss

        def recorded(model, batch):
            seen["batches"].append(our_pairs(batch))
            return loss(model, batch)

        return dataclasses.replace(built, micro_batch_loss=recorded)

    backend.train(resolution.config, resolution.recipe, build=build)
    dataset = seen["dataset"]
    rows = [trl_pair(*(dataset[i][c] for c in ("chosen_input_ids", "chosen_labels", "rejected_input_ids",
                                                "rejected_labels"))) for i in range(len(dataset))]
    return Run(train_steps(Path(resolution.config.output_dir)), seen["batches"], seen["initial"],
               trainable(seen["model"])), rows


def order_of(batches: list[list[tuple]], rows: list[dict]) -> list[int]:
    """The indices into ``rows`` of the pairs of ``batches`` (``Run.batches``), in their order (equal pairs taken
    in turn)."""
    where: dict = {}
    for index, row in enumerate(rows):
        where.setdefault(key(row), []).append(index)
    return [where[pair].pop(0) for batch in batches for pair in batch]


class PeerDPOTrainer(trl.DPOTrainer):
    """``DPOTrainer`` on pairs tokenised already (``trl_pair`` rows), trained in ``order``; with ``record`` it
    records the pairs of every micro-batch it trains, and whether they held precomputed reference log-probabilities;
    it times its precomputation of them."""

    def __init__(self, *args, order: list[int], record: bool = True, **kwargs):
        self.order, self.record = order, record
        self.batches, self.precomputed, self.precompute_seconds = [], set(), 0.0
        super().__init__(*args, **kwargs)

    def _prepare_dataset(self, dataset, *args, **kwargs):
        return dataset  # tokenised already, in the columns of TRL's collator (see the module docstring)

    def _precompute_ref_logps(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super()._precompute_ref_logps(*args, **kwargs)
        finally:
            self.precompute_seconds += time.perf_counter() - start

    def _get_train_sampler(self, train_dataset=None):
        return self.order

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.record and model.training:
            self.batches.append(their_pairs(inputs))
            self.precomputed.add("ref_chosen_logps" in inputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def trl_config(output_dir, **arguments) -> trl.DPOConfig:
    """A ``DPOConfig`` for a run beside ours: ``arguments`` (batch, learning rate, seed, loss, ...) over fp32 without
    gradient checkpointing (``DPOConfig`` turns both on), no truncation (our pairs fit already), a record per
    optimizer step, nothing saved or reported."""
    defaults = dict(bf16=False, gradient_checkpointing=False, max_length=None, logging_steps=1, save_strategy="no",
                    report_to="none", use_cpu=not torch.cuda.is_available(), num_train_epochs=1)
    return trl.DPOConfig(output_dir=str(output_dir), **{**defaults, **arguments})


def run_trl(model_dir: str, rows: list[dict], order: list[int], args: trl.DPOConfig, peft_config=None,
            record: bool = True) -> Run:
    """TRL's ``DPOTrainer`` (``PeerDPOTrainer``) on ``rows`` in ``order``, the model and tokenizer loaded from
    ``model_dir``, with ``args`` (``trl_config``) and, for LoRA, ``peft_config``."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reset_accelerate_state()
    trainer = PeerDPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                             train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=peft_config,
                             order=order, record=record)
    initial = trainable(trainer.model)
    trainer.train()
    return Run([r for r in trainer.state.log_history if "loss" in r], trainer.batches, initial,
               trainable(trainer.model), trainer.precomputed, trainer.precompute_seconds)
