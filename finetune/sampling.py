"""The training order: the length-grouped sampler, the accumulation windows (docs/design-notes.md#sampling)."""

from __future__ import annotations

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """transformers' ``LengthGroupedSampler`` (``group_by_length``), its order set by seed and epoch only."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        # batch_size: the global effective batch (samples per optimizer step), as in Trainer; lengths in tokens
        super().__init__(batch_size, lengths=lengths, generator=torch.Generator())
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:  # called by Accelerate's dataloader: resumes replay the same order
        """Select the epoch whose order ``__iter__`` yields."""
        self.epoch = epoch

    def __iter__(self):
        self.generator.manual_seed(self.seed + self.epoch)
        return super().__iter__()


def iter_windows(dataloader, gradient_accumulation_steps: int):
    """Accumulation windows: lists of N micro-batches (the last may be shorter), so items are counted first."""
    window = []
    for batch in dataloader:
        window.append(batch)
        if len(window) == gradient_accumulation_steps:
            yield window
            window = []
    if window:
        yield window
