"""The planner's answers agreed over the ranks, so every rank follows the same plan.

A rank with another accumulation count than the others would wait in a collective they never reach: a
hang. So every answer is agreed on: ``fits(m)`` holds only if m fits on every rank (``agreed_fits``, one MAX
all-reduce per question), a timing is the slowest rank's (``agreed_seconds``), and an error on any rank
ends the planning on every rank. Since every rank then sees the same answers, every rank's search asks
the same questions and ends on the same plan. All of it goes through ``finetune.distributed.agreed_max``;
the reduction is passed in (``distributed.all_reduce_max``, or a stand-in in tests).
"""

from __future__ import annotations

from typing import Callable

from finetune.distributed import agreed_max

# What a rank answers, ordered so that the maximum over the ranks is the answer for all of them.
FITS, DOES_NOT_FIT, FAILED = 0, 1, 2


def true_everywhere(answer: Callable[[], bool], max_over_processes: Callable[[float], float]) -> bool:
    """Ask ``answer()`` on this rank and agree with every rank: True only if it is True on all of them.

    ``max_over_processes(code)``: the maximum of a number over all ranks (``distributed.all_reduce_max``;
    the identity for one process). The codes: ``FITS`` 0, ``DOES_NOT_FIT`` 1, ``FAILED`` 2 (``answer()`` raised).
    An error is agreed on too (``distributed.agreed_max``): the rank that failed re-raises its own exception,
    the others raise ``FinetuneError`` ("another process failed ...")."""
    worst = agreed_max(lambda: FITS if answer() else DOES_NOT_FIT, max_over_processes,
                       "probing the batch size for --auto_find_batch_size", failed=FAILED)
    return worst == FITS


def agreed_fits(fits: Callable[[int], bool],
                max_over_processes: Callable[[float], float]) -> Callable[[int], bool]:
    """``fits`` agreed over all ranks (``true_everywhere``): m fits only if it fits on every rank. Called in
    the same order on every rank (``plan_batch`` is deterministic given the answers, and the answers are the same
    everywhere), it keeps the ranks' collectives in step and gives every rank the same plan."""
    def fits_everywhere(micro_batch: int) -> bool:
        return true_everywhere(lambda: fits(micro_batch), max_over_processes)

    return fits_everywhere


def agreed_seconds(measure: Callable[[], float], slowest_over_processes: Callable[[float], float]) -> float:
    """``measure()`` (seconds) on this rank, then the slowest rank's figure (``slowest_over_processes``, a MAX
    all-reduce every rank calls once). A rank whose ``measure`` raised sends infinity
    (``distributed.agreed_max``): the failed rank re-raises its own error, the others raise ``FinetuneError``
    ("another process failed ...")."""
    return agreed_max(lambda: float(measure()), slowest_over_processes,
                      "timing a batch plan for --auto_find_batch_size")
