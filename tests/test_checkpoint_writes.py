"""Checkpoint writes that fail: each error type the writers raise on a full disk (torch.save's RuntimeError,
safetensors' SafetensorError, the tokenizers library's plain Exception, OSError), in every stage of the save, on
one process and on one rank of two, and a real full disk (a small tmpfs, where mounting is permitted). Every
time: one ``error:`` line per rank, exit 2, no hang, the partial write removed, the previous checkpoint intact
and resumable."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import uuid

import pytest

from finetune.errors import FinetuneError
from helpers import fault_env, launch, run_in_process, train_steps

# 24 samples, micro 2 x accumulation 2: 6 optimizer steps; checkpoints after steps 2 and 4 (not after the last)
RUN = dict(max_train_samples=24, max_eval_samples=8, per_device_train_batch_size=2, gradient_accumulation_steps=2,
           num_train_epochs=1, max_length=32, learning_rate=1e-3, warmup_steps=0, seed=11, eval_strategy="no",
           save_steps=2)


def _main_in_process(tmp_path, name: str, capsys, **overrides) -> tuple[int, list[str]]:
    """``finetune.run.main`` in this process (the CLI's own error handling); returns (exit code, the
    ``error:`` lines it printed)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from finetune.run import main

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    argv = ["--recipe", "bbc-news", "--output_dir", str(tmp_path / name)]
    for key, value in overrides.items():
        argv += [f"--{key}", str(value)]
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error: ")]


def _assert_only_the_previous_checkpoint(out, step: int = 2) -> None:
    from finetune.checkpoint import is_complete, verify_checkpoint

    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [f"step_{step:08d}"]  # no partial, no temporary folder
    assert is_complete(root / f"step_{step:08d}") and verify_checkpoint(root / f"step_{step:08d}")


def _in_checkpoint(path) -> bool:
    return ".tmp-step_00000004" in str(path)


def _tokenizer_fails(monkeypatch):
    """tokenizer.json is written by the tokenizers library (``Tokenizer.save``, Rust), which raises a plain
    ``Exception`` on a full disk ("No space left on device (os error 28)", measured on a full tmpfs)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    original = TokenizersBackend._save_pretrained

    def failing(self, save_directory, *args, **kwargs):
        if _in_checkpoint(save_directory):
            raise Exception("No space left on device (os error 28)")
        return original(self, save_directory, *args, **kwargs)

    monkeypatch.setattr(TokenizersBackend, "_save_pretrained", failing)


def _fsync_fails(monkeypatch):
    """The commit stage: fsync before the ``COMPLETE`` marker fails (an I/O error reported late)."""
    original = os.fsync

    def failing(fd):
        if _in_checkpoint(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EIO, "Input/output error")
        return original(fd)

    monkeypatch.setattr(os, "fsync", failing)


@pytest.mark.parametrize("inject, expected", [
    (lambda faults, mp: faults.save_error("RuntimeError", 0, 4), "RuntimeError: [enforce fail at inline_container"),
    (lambda faults, mp: faults.save_error("SafetensorError", 0, 4), "SafetensorError: Error while serializing"),
    (lambda faults, mp: _tokenizer_fails(mp), "Exception: No space left on device (os error 28)"),
    (lambda faults, mp: _fsync_fails(mp), "OSError: [Errno 5] Input/output error"),
], ids=["torch.save-RuntimeError", "safetensors-SafetensorError", "tokenizers-Exception", "fsync-OSError"])
def test_each_writer_error_is_one_error_line_and_keeps_the_previous_checkpoint(tmp_path, tiny_bert, faults,
                                                                              monkeypatch, capsys, inject, expected):
    """The write of step 4's checkpoint fails with what that writer really raises: the CLI prints one
    ``error:`` line naming the type and exits 2; step 2's checkpoint is intact, verifies and resumes (before:
    the tokenizers library's plain ``Exception`` and a failing fsync escaped as a traceback)."""
    inject(faults, monkeypatch)
    code, errors = _main_in_process(tmp_path, "run", capsys, model_name_or_path=tiny_bert, **RUN)
    assert code == 2, errors
    assert len(errors) == 1, errors
    assert "writing checkpoint step_00000004 failed" in errors[0] and expected in errors[0], errors[0]
    assert "the previous checkpoints are intact" in errors[0] and "--resume_from_checkpoint latest" in errors[0]
    out = tmp_path / "run"
    _assert_only_the_previous_checkpoint(out)
    assert not (out / "model.safetensors").exists()

    faults.undo()
    monkeypatch.undo()
    metrics, _ = run_in_process(tmp_path, "run", model_name_or_path=tiny_bert, resume_from_checkpoint="latest", **RUN)
    assert metrics["resumed_from"].endswith("step_00000002")
    assert [r["step"] for r in train_steps(out)] == list(range(1, 7))


# ------------------------------------------------------------------------------------------ through the launcher
@pytest.mark.integration
def test_one_rank_of_two_fails_to_write_every_rank_stops_with_one_error(tmp_path, tiny_bert):
    """Two gloo processes; only rank 1's write of step 4's checkpoint fails (its torch.save of its random state
    raises RuntimeError: ``tests/faults``, FAULT_SAVE_ERROR). Both ranks print the same ``error:`` line and exit
    non-zero, nobody hangs (the launch has a time limit), step 2's checkpoint is intact and a resume on two
    processes finishes the run."""
    args = ["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(tmp_path / "run"),
            *[f"--{k}={v}" for k, v in {**RUN, "max_train_samples": 48}.items()]]  # 48 / (2 x 2 x 2) = 6 steps
    failed = launch(args, num_processes=2, timeout=300, env=fault_env(save_error="RuntimeError@rank1@step4"))
    assert failed.returncode != 0
    # each rank prints its line (the ranks share the launcher's stderr: one may land after a progress bar)
    errors = [line[line.index("error: "):] for line in failed.stderr.splitlines() if "error: " in line]
    assert len(errors) == 2 and errors[0] == errors[1], failed.stderr[-4000:]
    assert "writing checkpoint step_00000004 failed on rank 1 (accelerator.save_state: RuntimeError" in errors[0]
    assert "Traceback" not in failed.stderr.split("error: ")[0], failed.stderr[-4000:]  # only the launcher's after
    out = tmp_path / "run"
    _assert_only_the_previous_checkpoint(out)

    resumed = launch([*args, "--resume_from_checkpoint", "latest"], num_processes=2, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in train_steps(out)] == list(range(1, 7))


# ------------------------------------------------------------------------------------------ a real full disk
@contextlib.contextmanager
def _small_disk(path, megabytes: float):
    """A tmpfs of ``megabytes`` mounted at ``path`` (root with CAP_SYS_ADMIN only; else the test is skipped)."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(megabytes * 1024)}k",
                              f"finetune-test-{uuid.uuid4().hex[:8]}", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)
        if os.path.ismount(path):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


# A checkpoint of the tiny BERT is ~12.2 MiB, written in this order: model.safetensors (3.8 MiB, safetensors),
# optimizer.bin (7.7 MiB, torch.save), small states, tokenizer.json (0.7 MiB, tokenizers). The first checkpoint
# fits; the second runs out in the writer each size leaves too little room for.
@pytest.mark.parametrize("megabytes, writer", [(15, "SafetensorError"), (21, "RuntimeError"),
                                               (24, "No space left on device")],
                         ids=["weights-safetensors", "optimizer-torch.save", "tokenizer"])
def test_a_real_full_disk_keeps_the_previous_checkpoint(tmp_path, tiny_bert, capsys, megabytes, writer):
    with _small_disk(tmp_path / "disk", megabytes) as disk:
        code, errors = _main_in_process(disk, "run", capsys, model_name_or_path=tiny_bert, **RUN)
        assert code == 2 and len(errors) == 1, errors
        assert "writing checkpoint step_00000004 failed" in errors[0] and writer in errors[0], errors[0]
        assert "free" in errors[0]  # the free space is reported: torch.save's own message does not mention the disk
        out = disk / "run"
        _assert_only_the_previous_checkpoint(out)
        shutil.copytree(out, tmp_path / "copy")  # resume where there is room
    metrics, _ = run_in_process(tmp_path, "copy", model_name_or_path=tiny_bert, resume_from_checkpoint="latest",
                                **RUN)
    assert metrics["resumed_from"].endswith("step_00000002")
    assert [r["step"] for r in train_steps(tmp_path / "copy")] == list(range(1, 7))
