"""The training order: the length-grouped sampler, the accumulation windows (docs/design-notes.md#sampling)."""

from __future__ import annotations

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler

from finetune.elastic import trim_ids


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


def repeated_rows(local_micro_batch: int, micro_batch: int, num_processes: int, process_index: int,
                  dataset_length: int) -> int:
    """How many trailing rows of this process's ``local_micro_batch``-th micro-batch of an epoch (0-based) are
    repeats: on several processes Accelerate's sharded sampler (``even_batches``) completes the epoch's last
    micro-batches with samples from its start (accelerate 1.15 ``data_loader.py`` ``BatchSamplerShard.
    _iter_with_no_split``: global micro-batch i goes to process i mod P, and the order is continued from its
    beginning until every process has a full micro-batch). Those rows are the global positions past
    ``dataset_length`` (samples); they must not be trained or counted, or the last window would hold other samples
    than B x 1 gives. 0 on one process (the last micro-batch is short instead)."""
    if num_processes <= 1:
        return 0
    start = (local_micro_batch * num_processes + process_index) * micro_batch
    return micro_batch - max(0, min(micro_batch, dataset_length - start))


def window_repeats(first_micro_batch: int, micro_batches: int, micro_batch: int, num_processes: int,
                   process_index: int, dataset_length: int) -> int:
    """This process's repeated rows (``repeated_rows``) in a window of ``micro_batches`` micro-batches that starts
    at the epoch's ``first_micro_batch``-th: the rows not counted as samples."""
    return sum(repeated_rows(first_micro_batch + k, micro_batch, num_processes, process_index, dataset_length)
               for k in range(micro_batches))


def mask_repeats(batches, first_micro_batch: int, micro_batch: int, num_processes: int, process_index: int,
                 dataset_length: int, ignore_index: int):
    """``batches`` (an epoch's micro-batches from number ``first_micro_batch`` on) with each repeated row
    (``repeated_rows``) given ``ignore_index`` labels, so it adds no loss, gradient or item; the rows are kept
    (every process runs the same number of forward and backward passes); their sample ids, if the batch carries
    them (``elastic.SAMPLE_IDS``), are dropped."""
    for index, batch in enumerate(batches, start=first_micro_batch):
        repeats = repeated_rows(index, micro_batch, num_processes, process_index, dataset_length)
        if repeats:
            labels = batch["labels"].clone()
            labels[labels.shape[0] - repeats:] = ignore_index
            batch = trim_ids({**batch, "labels": labels}, repeats)
        yield batch
