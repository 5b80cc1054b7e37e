"""The training order: the length-grouped sampler, and the loop's accumulation windows."""

from __future__ import annotations

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """transformers' ``LengthGroupedSampler`` (what ``TrainingArguments(train_sampling_strategy=
    "group_by_length")`` uses) whose order depends on the seed and the epoch only.

    Each epoch: a seeded permutation, cut into mega-batches of ``50 x batch_size`` samples (fewer on small
    data), each sorted by length, longest first. ``batch_size`` is the global effective batch (samples per
    optimizer step), as in Trainer, so every window holds samples of similar length. ``lengths`` in tokens.
    ``set_epoch`` (called by Accelerate's dataloader) reseeds, so a resumed run and every process replay the
    same order.
    """

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        super().__init__(batch_size, lengths=lengths, generator=torch.Generator())
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order ``__iter__`` yields."""
        self.epoch = epoch

    def __iter__(self):
        self.generator.manual_seed(self.seed + self.epoch)
        return super().__iter__()


def iter_windows(dataloader, gradient_accumulation_steps: int):
    """Group a dataloader's micro-batches into accumulation windows: lists of N micro-batches, the
    last one possibly shorter. Prefetching a window lets the engine count its items before any backward."""
    window = []
    for batch in dataloader:
        window.append(batch)
        if len(window) == gradient_accumulation_steps:
            yield window
            window = []
    if window:
        yield window
