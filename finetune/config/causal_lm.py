"""The causal LM and SFT section: the flags only a causal language model (``--recipe bbc-news-clm``, the SFT
recipes) takes: padding-free micro-batches, packing each window's own samples, and the chunked loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from finetune.config.flags import flag
from finetune.errors import FinetuneError


@dataclass
class CausalLMArguments:
    """Padding-free batches, packing (TRL's names) and the chunked loss of a causal LM."""

    padding_free: bool = flag(
        False,
        "Causal LM/SFT (TRL's name): each micro-batch's samples concatenated into one row, position_ids restarting "
        "per sample, no padding computed; the same samples and label tokens per step as padded micro-batches "
        "(docs/packing.md).",
        step=False, trainer=None,  # how a step is computed, not which samples form it
    )
    packing: bool = flag(
        False,
        "Causal LM/SFT (TRL's name): repack each optimizer step's own samples into padding-free micro-batches of at "
        "most --max_tokens_per_micro_batch tokens (--packing_strategy); which samples form a step never changes "
        "(docs/packing.md).",
        step=False, trainer=None,
    )
    packing_strategy: Literal["window_bfd"] = flag(
        "window_bfd",
        "With --packing: 'window_bfd', best-fit decreasing within each accumulation window. TRL's dataset-wide "
        "'bfd'/'wrapped' are not offered: they change which samples form a step.",
        step=False, trainer=None,
    )
    max_tokens_per_micro_batch: int | None = flag(
        None,
        "With --packing: positions per packed micro-batch, per process (its rows x its longest row's tokens; rows "
        "hold at most --max_length tokens). Default: micro-batch x max_length, the most a padded micro-batch "
        "computes (docs/packing.md).",
        step=False, trainer=None,
    )
    add_eos: bool = flag(
        False,
        "Causal LM: end each text with the tokenizer's eos token (unless it ends with it already) before it is cut "
        "at --max_length, as trl sft does for text rows (with --block_size texts are joined by eos already); the clm "
        "recipe's default. Refused for SFT and DPO, whose rows the chat template ends.",
        step=True, trainer=None,  # the tokens trained
    )
    assistant_only_loss: bool = flag(
        False,
        "SFT (TRL's name and default): train only the assistant turns of a conversation, through each turn's "
        "end-of-turn token: the template's generation-marked spans where it has them (as trl sft), else each turn "
        "found by rendering (where trl sft swaps in a known training template or errors). Off: every token of a "
        "messages row, as trl sft. The shipped SFT recipes' default: on.",
        step=True, trainer=None,  # the tokens trained
    )
    completion_only_loss: bool | None = flag(
        None,
        "SFT (TRL's name and default): on prompt-completion rows, train only what the template writes after the "
        "prompt (None: on for such rows, as trl sft; false: every token).",
        step=True, trainer=None,
    )
    loss_chunk_size: int | None = flag(
        None,
        "Causal LM: compute the loss from the final hidden states, this many label "
        "tokens at a time, never materialising the (batch, seq, vocab) logits (0: the "
        "plain full logits). Default: 1024 on a CPU, where it was measured faster and "
        "7x lighter; 0 on a GPU until measured there.",
        step=False, trainer=None,
    )

    def _check_causal_lm(self) -> None:
        """The chunked loss's chunk size (label tokens) and the ``--packing`` token budget."""
        if self.loss_chunk_size is not None and self.loss_chunk_size < 0:
            raise FinetuneError(f"--loss_chunk_size must be >= 0 (label tokens per chunk; 0 for the plain loss), "
                                f"got {self.loss_chunk_size}.")
        if self.max_tokens_per_micro_batch is not None and (not self.packing or self.max_tokens_per_micro_batch < 2):
            raise FinetuneError(f"--max_tokens_per_micro_batch is the --packing token budget: add --packing, and give "
                                f"at least 2 tokens (got {self.max_tokens_per_micro_batch}).")
