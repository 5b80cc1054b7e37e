"""Precomputed reference log-probabilities (``--precompute_ref_log_probs``, TRL's name): every pair's chosen and
rejected log-probability under the starting model, computed once before training and kept in
``<output_dir>/reference_logps/<split>-<key>.safetensors``, where the key hashes the model's weights, the precision
they are computed in (the policy's autocast) and the split's tokenized pairs in order (the columns are attached by
position). A resume (or another run into the same directory on the same model and pairs) reads the file back, bit
for bit, instead of computing again. The file is written once the output directory is prepared (``keep``, after
``--overwrite_output_dir`` cleared it), never before: a run refused before training writes nothing, and the run
that reads a file leaves it in place."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from finetune import distributed
from finetune.data.loading import training_set_identity
from finetune.distributed import is_main_process
from finetune.errors import FinetuneError
from finetune.tasks.base import unwrapped

FOLDER = "reference_logps"


def model_fingerprint(model) -> str:
    """16 hex digits of blake2b over every parameter's name, dtype, shape and bytes (the adapter's too): the
    model the reference log-probabilities were computed with. Cost: one pass over the weights (~0.5 s per
    500 MB)."""
    digest = hashlib.blake2b(digest_size=8)
    for name, parameter in unwrapped(model).named_parameters():
        tensor = parameter.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def reference_path(output_dir, split: str, model_key: str, dataset) -> Path:
    """Where ``split``'s reference log-probabilities are kept: keyed by the model and the split's tokenized pairs
    in order (``loading.training_set_identity``'s ``order_fingerprint``: the same pairs reordered are another
    file, since the columns are attached by position)."""
    identity = training_set_identity(dataset)
    key = hashlib.blake2b(f"{model_key}:{identity['samples']}:{identity['order_fingerprint']}".encode(),
                          digest_size=8).hexdigest()
    return Path(output_dir) / FOLDER / f"{split}-{key}.safetensors"


def compute(task, model, dataset, collator, batch_size: int, device) -> dict[str, torch.Tensor]:
    """Every pair's reference log-probabilities, (pairs,) float64 each, in the dataset's order, without
    gradients: the starting model, its adapter disabled where it has one (``PreferenceTask.reference_logps``)."""
    chosen, rejected = [], []
    training = model.training
    model.eval()
    model.to(device)
    try:
        for start in range(0, len(dataset), batch_size):
            batch = collator([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            batch = {k: v.to(device) for k, v in batch.items()}
            c, r = task.reference_logps(model, batch, starting=True)
            chosen.append(c.double().cpu())
            rejected.append(r.double().cpu())
    finally:
        model.train(training)
    empty = torch.zeros(0, dtype=torch.float64)
    return {"ref_chosen_logps": torch.cat(chosen) if chosen else empty,
            "ref_rejected_logps": torch.cat(rejected) if rejected else empty}


def _read_or_compute(task, model, dataset, collator, batch_size: int, device, path: Path, split: str):
    """(columns, "read back from" or "computed into") for one split: ``path`` read where a run wrote it, else
    ``compute``. Raises ``FinetuneError`` for a file that cannot be read or holds another number of pairs."""
    if path.is_file():
        try:
            columns = load_file(str(path))
        except Exception as err:  # safetensors raises several types for a damaged file
            raise FinetuneError(f"{path} cannot be read ({type(err).__name__}: {err}): delete it and the "
                                "reference log-probabilities are computed again.") from None
        how = "read back from"
    else:
        columns, how = compute(task, model, dataset, collator, batch_size, device), "computed into"
    if any(len(v) != len(dataset) for v in columns.values()):
        raise FinetuneError(f"{path} holds {len(columns['ref_chosen_logps'])} pairs, the {split} split "
                            f"{len(dataset)}: delete it and the reference log-probabilities are computed again.")
    return columns, how


def precomputed(task, model, tokenized, collator, config, device) -> tuple[object, dict[str, dict]]:
    """(``tokenized`` with each split's reference log-probabilities as two float64 columns
    (``preference.REFERENCE_COLUMNS``), the files to ``keep``: {file name: columns}). The main process reads them
    from ``reference_path`` where a run wrote them, else computes them (``compute``), and every process takes the
    main process's (one broadcast); nothing is written here. Prints where they came from. Collective where there
    are several processes. Raises ``FinetuneError`` on every process for a file that cannot be read."""
    if not tokenized:  # nothing to compute for (the planner's probes attach without data)
        return tokenized, {}
    model_key = f"{model_fingerprint(model)}:{task.autocast_dtype}"  # bf16 log-probabilities are another set
    out, files = {}, {}
    for split, dataset in tokenized.items():
        path = reference_path(config.output_dir, split, model_key, dataset)
        on_main = functools.partial(_read_or_compute, task, model, dataset, collator,
                                    config.per_device_eval_batch_size, device, path, split)
        found = distributed.agree(on_main if is_main_process() else lambda: None)  # an error: on every process
        if distributed.world_size() > 1:
            from accelerate.utils import broadcast_object_list

            found = broadcast_object_list([found])[0]
        columns, how = found
        for name in ("ref_chosen_logps", "ref_rejected_logps"):
            dataset = dataset.add_column(name, columns[name].tolist())
        out[split], files[path.name] = dataset, columns
        if is_main_process() and split == "train":
            print(f"reference log-probabilities of {len(dataset)} {split} pairs {how} {path}", flush=True)
    return type(tokenized)(out), files


def keep(output_dir, files: dict[str, dict]) -> None:
    """Write each of ``files`` ({file name: columns}, ``precomputed``'s) atomically into
    ``<output_dir>/reference_logps`` where it is not there yet. Called by the processes that write the output
    directory once it is prepared (``--overwrite_output_dir`` cleared it before). Raises ``FinetuneError`` for a
    file that cannot be written."""
    for name, columns in files.items():
        path = Path(output_dir) / FOLDER / name
        if path.is_file():  # read back: the same pairs under the same model
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
            save_file(columns, str(tmp))
            os.replace(tmp, path)
        except OSError as err:
            raise FinetuneError(f"cannot write the reference log-probabilities to {path}: {err}. Free space "
                                "or choose another --output_dir.") from None
