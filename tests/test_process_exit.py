"""How a launched command's processes end: every process leaves the process group together
(``distributed.leave``: a barrier, then ``destroy_process_group``) once its work is done, so none exits with its
gloo group alive while a peer is still busy (which can abort it in interpreter teardown, exit -6:
docs/robustness.md)."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    mp.spawn(_leave_late_or_early, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert not any(r["initialized"] for r in ranks)  # the group is destroyed on both
    assert ranks[1]["left"] >= ranks[0]["arrived"]  # rank 1 waited for the late rank 0 (no barrier: ~1 s early)


def test_leave_without_a_process_group_does_nothing():
    from finetune import distributed

    assert not dist.is_initialized()
    distributed.leave()
    assert not dist.is_initialized()


def _entries():
    from finetune import plan, run, verify

    return {  # each launched command's main: (module, the name of the work it calls, its argv)
        "train": (run, "run", ["--recipe", "bbc-news"]),
        "verify": (verify, "verify", ["--recipe", "bbc-news"]),
        "plan": (plan, "plan", ["--recipe", "bbc-news"]),
    }


@pytest.mark.parametrize("command", ["train", "verify", "plan"])
def test_each_launched_command_leaves_the_group_after_its_work(monkeypatch, command):
    from finetune import distributed

    module, work, argv = _entries()[command]
    calls = []
    result = None if command == "train" else 1  # train's run returns metrics (None: nothing to print)

    def fake_work(*args, **kwargs):
        calls.append("work")
        return result

    monkeypatch.setattr(module, work, fake_work)
    if command == "verify":
        monkeypatch.setattr(module, "parse", lambda argv: (argv, 1))
    monkeypatch.setattr(distributed, "leave", lambda: calls.append("leave"))
    code = module.main(argv)
    assert calls == ["work", "leave"]
    assert code == (0 if command == "train" else 1)  # the work's exit code is kept


def test_a_refused_command_does_not_wait_at_the_barrier(monkeypatch, capsys):
    """A ``FinetuneError`` (one ``error:`` line) ends the command without ``leave``: a process that refuses
    while its peers went on must not wait at a barrier they never reach."""
    from finetune import distributed, run
    from finetune.errors import FinetuneError

    def refuse(config):
        raise FinetuneError("refused")

    monkeypatch.setattr(run, "run", refuse)
    monkeypatch.setattr(distributed, "leave", lambda: pytest.fail("leave after a refusal"))
    assert run.main(["--recipe", "bbc-news"]) == 2
    assert "error: refused" in capsys.readouterr().err
