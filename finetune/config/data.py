"""The data section: which data (the recipe's, your files, or a dataset by name), how much of it, how it is cut
into tokens, in which order it is trained, and how it is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from finetune.config.flags import check_positive_int, flag
from finetune.errors import FinetuneError


@dataclass
class DataArguments:
    """Training and validation data, truncation and blocks (tokens), subsets, the training order, data loading."""

    train_file: str | None = flag(
        None, "Your own training data: CSV or JSON lines with the recipe's text column(s) and `label`.",
        step=True, trainer=None,
    )
    validation_file: str | None = flag(
        None, "Your own validation data (same format). Default: 20%% split of train_file.",
        step=False, trainer=None,
    )
    dataset_name: str | None = flag(
        None,
        "A dataset by name (TRL's flag): a folder written by save_to_disk, a folder of "
        "data files, or a Hub name (needs the Hub).",
        step=True, trainer=None,
    )
    dataset_config: str | None = flag(
        None, "The --dataset_name configuration (subset).",
        step=True, trainer=None,
    )
    dataset_train_split: str = flag(
        "train", "The --dataset_name split to train on.",
        step=True, trainer=None,
    )
    dataset_test_split: str = flag(
        "test",
        "The --dataset_name split to validate on; without it 20%% of the train "
        "split is held out.",
        step=False, trainer=None,
    )
    max_length: int = flag(
        128, "Truncate inputs to this many tokens.",
        step=True, trainer=None,
    )
    block_size: int | None = flag(
        None, "Causal LM: concatenate texts and cut blocks of this many tokens (default: one text per sample).",
        step=True, trainer=None,
    )
    max_train_samples: int | None = flag(
        None, "Use only the first N training samples.",
        step=True, trainer=None,
    )
    max_eval_samples: int | None = flag(
        None, "Use only the first N evaluation samples.",
        step=False, trainer=None,
    )
    train_sampling_strategy: Literal["random", "group_by_length"] = flag(
        "random",
        "Training order (TrainingArguments name): 'random', or 'group_by_length' (shuffled, then "
        "sorted by length within mega-batches of 50 optimizer steps, so micro-batches need less padding).",
        step=True, trainer="train_sampling_strategy",
    )
    dataloader_num_workers: int = flag(
        0, "DataLoader worker processes (0: collate in the training process).",
        step=False, trainer="dataloader_num_workers",
    )
    dataloader_pin_memory: bool = flag(
        True, "Pin host memory for faster copies to a GPU (ignored on a CPU).",
        step=False, trainer="dataloader_pin_memory",
    )
    cache_dir: str | None = flag(
        None, "Where tokenized datasets are cached. Default: the datasets library cache.",
        step=False, trainer=None,
    )

    def _check_data(self) -> None:
        """Which data, how much of it, how it is cut and loaded."""
        check_positive_int("max_length", self.max_length)
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise FinetuneError(f"--{name} must be a positive integer, got {value}.")
        if self.block_size is not None and self.block_size < 2:
            raise FinetuneError(f"--block_size must be an integer >= 2 (tokens), got {self.block_size}.")
        if self.dataloader_num_workers < 0:
            raise FinetuneError(f"--dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}.")
        if self.validation_file and not self.train_file:
            raise FinetuneError("--validation_file needs --train_file as well (or drop it to use the recipe's data).")
        if self.dataset_name and self.train_file:
            raise FinetuneError("--dataset_name and --train_file both name the training data: pass one of them.")
