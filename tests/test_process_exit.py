"""How a launched command's processes end: every process leaves the process group together
(``distributed.leave``: ``gc.collect``, a barrier, then ``destroy_process_group``) once its work is done and its
models are dropped, so none exits with its gloo group alive while a peer is still busy (which can abort it in
interpreter teardown, exit -6), and the group's gloo threads are joined inside ``leave`` (a model still alive would
join them later with the GIL held, which can hang: docs/resume.md#leaving-the-process-group)."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port


def _leave_late_or_early(rank: int, port: int, folder: str) -> None:
    """Rank 0 arrives at ``leave`` 1 s after rank 1; each writes when it arrived and when ``leave`` returned."""
    from finetune import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 0:
        time.sleep(1.0)
    arrived = time.time()
    distributed.leave()
    left = time.time()
    distributed.leave()  # a second call does nothing
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"arrived": arrived, "left": left, "initialized": dist.is_initialized()}, f)


def test_leave_waits_for_every_process_then_ends_the_group(tmp_path):
    mp.spawn(_leave_late_or_early, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert not any(r["initialized"] for r in ranks)  # the group is destroyed on both
    assert ranks[1]["left"] >= ranks[0]["arrived"]  # rank 1 waited for the late rank 0 (no barrier: ~1 s early)


def _leave_with_a_model_in_a_cycle(rank: int, port: int, folder: str) -> None:
    """A DDP model trained one step, then dropped into an unreachable reference cycle; an object gather as the last
    collective (its tensors are Python's: a gloo worker needs the GIL to free them). Writes whether ``leave`` ended
    the group's Python handle (then its C++ group, and its gloo worker threads, went with it)."""
    import gc
    import weakref

    import torch
    from accelerate.utils import gather_object

    from finetune import distributed

    gc.disable()  # no collection by chance: leave() must do it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", ACCELERATE_USE_CPU="1")
    distributed.process_state()  # the product's way in: it starts the gloo group
    import torch.distributed.nn  # noqa: F401 - as the first DDP would: no-op when process_state imported it already
    handle = weakref.ref(dist.group.WORLD)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    cycle = {"model": model}
    cycle["self"] = cycle  # reachable from nothing once the names below go: only gc.collect frees it
    del model, cycle
    gathered = gather_object([rank])
    distributed.leave()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"gathered": gathered, "initialized": dist.is_initialized(), "handle_alive": handle() is not None},
                  f)


def test_leave_ends_the_group_when_the_model_sits_in_a_reference_cycle(tmp_path):
    """A model's DistributedDataParallel ``Reducer`` owns the group from C++ and frees it with the GIL held: if it
    outlives ``leave``, gloo's threads are joined at its release, and a worker that still needs the GIL hangs the
    process (CI: torchrun's SIGKILL 30 s after a stop). ``leave`` frees the cycle first, so the group's last owner is
    its Python handle, released in ``destroy_process_group``. Without ``gc.collect`` in ``leave``, or with
    ``torch.distributed.nn`` first imported after the group started (its functions would hold the handle as a
    default argument), the handle outlives ``leave`` and this fails."""
    mp.spawn(_leave_with_a_model_in_a_cycle, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["gathered"] for r in ranks] == [[0, 1], [0, 1]]
    assert [r["initialized"] for r in ranks] == [False, False]
    assert [r["handle_alive"] for r in ranks] == [False, False]


def test_leave_without_a_process_group_does_nothing():
    from finetune import distributed

    assert not dist.is_initialized()
    distributed.leave()
    assert not dist.is_initialized()


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
@pytest.mark.parametrize("push", [False, True])
def test_a_run_leaves_the_group_after_training_and_before_the_final_push(monkeypatch, backend, push):
    """``run.run``: the backend trains (its last collective: the final save), every process leaves the group,
    then the main process pushes (``--push_to_hub``: may outlast ``--ddp_timeout``, so no peer may wait for it
    at a barrier)."""
    import importlib

    from finetune import distributed, run
    from finetune.config import parse_config
    from finetune.lifecycle import resolve

    calls = []

    class Hub:
        def at_end(self, output_dir):
            calls.append(("push", output_dir))

    config = parse_config(["--recipe", "bbc-news", "--output_dir", "out", "--backend", backend])
    monkeypatch.setattr(resolve, "resolve", lambda config: resolve.Resolution(config, None, hub=Hub() if push else None))
    module = importlib.import_module("finetune.backends.accelerate" if backend == "accelerate" else "finetune.backends.trainer")
    monkeypatch.setattr(module, "train", lambda *a, **k: calls.append("train") or {"optimizer_steps": 1})
    monkeypatch.setattr(distributed, "leave", lambda: calls.append("leave"))
    assert run.run(config) == {"optimizer_steps": 1}
    assert calls == ["train", "leave", *([("push", "out")] if push else [])]


@pytest.mark.parametrize("command", ["verify", "plan"])
def test_verify_and_plan_leave_the_group_after_their_work(monkeypatch, command):
    import importlib

    from finetune import distributed

    module = importlib.import_module(f"finetune.commands.{command}")
    calls = []
    monkeypatch.setattr(module, command, lambda *a, **k: calls.append("work") or 1)
    if command == "verify":
        monkeypatch.setattr(module, "parse", lambda argv: (argv, 1))
    monkeypatch.setattr(distributed, "leave", lambda: calls.append("leave"))
    assert module.main(["--recipe", "bbc-news"]) == 1  # the work's exit code is kept
    assert calls == ["work", "leave"]


@pytest.mark.parametrize("push", [False, True])
def test_a_stopped_run_leaves_the_group_once_its_frames_are_gone(monkeypatch, capsys, push):
    """A signal stops every process at the same step (``TrainingStopped``, after the checkpoint): ``run.run`` drops
    the exception's traceback, and with it the training frames that hold the model, then leaves the group, and
    the stop ends the command (exit 143) with no final push. Leaving with the traceback alive would keep the model
    (test above), and this fails."""
    import gc
    import weakref

    from finetune import distributed, run
    from finetune.backends import accelerate as backend
    from finetune.errors import TrainingStopped
    from finetune.lifecycle import resolve

    class Model:  # stands for the prepared model the training frames hold
        pass

    calls, model = [], []

    class Hub:
        def at_end(self, output_dir):
            calls.append("push")

    def stopped(*args, **kwargs):
        frame_model = Model()
        model.append(weakref.ref(frame_model))
        calls.append("train")
        raise TrainingStopped("stopped by SIGTERM after optimizer step 3; checkpoint: out/checkpoints/step_00000003",
                              15)

    def leave():
        calls.append("leave")
        assert model[0]() is None, "leave() while the stopped run's frames still hold its model"

    gc.disable()  # the frames must go by reference counting, not by a collection that happens to run
    try:
        monkeypatch.setattr(resolve, "resolve", lambda config: resolve.Resolution(config, None,
                                                                                   hub=Hub() if push else None))
        monkeypatch.setattr(backend, "train", stopped)
        monkeypatch.setattr(distributed, "leave", leave)
        assert run.main(["--recipe", "bbc-news"]) == 143
    finally:
        gc.enable()
    assert calls == ["train", "leave"]
    assert "error: stopped by SIGTERM after optimizer step 3" in capsys.readouterr().err


def test_a_run_that_fails_does_not_wait_at_the_barrier(monkeypatch, capsys):
    """A ``FinetuneError`` from the backend (one ``error:`` line) ends the run without ``leave``: a failing
    process must not block at a barrier its peers may never reach."""
    from finetune import distributed, run
    from finetune.backends import accelerate as backend
    from finetune.errors import FinetuneError
    from finetune.lifecycle import resolve

    def fail(*args, **kwargs):
        raise FinetuneError("writing checkpoint step_00000001 failed")

    monkeypatch.setattr(resolve, "resolve", lambda config: resolve.Resolution(config, None))
    monkeypatch.setattr(backend, "train", fail)
    monkeypatch.setattr(distributed, "leave", lambda: pytest.fail("leave after a failure"))
    assert run.main(["--recipe", "bbc-news"]) == 2
    assert "error: writing checkpoint step_00000001 failed" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ errors on every rank
@pytest.mark.parametrize("fault, code, message", [
    ({"overflow_steps": {2}}, 3, "non-finite loss or gradient at optimizer step 2"),
    ({"save_error": "RuntimeError@rank1@step1"}, 2, "writing checkpoint step_00000001 failed on rank 1"),
])
def test_an_error_on_every_rank_leaves_the_group_on_every_rank(tmp_path, tiny_bert, fault, code, message):
    """2 gloo processes, the accelerate backend: a non-finite gradient at step 2 (``FAULT_OVERFLOW_STEPS``: the
    numerical error, exit 3, decided on the all-reduced gradients) or rank 1's failed checkpoint write at step 1
    (``FAULT_SAVE_ERROR``: agreed, exit 2) stops both processes at the same point; each leaves the process group
    in ``distributed.leave`` with its last owner gone (``install_leave_log``), as a finished run does, instead of
    exiting with the group alive (which can abort a process whose peer is still busy, exit -6)."""
    from helpers import fault_env, launch, leave_records

    log = tmp_path / "leave"
    log.mkdir()
    args = ["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(tmp_path / "run"),
            "--max_steps", "3", "--eval_strategy", "no", "--max_train_samples", "16", "--max_length", "32",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--save_steps", "1"]
    result = launch(args, num_processes=2, timeout=300, env=fault_env(leave_log=str(log), **fault))
    assert result.returncode == 1, result.stderr[-3000:]  # the launcher's code for a failed worker
    # torchrun's report names each failed worker's own exit code: the error's, none aborted (-6). Once the first
    # worker has exited, torchrun SIGTERMs the others (-15): on a busy machine the second can still be in its
    # interpreter's teardown then, after leaving the group. A worker that exited by itself left the group first.
    codes = re.findall(r"exitcode\s+: (-?\d+) \(pid", result.stderr)
    assert len(codes) == 2 and set(codes) <= {str(code), "-15"} and str(code) in codes, result.stderr[-3000:]
    assert result.stderr.count(f"error: {message}") == 2, result.stderr[-3000:]  # each rank's line (may interleave)
    records = leave_records(log)
    assert records == [{"group_started": True, "handle_alive": False}] * len(records), records
    assert len(records) >= codes.count(str(code)), (records, codes)


@pytest.mark.parametrize("every_rank", [True, False])
def test_run_leaves_the_group_before_an_error_every_rank_raised_and_not_before_its_own(monkeypatch, capsys,
                                                                                       every_rank):
    """``run.run``: an error marked ``every_rank`` (``errors.together``) leaves the group first, its frames gone
    (the model they hold must not outlive the group's handle); an unmarked one (this process's alone) does not."""
    import gc
    import weakref

    from finetune import distributed, run
    from finetune.backends import accelerate as backend
    from finetune.errors import NumericalError, together
    from finetune.lifecycle import resolve

    class Model:
        pass

    calls, model = [], []

    def fail(*args, **kwargs):
        frame_model = Model()
        model.append(weakref.ref(frame_model))
        calls.append("train")
        err = NumericalError("non-finite loss or gradient at optimizer step 2")
        raise together(err) if every_rank else err

    def leave():
        calls.append("leave")
        assert model[0]() is None, "leave() while the failed run's frames still hold its model"

    gc.disable()
    try:
        monkeypatch.setattr(resolve, "resolve", lambda config: resolve.Resolution(config, None))
        monkeypatch.setattr(backend, "train", fail)
        monkeypatch.setattr(distributed, "leave", leave)
        assert run.main(["--recipe", "bbc-news"]) == 3
    finally:
        gc.enable()
    assert calls == (["train", "leave"] if every_rank else ["train"])
    assert "error: non-finite loss or gradient at optimizer step 2" in capsys.readouterr().err


def test_an_agreed_check_in_resolve_leaves_the_group(monkeypatch, capsys):
    """An error of ``resolve`` agreed over the processes (``distributed.agree``: after the group started) leaves
    it too; the agreed errors, the empty window and the failed checkpoint commit are marked ``every_rank``."""
    from finetune import distributed, run
    from finetune.errors import FinetuneError
    from finetune.lifecycle import resolve
    from finetune.lifecycle.window import empty_window_error

    def agreed(config):
        return distributed.agree(lambda: (_ for _ in ()).throw(FinetuneError("--output_dir out holds another run")))

    calls = []
    monkeypatch.setattr(resolve, "resolve", agreed)
    monkeypatch.setattr(distributed, "leave", lambda: calls.append("leave"))
    assert run.main(["--recipe", "bbc-news"]) == 2
    assert calls == ["leave"]
    assert "error: --output_dir out holds another run" in capsys.readouterr().err
    assert empty_window_error(4).every_rank and not FinetuneError("alone").every_rank


@pytest.mark.parametrize("command", ["verify", "plan"])
def test_verify_and_plan_leave_the_group_before_an_error_every_rank_raised(monkeypatch, capsys, command):
    import importlib

    from finetune import distributed
    from finetune.errors import FinetuneError, together

    module = importlib.import_module(f"finetune.commands.{command}")
    calls = []

    def fail(*args, **kwargs):
        calls.append("work")
        raise together(FinetuneError("verify: no way of the effective batch ran"))

    monkeypatch.setattr(module, command, fail)
    if command == "verify":
        monkeypatch.setattr(module, "parse", lambda argv: (argv, 1))
    monkeypatch.setattr(distributed, "leave", lambda: calls.append("leave"))
    assert module.main(["--recipe", "bbc-news"]) == 2
    assert calls == ["work", "leave"]
    assert "error: verify: no way of the effective batch ran" in capsys.readouterr().err


def test_the_error_line_is_one_write_so_two_ranks_lines_do_not_interleave(monkeypatch):
    """Under ``python -u`` (accelerate launch's workers) ``print`` wrote the text and its newline as two writes,
    and two ranks' identical error lines came out as "...latest.error: writing ..." on one line
    (test_checkpoint_writes' one-rank-fails test, flaky). The line is now one write of text and newline."""
    import io

    from finetune.errors import FinetuneError, reports_errors

    class Writes(io.StringIO):
        def __init__(self):
            super().__init__()
            self.calls = []

        def write(self, text):
            self.calls.append(text)
            return super().write(text)

    stderr = Writes()
    monkeypatch.setattr("sys.stderr", stderr)

    def main() -> int:
        raise FinetuneError("writing checkpoint step_00000004 failed on rank 1")

    assert reports_errors(main)() == 2
    assert stderr.calls == ["error: writing checkpoint step_00000004 failed on rank 1\n"]
