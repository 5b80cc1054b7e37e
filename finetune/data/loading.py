"""Loading the data a run needs: the Hub check (fast, clear failures when it is out of reach), data files and
dataset names, tokenization, the training set's identity; models and tokenizers load in ``finetune.models.loading``.
See docs/recipes.md#hold-out-blocks-and-the-hub-check."""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from pathlib import Path

import datasets
from huggingface_hub import constants, get_session

from finetune.data.formats import chatml_dataset
from finetune.errors import FinetuneError, HubUnreachableError

LABEL_COLUMN = "label"
IGNORE_INDEX = -100  # label value that the loss skips (padding, repeated rows, the prompt where masked)
ROW_COLUMN = "__row__"  # where a raw row came from ("train.csv line 7"): errors about a row name it


# --------------------------------------------------------------------------------------- the hub
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers ``HEAD {endpoint}/`` below HTTP 500 within ``timeout_s`` seconds
    (name resolution included), through ``huggingface_hub.get_session()`` (so ``HF_ENDPOINT`` and proxies apply).
    False at once in offline mode (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``). Never raises. Why bounded:
    docs/recipes.md#hold-out-blocks-and-the-hub-check."""
    if constants.is_offline_mode():
        return False
    answers: list[bool] = []

    def probe() -> None:
        try:
            response = get_session().head(constants.ENDPOINT + "/", timeout=timeout_s)
            answers.append(response.status_code < 500)
        except Exception:  # httpx2 connect/proxy/timeout errors, and anything else: not reachable
            answers.append(False)

    thread = threading.Thread(target=probe, name="finetune-hub-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(answers) and answers[0]


def require_hub(what: str, alternative: str) -> None:
    """Raise ``HubUnreachableError`` naming ``what`` needs the hub and the local ``alternative``, unless
    ``hub_reachable()`` (at most ~3 s)."""
    if not hub_reachable():
        raise HubUnreachableError(
            f"{what} must be downloaded from the Hugging Face Hub, which cannot be reached from this machine "
            f"(offline, HF_HUB_OFFLINE is set, or HF_ENDPOINT/HTTPS_PROXY lead nowhere). To run without the hub, {alternative}."
        )


# --------------------------------------------------------------------------------------- data files
def row_names(path: Path, flag: str, n: int) -> list[str]:
    """Where each of a data file's ``n`` rows is, for error messages: a CSV's line (its header is line 1), a JSON
    lines file's line (blank lines skipped, as the reader does), else the record's number (a JSON array)."""
    if path.suffix.lower() == ".csv":
        return [f"{flag} {str(path)!r} line {i + 2}" for i in range(n)]
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [k for k, line in enumerate(f, 1) if line.strip()]
    if len(lines) == n and not (lines and path.read_text(errors="replace").lstrip().startswith("[")):
        return [f"{flag} {str(path)!r} line {k}" for k in lines]
    return [f"{flag} {str(path)!r} record {i + 1}" for i in range(n)]


def rows_named(ds, split_name: str = "") -> list[str]:
    """Where each row of ``ds`` came from: its file and line (``ROW_COLUMN``), else "<split_name> row <index>"."""
    if ROW_COLUMN in ds.column_names:
        return list(ds[ROW_COLUMN])
    return [f"{split_name} row {i}".lstrip() for i in range(len(ds))]


def check_rows(ds, names: list[str], text_columns, with_labels: bool) -> None:
    """Raise ``FinetuneError`` naming the first row (``names``) whose text column is empty or whose label is
    missing, and what is wrong with it."""
    for column in text_columns:
        for i, text in enumerate(ds[column]):
            if text is None or not str(text).strip():
                raise FinetuneError(f"{names[i]}: the {column!r} column is empty. Fill it in or drop the row.")
    if with_labels:
        for i, label in enumerate(ds[LABEL_COLUMN]):
            if label is None or not str(label).strip():
                raise FinetuneError(f"{names[i]}: the label is empty. Fill it in or drop the row.")


def _read_data_file(path_str: str, flag: str, text_columns, cache_dir, with_labels: bool = True):
    needed = (*text_columns, LABEL_COLUMN) if with_labels else tuple(text_columns)

    path = Path(path_str)
    if not path.is_file():
        raise FinetuneError(f"{flag} {path_str!r} does not exist. Pass a CSV or JSON-lines file.")
    if path.stat().st_size == 0:
        raise FinetuneError(f"{flag} {path_str!r} is empty. It needs a header/keys {', '.join(needed)}.")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        builder = "csv"
    elif suffix in (".json", ".jsonl"):
        builder = "json"
    else:
        raise FinetuneError(f"{flag} {path_str!r}: unknown format {suffix!r}. Use .csv, .json or .jsonl.")
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as err:  # the datasets library raises many types for malformed files
        raise FinetuneError(f"{flag} {path_str!r} could not be read as {builder}: {err}") from None
    missing = [c for c in needed if c not in ds.column_names]
    if missing:
        raise FinetuneError(
            f"{flag} {path_str!r} lacks column(s) {', '.join(missing)} (it has {', '.join(ds.column_names)}). "
            f"This recipe needs {', '.join(needed)}."
        )
    if len(ds) == 0:
        raise FinetuneError(f"{flag} {path_str!r} has no rows.")
    names = row_names(path, flag, len(ds))
    check_rows(ds, names, text_columns, with_labels)
    return ds.select_columns(list(needed)).add_column(ROW_COLUMN, names)


HOLDOUT_FRACTION = 0.2  # of --train_file held out for validation when no --validation_file is given


def _check_holdout(train_file: str, n_rows: int, label_counts: dict[str, int] | None = None,
                   what: str = "--train_file") -> None:
    """Raise ``FinetuneError`` (naming the file, the short labels and the fix) unless ``HOLDOUT_FRACTION`` of
    ``n_rows`` can be held out with rows left; stratified (``label_counts``): every label 2+ rows and n >= 5k - 4
    for k labels, what ``Dataset.train_test_split`` needs (see docs/recipes.md#hold-out-blocks-and-the-hub-check)."""
    n_test = math.ceil(HOLDOUT_FRACTION * n_rows)
    fix = "Add rows, or pass --validation_file with your own validation data."
    if label_counts is None:
        if n_rows - n_test < 1:
            raise FinetuneError(
                f"{what} {train_file!r} is too small to hold out 20% for validation (no --validation_file): "
                f"it has {n_rows} row(s) and needs at least 2. {fix}"
            )
        return
    k = len(label_counts)
    min_rows = max(5 * k - 4, 2 * k)
    short = [(name, count) for name, count in label_counts.items() if count < 2]
    n_train = n_rows - n_test
    if not short and n_test >= k and n_train >= k:
        return
    problems = []
    if short:
        listed = ", ".join(f"{name!r} ({count} row{'' if count == 1 else 's'})" for name, count in short)
        problems.append(f"label(s) {listed} need at least 2 rows each, one to train on and one to validate on")
    if n_test < k or n_train < k:
        problems.append(f"its {n_rows} rows give a hold-out of {n_test} row{'' if n_test == 1 else 's'} and "
                        f"{n_train} to train on, too few to hold one of each of its {k} labels on both sides "
                        f"(that needs at least {min_rows} rows)")
    raise FinetuneError(
        f"{what} {train_file!r} is too small to hold out a stratified 20% for validation "
        f"(no --validation_file): {'; '.join(problems)}. {fix}"
    )


def load_data_files(train_file: str, validation_file: str | None, text_columns, cache_dir=None, with_labels=True):
    """Your own data as a DatasetDict (``train``, ``validation``) with a ``ClassLabel`` ``label`` (the sorted
    distinct train labels, strings or ints; ``with_labels=False``: text columns only). Without
    ``validation_file``, 20% of ``train_file`` (rounded up) is held out (stratified, seed 42). Raises
    ``FinetuneError`` for a missing/empty/unreadable file, missing columns, empty texts, validation labels the
    training data never shows, or a ``train_file`` too small to hold out from (``_check_holdout``)."""
    train = _read_data_file(train_file, "--train_file", text_columns, cache_dir, with_labels)
    if not with_labels:
        if validation_file:
            validation = _read_data_file(validation_file, "--validation_file", text_columns, cache_dir, False)
            return datasets.DatasetDict({"train": train, "validation": validation})
        _check_holdout(train_file, len(train))
        split = train.train_test_split(test_size=HOLDOUT_FRACTION, seed=42)
        return datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    distinct = {str(x) for x in train[LABEL_COLUMN]}
    # integer labels keep their numeric order (so label 1 stays id 1); strings sort alphabetically
    numeric = all(x.lstrip("-").isdigit() for x in distinct)
    names = sorted(distinct, key=int) if numeric else sorted(distinct)
    if len(names) < 2:
        raise FinetuneError(f"--train_file {train_file!r} has only one label ({names[0]!r}); classification needs 2+.")
    features = datasets.Features({**{c: datasets.Value("string") for c in text_columns},
                                  LABEL_COLUMN: datasets.ClassLabel(names=names), ROW_COLUMN: datasets.Value("string")})

    def to_class(ds, flag, path):
        unknown = [i for i, x in enumerate(ds[LABEL_COLUMN]) if str(x) not in names]
        if unknown:
            raise FinetuneError(
                f"{ds[ROW_COLUMN][unknown[0]]}: the label {str(ds[LABEL_COLUMN][unknown[0]])!r} never appears in "
                f"--train_file (known: {', '.join(names)}); {len(unknown)} such row(s). Fix the labels or add examples "
                "of them to the training data."
            )
        return ds.map(lambda b: {LABEL_COLUMN: [names.index(str(x)) for x in b[LABEL_COLUMN]],
                                 **{c: [str(t) for t in b[c]] for c in text_columns}},
                      batched=True, features=features)

    train = to_class(train, "--train_file", train_file)
    if validation_file:
        validation = to_class(_read_data_file(validation_file, "--validation_file", text_columns, cache_dir),
                              "--validation_file", validation_file)
        return datasets.DatasetDict({"train": train, "validation": validation})
    counts = Counter(train[LABEL_COLUMN])
    _check_holdout(train_file, len(train), label_counts={name: counts[i] for i, name in enumerate(names)})
    split = train.train_test_split(test_size=HOLDOUT_FRACTION, stratify_by_column=LABEL_COLUMN, seed=42)
    return datasets.DatasetDict({"train": split["train"], "validation": split["test"]})


def _class_labels(ds, where: str):
    """``ds`` with its ``label`` column as a ``ClassLabel``: kept where it is one; else the sorted distinct
    values (integers in numeric order) become the names. Raises ``FinetuneError`` for fewer than 2 labels."""
    if isinstance(ds.features.get(LABEL_COLUMN), datasets.ClassLabel):
        return ds
    distinct = {str(x) for x in ds[LABEL_COLUMN]}
    names = sorted(distinct, key=int) if all(x.lstrip("-").isdigit() for x in distinct) else sorted(distinct)
    if len(names) < 2:
        raise FinetuneError(f"{where} has only one label ({names[0]!r}); classification needs 2+.")
    return ds.cast_column(LABEL_COLUMN, datasets.Value("string")).cast_column(
        LABEL_COLUMN, datasets.ClassLabel(names=names))


def is_saved_folder(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``save_to_disk``: a DatasetDict's (``dataset_dict.json``) or one
    Dataset's (``state.json``)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def load_saved_folder(path: Path, cache_dir=None):
    """A ``save_to_disk`` folder's rows and features, as ``datasets.load_from_disk`` gives them (a DatasetDict, or a
    Dataset), read by datasets' ``arrow`` builder from the data files each split's ``state.json`` lists, in order,
    into the datasets cache (``cache_dir``). Not ``load_from_disk``: the run's tokenized caches (``Dataset.map``)
    would be written beside its files, inside the user's folder, where ``datasets.load_dataset(folder)`` (``trl sft
    --dataset_name folder``) then reads them as data and fails."""
    def files(folder: Path) -> list[str]:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        return [str(folder / f["filename"]) for f in state["_data_files"]]

    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        return datasets.load_dataset("arrow", data_files={s: files(path / s) for s in splits}, cache_dir=cache_dir)
    return datasets.load_dataset("arrow", data_files={"train": files(path)}, split="train", cache_dir=cache_dir)


def _load_by_name(name: str, config_name: str | None, cache_dir=None):
    """``--dataset_name`` loaded: a ``save_to_disk`` folder (``dataset_dict.json``/``state.json``) through
    ``load_saved_folder``, else ``datasets.load_dataset`` (a local data folder, or a Hub name, which needs the
    Hub). Raises ``FinetuneError`` for an unreadable dataset and ``HubUnreachableError`` offline for a Hub name."""
    path = Path(name)
    try:
        if is_saved_folder(path):
            return load_saved_folder(path, cache_dir)
        if not path.exists() and name.startswith((".", "/", "~")):
            raise FinetuneError(f"--dataset_name {name}: no such folder. Pass a folder written by "
                                "Dataset.save_to_disk, a folder of data files, or a Hub dataset name.")
        if not path.exists():
            require_hub(f"--dataset_name {name}", "pass a local folder as --dataset_name (one written by "
                        "Dataset.save_to_disk, or a folder of data files), or --train_file")
        return datasets.load_dataset(name, config_name, cache_dir=cache_dir)
    except FinetuneError:
        raise
    except Exception as err:  # the datasets library raises many types for unreadable data
        raise FinetuneError(f"--dataset_name {name} could not be loaded: {err}") from None


def load_named_dataset(name: str, config_name: str | None, train_split: str, test_split: str, text_columns,  # noqa: C901 - over the budget; to split
                       cache_dir=None, *, class_labels: bool, conversations: bool, loaded=None):
    """``--dataset_name`` (TRL's flags), loaded by ``_load_by_name`` (or ``loaded``, a dataset already loaded: a
    mixture's, ``data.mixture``, whose rows may already carry their names). Returns a DatasetDict (``train``,
    ``validation``) as ``load_data_files`` does: classification gets a ``ClassLabel`` ``label`` (``class_labels``: a
    ClassLabel's names kept), conversations (``conversations``: the task's ``chat``) keep their prompt/completion or
    messages (ShareGPT's converted); without ``test_split``, 20% of the train split is held out (stratified for
    classification, seed 42). Raises ``FinetuneError`` for a missing split or column (listing what the dataset has)
    or an unreadable dataset, and ``HubUnreachableError`` offline for a Hub name."""
    if loaded is None:
        loaded = _load_by_name(name, config_name, cache_dir)
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({train_split: loaded})
    if train_split not in loaded:
        raise FinetuneError(f"--dataset_name {name} has no split {train_split!r} (it has {', '.join(loaded)}). "
                            "Pass --dataset_train_split.")
    where = f"--dataset_name {name} (split {train_split!r})"
    train = loaded[train_split]
    if conversations:
        loaded = datasets.DatasetDict({k: chatml_dataset(v) for k, v in loaded.items()})  # ShareGPT, as TRL converts
        train = loaded[train_split]
        columns = set(train.column_names)
        if not ({"prompt", "completion"} <= columns or "messages" in columns or {"chosen", "rejected"} <= columns):
            raise FinetuneError(f"{where} has columns {', '.join(train.column_names)}; conversation data needs "
                                "prompt + completion, or messages (instruction tuning), or chosen + rejected "
                                "(preference pairs): TRL's dataset formats.")
        needed = None
    else:
        needed = [*text_columns, *([LABEL_COLUMN] if class_labels else [])]
        missing = [c for c in needed if c not in train.column_names]
        if missing:
            raise FinetuneError(f"{where} lacks column(s) {', '.join(missing)} (it has {', '.join(train.column_names)})."
                                f" This recipe needs {', '.join(needed)}.")
    splits = {"train": train, "validation": loaded.get(test_split)}
    for key, split in (("train", train_split), ("validation", test_split)):
        ds = splits[key]
        if ds is None:
            continue
        names = [f"--dataset_name {name} split {split!r} row {i}" for i in range(len(ds))]
        if ROW_COLUMN in ds.column_names:  # named where they came from (a mixture's sources)
            names = ds[ROW_COLUMN]
            ds = ds.remove_columns(ROW_COLUMN)
        if needed:
            ds = ds.select_columns(needed)
            check_rows(ds, names, text_columns, class_labels)
        splits[key] = ds.add_column(ROW_COLUMN, names)
    if class_labels:
        splits["train"] = _class_labels(splits["train"], where)
        if splits["validation"] is not None:
            names = splits["train"].features[LABEL_COLUMN].names
            validation = splits["validation"]
            if not isinstance(validation.features[LABEL_COLUMN], datasets.ClassLabel):
                validation = validation.cast_column(LABEL_COLUMN, datasets.Value("string")).cast_column(
                    LABEL_COLUMN, datasets.ClassLabel(names=names))
            splits["validation"] = validation
    if splits["validation"] is None:
        stratify = class_labels
        counts = Counter(splits["train"][LABEL_COLUMN]) if stratify else None
        label_counts = ({n: counts[i] for i, n in enumerate(splits["train"].features[LABEL_COLUMN].names)}
                        if stratify else None)
        _check_holdout(name, len(splits["train"]), label_counts, what="--dataset_name")
        held = splits["train"].train_test_split(test_size=HOLDOUT_FRACTION, seed=42,
                                                **({"stratify_by_column": LABEL_COLUMN} if stratify else {}))
        splits = {"train": held["train"], "validation": held["test"]}
    return datasets.DatasetDict(splits)


# --------------------------------------------------------------------------------------- tokenization
def tokenize_datasets(raw, tokenizer, text_columns, max_length: int):
    """Every split tokenized with ``Dataset.map`` (batched, cached), truncated to ``max_length`` tokens, unpadded
    (the collator pads per micro-batch). Columns: ``input_ids``, ``attention_mask`` (``token_type_ids``), ``labels``."""

    def encode(batch):
        texts = [batch[c] for c in text_columns]
        return tokenizer(*texts, truncation=True, max_length=max_length)

    columns = raw["train"].column_names
    tokenized = raw.map(encode, batched=True, remove_columns=[c for c in columns if c != LABEL_COLUMN],
                        desc="Tokenizing")
    return tokenized.rename_column(LABEL_COLUMN, "labels")


def tokenize_for_causal_lm(raw, tokenizer, text_columns, max_length: int, block_size: int | None = None,
                           add_eos: bool = False):
    """Texts -> ``input_ids`` for next-token prediction (``Dataset.map``, batched, cached; empty texts dropped).
    One sample per text truncated at ``max_length`` tokens (with ``add_eos``, the text first ends with the eos token
    unless it ends with it already: trl 1.16 ``SFTTrainer._prepare_dataset``'s ``add_eos``, then its keep-start
    truncation), or with ``block_size`` all texts of a split joined by eos and cut into ``block_size``-token blocks,
    the short tail dropped (transformers' ``run_clm.py``). The collator derives ``labels``. Raises
    ``FinetuneError`` for ``add_eos`` with a tokenizer that has no eos token."""
    (column,) = text_columns
    eos = tokenizer.eos_token
    if add_eos and eos is None:
        raise FinetuneError("--add_eos: this tokenizer has no eos token to end each text with; drop --add_eos (or "
                            "pass --add_eos false) or use a tokenizer that defines one.")

    def encode(batch):
        texts = [t for t in batch[column] if t and t.strip()]
        if block_size is None:
            if add_eos:
                texts = [t if t.endswith(eos) else t + eos for t in texts]
            return {"input_ids": tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]}
        ids = []
        for row in tokenizer(texts)["input_ids"]:
            ids.extend(row + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []))
        usable = len(ids) // block_size * block_size
        return {"input_ids": [ids[i:i + block_size] for i in range(0, usable, block_size)]}

    columns = next(iter(raw.values())).column_names  # every split has the text columns; any split may be given
    # block grouping crosses row boundaries within a map batch; 1,000 texts a batch keeps tails rare
    return raw.map(encode, batched=True, batch_size=1000, remove_columns=columns, desc="Tokenizing")


def load_conversation_files(train_file: str, validation_file: str | None, cache_dir=None, preference: bool = False):
    """Instruction data (JSON lines in TRL's ``prompt`` + ``completion`` or ``messages`` format), or with
    ``preference`` preference pairs (``chosen`` + ``rejected``, with or without ``prompt``), as a DatasetDict
    (``train``, ``validation``); rows are checked when rendered (``finetune.data.chat``, ``data.preference``).
    Without ``validation_file``, 20% of ``train_file`` is held out (seed 42). Raises ``FinetuneError`` for a
    missing, empty or unreadable file, or one without the format's columns."""
    kind, columns = (("preference data", "chosen + rejected (and prompt, unless the sides are whole conversations)")
                     if preference else ("instruction data", "prompt + completion, or messages"))

    def read(path_str: str, flag: str):
        path = Path(path_str)
        if not path.is_file() or path.stat().st_size == 0:
            raise FinetuneError(f"{flag} {path_str!r} does not exist or is empty. Pass a JSON-lines file of "
                                f"{columns} rows.")
        if path.suffix.lower() not in (".json", ".jsonl"):
            raise FinetuneError(f"{flag} {path_str!r}: {kind} must be JSON lines (.jsonl or .json) with {columns}.")
        try:
            ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir)
        except Exception as err:  # the datasets library raises many types for malformed files
            raise FinetuneError(f"{flag} {path_str!r} could not be read as JSON lines: {err}") from None
        ds = chatml_dataset(ds)  # ShareGPT's conversations of from/value, as TRL converts them
        names = set(ds.column_names)
        if not ({"chosen", "rejected"} <= names if preference else
                ({"prompt", "completion"} <= names or "messages" in names)):
            raise FinetuneError(f"{flag} {path_str!r} has columns {', '.join(ds.column_names)}; {kind} needs "
                                f"{columns} (TRL's dataset formats).")
        return ds.add_column(ROW_COLUMN, row_names(path, flag, len(ds)))

    return read_split_files(read, train_file, validation_file)


def read_split_files(read, train_file: str, validation_file: str | None):
    """``read(path, flag)`` of ``--train_file`` and ``--validation_file`` as a ``DatasetDict`` (train, validation);
    without ``validation_file``, 20% of the training rows held out (seed 42). ``read`` raises for a bad file."""
    train = read(train_file, "--train_file")
    if validation_file:
        return datasets.DatasetDict({"train": train, "validation": read(validation_file, "--validation_file")})
    split = train.train_test_split(test_size=0.2, seed=42)
    return datasets.DatasetDict({"train": split["train"], "validation": split["test"]})


# --------------------------------------------------------------------------------------- the data a run is bound to
_MASK64 = (1 << 64) - 1


def _mix(z):
    """splitmix64's finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014) on a
    uint64 array: each bit of the result depends on every bit of the input. Arithmetic wraps modulo 2**64."""
    import numpy as np

    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _column_hashes(column, index: int):
    """One uint64 per row of the Arrow ``column`` (the ``index``-th column): a list column hashes each value with
    its position in the row (so the order inside a row counts), summed per row with the row's length; a scalar
    column hashes its value's bits; any other type its text."""
    import numpy as np
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    salt = np.uint64((index + 1) * 0x9E3779B97F4A7C15 & _MASK64)
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        offsets = array.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        offsets -= offsets[0]
        values = _column_hashes(array.flatten(), index)
        lengths = np.diff(offsets)
        positions = (np.arange(len(values), dtype=np.int64) - np.repeat(offsets[:-1], lengths)).astype(np.uint64)
        hashed = _mix(values ^ _mix(positions + salt))
        sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(hashed, dtype=np.uint64)])
        return _mix(sums[offsets[1:]] - sums[offsets[:-1]] + lengths.astype(np.uint64) * salt)
    if pa.types.is_integer(array.type) or pa.types.is_boolean(array.type):
        values = array.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64)
    elif pa.types.is_floating(array.type):
        values = array.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64).view(np.uint64)
    else:
        import hashlib

        values = np.array([int.from_bytes(hashlib.blake2b(repr(v).encode(), digest_size=8).digest(), "little")
                           for v in array.to_pylist()], dtype=np.uint64)
    return _mix(values + salt)


def training_set_identity(dataset) -> dict:
    """What a checkpoint binds its run to (``checkpoint.step_meaning``) and what the precomputed reference is
    keyed by (``tasks.reference``): ``{"samples": rows, "fingerprint": 16 hex digits, "order_fingerprint": 16 hex
    digits}`` of the tokenized training set ``dataset`` (a ``datasets.Dataset``), from one hash per row over every
    column but the row names (``ROW_COLUMN``; changed by any token, label or column of the row).

    ``order_fingerprint``: the sum modulo 2**64 of each row's hash mixed with its position (splitmix64,
    ``_mix``), so it also changes when rows swap places; the seeded epoch order is a permutation of row
    positions, so a step means the same samples only on the same rows in the same order. ``fingerprint``: the
    plain sum of the row hashes, independent of the order: with it a change is named as "the same rows in another
    order" rather than "other rows", and checkpoints recorded before ``order_fingerprint`` are still checked
    (``elastic.training_set_change``). Cost: one pass over the Arrow columns, vectorised (both from the same row
    hashes)."""
    import numpy as np

    columns = sorted(name for name in dataset.column_names if name != ROW_COLUMN)
    rows_sum, ordered_sum, start = 0, 0, 0
    salt = np.uint64(0xD1B54A32D192ED03)  # positions hash apart from every column's salt
    for table in dataset.select_columns(columns).with_format("arrow").iter(batch_size=8192):
        rows = np.zeros(table.num_rows, dtype=np.uint64)
        for index, name in enumerate(columns):
            rows = _mix(rows ^ _column_hashes(table.column(name), index))
        positions = np.arange(start, start + table.num_rows, dtype=np.uint64)
        rows_sum = (rows_sum + int(rows.sum(dtype=np.uint64))) & _MASK64
        ordered_sum = (ordered_sum + int(_mix(rows ^ _mix(positions + salt)).sum(dtype=np.uint64))) & _MASK64
        start += table.num_rows
    return {"samples": len(dataset), "fingerprint": f"{rows_sum:016x}", "order_fingerprint": f"{ordered_sum:016x}"}
