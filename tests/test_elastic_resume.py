"""Elastic resume through the real CLI (docs/resume.md): a run on 2 gloo processes checkpointed at step 7 and
resumed on 1 process with another split of the same effective batch trains the uninterrupted run's samples in
every step (the log's sample-id hashes), its losses to 1e-6 and its weights within the noise floor (dropout off);
the same for a micro-batch change on one process (4 x 2 -> 2 x 4) and for 1 process resumed on 2. The positive control resumes with the old
per-process skip (``micro_batches_done`` unchanged on the new launch), installed from here: its hashes differ and
its weights leave the floor."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import REPO, launch, load_params, run_args_in_process, run_in_process, train_steps

from finetune.lifecycle import elastic

pytestmark = pytest.mark.integration

# 34 samples, B = 8: 5 steps per epoch (the last of 2 samples; on 2 processes of 2-row micro-batches the epoch's
# 18th micro-batch repeats a sample, masked), 2 epochs = 10 steps; the checkpoint at step 7 is mid-epoch 1.
RUN = dict(max_train_samples=34, max_eval_samples=4, num_train_epochs=2, max_length=32, learning_rate=1e-3,
           warmup_steps=2, seed=11, eval_strategy="no", save_strategy="steps", save_steps=7, disable_dropout="true")
STOP = 7
FLOOR = 1e-6  # verify's floor for fp32: relative difference of the whole model (DESIGN.md, issue 28)


def _args(model: str, out, m: int, n: int, **extra) -> list[str]:
    flags = {**RUN, "per_device_train_batch_size": m, "gradient_accumulation_steps": n, **extra}
    return ["--recipe", "bbc-news", "--output_dir", str(out), "--model_name_or_path", model,
            *[part for k, v in flags.items() for part in (f"--{k}", str(v))]]


def _stopped_copy(reference, target):
    """``reference``'s output directory as a run stopped after step ``STOP`` leaves it: its checkpoint and log (a
    checkpoint taken on the way is the one a SIGTERM at that step writes: both are taken at a step boundary)."""
    target.mkdir()
    shutil.copytree(reference / "checkpoints", target / "checkpoints")
    for name in ("log.jsonl", "run_config.json"):  # the log is cut back to step 7 by the resume
        shutil.copy(reference / name, target / name)


def _relative_gap(a: dict, b: dict) -> float:
    diff = torch.cat([(a[k].float() - b[k].float()).flatten() for k in sorted(b)])
    whole = torch.cat([b[k].float().flatten() for k in sorted(b)])
    return float(diff.norm() / whole.norm())


def _hashes(out) -> list[str]:
    return [r["sample_ids"] for r in train_steps(out)]


def _seeded_order_hashes(n: int, b: int, seed: int, epochs: int) -> list[str]:
    """Each step's hash from the order alone: Accelerate's ``SeedableRandomSampler`` draws ``randperm(n)`` from a
    generator seeded with data_seed + epoch (accelerate 1.15 ``data_loader.py`` lines 94-103; torch ``RandomSampler``)
    and step w of an epoch holds its positions [w x B, (w + 1) x B)."""
    hashes = []
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        hashes += [elastic.format_hash(elastic.id_hash(order[i:i + b])) for i in range(0, n, b)]
    return hashes


def test_two_processes_resumed_on_one_and_the_old_skip_as_control(tmp_path, tiny_bert, monkeypatch, capsys):
    reference = tmp_path / "two"
    result = launch(_args(tiny_bert, reference, 2, 2), num_processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    full = train_steps(reference)
    assert [r["step"] for r in full] == list(range(1, 11))
    assert _hashes(reference) == _seeded_order_hashes(34, 8, RUN["seed"], 2)  # each step: B positions of the order
    assert [r["samples"] for r in full] == [8, 8, 8, 8, 2] * 2

    resumed = tmp_path / "one"
    _stopped_copy(reference, resumed)
    # the one-process resume in this process (the launcher is the 2-process run's; the same argv, on the CPU)
    capsys.readouterr()
    run_args_in_process(_args(tiny_bert, resumed, 2, 4, resume_from_checkpoint="latest"))
    stdout = capsys.readouterr().out
    assert "resumed on 1 process from a run on 2: micro-batch 2 x 2 -> 2 x 4 (B = 8 samples per step)" in stdout
    assert "random state: per-process generators cannot move" in stdout
    steps = train_steps(resumed)
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert _hashes(resumed) == _hashes(reference)
    for mine, theirs in zip(steps[STOP:], full[STOP:]):
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-6, (mine, theirs)
    floor_gap = _relative_gap(load_params(resumed), load_params(reference))
    print(f"2 processes (2 x 2) -> 1 (2 x 4) at step {STOP}: relative weight gap {floor_gap:.3g}, largest loss "
          f"difference {max(abs(a['loss'] - b['loss']) for a, b in zip(steps, full)):.3g}")  # docs/resume.md
    assert floor_gap < FLOOR, floor_gap

    # the positive control: the old skip, micro-batches per process carried over unchanged (4 here, 8 are due)
    def old_skip(progress, saved, meaning, dataset_length):
        return progress.samples_done, progress.micro_batches_done

    monkeypatch.setattr(elastic, "resume_position", old_skip)
    control = tmp_path / "control"
    _stopped_copy(reference, control)
    run_in_process(tmp_path, "control", model_name_or_path=tiny_bert, per_device_train_batch_size=2,
                   gradient_accumulation_steps=4, resume_from_checkpoint="latest", **RUN)
    replayed = _hashes(control)
    control_gap = _relative_gap(load_params(control), load_params(reference))
    print(f"the old per-process skip: steps with other samples {sum(a != b for a, b in zip(replayed, _hashes(reference)))}"
          f" of {len(replayed)}, relative weight gap {control_gap:.3g}")
    assert replayed[:STOP] == _hashes(reference)[:STOP] and replayed[STOP] != _hashes(reference)[STOP]
    assert control_gap > 100 * FLOOR


def test_one_process_resumed_as_2x4_and_on_two_processes(tmp_path, tiny_bert):
    """4 x 2 on one process (in-process), resumed at step 7 as 2 x 4 (another GPU's memory) and, through the
    launcher, on 2 processes as 2 x 2 (the reverse of the test above): the same samples in every step, the losses
    to 1e-6, the weights within the floor."""
    _, reference = run_in_process(tmp_path, "four", model_name_or_path=tiny_bert, per_device_train_batch_size=4,
                                  gradient_accumulation_steps=2, **RUN)
    assert _hashes(reference) == _seeded_order_hashes(34, 8, RUN["seed"], 2)
    _stopped_copy(reference, tmp_path / "two")
    _, resumed = run_in_process(tmp_path, "two", model_name_or_path=tiny_bert, per_device_train_batch_size=2,
                                gradient_accumulation_steps=4, resume_from_checkpoint="latest", **RUN)
    wider = tmp_path / "wider"
    _stopped_copy(reference, wider)
    result = launch(_args(tiny_bert, wider, 2, 2, resume_from_checkpoint="latest"), num_processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed on 2 processes from a run on 1: micro-batch 4 x 2 -> 2 x 2 (B = 8 samples per step)" in result.stdout
    for out, what in ((resumed, "1 process 4 x 2 -> 2 x 4"), (wider, "1 process 4 x 2 -> 2 processes 2 x 2")):
        assert _hashes(out) == _hashes(reference), what
        for mine, theirs in zip(train_steps(out)[STOP:], train_steps(reference)[STOP:]):
            assert abs(mine["loss"] - theirs["loss"]) <= 1e-6, (what, mine, theirs)
        gap = _relative_gap(load_params(out), load_params(reference))
        print(f"{what} at step {STOP}: relative weight gap {gap:.3g}")
        assert gap < FLOOR, (what, gap)


def test_elastic_kill_campaign_ci_variant(tmp_path):
    """``bench/kill_anywhere.py --elastic``, short: 2 SIGKILLs at seeded moments, each restart on a random process
    count (1 or 2); every directory resumable, nothing hung, the finished run's per-step sample ids the
    uninterrupted run's and its weights within the floor."""
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "kill_anywhere.py"), "--elastic", "--smoke",
                             "--kills", "2", "--seed", "5", "--json", str(report), "--work_dir", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(report.read_text())["summary"]
    assert summary["kills"] == 2 and summary["unresumable_directories"] == 0 and summary["hangs"] == 0, summary
    assert summary["rounds"] and all(r["sample_ids_equal"] and r["relative_weight_gap"] < FLOOR
                                     for r in summary["rounds"]), summary
