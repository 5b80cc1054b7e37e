"""Checkpoints damaged after they were marked complete (a file truncated, removed or changed) are found before
anything is loaded: ``manifest.json`` records every file's size and the small files' sha256, the ``COMPLETE``
marker the manifest's sha256. "latest" skips a damaged checkpoint with a warning naming the file and takes the
newest that verifies; an explicit path that fails is refused; checkpoints written before manifests still
resume (unverified, with a note). Killed saves and prunes leave no folder a resume could take."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import launch, load_params, run_in_process, train_steps

from finetune.errors import FinetuneError
from finetune.lifecycle.checkpoint import (
    HASH_LIMIT,
    MANIFEST,
    MARKER,
    find_resume_checkpoint,
    newest_complete_checkpoint,
    verify_checkpoint,
)

# 24 samples, micro 2 x accumulation 2: 6 optimizer steps; checkpoints after steps 2 and 4
RUN = dict(max_train_samples=24, max_eval_samples=8, per_device_train_batch_size=2, gradient_accumulation_steps=2,
           num_train_epochs=1, max_length=32, learning_rate=1e-3, warmup_steps=0, seed=11, eval_strategy="no",
           save_steps=2)


@pytest.fixture
def finished(tmp_path, tiny_bert, shared_runs):
    """A finished run with checkpoints after steps 2 and 4: (output dir, its final weights). Trained once per
    session; each test gets its own copy at ``tmp_path/run`` (where ``run_in_process(tmp_path, "run", ...)``
    resumes it), to damage as it likes."""
    _, trained = shared_runs.in_process(model_name_or_path=tiny_bert, **RUN)
    out = Path(shutil.copytree(trained, tmp_path / "run"))
    return out, load_params(out)


def test_the_manifest_records_every_file_and_the_marker_the_manifest(finished):
    out, _ = finished
    checkpoint = out / "checkpoints" / "step_00000004"
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    assert manifest["format"] == 1 and manifest["step"] == 4 and manifest["hash_limit"] == HASH_LIMIT
    on_disk = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == sorted(set(on_disk) - {MANIFEST, MARKER})
    for name, entry in manifest["files"].items():
        data = (checkpoint / name).read_bytes()
        assert entry["size"] == len(data)
        if len(data) <= HASH_LIMIT:
            assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        else:
            assert "sha256" not in entry  # the weights and the optimizer: sizes only, verification stays cheap
    for small in ("trainer_state.json", "random_states_0.pkl", "custom_checkpoint_0.pkl", "config.json"):
        assert "sha256" in manifest["files"][small], small  # the state files, the scheduler's included
    assert "sha256" not in manifest["files"]["optimizer.bin"] and "sha256" not in manifest["files"]["model.safetensors"]
    marker = (checkpoint / MARKER).read_text()
    assert marker == f"step 4\n{MANIFEST} sha256 {hashlib.sha256((checkpoint / MANIFEST).read_bytes()).hexdigest()}\n"
    assert verify_checkpoint(checkpoint) is True


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _same_size_change(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "optimizer.bin truncated": ("optimizer.bin", _truncate, "optimizer.bin has"),
    "model.safetensors truncated": ("model.safetensors", _truncate, "model.safetensors has"),
    "random state removed": ("random_states_0.pkl", lambda p: p.unlink(), "random_states_0.pkl is missing"),
    "trainer_state.json changed": ("trainer_state.json", _same_size_change,
                                   "trainer_state.json does not match the sha256"),
    "scheduler changed": ("custom_checkpoint_0.pkl", _same_size_change, "custom_checkpoint_0.pkl does not match"),
    "manifest removed": (MANIFEST, lambda p: p.unlink(), f"{MANIFEST} is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_skipped_by_latest(finished, capsys, damage):
    """A file of the newest checkpoint is damaged after its ``COMPLETE`` marker: "latest" warns naming the file
    and takes step 2; the path itself is refused naming the file and the fix (before: "latest" took it; a
    truncated or removed file then failed the resume, so "latest" could not resume the directory at all, and a
    same-size change of trainer_state.json resumed silently to other weights)."""
    out, _ = finished
    name, damage_it, expected = DAMAGE[damage]
    newest = out / "checkpoints" / "step_00000004"
    damage_it(newest / name)
    capsys.readouterr()
    assert find_resume_checkpoint(out, "latest").name == "step_00000002"
    warning = capsys.readouterr().out
    assert f"warning: skipping damaged checkpoint {newest}: {expected}" in warning, warning
    assert find_resume_checkpoint(out, "auto").name == "step_00000002"
    with pytest.raises(FinetuneError, match=f"checkpoint {newest} is damaged: {expected}.*--resume_from_checkpoint "
                                            "latest takes the newest one that verifies"):
        find_resume_checkpoint(out, str(newest))


def test_latest_resumes_from_the_newest_checkpoint_that_verifies_to_the_same_weights(tmp_path, tiny_bert, finished):
    out, weights = finished
    _truncate(out / "checkpoints" / "step_00000004" / "optimizer.bin")
    metrics, _ = run_in_process(tmp_path, "run", model_name_or_path=tiny_bert, resume_from_checkpoint="latest", **RUN)
    assert metrics["resumed_from"].endswith("step_00000002")
    assert [r["step"] for r in train_steps(out)] == list(range(1, 7))
    resumed = load_params(out)
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)  # bit-exact, one process
    assert verify_checkpoint(out / "checkpoints" / "step_00000004")  # written again, whole


def test_latest_with_every_checkpoint_damaged_is_one_clear_error(finished):
    """Every checkpoint damaged: "latest" and "auto" both refuse; "auto" names each checkpoint and why, and the
    ways on (before: "auto" returned None, a fresh start that deleted them under --overwrite_output_dir)."""
    out, _ = finished
    for step in (2, 4):
        (out / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").unlink()
    with pytest.raises(FinetuneError, match="latest: no complete checkpoint"):
        find_resume_checkpoint(out, "latest")
    with pytest.raises(FinetuneError) as refused:
        find_resume_checkpoint(out, "auto")
    message = str(refused.value)
    assert (f"--resume_from_checkpoint auto: no checkpoint under {out / 'checkpoints'} can be resumed "
            "(step_00000004: trainer_state.json is missing (it had ") in message
    assert "; step_00000002: trainer_state.json is missing" in message
    assert f"remove them (rm -r {out / 'checkpoints'})" in message and "--resume_from_checkpoint PATH" in message


def test_auto_with_overwrite_never_starts_over_damaged_checkpoints(finished, tiny_bert, capsys):
    """``--resume_from_checkpoint auto --overwrite_output_dir`` (a requeued job's command) over a directory whose
    every checkpoint is damaged (step 4's optimizer truncated, step 2's marker gone): exit 2 with one ``error:``
    line naming both and why, and nothing deleted (before: exit 0, a fresh run from step 0 that deleted them)."""
    from finetune.run import main

    out, _ = finished
    _truncate(out / "checkpoints" / "step_00000004" / "optimizer.bin")
    (out / "checkpoints" / "step_00000002" / MARKER).unlink()
    (out / "metrics.json").unlink()  # preempted: no finished run
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    capsys.readouterr()
    code = main(["--recipe", "bbc-news", "--output_dir", str(out), "--model_name_or_path", tiny_bert,
                 "--resume_from_checkpoint", "auto", "--overwrite_output_dir", "True",
                 *[f"--{k}={v}" for k, v in RUN.items()]])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and len(err.strip().splitlines()) == 1, err
    assert "step_00000004: optimizer.bin has" in errors[0]
    assert f"step_00000002: no {MARKER} marker" in errors[0]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before


def test_a_checkpoint_written_before_manifests_resumes_unverified_with_a_note(tmp_path, tiny_bert, finished, capsys):
    out, weights = finished
    for step in (2, 4):  # as the previous version wrote them
        checkpoint = out / "checkpoints" / f"step_{step:08d}"
        (checkpoint / MANIFEST).unlink()
        (checkpoint / MARKER).write_text(f"step {step}\n")
    assert verify_checkpoint(out / "checkpoints" / "step_00000004") is False
    capsys.readouterr()
    assert newest_complete_checkpoint(out, warn=True).name == "step_00000004"
    assert "note: checkpoint" in capsys.readouterr().out
    metrics, _ = run_in_process(tmp_path, "run", model_name_or_path=tiny_bert, resume_from_checkpoint="latest", **RUN)
    assert metrics["resumed_from"].endswith("step_00000004")
    assert all(torch.equal(load_params(out)[k], weights[k]) for k in weights)


def test_what_killed_saves_and_prunes_leave_is_never_resumed_and_is_cleared(tmp_path, tiny_bert, finished):
    """A save killed before its rename leaves ``.tmp-step_N``; one killed while replacing a checkpoint of the
    same step, ``.replaced-step_N``; a prune killed mid-delete, ``.deleting-step_N``. None is ever taken for a
    checkpoint, and the next save removes them (before: every killed save's folder stayed, full size)."""
    out, _ = finished
    root = out / "checkpoints"
    for leftover in (".tmp-step_00000006", ".replaced-step_00000004", ".deleting-step_00000002"):
        (root / leftover).mkdir()
        (root / leftover / "optimizer.bin").write_bytes(b"x" * 1000)
        (root / leftover / MARKER).write_text("step 0\n")
    assert find_resume_checkpoint(out, "latest").name == "step_00000004"
    run_in_process(tmp_path, "run", model_name_or_path=tiny_bert, resume_from_checkpoint=str(root / "step_00000002"),
                   save_total_limit=1, **RUN)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004"]


@pytest.mark.integration
def test_two_processes_agree_on_the_newest_checkpoint_that_verifies(tmp_path, tiny_bert):
    """Two gloo processes resume with "latest" after the newest checkpoint lost a file: both skip it and resume
    from the one before, and the run ends with the weights of an uninterrupted one."""
    args = ["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--disable_dropout",
            *[f"--{k}={v}" for k, v in {**RUN, "max_train_samples": 48}.items()]]  # 48 / (2 x 2 x 2) = 6 steps
    out = tmp_path / "run"
    first = launch([*args, "--output_dir", str(out)], num_processes=2, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    weights = load_params(out)
    (out / "checkpoints" / "step_00000004" / "random_states_1.pkl").unlink()
    resumed = launch([*args, "--output_dir", str(out), "--resume_from_checkpoint", "latest"], num_processes=2,
                     timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("skipping damaged checkpoint") + resumed.stderr.count("skipping damaged checkpoint") == 2
    assert "Resuming from " + str(out / "checkpoints" / "step_00000002") in resumed.stdout + resumed.stderr
    again = load_params(out)
    for name in weights:
        torch.testing.assert_close(again[name], weights[name], rtol=1e-5, atol=1e-6)
