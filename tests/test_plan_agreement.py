"""Every rank must follow the same batch plan under --auto_find_batch_size: each ``fits(m)`` answer is
agreed over the ranks (a MAX all-reduce of FITS 0 / DOES_NOT_FIT 1 / FAILED 2), so every rank's search asks
the same questions and ends on the largest micro-batch that fits on EVERY rank. Two ranks are faked with
threads and a barrier-based all-reduce (no process group), then once with a real gloo group; and the CUDA
probe's step, run on a CPU with a simulated out-of-memory error, allocates AdamW's state first."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from finetune import distributed
from finetune.distributed import agreed_max
from finetune.errors import FinetuneError
from finetune.planner.agreement import DOES_NOT_FIT, FAILED, FITS, agreed_fits, true_everywhere
from finetune.planner.plans import plan_batch
from finetune.planner.probes import oom_probe


class FakeGroup:
    """An all-reduce MAX for ``n`` ranks running in threads: each rank's call blocks until every rank has
    contributed, like the collective. Records the sequence of contributions of each rank."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n, timeout=20)
        self.values = [None] * n
        self.calls = [[] for _ in range(n)]

    def max_for(self, rank: int):
        def reduce(code: int) -> int:
            self.calls[rank].append(code)
            self.values[rank] = code
            self.barrier.wait()
            result = max(self.values)
            self.barrier.wait()  # nobody overwrites values before everyone has read them
            return result

        return reduce


def run_ranks(work, n: int = 2) -> list:
    """``work(rank, group)`` on ``n`` threads; returns each rank's result or raised exception."""
    group, results = FakeGroup(n), [None] * n

    def target(rank):
        try:
            results[rank] = work(rank, group)
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            results[rank] = err

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a rank is stuck in the fake collective: the ranks fell out of step"
    return results


def limit_fits(limit: int, asked: list):
    def fits(m: int) -> bool:
        asked.append(m)
        return m <= limit

    return fits


@pytest.mark.parametrize("limits", [(8, 4), (4, 8), (32, 1), (2, 2), (16, 16)])
def test_ranks_agree_on_the_largest_plan_that_fits_everywhere(limits):
    asked = [[], []]

    def work(rank, group):
        return plan_batch(64, 2, agreed_fits(limit_fits(limits[rank], asked[rank]), group.max_for(rank)))

    plans = run_ranks(work)
    assert plans[0] == plans[1]
    assert plans[0].per_device_train_batch_size == min(limits)  # 32 per process: every power of 2 <= 32
    assert asked[0] == asked[1]  # the same search on both ranks


def test_without_agreement_the_ranks_would_disagree():
    """What the agreement prevents: each rank alone picks its own largest micro-batch, so the ranks would
    run different accumulation counts and hang in a collective."""
    alone = [plan_batch(64, 2, limit_fits(limit, [])) for limit in (8, 4)]
    assert alone[0].gradient_accumulation_steps != alone[1].gradient_accumulation_steps


def test_nothing_fits_on_one_rank_fails_on_both():
    def work(rank, group):
        return plan_batch(8, 2, agreed_fits(limit_fits(4 if rank == 0 else 0, []), group.max_for(rank)))

    results = run_ranks(work)
    assert all(isinstance(r, FinetuneError) and "even a micro-batch of 1" in str(r) for r in results), results


def test_an_error_on_one_rank_is_raised_on_every_rank():
    def work(rank, group):
        def fits(m):
            if rank == 1 and m == 2:
                raise RuntimeError("probe broke")
            return m <= 1

        return plan_batch(8, 2, agreed_fits(fits, group.max_for(rank)))

    results = run_ranks(work)
    assert isinstance(results[1], RuntimeError) and str(results[1]) == "probe broke"
    assert isinstance(results[0], FinetuneError) and "another process failed" in str(results[0])


def test_agree_codes_and_single_process():
    identity = lambda code: code  # noqa: E731 - one process
    assert true_everywhere(lambda: True, identity) is True and true_everywhere(lambda: False, identity) is False
    assert (FITS, DOES_NOT_FIT, FAILED) == (0, 1, 2)
    assert true_everywhere(lambda: True, lambda code: DOES_NOT_FIT) is False  # another rank said no
    with pytest.raises(ZeroDivisionError):
        true_everywhere(lambda: 1 / 0, identity)


# ------------------------------------------------------------------------------------------ a real group
def _gloo_rank(rank: int, init_file: str, queue) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist

    from finetune.distributed import all_reduce_max
    from finetune.planner.agreement import agreed_fits
    from finetune.planner.plans import plan_batch

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        state = SimpleNamespace(num_processes=2, device=torch.device("cpu"))
        plan = plan_batch(64, 2, agreed_fits(lambda m: m <= (8 if rank == 0 else 2), all_reduce_max(state)))
        queue.put((rank, plan.per_device_train_batch_size, plan.gradient_accumulation_steps))
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_all_reduce_max_agrees_over_a_real_gloo_group(tmp_path):
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_gloo_rank, args=(rank, str(tmp_path / "init"), queue)) for rank in (0, 1)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert sorted(queue.get(timeout=5) for _ in processes) == [(0, 2, 16), (1, 2, 16)]


# ------------------------------------------------------------------------------------------ the CUDA probe's step
def test_oom_probe_steps_adamw_with_its_state_allocated_first():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forwards, released = [], []

    def loss_at(m: int):
        forwards.append((m, len(optimizer.state)))  # how much AdamW state exists when the forward runs
        if m > 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return model(torch.randn(m, 8)).sum()

    fits = oom_probe(model, optimizer, loss_at, release=lambda: released.append(1))
    assert fits(8) is False
    assert fits(4) is True
    params = list(model.parameters())
    # the first forward already ran beside the whole AdamW state, as every training step after the first does
    assert forwards == [(8, len(params)), (4, len(params))]
    assert all({"exp_avg", "exp_avg_sq"} <= set(optimizer.state[p]) for p in params)
    assert int(optimizer.state[params[0]]["step"]) == 2  # the state allocation, then the probe at m = 4
    assert all(p.grad is None for p in params) and len(released) == 2


def test_oom_probe_lets_other_errors_through():
    model = torch.nn.Linear(2, 2)
    fits = oom_probe(model, torch.optim.AdamW(model.parameters()), lambda m: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(ValueError, match="bad"):
        fits(1)


@pytest.mark.integration
def test_two_gloo_ranks_run_auto_find_batch_size_end_to_end(tmp_path, tiny_bert):
    """The real path: `accelerate launch` with two CPU ranks, --auto_find_batch_size: each rank probes, the
    answers go through all_reduce_max on Accelerate's process group, and both ranks train the plan printed."""
    import json

    from helpers import launch

    out = tmp_path / "auto"
    result = launch(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--max_train_samples", "32",
                     "--max_eval_samples", "8", "--max_length", "32", "--total_batch_size", "16",
                     "--auto_find_batch_size", "True", "--max_steps", "1", "--eval_strategy", "no",
                     "--output_dir", str(out)], num_processes=2)
    assert result.returncode == 0, result.stderr[-4000:]
    # which exact split wins is timed (8 x 1 run alone; another split once in the parallel suite, whose load
    # moves the timings): the claim is that the run trains the plan it printed, an exact split of 16 over 2 ranks
    printed = re.search(r"Batch plan for --total_batch_size 16: micro-batch (\d+) x accumulation (\d+) x 2 processes",
                        result.stdout)
    assert printed, result.stdout[-3000:]
    m, n = int(printed.group(1)), int(printed.group(2))
    assert m * n * 2 == 16
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["per_device_train_batch_size"], metrics["gradient_accumulation_steps"]) == (m, n)


# ------------------------------------------------------------------------------------------ the shared helper
def test_agreed_max_is_the_one_helper_under_every_agreement():
    """``distributed.agreed_max``: the maximum over the ranks, a failure on one rank raised on every rank;
    ``distributed.agree`` (the output-dir and resume checks) is built on it and keeps its single-process
    behaviour: the check's value, or its own error."""
    def work(rank, group):
        def measure():
            if rank == 0:
                raise RuntimeError("rank 0 broke")
            return 3

        return agreed_max(measure, group.max_for(rank), "testing")

    results = run_ranks(work)
    assert isinstance(results[0], RuntimeError)
    assert isinstance(results[1], FinetuneError) and str(results[1]) == (
        "another process failed while testing; its error is printed above.")
    assert run_ranks(lambda rank, group: agreed_max(lambda: rank + 1, group.max_for(rank), "testing")) == [2, 2]
    assert distributed.agree(lambda: "value") == "value"
    with pytest.raises(FinetuneError, match="bad output dir"):
        distributed.agree(lambda: (_ for _ in ()).throw(FinetuneError("bad output dir")))
