"""Elastic resume: a step means B samples of the epoch's seeded order, not how B is split, so a checkpoint resumes
on another process count or micro-batch plan with the same effective batch B (docs/resume.md).

Why it is exact: Accelerate's sharded dataloader gives global micro-batch i of the seeded order to process
i mod P (accelerate 1.15 ``data_loader.py`` ``BatchSamplerShard._iter_with_no_split``), so an accumulation window
of N micro-batches per process covers the order's positions [w x B, (w + 1) x B) whatever (m, N, P) splits
B = m x N x P; the order itself depends on the seed and the epoch only (``SeedableRandomSampler``: data_seed +
epoch, ``data_loader.py`` lines 85-103) or, under ``group_by_length``, on B too
(``window.EpochSeededLengthGroupedSampler``). A checkpoint is taken on a step boundary, so the samples of its
epoch consumed are a multiple of B, and the micro-batches per process to skip on the new plan,
consumed / (m' x P'), are whole. This is Megatron-LM's ``consumed_samples`` (``MegatronPretrainingSampler``).

Units: samples (positions in the epoch's seeded order, over all processes), micro-batches per process.
"""

from __future__ import annotations

import hashlib
import math

import torch

from finetune.errors import FinetuneError

# How B is split: may change on resume (the checkpoint records them, the banner names the change)
SPLIT_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_processes")
TOTAL = "total_batch_size"  # B in a checkpoint's step meaning: samples per optimizer step over all processes
SAMPLE_ID = "_sample_id"  # a row's position in the training set, added by ``SampleIds`` for the batch's hash
SAMPLE_IDS = "sample_ids"  # the batch key ``with_sample_ids`` puts them under (a 1-D int64 tensor)
_HASH_BITS = 40  # each id hashes to 40 bits: sums of up to 2**23 ids per step fit an int64


def batch_meaning(config, num_processes: int) -> dict:
    """What a checkpoint records of the batch: B (``TOTAL``) and the split it was taken under (``SPLIT_FIELDS``:
    micro-batch m, accumulation N, processes P; B = m x N x P samples)."""
    m, n = config.per_device_train_batch_size, config.gradient_accumulation_steps
    return {TOTAL: m * n * num_processes, "per_device_train_batch_size": m, "gradient_accumulation_steps": n,
            "num_processes": num_processes}


def effective_batch(meaning: dict) -> int | None:
    """B of a step meaning: its ``TOTAL``, or for a checkpoint written before it was recorded, m x N x P from its
    split; None where neither is there (a step meaning without the batch)."""
    if meaning.get(TOTAL) is not None:
        return meaning[TOTAL]
    split = [meaning.get(name) for name in SPLIT_FIELDS]
    return split[0] * split[1] * split[2] if all(isinstance(v, int) for v in split) else None


def describe_split(meaning: dict) -> str:
    """"8 x 4 x 1 process" (micro-batch x accumulation x processes) for messages."""
    p = meaning.get("num_processes")
    return (f"{meaning.get('per_device_train_batch_size')} x {meaning.get('gradient_accumulation_steps')} x {p} "
            f"process{'es' if p != 1 else ''}")


def check_batch(saved: dict, meaning: dict, path, allow: bool) -> None:
    """Refuse a resume whose effective batch B differs from the checkpoint's: a step would then mean other
    samples (and the schedule, sized in steps, another length). ``allow`` (``--ignore_checkpoint_mismatch``) lets
    it through; ``resume_position`` still refuses where the samples done are not whole micro-batches of the new
    plan (that would replay or skip samples). Raises ``FinetuneError`` naming both B's and the fix."""
    before, now = effective_batch(saved), effective_batch(meaning)
    if before is None or before == now or allow:
        return
    raise FinetuneError(
        f"cannot resume from {path}: its effective batch was B = {before} samples per optimizer step "
        f"({describe_split(saved)}), this launch's is B = {now} ({describe_split(meaning)}). Resume with the same "
        f"B, split any way (--total_batch_size {before}, or micro-batch x accumulation x processes = {before}), or "
        "start a fresh run in another --output_dir.")


# The training set in a checkpoint's step meaning: its identity (``data.training_set_identity``: samples, a
# fingerprint of the tokenized rows as a set and one of the rows in order) and the flags that decide which rows are
# held out for validation instead of trained on. A resume is bound to it (``training_set_change``).
DATA = "training_set"
HELD_OUT_FLAGS = ("validation_file", "dataset_test_split")
ORDER = "order_fingerprint"  # not in checkpoints recorded before it: those are compared as a set of rows


def data_meaning(config, identity: dict | None) -> dict:
    """The step meaning's ``DATA`` entry for a run on the training set ``identity``
    (``data.training_set_identity``), with the held-out flags of ``config``; {} where the identity is unknown."""
    if identity is None:
        return {}
    return {DATA: {**identity, **{name: getattr(config, name, None) for name in HELD_OUT_FLAGS}}}


def training_set_change(saved: dict, meaning: dict) -> str | None:
    """How this launch's training set differs from the one checkpoint ``saved`` was trained on, as "25 training
    samples, 20 in the checkpoint's run (--validation_file: checkpoint None, now 'dev.csv')" or "the same 10
    training samples as in the checkpoint's run, in another order (...)", or None where it is the same (equal
    sample counts and fingerprints, and order fingerprints where the checkpoint records one) or the checkpoint
    predates the record (before round 5)."""
    before, now = saved.get(DATA), meaning.get(DATA)
    if not before or not now:
        return None
    keys = ("samples", "fingerprint", ORDER) if ORDER in before else ("samples", "fingerprint")
    if all(before[key] == now.get(key) for key in keys):
        return None
    if before["samples"] != now["samples"]:
        what = f"{now['samples']} training samples, {before['samples']} in the checkpoint's run"
    elif before["fingerprint"] == now["fingerprint"]:
        what = (f"the same {now['samples']} training samples as in the checkpoint's run, in another order (order "
                f"fingerprint {now[ORDER]}, checkpoint {before[ORDER]})")
    else:
        what = (f"{now['samples']} training samples as in the checkpoint's run, but other ones (fingerprint "
                f"{now['fingerprint']}, checkpoint {before['fingerprint']})")
    flags = [f"--{name}: checkpoint {before.get(name)!r}, now {now.get(name)!r}" for name in HELD_OUT_FLAGS
             if before.get(name) != now.get(name)]
    source = [f"--{name} {meaning[name]!r}" for name in ("train_file", "dataset_name") if meaning.get(name)]
    if meaning.get("dataset_mixture"):  # which source changed is in the two mixtures; the flag names them
        source = ["--dataset_mixture (the datasets: section)"]
    if flags:
        return f"{what} ({'; '.join(flags)}: another split of rows held out for validation)"
    return f"{what} (the data of {source[0] if source else 'the recipe'} changed)"


def check_training_set(saved: dict, meaning: dict, path, allow: bool) -> str | None:
    """Refuse a resume on another training set (``training_set_change``): its steps would train other samples,
    the epoch's position would skip or repeat rows, and the schedule, sized in optimizer steps from the set's
    size, would be re-sized mid-run. Raises ``FinetuneError`` naming the change and the fix; with ``allow``
    (``--ignore_checkpoint_mismatch``) returns the change for the banner instead. None: the same training set."""
    change = training_set_change(saved, meaning)
    if change is None or allow:
        return change
    effect = "samples of the current epoch are trained twice or not at all"
    if saved[DATA]["samples"] != meaning[DATA]["samples"]:
        effect = f"the schedule is re-sized, and {effect}"
    raise FinetuneError(
        f"cannot resume from {path}: this launch trains on another training set: {change}. Resume with the "
        "checkpoint's data and flags, start a fresh run in another --output_dir, or pass "
        f"--ignore_checkpoint_mismatch to continue on the new data ({effect}).")


def step_differences(saved: dict, meaning: dict) -> list[str]:
    """The settings of ``meaning`` (a step's meaning now) that differ from ``saved`` (the checkpoint's), as
    "name: checkpoint X, now Y", leaving out the split (``SPLIT_FIELDS``), B (``check_batch`` judges them) and the training set
    (``check_training_set``), and the settings a checkpoint written before they existed does not record (the
    preference flags)."""
    return [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in meaning.items()
            if k not in SPLIT_FIELDS and k not in (TOTAL, DATA) and k in saved and saved[k] != v]


def samples_done(progress, saved: dict) -> int:
    """Samples of the epoch's seeded order a checkpoint's run consumed (positions, over all processes): its
    ``samples_done``, or for a checkpoint that counted micro-batches per process only (before elastic resume),
    ``micro_batches_done`` x m x P of the split it was taken under."""
    if progress.samples_done or not progress.micro_batches_done:
        return progress.samples_done
    return progress.micro_batches_done * saved["per_device_train_batch_size"] * saved["num_processes"]


def micro_batches_to_skip(samples: int, micro_batch: int, num_processes: int) -> int:
    """Micro-batches per process to skip so that ``samples`` positions of the seeded order are consumed on a
    launch of ``num_processes`` processes with ``micro_batch`` rows each: samples / (m x P). Raises
    ``FinetuneError`` when that is not whole (the resume would replay or skip samples)."""
    per_round = micro_batch * num_processes
    if samples % per_round:
        raise FinetuneError(
            f"cannot resume exactly: the checkpoint's run consumed {samples} samples of its epoch, not a whole number "
            f"of this launch's micro-batches ({micro_batch} x {num_processes} process(es) = {per_round} samples), so "
            "some would be trained twice or not at all. Resume with the checkpoint's effective batch "
            "(--total_batch_size), or start a fresh run.")
    return samples // per_round


def resume_position(progress, saved: dict, meaning: dict, dataset_length: int) -> tuple[int, int]:
    """(samples done of the epoch, micro-batches per process to skip) for resuming checkpoint progress
    ``progress`` (its split ``saved``) on the launch ``meaning`` (``batch_meaning``) over a training set of
    ``dataset_length`` samples. A checkpoint taken after an epoch's last step counts the positions its last
    micro-batches covered, up to m x P - 1 past the end: the epoch is done, every micro-batch of it is skipped.
    Raises ``FinetuneError`` as ``micro_batches_to_skip``."""
    samples = samples_done(progress, saved)
    micro_batch, processes = meaning["per_device_train_batch_size"], meaning["num_processes"]
    if samples >= dataset_length:
        return samples, math.ceil(dataset_length / (micro_batch * processes))
    return samples, micro_batches_to_skip(samples, micro_batch, processes)


def resume_change(saved: dict, meaning: dict) -> str | None:
    """The banner's line for a resume on another split, or None where the split is the checkpoint's:
    "resumed on 1 process from a run on 2: micro-batch 8 x 4 -> 8 x 8 (B = 64 samples per step)"."""
    before = [saved.get(name) for name in SPLIT_FIELDS]
    after = [meaning[name] for name in SPLIT_FIELDS]
    if before == after:
        return None
    p_before, p_now = before[2], after[2]
    where = (f"resumed on {p_now} process{'es' if p_now != 1 else ''} from a run on {p_before}" if p_before != p_now
             else f"resumed on {p_now} process{'es' if p_now != 1 else ''} as before")
    return (f"{where}: micro-batch {before[0]} x {before[1]} -> {after[0]} x {after[1]} "
            f"(B = {effective_batch(meaning)} samples per step)")


RNG_NOTE = ("random state: per-process generators cannot move to another process count; each process is re-seeded "
            "from (--seed, optimizer step, process index). Dropout masks from here differ from an uninterrupted run's; "
            "the data order does not (it comes from the seeded sampler).")


def processes_changed(saved: dict, meaning: dict) -> bool:
    """Whether the checkpoint was written by another number of processes (its random states do not carry over:
    Accelerate's ``load_state`` reads ``random_states_{process_index}.pkl``, accelerate 1.15 ``checkpointing.py``
    lines 292-318, and silently keeps the current state where that file is missing)."""
    return saved.get("num_processes") is not None and saved.get("num_processes") != meaning["num_processes"]


def reseed(seed: int, step: int) -> None:
    """Re-seed this process's generators from (``seed``, ``step``, its process index): deterministic, distinct per
    process (``accelerate.utils.set_seed(device_specific=True)`` adds the process index)."""
    from accelerate.utils import set_seed

    set_seed(seed + step, device_specific=True)


def refuse_trainer_split_change(saved: dict, meaning: dict, path) -> None:
    """The Trainer backend resumes only on the checkpoint's split: its ``group_by_length`` order is sized in the
    per-process batch m x N (transformers 5.24 ``trainer.py`` line 1101, ``LengthGroupedSampler(
    train_batch_size * gradient_accumulation_steps)``), so on another P it would train other samples per step.
    Raises ``FinetuneError`` naming both splits and the fix (``--backend accelerate`` resumes on another split)."""
    if effective_batch(saved) is None or all(saved.get(k) == meaning[k] for k in SPLIT_FIELDS):
        return
    raise FinetuneError(
        f"cannot resume {path} with --backend trainer on another split ({describe_split(saved)} -> "
        f"{describe_split(meaning)}): Trainer's resume is exact only on the checkpoint's split. Resume with "
        f"{describe_split(saved)}, or with --backend accelerate (it resumes any split of the same B).")


# ------------------------------------------------------------------------------------------ sample ids
class SampleIds(torch.utils.data.Dataset):
    """``dataset`` whose rows, when a dataloader fetches a batch of them (``__getitems__``, which torch's fetcher
    prefers: torch ``utils/data/_utils/fetch.py`` ``_MapDatasetFetcher``), carry their position (``SAMPLE_ID``) for
    ``with_sample_ids``; a row read alone (``dataset[i]``) and anything else are the dataset's own."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        return [{**self.dataset[i], SAMPLE_ID: i} for i in indices]

    def __getattr__(self, name):  # column_names, features, ...: the dataset's
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class with_sample_ids:  # noqa: N801 - used as a function; a class so it pickles (dataloader workers, spawn)
    """``collate`` that moves the rows' ``SAMPLE_ID`` into the batch as ``SAMPLE_IDS`` (int64, one per row);
    rows without it collate as before."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, features):
        if not features or SAMPLE_ID not in features[0]:
            return self.collate(features)
        ids = [feature[SAMPLE_ID] for feature in features]
        batch = self.collate([{k: v for k, v in feature.items() if k != SAMPLE_ID} for feature in features])
        batch[SAMPLE_IDS] = torch.tensor(ids, dtype=torch.long)
        return batch


def trim_ids(batch: dict, repeats: int) -> dict:
    """``batch`` with the ids of its last ``repeats`` rows (repeated samples, not trained) dropped."""
    if repeats and SAMPLE_IDS in batch:
        ids = batch[SAMPLE_IDS]
        batch = {**batch, SAMPLE_IDS: ids[: ids.shape[0] - repeats]}
    return batch


def id_hash(ids) -> int:
    """The multiset hash of sample ids (an iterable of ints): the sum of each id's 40-bit blake2b hash. Order-
    independent and additive, so each process hashes its own rows and one all-reduce sums them; a replayed or
    skipped sample changes it."""
    return sum(int.from_bytes(hashlib.blake2b(int(i).to_bytes(8, "little"), digest_size=5).digest(), "little")
               for i in ids)


def format_hash(value: int) -> str:
    """The log's form of an ``id_hash``: 16 hex digits."""
    return f"{value & (2 ** 64 - 1):016x}"


def window_ids_hash(window: list[dict], accelerator) -> str | None:
    """Pop ``SAMPLE_IDS`` from each micro-batch of ``window`` and return the hash of the window's sample ids over
    all processes (``format_hash``; one all-reduce), or None where the batches carry none (collective: every
    process calls it)."""
    ids = [b.pop(SAMPLE_IDS) for b in window if SAMPLE_IDS in b]
    if not ids:
        return None
    local = torch.tensor(id_hash(torch.cat(ids).tolist()), dtype=torch.long, device=accelerator.device)
    return format_hash(int(accelerator.reduce(local, "sum").item()))
