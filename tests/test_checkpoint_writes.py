"""Checkpoint writes that fail: each error type the writers raise on a full disk (torch.save's RuntimeError,
safetensors' SafetensorError, the tokenizers library's plain Exception, OSError), in every stage of the save, on
one process and on one rank of two, and a real full disk (a small tmpfs, where mounting is permitted). Every
time: one ``error:`` line per rank, exit 2, no hang, the partial write removed, the previous checkpoint intact
and resumable."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
import uuid

import pytest
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
    from finetune.lifecycle.checkpoint import is_complete, verify_checkpoint

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
        out = disk / "run"
        _assert_only_the_previous_checkpoint(out)
        # named as a full disk, with the numbers: torch.save's own message does not mention the disk (before:
        # only "...; 0.2 MiB free on its disk" after the writer's text)
        named = re.search(r"\(no space left on (\S+): (\d+\.\d) MiB free, the checkpoint needs about (\d+\.\d) MiB "
                          r"\((accelerator\.save_state|writing model files and trainer state): ", errors[0])
        assert named, errors[0]
        assert named[1] == str(out / "checkpoints")
        mib = 1024 * 1024
        free_now = shutil.disk_usage(disk).free / mib  # the partial write is gone: what the error promised
        assert abs(float(named[2]) - free_now) <= 0.15, (named[2], free_now)
        previous = sum(f.stat().st_size for f in (out / "checkpoints" / "step_00000002").rglob("*") if f.is_file())
        assert float(named[3]) == round(previous / mib, 1) and float(named[2]) < float(named[3])
        shutil.copytree(out, tmp_path / "copy")  # resume where there is room
    metrics, _ = run_in_process(tmp_path, "copy", model_name_or_path=tiny_bert, resume_from_checkpoint="latest",
                                **RUN)
    assert metrics["resumed_from"].endswith("step_00000002")
    assert [r["step"] for r in train_steps(tmp_path / "copy")] == list(range(1, 7))


# ------------------------------------------------------------------------------------------ naming a full disk
def test_a_full_disk_is_named_with_the_free_space_and_the_size_needed(tmp_path, monkeypatch):
    """torch.save's RuntimeError on a full disk carries no errno ("[enforce fail at inline_container.cc:672] .
    unexpected pos 39166 vs 39054": torch/serialization.py's zip writer, c10::Error). A failure is named as a full
    disk when the exception chain holds ENOSPC, the writer says "No space left on device", or the disk has less
    room after the failure than the checkpoint needs (here: 1 MiB free plus the 2 MiB partial write, 12 MiB
    needed). ``shutil.disk_usage`` is replaced by one returning what it returns, a ``usage(total, used, free)``
    named tuple in bytes (CPython 3.11 ``Lib/shutil.py``: ``_ntuple_diskusage``, ``disk_usage`` on POSIX)."""
    from finetune.lifecycle import checkpoint

    mib = 1024 * 1024
    root, partial = tmp_path / "checkpoints", tmp_path / "checkpoints" / ".tmp-step_00000004"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"\0" * (2 * mib))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                        lambda path: type(usage)(usage.total, usage.total - mib, mib))

    def torch_save_on_a_full_disk():
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 39166 vs 39054")

    failure = checkpoint._Failure(0, root, partial, needed=lambda: 12 * mib)
    failure.run("accelerator.save_state", torch_save_on_a_full_disk)
    assert failure.report == {"rank": 0, "text": (
        f"no space left on {root}: 3.0 MiB free, the checkpoint needs about 12.0 MiB (accelerator.save_state: "
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 39166 vs 39054)")}

    # room enough after the failure: not a full disk, whatever the writer raised (an I/O error)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                        lambda path: type(usage)(usage.total, usage.total - 100 * mib, 100 * mib))
    failure = checkpoint._Failure(0, root, partial, needed=lambda: 12 * mib)
    failure.run("committing", lambda: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    assert failure.report["text"] == "committing: OSError: [Errno 5] Input/output error; 100.0 MiB free on its disk"

    # ENOSPC in the chain names it even where the estimate is missing or the space was freed since
    def wrapped():
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as err:
            raise RuntimeError("write failed") from err

    failure = checkpoint._Failure(0, root, partial)
    failure.run("writing model files and trainer state", wrapped)
    assert failure.report["text"] == (f"no space left on {root}: 102.0 MiB free (writing model files and trainer "
                                      "state: RuntimeError: write failed)")
