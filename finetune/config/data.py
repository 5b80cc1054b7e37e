"""The data section: which data (the recipe's, your files, or a dataset by name), how much of it, how it is cut
into tokens, in which order it is trained, and how it is loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from finetune.config.flags import check_positive_int, flag
from finetune.errors import FinetuneError

# TRL 1.16's DatasetConfig fields (trl/scripts/utils.py) and DatasetMixtureConfig's besides `datasets`
SOURCE_KEYS = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction")
MIXTURE_KEYS = ("datasets", "streaming", "test_split_size")


def canonical_mixture(value) -> str:
    """A mixture (JSON text, a dict with ``datasets``, or the list of sources) checked and written as canonical JSON
    (sorted keys, TRL's defaults filled in: ``split`` "train"), so that equal mixtures compare equal in a step's
    meaning. Raises ``FinetuneError`` naming the source and key for a missing ``path``, an unknown key, a fraction
    set on some sources only or not positive, ``streaming`` (not supported), or a bad ``test_split_size``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise FinetuneError(f"--dataset_mixture: not JSON ({err}); give a list of sources or put a `datasets:` "
                                "section in a --config file.") from None
    mixture = {"datasets": value} if isinstance(value, list) else dict(value or {})
    unknown = sorted(set(mixture) - set(MIXTURE_KEYS))
    if unknown:
        raise FinetuneError(f"the dataset mixture: unknown key(s) {', '.join(unknown)} (TRL's are "
                            f"{', '.join(MIXTURE_KEYS)}).")
    if mixture.get("streaming"):
        raise FinetuneError("the dataset mixture: streaming is not supported (a run's step meaning counts its rows); "
                            "drop `streaming: true`.")
    sources = mixture.get("datasets")
    if not isinstance(sources, list) or not sources:
        raise FinetuneError("the dataset mixture: `datasets:` must be a non-empty list of sources, each with a path.")
    checked = []
    for i, source in enumerate(sources):
        if not isinstance(source, dict) or not isinstance(source.get("path"), str):
            raise FinetuneError(f"the dataset mixture: datasets[{i}] needs a `path` (a folder, a Hub name, or a file "
                                "builder such as json with data_files).")
        bad = sorted(set(source) - set(SOURCE_KEYS))
        if bad:
            raise FinetuneError(f"the dataset mixture: datasets[{i}] ({source['path']}) has unknown key(s) "
                                f"{', '.join(bad)} (TRL's DatasetConfig has {', '.join(SOURCE_KEYS)}).")
        checked.append({"split": "train", **{k: v for k, v in source.items() if v is not None}})
    fractions = [s.get("fraction") for s in checked]
    if any(f is not None for f in fractions) and (any(f is None for f in fractions) or
                                                 any(not isinstance(f, (int, float)) or f <= 0 for f in fractions)):
        raise FinetuneError("the dataset mixture: `fraction` must be set for every source or none, each above 0 "
                            f"(got {fractions}), as TRL's DatasetMixtureConfig requires.")
    size = mixture.get("test_split_size")
    if size is not None and not ((isinstance(size, float) and 0 < size < 1) or (isinstance(size, int) and size >= 1)):
        raise FinetuneError(f"the dataset mixture: test_split_size must be a fraction in (0, 1) or a row count, "
                            f"got {size!r}.")
    return json.dumps({"datasets": checked, "test_split_size": size}, sort_keys=True)


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
    dataset_mixture: str | None = flag(
        None,
        "Several datasets in one run, as TRL's `datasets:` section (in a --config file, or this flag as JSON): "
        "a list of {path, name, data_dir, data_files, split, columns, fraction}, plus test_split_size; fractions "
        "keep the rows TRL's mixture keeps (normalized, no source oversampled).",
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
        if self.dataset_mixture is not None:
            if self.dataset_name or self.train_file:
                raise FinetuneError("--dataset_mixture (datasets:) and --dataset_name/--train_file both name the "
                                    "training data: pass one of them.")
            self.dataset_mixture = canonical_mixture(self.dataset_mixture)
