"""The planner's arithmetic: exact batch plans, the search for the largest micro-batch that fits, the
linear memory model, and the choice among the timed plans. No model, no tensor: whether a plan fits and
how fast it runs come in as functions (``fits(m)``, ``Probe``-like objects), agreed over the ranks by
``finetune.planner.agreement``.

A plan for ``total_batch_size`` B (samples per optimizer step across all processes) on P processes is a
micro-batch m (``per_device_train_batch_size``, samples per process per forward/backward) and N
micro-batches per optimizer step (``gradient_accumulation_steps``) with ``m * N * P == B`` exactly.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Callable

from finetune.errors import FinetuneError
from finetune.planner.agreement import agreed_fits, agreed_seconds

PROBE_MARGIN = 0.02  # a later plan must be this much faster (fraction of time per sample) to be chosen instead


class NothingFits(FinetuneError):
    """Not even a micro-batch of 1 sample fits (``plan_batch``); distinct from a probe that failed."""


@dataclass(frozen=True)
class BatchPlan:
    """A batch plan: ``per_device_train_batch_size`` x ``gradient_accumulation_steps`` x
    ``num_processes`` == ``total_batch_size`` (all batch sizes in samples).

    - ``per_device_train_batch_size``: micro-batch m, samples per process per forward/backward.
    - ``gradient_accumulation_steps``: N, micro-batches per process per optimizer step.
    - ``num_processes``: P, data-parallel processes.
    - ``total_batch_size``: B, samples per optimizer step across all processes.
    - ``lever``: the ``Lever`` setting the planner chose with it under ``--auto_find_batch_size`` (its
      ``config_fields`` go into the run's config), or None where the run keeps its own settings.

    Raises ``ValueError`` on construction if the product does not hold.
    """

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_processes: int
    total_batch_size: int
    lever: Lever | None = None

    def __post_init__(self) -> None:
        product = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.num_processes
        if product != self.total_batch_size:
            raise ValueError(f"inconsistent BatchPlan: {self.per_device_train_batch_size} x "
                             f"{self.gradient_accumulation_steps} x {self.num_processes} = {product}, "
                             f"not total_batch_size {self.total_batch_size}")

    def to_dict(self) -> dict:
        """The plan as JSON-serialisable values (what ``run_config.json`` records as ``batch_plan``)."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        processes = "process" if self.num_processes == 1 else "processes"
        return (f"micro-batch {self.per_device_train_batch_size} x accumulation {self.gradient_accumulation_steps} "
                f"x {self.num_processes} {processes} = {self.total_batch_size} samples per optimizer step")


def _is_positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _check_total_and_processes(total_batch_size, num_processes) -> None:
    if not _is_positive_int(num_processes):
        raise FinetuneError(f"the number of processes must be a positive integer, got {num_processes!r}.")
    if not _is_positive_int(total_batch_size):
        raise FinetuneError(f"--total_batch_size must be a positive integer (samples per optimizer step across "
                            f"all processes), got {total_batch_size!r}.")
    if total_batch_size % num_processes:
        below = (total_batch_size // num_processes) * num_processes
        above = below + num_processes
        nearest = f"{below} or {above}" if below > 0 else f"{above}"
        raise FinetuneError(
            f"--total_batch_size {total_batch_size} cannot be split evenly over {num_processes} processes: it must "
            f"be a multiple of {num_processes}. Change --total_batch_size to the nearest valid value, {nearest} "
            f"(or run on a number of processes that divides {total_batch_size})."
        )


def valid_plans(total_batch_size: int, num_processes: int) -> list[tuple[int, int]]:
    """Every exact plan for ``total_batch_size`` samples per optimizer step on ``num_processes``
    processes: the pairs (micro-batch m in samples, accumulation steps N) with m * N * P == B, sorted by
    m descending (so the first pair is (B / P, 1) and the last is (1, B / P)).

    Raises ``FinetuneError`` if B or P is not a positive integer, or if B is not a multiple of P (the
    message names the nearest valid --total_batch_size values below and above).
    """
    _check_total_and_processes(total_batch_size, num_processes)
    per_process = total_batch_size // num_processes
    small = [d for d in range(1, math.isqrt(per_process) + 1) if per_process % d == 0]
    divisors = sorted(set(small) | {per_process // d for d in small}, reverse=True)
    return [(m, per_process // m) for m in divisors]


def plan_batch(total_batch_size: int, num_processes: int, fits: Callable[[int], bool],
               max_micro_batch: int | None = None) -> BatchPlan:
    """Choose the plan with the largest micro-batch that fits in memory.

    ``total_batch_size`` B: samples per optimizer step across all processes. ``num_processes`` P.
    ``fits(m)``: whether a micro-batch of m samples per process fits in memory; it must be monotone
    (if m fits, every smaller m fits). ``max_micro_batch``: an optional upper bound on m in samples
    (e.g. the samples one process sees per epoch); None for no bound.

    Candidates are the exact micro-batches of ``valid_plans(B, P)`` (divisors of B / P), largest first.
    The largest is tried first (the common case costs one call); if it does not fit, the boundary is
    binary-searched among the rest. Each m is asked at most once, and at most ceil(log2(n)) + 1 calls
    are made for n candidates.

    Returns a ``BatchPlan`` with m * N * P == B. Raises ``FinetuneError`` if B or P is not a positive
    integer, if B is not a multiple of P (naming the nearest valid --total_batch_size values), and
    ``NothingFits`` (a ``FinetuneError``) if even a micro-batch of 1 sample does not fit. Raises
    ``ValueError`` if ``max_micro_batch`` < 1.
    Exceptions raised by ``fits`` propagate.
    """
    plans = valid_plans(total_batch_size, num_processes)
    if max_micro_batch is not None:
        if not _is_positive_int(max_micro_batch):
            raise ValueError(f"max_micro_batch must be a positive integer or None, got {max_micro_batch!r}")
        plans = [(m, n) for m, n in plans if m <= max_micro_batch]  # (1, B / P) always remains

    answers: dict[int, bool] = {}

    def ask(index: int) -> bool:
        m = plans[index][0]
        if m not in answers:
            answers[m] = bool(fits(m))
        return answers[m]

    # Find the first index (largest m) that fits; fits is False before it and True from it on.
    if ask(0):
        first_fit = 0
    else:
        lo, hi = 1, len(plans)  # the boundary lies in [lo, hi]; hi == len(plans) means nothing fits
        while lo < hi:
            mid = (lo + hi) // 2
            if ask(mid):
                hi = mid
            else:
                lo = mid + 1
        first_fit = lo
    if first_fit == len(plans):
        raise NothingFits(
            f"even a micro-batch of 1 sample per process does not fit in memory (--total_batch_size "
            f"{total_batch_size} on {num_processes} process(es)). Reduce --max_length, use a machine (or GPU) "
            f"with more memory, or raise --max_memory_mb if you set a memory budget."
        )
    m, n = plans[first_fit]
    return BatchPlan(per_device_train_batch_size=m, gradient_accumulation_steps=n, num_processes=num_processes,
                     total_batch_size=total_batch_size)


def estimate_fits_from_memory(bytes_per_sample: float, fixed_bytes: float,
                              budget_bytes: float) -> Callable[[int], bool]:
    """A ``fits(m)`` for ``plan_batch`` from a linear memory model, for CPUs with a --max_memory_mb
    budget (where there is no out-of-memory error to probe for).

    The model: peak bytes of one training step with micro-batch m = ``fixed_bytes`` + m x
    ``bytes_per_sample``. ``fixed_bytes`` (bytes) covers what does not grow with the batch: weights,
    gradients, optimizer state, framework overhead. ``bytes_per_sample`` (bytes per sample) is the
    activation memory per sample at the run's --max_length. Both are measured by the caller
    (``probes.Probe``: the bytes saved for backward at micro-batch 1 and 2, plus the weights, gradients and
    AdamW state), so this is a model of that measurement, not a guarantee. ``budget_bytes`` (bytes) is the peak allowed.

    The returned function takes m (samples) and returns whether the modelled peak <= budget; it is
    monotone in m. Raises ``FinetuneError`` if the budget is not positive, and ``ValueError`` if a
    measured quantity is negative or not finite.
    """
    if not (isinstance(budget_bytes, numbers.Real) and math.isfinite(budget_bytes) and budget_bytes > 0):
        raise FinetuneError(f"the memory budget must be a positive number of bytes (--max_memory_mb > 0), "
                            f"got {budget_bytes!r}.")
    for name, value in (("bytes_per_sample", bytes_per_sample), ("fixed_bytes", fixed_bytes)):
        if not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def fits(micro_batch: int) -> bool:
        return fixed_bytes + micro_batch * bytes_per_sample <= budget_bytes

    fits.__doc__ = (f"True if {fixed_bytes:.0f} + m x {bytes_per_sample:.0f} bytes <= {budget_bytes:.0f} bytes "
                    f"(linear memory model).")
    return fits


def given_plan(micro_batch: int, total_batch_size: int, num_processes: int) -> BatchPlan:
    """The plan of a micro-batch the user gave (``--per_device_train_batch_size``, samples) for
    ``total_batch_size`` B on ``num_processes`` P: accumulation B / P / m. Raises ``FinetuneError`` when m
    does not divide B / P (listing the valid micro-batches), or as ``valid_plans``."""
    plans = valid_plans(total_batch_size, num_processes)
    if micro_batch not in [m for m, _ in plans]:
        raise FinetuneError(
            f"--total_batch_size {total_batch_size} with {num_processes} process(es) cannot use "
            f"--per_device_train_batch_size {micro_batch}: it must divide {total_batch_size // num_processes}. "
            f"Valid micro-batches: {', '.join(str(m) for m, _ in plans)} (or pass --auto_find_batch_size).")
    return BatchPlan(micro_batch, total_batch_size // num_processes // micro_batch, num_processes, total_batch_size)


@dataclass(frozen=True)
class Lever:
    """One setting of the memory levers the planner chooses among: activation checkpointing on or off, and
    for causal LM the loss chunk size (0: the plain full-logits loss; see ``loss.loss_function``). Each field is
    the ``TrainConfig`` field of that name: a new lever is a field here (and in ``TrainConfig``)."""

    activation_checkpointing: bool
    loss_chunk_size: int | None

    def config_fields(self) -> dict:
        """The ``TrainConfig`` fields this setting sets, for ``dataclasses.replace``: each of the lever's fields
        that has a value (``activation_checkpointing``, and ``loss_chunk_size`` where the setting has one: causal
        LM)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    def __str__(self) -> str:
        parts = ["checkpointing" if self.activation_checkpointing else "no checkpointing"]
        if self.loss_chunk_size is not None:
            parts.append(f"chunked loss {self.loss_chunk_size}" if self.loss_chunk_size else "plain loss")
        return ", ".join(parts)


@dataclass
class Candidate:
    """A plan the planner considered: a ``BatchPlan`` under a ``Lever`` setting, its estimated peak memory
    (bytes; None where probing is by out-of-memory, on CUDA), whether it fits on every rank, and its measured
    time per sample (seconds; None where not timed: it does not fit, or ``choose_plan``'s descent did not reach
    it); ``note``: why it was not timed ("" where it was)."""

    plan: BatchPlan
    lever: Lever
    estimated_bytes: int | None
    fits: bool
    seconds_per_sample: float | None = None
    note: str = ""


def timed_micro_batches(lever: Lever, largest_fit: int, plans: list[tuple[int, int]],
                        largest_fit_without_checkpointing: int | None) -> list[int]:
    """The micro-batches of ``lever`` worth timing, largest first: those that fit (at most ``largest_fit``
    samples), and under activation checkpointing only those larger than the largest that fits without it
    (``largest_fit_without_checkpointing``, for the same loss setting; None when nothing fits without it): at an
    equal micro-batch checkpointing does the same work plus a recomputed forward, so it cannot be faster there.
    ``plans``: ``valid_plans`` (micro-batch, accumulation) pairs, micro-batch descending."""
    floor = largest_fit_without_checkpointing if lever.activation_checkpointing else None
    return [m for m, _ in plans if m <= largest_fit and (floor is None or m > floor)]


def choose_plan(total_batch_size: int, num_processes: int, probes: dict, max_over_processes=lambda code: code,
                slowest_over_processes=lambda seconds: seconds) -> tuple[Candidate, list[Candidate]]:
    """The fastest plan that fits, and every plan considered.

    ``probes``: ``Lever`` -> a ``Probe``-like object with ``fits(m)``, ``estimate(m)`` (bytes or None) and
    ``seconds_per_sample(m)`` (seconds), or a callable that builds one: then each is built, used and
    ``close()``d before the next, so no two probe models (and optimizer states) are alive at once. ``max_over_processes``/``slowest_over_processes``: MAX over the ranks
    (``distributed.all_reduce_max``; the identity for one process). For every setting: the exact plans
    (``valid_plans``), the largest that fits on every rank (``plan_batch`` on ``agreed_fits``; smaller ones
    fit too, ``fits`` being monotone), then a timed descent from it (``timed_micro_batches``): each micro-
    batch's time per sample, the slowest rank's (``agreed_seconds``), until one is slower than the one before
    (time per sample falls while larger matrix products use the hardware better, and may rise once they
    outgrow the caches; a rise within noise stops it too, keeping the larger plan). In the order timed
    (``probes``' order, ``probes.levers``: no checkpointing and the plain loss first; micro-batch descending),
    a later plan replaces the one chosen so far only if ``PROBE_MARGIN`` faster: the probes time forward and
    backward alone and do not see a smaller micro-batch's per-micro-batch costs (loading, collating, the
    loop). Measurements behind both rules: docs/speed.md, "Memory levers" and "The batch planner under
    two budgets".

    Returns (the chosen ``Candidate``, every ``Candidate`` in table order: settings as given, micro-batch
    descending; each untimed one with its ``note``). Every plan keeps ``total_batch_size`` exactly. Raises
    ``NothingFits`` when nothing fits under any setting; an error of a probe on any rank is raised on every
    rank (``agreed_fits``, ``agreed_seconds``).
    """
    plans = valid_plans(total_batch_size, num_processes)
    largest: dict[Lever, int | None] = {}
    candidates, measured = [], []
    for lever, probe in probes.items():
        built = callable(probe) and not hasattr(probe, "fits")
        probe = probe() if built else probe  # one probe model at a time: each is freed before the next is built
        try:
            try:
                best = plan_batch(total_batch_size, num_processes, agreed_fits(probe.fits, max_over_processes))
                largest[lever] = best.per_device_train_batch_size
            except NothingFits:  # any other error (a probe that failed, on any rank) ends the planning on every rank
                largest[lever] = None
            # settings come without checkpointing first (probes.levers): its largest fit is known here
            without = largest.get(Lever(False, lever.loss_chunk_size)) if lever.activation_checkpointing else None
            to_time = [] if largest[lever] is None else timed_micro_batches(lever, largest[lever], plans, without)
            previous = None
            rows = {}
            for m, n in plans:
                fits = largest[lever] is not None and m <= largest[lever]
                rows[m] = Candidate(BatchPlan(m, n, num_processes, total_batch_size), lever, probe.estimate(m), fits,
                                    note="" if fits else "does not fit")
                candidates.append(rows[m])
            for m in to_time:
                seconds = agreed_seconds(lambda: probe.seconds_per_sample(m), slowest_over_processes)  # noqa: B023 - the lambda runs inside this iteration
                rows[m].seconds_per_sample = seconds
                measured.append(rows[m])
                if previous is not None and seconds > previous:
                    break
                previous = seconds
            for m, row in rows.items():
                if row.fits and row.seconds_per_sample is None:
                    row.note = ("checkpointing: fits without it" if without is not None and m <= without
                                else "smaller than a slower timed one")
        finally:
            if built:
                probe.close()
    chosen = None
    for candidate in measured:  # settings in order (no checkpointing, plain loss first), micro-batch descending
        if chosen is None or candidate.seconds_per_sample < chosen.seconds_per_sample * (1 - PROBE_MARGIN):
            chosen = candidate
    if not measured:
        settings = "with or without activation checkpointing" if len({lv.activation_checkpointing for lv in probes}) > 1 \
            else ("with activation checkpointing" if next(iter(probes)).activation_checkpointing
                  else "without activation checkpointing")
        raise NothingFits(
            f"even a micro-batch of 1 sample per process does not fit in memory (--total_batch_size "
            f"{total_batch_size} on {num_processes} process(es)), {settings}. Reduce --max_length, use a machine "
            "(or GPU) with more memory, or raise --max_memory_mb if you set a budget.")
    return chosen, candidates


def plan_table(chosen: Candidate, candidates: list[Candidate]) -> str:
    """The table the planner prints: every plan considered (lever setting, micro-batch, accumulation,
    estimated peak MiB, fits, seconds per sample where timed, why not timed) and why it chose."""
    rows = [("levers", "micro-batch", "accumulation", "est. peak MiB", "fits", "s/sample", "")]
    for c in candidates:
        rows.append((str(c.lever), str(c.plan.per_device_train_batch_size), str(c.plan.gradient_accumulation_steps),
                     "-" if c.estimated_bytes is None else f"{c.estimated_bytes / 2**20:.0f}", "yes" if c.fits else "no",
                     "-" if c.seconds_per_sample is None else f"{c.seconds_per_sample:.4f}",
                     "<- chosen" if c is chosen else (f"({c.note})" if c.note else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    timed = [c for c in candidates if c.seconds_per_sample is not None]
    lines.append(f"Chose {chosen.plan} with {chosen.lever}: the least time per sample of the {len(timed)} plans "
                 "timed (each setting from its largest fitting micro-batch down, until one was slower than the one "
                 "before; checkpointing only where it fits a larger micro-batch than without it), a plan listed "
                 f"later needing to be {PROBE_MARGIN:.0%} faster to be chosen over an earlier one.")
    return "\n".join(lines)
