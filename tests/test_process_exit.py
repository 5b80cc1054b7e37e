"""How a launched command's processes end: every process leaves the process group together
(``distributed.leave``: a barrier, then ``destroy_process_group``) once its work is done, so none exits with its
gloo group alive while a peer is still busy (which can abort it in interpreter teardown, exit -6:
docs/robustness.md)."""

from __future__ import annotations

import json
import os
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

    from finetune import distributed, resolve, run
    from finetune.config import parse_config

    calls = []

    class Hub:
        def at_end(self, output_dir):
            calls.append(("push", output_dir))

    config = parse_config(["--recipe", "bbc-news", "--output_dir", "out", "--backend", backend])
    monkeypatch.setattr(resolve, "resolve", lambda config: resolve.Resolution(config, None, hub=Hub() if push else None))
    module = importlib.import_module("finetune.train" if backend == "accelerate" else "finetune.trainer_backend")
    monkeypatch.setattr(module, "train", lambda *a, **k: calls.append("train") or {"optimizer_steps": 1})
    monkeypatch.setattr(distributed, "leave", lambda: calls.append("leave"))
    assert run.run(config) == {"optimizer_steps": 1}
    assert calls == ["train", "leave", *([("push", "out")] if push else [])]


@pytest.mark.parametrize("command", ["verify", "plan"])
def test_verify_and_plan_leave_the_group_after_their_work(monkeypatch, command):
    import importlib

    from finetune import distributed

    module = importlib.import_module(f"finetune.{command}")
    calls = []
    monkeypatch.setattr(module, command, lambda *a, **k: calls.append("work") or 1)
    if command == "verify":
        monkeypatch.setattr(module, "parse", lambda argv: (argv, 1))
    monkeypatch.setattr(distributed, "leave", lambda: calls.append("leave"))
    assert module.main(["--recipe", "bbc-news"]) == 1  # the work's exit code is kept
    assert calls == ["work", "leave"]


def test_a_run_that_fails_does_not_wait_at_the_barrier(monkeypatch, capsys):
    """A ``FinetuneError`` from the backend (one ``error:`` line) ends the run without ``leave``: a failing
    process must not block at a barrier its peers may never reach."""
    from finetune import distributed, resolve, run
    from finetune import train as backend
    from finetune.errors import FinetuneError

    def fail(*args, **kwargs):
        raise FinetuneError("writing checkpoint step_00000001 failed")

    monkeypatch.setattr(resolve, "resolve", lambda config: resolve.Resolution(config, None))
    monkeypatch.setattr(backend, "train", fail)
    monkeypatch.setattr(distributed, "leave", lambda: pytest.fail("leave after a failure"))
    assert run.main(["--recipe", "bbc-news"]) == 2
    assert "error: writing checkpoint step_00000001 failed" in capsys.readouterr().err
