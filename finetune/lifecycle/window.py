"""The accumulation window: how many optimizer steps a run has (``StepPlan``), which micro-batches make a step (the
epoch's order, ``iter_windows``, the repeated rows at an epoch's end), what a window counts (``count_window``: its
items, samples and tokens over every process) and how Accelerate's sync counter is set for it
(``align_sync_counter``). Read with the loop (``finetune/backends/accelerate.py``), this is one optimizer step. Units: optimizer
steps, micro-batches per process, samples and tokens over all processes (docs/design-notes.md#sampling)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from finetune.errors import FinetuneError, together
from finetune.lifecycle.elastic import trim_ids, window_ids_hash


# ------------------------------------------------------------------------------------------ the run's length
@dataclass(frozen=True)
class StepPlan:
    """How long a run is, in optimizer steps (micro-batches per process)."""

    micro_batches_per_epoch: int  # per process
    steps_per_epoch: int  # ceil(micro-batches / N) x --num_iterations: an epoch's last window may be partial
    max_steps: int  # --max_steps if > 0, else ceil(epochs x steps per epoch)
    num_epochs: int  # epochs started: ceil(max_steps / steps per epoch)

    def steps(self, value: float | None) -> int | None:
        """A step value in optimizer steps: >= 1 as is, a ratio of ``max_steps`` rounded up; None stays None."""
        if value is None:
            return None
        return int(value) if value >= 1 else math.ceil(self.max_steps * value)  # TrainingArguments.get_warmup_steps

    def epoch_fraction(self, step: int) -> float:
        """Epochs completed after ``step`` optimizer steps (e.g. 1.5)."""
        return step / self.steps_per_epoch


def plan_steps(micro_batches_per_epoch: int, config) -> StepPlan:
    """The ``StepPlan`` for micro-batches per process per epoch; ``FinetuneError`` if there are none."""
    if micro_batches_per_epoch == 0:
        raise FinetuneError("the training set is empty after --max_train_samples; use more samples.")
    # --num_iterations (GRPO's mu): each window trains that many optimizer steps on one generation
    steps_per_epoch = math.ceil(micro_batches_per_epoch / config.gradient_accumulation_steps) * getattr(
        config, "num_iterations", 1)
    max_steps = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * steps_per_epoch)
    return StepPlan(micro_batches_per_epoch, steps_per_epoch, max_steps, math.ceil(max_steps / steps_per_epoch))


def micro_batches_per_process(num_samples: int, micro_batch: int, num_processes: int) -> int:
    """ceil(ceil(samples / micro-batch) / processes), as Accelerate's sharded dataloader yields them."""
    return math.ceil(math.ceil(num_samples / micro_batch) / num_processes)


# ------------------------------------------------------------------------------------------ the order
class EpochSeededLengthGroupedSampler(torch.utils.data.Sampler):
    """transformers' ``LengthGroupedSampler`` (``group_by_length``), its order set by seed and epoch only."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        # imported here: transformers.trainer_pt_utils costs seconds, and only group_by_length needs it
        from transformers.trainer_pt_utils import LengthGroupedSampler

        # batch_size: the global effective batch (samples per optimizer step), as in Trainer; lengths in tokens
        self.sampler = LengthGroupedSampler(batch_size, lengths=lengths, generator=torch.Generator())
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:  # called by Accelerate's dataloader: resumes replay the same order
        """Select the epoch whose order ``__iter__`` yields."""
        self.epoch = epoch

    def __iter__(self):
        self.sampler.generator.manual_seed(self.seed + self.epoch)
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


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


# ------------------------------------------------------------------------------------------ what a window counts
@dataclass
class WindowCounts:
    """An accumulation window's sizes, summed over all processes: loss ``items`` (samples, or label tokens
    for causal LM), ``samples``, non-padding ``input_tokens`` and ``padded_tokens`` (input positions)."""

    items: float
    samples: int
    input_tokens: int
    padded_tokens: int
    sample_ids: str | None = None  # the hash of the window's sample ids over all processes (elastic.window_ids_hash)


def tokens(batch: dict) -> tuple[int, int]:
    """(input tokens, computed positions) of a micro-batch: the ``attention_mask``'s ones and its size for a padded
    batch; ``input_ids.numel()`` less its ``padding`` (``packing.Rows``), and ``input_ids.numel()``, for a
    padding-free one."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum()), batch["attention_mask"].numel()
    return batch["input_ids"].numel() - getattr(batch, "padding", 0), batch["input_ids"].numel()


def empty_window_error(samples: int) -> FinetuneError:
    """The error for an accumulation window whose ``samples`` hold no trained item (no label token): its loss
    would divide by zero. Marked ``every_rank``: both backends count the window's items over every process first."""
    return together(FinetuneError(
        f"an accumulation window of {samples} samples has no trained tokens (every label is masked: texts of one "
        "token, or --max_length too small to keep a target). Raise --max_length (>= 2 for causal LM) or remove such "
        "samples (finetune check-data)."))


def count_window(window: list[dict], task, accelerator, repeats: int = 0, run: list[dict] | None = None) -> WindowCounts:
    """The window's ``WindowCounts`` over all processes, known before any backward: one all-reduce (a
    sync point) per window. ``repeats``: this process's rows that repeat samples at the epoch's end
    (``repeated_rows``), not counted. ``run``: the micro-batches actually computed when packing rebuilt the window
    (``packing.Packer``): tokens are counted on them, items and samples on ``window`` (equal either way: packing
    masks only labels the shift never trains). Both backends count their windows here. Raises ``FinetuneError``
    (on every process alike) for a window with no item. Takes the sample ids out of the batches where they carry
    them (``elastic.window_ids_hash``: a second all-reduce)."""
    device = accelerator.device
    sample_ids = window_ids_hash(window, accelerator)
    input_tokens, positions = map(sum, zip(*(tokens(b) for b in (run or window)), strict=True))
    local = torch.stack([sum(task.count(b) for b in window),
                         torch.tensor(sum(task.samples(b) for b in window) - repeats, device=device),
                         torch.tensor(input_tokens, device=device), torch.tensor(positions, device=device)])
    items, samples, input_tokens, padded = accelerator.reduce(local, "sum").tolist()
    if items == 0:
        raise empty_window_error(int(samples))
    return WindowCounts(items, int(samples), int(input_tokens), int(padded), sample_ids)


# ------------------------------------------------------------------------------------------ Accelerate's counter
def align_sync_counter(accelerator, window: list, micro_batches: list, accumulation: int) -> int:
    """Set Accelerate's micro-batch counter so that the last of ``micro_batches`` (the window as it runs) is the
    sync step, and return K, the divisor ``accelerator.backward`` applies to each loss. Accelerate syncs when its
    counter reaches a multiple of its ``gradient_accumulation_steps`` (accelerate 1.15 ``accelerator.py``
    ``_do_sync``, lines 1230-1237: ``self.step += 1``, sync where ``self.step % num_steps == 0``, called by
    ``accumulate``, line 1283), and ``backward`` divides the loss by that number. A padded window of N micro-batches (N = ``accumulation``), or a
    short last window: K = N, the counter started at N - len(window). A packed window with its own count (any
    number, differing by process): K = its count, the counter at 0. N is set each window: a packed window before
    may have changed it."""
    if len(micro_batches) == len(window):
        accelerator.gradient_accumulation_steps = accumulation
        accelerator.step = accumulation - len(window)
        return accumulation
    accelerator.gradient_accumulation_steps = len(micro_batches)
    accelerator.step = 0
    return len(micro_batches)
