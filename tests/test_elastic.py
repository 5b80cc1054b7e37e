"""Elastic resume's pure parts (finetune/lifecycle/elastic.py): what a step means (B, not its split), where a resume on another
split starts, the per-step sample-id hash, and the refusals. The claim that a step's samples depend only on B is
checked here against Accelerate's own samplers (``BatchSamplerShard``, ``SkipBatchSampler``), with the old
per-process skip as the positive control; tests/test_elastic_resume.py runs it through the launcher."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from torch.utils.data import BatchSampler, DataLoader

from finetune.errors import FinetuneError
from finetune.lifecycle import elastic
from finetune.lifecycle.checkpoint import RunProgress, check_compatible
from finetune.lifecycle.window import mask_repeats, repeated_rows


def _meaning(m, n, p, **rest):
    return {"recipe": "r", "seed": 1, **elastic.batch_meaning(SimpleNamespace(per_device_train_batch_size=m,
                                                                              gradient_accumulation_steps=n), p), **rest}


def test_a_step_means_b_not_its_split():
    saved, now = _meaning(2, 2, 2), _meaning(2, 4, 1)
    assert saved[elastic.TOTAL] == now[elastic.TOTAL] == 8
    check_compatible(RunProgress(step_meaning=saved), now, "ckpt", allow=False)  # no refusal
    with pytest.raises(FinetuneError, match=r"B = 8 samples per optimizer step \(2 x 2 x 2 processes\), this "
                                            r"launch's is B = 16 \(4 x 2 x 2 processes\).*--total_batch_size 8"):
        check_compatible(RunProgress(step_meaning=saved), _meaning(4, 2, 2), "ckpt", allow=False)
    with pytest.raises(FinetuneError, match="seed: checkpoint 1, now 2"):
        check_compatible(RunProgress(step_meaning=saved), _meaning(2, 4, 1, seed=2), "ckpt", allow=False)


def test_a_checkpoint_from_before_elastic_resume_reads():
    """Old checkpoints recorded the split (m, N, P) but not B, and counted micro-batches per process only."""
    old = {"recipe": "r", "seed": 1, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
           "num_processes": 2}
    assert elastic.effective_batch(old) == 8
    check_compatible(RunProgress(step_meaning=old), _meaning(4, 2, 1), "ckpt", allow=False)
    progress = RunProgress(micro_batches_done=6, step_meaning=old)  # 3 steps of 2 micro-batches per process
    assert elastic.resume_position(progress, old, _meaning(4, 2, 1), 100) == (24, 6)
    assert elastic.resume_position(progress, old, _meaning(1, 8, 1), 100) == (24, 24)


def test_resume_position_counts_samples_in_the_new_plan():
    saved = _meaning(2, 2, 2)
    progress = RunProgress(micro_batches_done=4, samples_done=16, step_meaning=saved)  # 2 steps of B = 8
    assert elastic.resume_position(progress, saved, _meaning(2, 4, 1), 34) == (16, 8)
    assert elastic.resume_position(progress, saved, _meaning(4, 2, 1), 34) == (16, 4)
    assert elastic.resume_position(progress, saved, _meaning(1, 2, 4), 34) == (16, 4)
    # after an epoch's last step the count passes the end (m x P rows per round): every micro-batch is done
    done = RunProgress(micro_batches_done=9, samples_done=36, step_meaning=saved)
    assert elastic.resume_position(done, saved, _meaning(8, 1, 1), 34) == (36, 5)
    # under --ignore_checkpoint_mismatch a changed B gets through check_batch, never a replay or a skip
    with pytest.raises(FinetuneError, match="consumed 16 samples.*not a whole number.*3 x 2"):
        elastic.resume_position(progress, saved, _meaning(3, 1, 2), 34)


def _steps(order, m, n, p, skip=0, steps=None):
    """Each optimizer step's sample ids over every process, as Accelerate's sharded sampler deals ``order`` to
    ``p`` processes in micro-batches of ``m`` (``even_batches``: the last ones completed from the start, then
    dropped as ``window.repeated_rows`` says; one process is not sharded: accelerate 1.15 ``data_loader.py``
    ``prepare_data_loader``, ``if num_processes != 1``) and a window takes ``n`` of each process's; ``skip``:
    micro-batches per process skipped first (``skip_first_batches``' ``SkipBatchSampler``)."""
    per_process = []
    for rank in range(p):
        shard = BatchSampler(order, m, drop_last=False)
        if p > 1:
            shard = BatchSamplerShard(shard, num_processes=p, process_index=rank)
        batches = list(SkipBatchSampler(shard, skip) if skip else shard)
        per_process.append([b[:m - repeated_rows(skip + i, m, p, rank, len(order))] for i, b in enumerate(batches)])
    windows = max(len(b) for b in per_process) // n + bool(max(len(b) for b in per_process) % n)
    result = [sorted(i for batches in per_process for b in batches[w * n:(w + 1) * n] for i in b)
              for w in range(windows)]
    return result[:steps] if steps else result


def test_each_step_holds_the_same_samples_on_every_split_of_b():
    order = torch.randperm(34, generator=torch.Generator().manual_seed(5)).tolist()
    expected = [sorted(order[i:i + 8]) for i in range(0, 34, 8)]
    for m, n, p in [(2, 2, 2), (2, 4, 1), (4, 2, 1), (1, 4, 2), (8, 1, 1), (1, 2, 4)]:
        assert _steps(order, m, n, p) == expected, (m, n, p)


def test_the_new_skip_resumes_the_same_samples_and_the_old_one_does_not():
    """2 processes (2 x 2) stopped after step 2, resumed on 1 process (2 x 4): the skip in samples continues with
    steps 3..5 of the uninterrupted run; the old skip (micro_batches_done per process unchanged) replays."""
    order = torch.randperm(34, generator=torch.Generator().manual_seed(5)).tolist()
    full = _steps(order, 2, 2, 2)
    saved = _meaning(2, 2, 2)
    progress = RunProgress(micro_batches_done=4, samples_done=16, step_meaning=saved)
    _, skip = elastic.resume_position(progress, saved, _meaning(2, 4, 1), len(order))
    assert _steps(order, 2, 4, 1, skip=skip) == full[2:]
    old = _steps(order, 2, 4, 1, skip=progress.micro_batches_done)
    assert old != full[2:] and set(old[0]) & set(full[1])  # a sample of step 2 trained again


def test_sample_ids_reach_the_batch_and_hash_order_free():
    rows = [{"input_ids": [i, i + 1], "labels": i % 2} for i in range(10)]
    loader = DataLoader(elastic.SampleIds(rows), batch_size=4, shuffle=False,
                        collate_fn=elastic.with_sample_ids(lambda f: {"labels": torch.tensor([r["labels"] for r in f])}))
    batches = list(loader)
    assert [b[elastic.SAMPLE_IDS].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert elastic.SampleIds(rows)[3] == rows[3]  # a row read alone stays the dataset's (verify reads them so)
    assert elastic.id_hash([3, 1, 2]) == elastic.id_hash([1, 2, 3]) == elastic.id_hash([1]) + elastic.id_hash([2, 3])
    assert elastic.id_hash([1, 2, 2]) != elastic.id_hash([1, 2, 3])  # a replayed sample shows
    accelerator = SimpleNamespace(device=torch.device("cpu"), reduce=lambda t, op: t)
    window = [dict(b) for b in batches[:2]]
    assert elastic.window_ids_hash(window, accelerator) == elastic.format_hash(elastic.id_hash(range(8)))
    assert all(elastic.SAMPLE_IDS not in b for b in window)  # taken out: no model input


def test_repeated_rows_lose_their_ids():
    # 5 samples, micro-batch 2, 2 processes: global micro-batch 2 (process 0's second) holds sample 4 and a repeat
    batch = {"labels": torch.tensor([1, 1]), elastic.SAMPLE_IDS: torch.tensor([4, 0])}
    (masked,) = mask_repeats([batch], 1, 2, 2, 0, 5, -100)
    assert masked["labels"].tolist() == [1, -100] and masked[elastic.SAMPLE_IDS].tolist() == [4]


def test_refusals_name_the_fix():
    two, one = _meaning(2, 2, 2), _meaning(2, 4, 1)
    from accelerate.utils import DistributedType

    from finetune.engine import engine_for

    def engine(kind):  # an accelerator stand-in: Accelerate's FSDP plugin defaults to FSDP1
        return engine_for(SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=None)))

    with pytest.raises(FinetuneError, match="ds_to_universal.py.*Resume on 2 processes|Resume on 2 processes.*ds_to_univ"):
        engine(DistributedType.DEEPSPEED).resume_on_another_count(2, 1, "ckpt")
    with pytest.raises(FinetuneError, match="FSDP checkpoint written by 2 processes on 1.*Resume on 2 processes"):
        engine(DistributedType.FSDP).resume_on_another_count(2, 1, "ckpt")  # FSDP1: tests/test_elastic_fsdp.py
    assert engine(DistributedType.MULTI_CPU).resume_on_another_count(2, 1, "ckpt") is None
    with pytest.raises(FinetuneError, match=r"--backend trainer on another split \(2 x 2 x 2 processes -> 2 x 4 x 1 "
                                            r"process\).*--backend accelerate"):
        elastic.refuse_trainer_split_change(two, one, "ckpt")
    elastic.refuse_trainer_split_change(two, _meaning(2, 2, 2), "ckpt")
    assert elastic.resume_change(two, one) == "resumed on 1 process from a run on 2: micro-batch 2 x 2 -> 2 x 4 (B = 8 " \
                                              "samples per step)"
    assert elastic.resume_change(two, two) is None
