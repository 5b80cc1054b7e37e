"""Several datasets in one run: TRL 1.16's ``datasets:`` section (``DatasetMixtureConfig`` of ``DatasetConfig``s,
trl/scripts/utils.py), loaded as ``get_dataset`` loads it, the rows of each source named where they came from.

``fraction``: target shares of the mixture, normalized to sum to one; the mixture's size N is the largest that
oversamples no source (N = min over sources of rows / share), and each source keeps its first ``round(share * N)``
rows (TRL's ``get_dataset``, the same formula). Then the sources are concatenated in their order; the validation
split is ``test_split_size`` of it (seeded, 42), else the run's usual 20% held out."""

from __future__ import annotations

from pathlib import Path

import datasets

from finetune.data.formats import chatml_dataset
from finetune.data.loading import ROW_COLUMN, is_saved_folder, load_saved_folder, require_hub
from finetune.errors import FinetuneError

# Dataset builders that read local files (datasets' packaged modules): no Hub needed
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


def source_name(index: int, source: dict) -> str:
    """How a source is named in messages and row names: ``datasets[i] (path)``, or its data file for a file builder
    (``json`` with ``data_files``)."""
    files = source.get("data_files")
    shown = files if source["path"] in LOCAL_BUILDERS and isinstance(files, str) else source["path"]
    return f"datasets[{index}] ({shown})"


def load_source(index: int, source: dict, cache_dir=None) -> datasets.Dataset:
    """One ``datasets:`` entry as ``datasets.load_dataset(path, name, data_dir, data_files, split)`` loads it (a
    ``save_to_disk`` folder through ``load_saved_folder``), its ``columns`` selected, ShareGPT rows converted. Raises
    ``FinetuneError`` naming the source for a missing split, column or unreadable data; ``HubUnreachableError``
    offline for a Hub name."""
    where, path = source_name(index, source), Path(source["path"])
    split = source.get("split") or "train"
    try:
        if is_saved_folder(path):
            loaded = load_saved_folder(path, cache_dir)
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise FinetuneError(f"{where} has no split {split!r} (it has {', '.join(loaded)}).")
                loaded = loaded[split]
        else:
            if source["path"] not in LOCAL_BUILDERS and not path.exists():
                require_hub(where, "name a local folder or a file builder (json, csv, parquet) with data_files")
            loaded = datasets.load_dataset(path=source["path"], name=source.get("name"),
                                           data_dir=source.get("data_dir"), data_files=source.get("data_files"),
                                           split=split, cache_dir=cache_dir)
    except FinetuneError:
        raise
    except Exception as err:  # the datasets library raises many types for unreadable data
        raise FinetuneError(f"{where} could not be loaded: {err}") from None
    if source.get("columns"):
        missing = [c for c in source["columns"] if c not in loaded.column_names]
        if missing:
            raise FinetuneError(f"{where} lacks column(s) {', '.join(missing)} (it has "
                                f"{', '.join(loaded.column_names)}).")
        loaded = loaded.select_columns(source["columns"])
    return chatml_dataset(loaded)


def kept_rows(sizes: list[int], fractions: list[float | None]) -> list[int]:
    """Rows kept of each source (``sizes``: their rows) under TRL's ``fraction`` rule (module docstring); every row
    where no fraction is set. ``fractions``: all None or all > 0 (``config.data`` checks it)."""
    if all(f is None for f in fractions):
        return list(sizes)
    weights = [f / sum(fractions) for f in fractions]
    total = min(size / weight for size, weight in zip(sizes, weights) if weight > 0)
    return [round(weight * total) for weight in weights]


def load_mixture(mixture: dict, cache_dir=None) -> tuple[datasets.DatasetDict, list[tuple[str, int, int]]]:
    """The mixture (``config.dataset_mixture`` parsed: ``{"datasets": [...], "test_split_size": x | None}``) as one
    ``train`` split (and ``test`` where ``test_split_size`` is set, split with seed 42), each row named
    ``datasets[i] (path) row j`` in ``ROW_COLUMN``; and per source (name, rows kept, rows it has). Raises
    ``load_source``'s errors, and ``FinetuneError`` where the sources' columns differ (they must concatenate)."""
    sources = mixture["datasets"]
    loaded = [load_source(i, s, cache_dir) for i, s in enumerate(sources)]
    keep = kept_rows([len(d) for d in loaded], [s.get("fraction") for s in sources])
    parts = []
    for i, (source, ds, n) in enumerate(zip(sources, loaded, keep)):
        ds = ds.select(range(n))
        parts.append(ds.add_column(ROW_COLUMN, [f"{source_name(i, source)} row {j}" for j in range(n)]))
    columns = [sorted(p.column_names) for p in parts]
    if any(c != columns[0] for c in columns):
        raise FinetuneError("the datasets of the mixture have different columns (" + "; ".join(
            f"{source_name(i, s)}: {', '.join(c)}" for i, (s, c) in enumerate(zip(sources, columns)))
            + "): give each source the same columns (its `columns:` key selects them).")
    try:
        combined = datasets.concatenate_datasets(parts)
    except ValueError as err:  # features of the same names but other types
        raise FinetuneError(f"the datasets of the mixture cannot be concatenated: {err}") from None
    kept = [(source_name(i, s), n, len(d)) for i, (s, d, n) in enumerate(zip(sources, loaded, keep))]
    if mixture.get("test_split_size") is None:
        return datasets.DatasetDict({"train": combined}), kept
    split = combined.train_test_split(test_size=mixture["test_split_size"], seed=42)
    return datasets.DatasetDict({"train": split["train"], "test": split["test"]}), kept


def row_source(row: str) -> str:
    """The source a mixture's row name (``ROW_COLUMN``: ``datasets[i] (path) row j``) came from: ``datasets[i] (path)``."""
    return row.rsplit(" row ", 1)[0]


def mixture_counts(mixture: dict, rows: list[str]) -> dict[str, int]:
    """Rows per source among ``rows`` (``ROW_COLUMN`` values): ``{source name: count}``, in the mixture's order."""
    names = [source_name(i, s) for i, s in enumerate(mixture["datasets"])]
    counts = dict.fromkeys(names, 0)
    for row in rows:
        counts[row_source(row)] += 1
    return counts
