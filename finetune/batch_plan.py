"""The batch planner: from a global batch size to a micro-batch and an accumulation count.

The user fixes ``total_batch_size`` B, the samples that make up one optimizer step across all
processes. With P processes, a plan is a micro-batch m (``per_device_train_batch_size``, samples per
process per forward/backward) and N micro-batches per optimizer step (``gradient_accumulation_steps``)
with ``m * N * P == B`` exactly, so the optimisation does not depend on the hardware. Without
``--auto_find_batch_size`` the user's m must be exact; with it, ``plan_batch`` finds the largest m that fits
in memory under each lever setting (activation checkpointing, the loss) and ``choose_plan`` times the
fitting plans and takes the fastest.

Whether m fits is the caller's question, asked through ``fits(m)``: on a GPU, a probe step that may
run out of memory (Accelerate's ``find_executable_batch_size``); on a CPU with a ``--max_memory_mb``
budget, the linear model of ``estimate_fits_from_memory``. ``fits`` must be monotone: if m fits,
every smaller m fits.

With several processes every rank must follow the same plan (a rank with another accumulation count would
wait in a collective the others never reach: a hang). So every answer is agreed on: ``fits(m)`` holds
only if m fits on every rank (``agreed_fits``, one MAX all-reduce per question), and since every rank then
sees the same answers, every rank's search asks the same questions and ends on the same plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import numbers
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable


import psutil
import torch
from accelerate.utils.memory import should_reduce_batch_size

from finetune.builders import build_model, get_task
from finetune.components import DEFAULT_LOSS_CHUNK_SIZE, build_optimizer, loss_function
from finetune.distributed import agreed_max, all_reduce_max, process_state
from finetune.errors import FinetuneError
from finetune.tasks import CausalLM


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

    Raises ``ValueError`` on construction if the product does not hold.
    """

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_processes: int
    total_batch_size: int

    def __post_init__(self) -> None:
        product = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.num_processes
        if product != self.total_batch_size:
            raise ValueError(f"inconsistent BatchPlan: {self.per_device_train_batch_size} x "
                             f"{self.gradient_accumulation_steps} x {self.num_processes} = {product}, "
                             f"not total_batch_size {self.total_batch_size}")

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
    (``probe_fits``: ``saved_tensor_bytes`` at micro-batch 1 and 2, plus gradients and AdamW state), so
    this is a model of that measurement, not a guarantee. ``budget_bytes`` (bytes) is the peak allowed.

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


# ----------------------------------------------------------------------------------------- agreement
# What a rank answers, ordered so that the maximum over the ranks is the answer for all of them.
FITS, DOES_NOT_FIT, FAILED = 0, 1, 2


def agree(answer: Callable[[], bool], max_over_processes: Callable[[int], int]) -> bool:
    """Ask ``answer()`` on this rank and agree with every rank: True only if it is True on all of them.

    ``max_over_processes(code)``: the maximum of an int over all ranks (``distributed.all_reduce_max``; the
    identity for one process). The codes: ``FITS`` 0, ``DOES_NOT_FIT`` 1, ``FAILED`` 2 (``answer()`` raised).
    An error is agreed on too (``distributed.agreed_max``): the rank that failed re-raises its own exception,
    the others raise ``FinetuneError`` ("another process failed ...")."""
    worst = agreed_max(lambda: FITS if answer() else DOES_NOT_FIT, max_over_processes,
                       "probing the batch size for --auto_find_batch_size", failed=FAILED)
    return worst == FITS


def agreed_fits(fits: Callable[[int], bool], max_over_processes: Callable[[int], int]) -> Callable[[int], bool]:
    """``fits`` agreed over all ranks (``agree``): m fits only if it fits on every rank. Called in the same
    order on every rank (``plan_batch`` is deterministic given the answers, and the answers are the same
    everywhere), it keeps the ranks' collectives in step and gives every rank the same plan."""
    def fits_everywhere(micro_batch: int) -> bool:
        return agree(lambda: fits(micro_batch), max_over_processes)

    return fits_everywhere


# ----------------------------------------------------------------------------------------- probing
def saved_storages(run_step: Callable[[], "object"]) -> tuple[dict[int, int], "object"]:
    """The distinct tensor storages autograd saves for backward while ``run_step()`` builds its graph
    (``torch.autograd.graph.saved_tensors_hooks``), as ``{data_ptr: bytes}``, and ``run_step``'s loss (not
    back-propagated)."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = run_step()
    return storages, loss


def saved_tensor_bytes(run_step: Callable[[], "object"]) -> int:
    """Bytes of the distinct tensor storages autograd saves for backward while ``run_step()`` builds its
    graph (``saved_storages``): the activation memory of a training step, measured exactly (RSS cannot see
    it in a long-lived process, whose freed heap is reused silently). ``run_step`` returns the loss; it is
    back-propagated here to free the graph."""
    storages, loss = saved_storages(run_step)
    loss.backward()
    return sum(storages.values())


def oom_probe(model, optimizer, loss_at: Callable[[int], "torch.Tensor"],
              release: Callable[[], None] = lambda: None) -> Callable[[int], bool]:
    """A ``fits(m)`` that tries a whole training step: ``loss_at(m)`` (forward at micro-batch m, returning
    the loss), backward, and ``optimizer.step()``; out-of-memory (Accelerate's ``should_reduce_batch_size``,
    as ``find_executable_batch_size`` recognises it) answers False, any other error propagates.

    The optimizer's state is allocated before the first probe (one step on zero gradients, on this probe
    copy of the model) and kept, as it is through training: AdamW holds two moments per parameter, as large
    as the weights, which a forward/backward probe alone leaves out. After each probe the gradients are
    freed (``zero_grad(set_to_none=True)``) and ``release()`` runs (e.g. ``torch.cuda.empty_cache``)."""
    state_ready = False

    def allocate_state() -> None:
        nonlocal state_ready
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for param in params:
            param.grad = torch.zeros_like(param)
        optimizer.step()
        state_ready = True

    def fits(micro_batch: int) -> bool:
        try:
            if not state_ready:
                allocate_state()
                optimizer.zero_grad(set_to_none=True)
            loss_at(micro_batch).backward()
            optimizer.step()
            return True
        except Exception as err:  # noqa: BLE001 - the OOM types differ by backend
            if should_reduce_batch_size(err):
                return False
            raise
        finally:
            optimizer.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            gc.collect()
            release()

    return fits


@dataclass(frozen=True)
class Lever:
    """One setting of the memory levers the planner chooses among: activation checkpointing on or off, and
    for causal LM the loss chunk size (0: the plain full-logits loss; see ``components.loss_function``)."""

    activation_checkpointing: bool
    loss_chunk_size: int | None

    def config_fields(self) -> dict:
        """The ``TrainConfig`` fields this setting sets, for ``dataclasses.replace``: ``activation_checkpointing``,
        and ``loss_chunk_size`` where the setting has one (causal LM)."""
        fields = {"activation_checkpointing": self.activation_checkpointing}
        if self.loss_chunk_size is not None:
            fields["loss_chunk_size"] = self.loss_chunk_size
        return fields

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


class Probe:
    """Probe steps of the recipe's model on worst-case batches (every sample ``max_length`` tokens, or
    ``block_size``) under one ``Lever`` setting, on this process alone, built as training builds it
    (activation checkpointing with the run's kwargs, LoRA adapters under ``--use_peft``).

    - ``fits(m)``: CUDA: a whole training step at micro-batch m (forward, backward, the run's AdamW step with
      its state allocated: ``oom_probe``) either runs or raises out-of-memory. CPU: no OOM to catch, so the
      budget is ``--max_memory_mb`` (default: the memory available now) above what the process holds before
      any model exists: activation bytes saved for backward at micro-batch 1 and 2 (``activation_bytes``) give
      a linear model (bytes per sample, plus a fixed part); the weights add their bytes, gradients and AdamW's
      two moments 3x the trainable parameter bytes (``estimate(m)``). Transient buffers (a layer's temporaries,
      the allocator's slack, the data pipeline) are not modelled: measured at bbc-news 256 tokens the real
      peak RSS ran ~0.3 GiB above the estimate, so keep a margin.
    - ``seconds_per_sample(m)``: one warm-up and one to three timed forward/backward passes at micro-batch m
      (seconds per sample; the optimizer step, once per optimizer step whatever the plan, is left out).
    Raises ``FinetuneError`` when the budget leaves no room at all.
    """

    def __init__(self, config, recipe, device, lever: Lever, held: int | None = None):
        task = get_task(recipe.TASK)
        label_names = ["a", "b"] if task.name == "sequence-classification" else None
        config = dataclasses.replace(config, **lever.config_fields())  # the run as it would be under this lever
        self.device, self.task, self.lever = device, task, lever
        self.model = build_model(config, task, label_names).to(device)
        self.model.train()
        self.length = config.block_size or config.max_length
        self.vocab = self.model.config.vocab_size
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.mixed_precision)
        self.loss_sum = probe_loss_function(task, config, device)
        if device.type == "cuda":
            self.fits = oom_probe(self.model, build_optimizer(self.model, config), self.step,
                                  release=torch.cuda.empty_cache)
            self.estimate = lambda m: None
            return
        budget = (config.max_memory_mb * 2**20) if config.max_memory_mb else psutil.virtual_memory().available
        one, two = self.activation_bytes(1), self.activation_bytes(2)
        per_sample = max(two - one, 1)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        trainable = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        fixed = max(one - per_sample, 0) + weights + 3 * trainable
        self.per_sample_bytes, self.fixed_bytes = per_sample, fixed
        held = psutil.Process().memory_info().rss if held is None else held
        print(f"Memory probe ({lever}): {per_sample / 2**20:.1f} MiB per sample + {fixed / 2**20:.1f} MiB per step "
              f"(activations saved for backward at micro-batch 1 and 2; the weights, gradients and AdamW state); "
              f"budget {budget / 2**20:.0f} MiB, process holds {held / 2**20:.0f} MiB")
        if budget <= held + fixed + per_sample:
            raise FinetuneError(f"--max_memory_mb {budget / 2**20:.0f} leaves no room: this process already holds "
                                f"{held / 2**20:.0f} MiB and one sample needs about {(fixed + per_sample) / 2**20:.0f} "
                                f"MiB more. Raise --max_memory_mb above {(held + fixed + per_sample) / 2**20:.0f}.")
        self.fits = estimate_fits_from_memory(per_sample, fixed, budget - held)
        self.estimate = lambda m: int(held + fixed + m * per_sample)

    def activation_bytes(self, m: int) -> int:
        """Bytes autograd saves for backward in one forward at micro-batch ``m`` (``saved_storages``), less the
        parameters' own storages among them (weights a layer keeps for its input's gradient: memory the model
        holds anyway, counted once as the weights)."""
        storages, loss = saved_storages(lambda: self.step(m))
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        return sum(size for ptr, size in storages.items() if ptr not in params)

    def step(self, m: int):
        """The summed loss of a worst-case micro-batch of ``m`` samples (forward only; the caller backs it)."""
        ids = torch.randint(0, self.vocab, (m, self.length), device=self.device)
        labels = ids if isinstance(self.task, CausalLM) else torch.zeros(m, dtype=torch.long, device=self.device)
        with torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            return self.loss_sum(self.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels)

    def seconds_per_sample(self, m: int, min_seconds: float = 1.0, max_passes: int = 3) -> float:
        """Seconds per sample of forward + backward at micro-batch ``m``: after one untimed warm-up pass, the
        median of timed passes, repeated until they add up to ``min_seconds`` or ``max_passes`` were run (one
        pass where a pass is long, as on a CPU at 512 tokens; up to three where it is short, as on a GPU)."""
        def one_pass() -> float:  # seconds
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            self.step(m).backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.model.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        one_pass()  # warm-up: first-call kernels, allocations
        times = [one_pass()]
        while len(times) < max_passes and sum(times) < min_seconds:
            times.append(one_pass())
        return statistics.median(times) / m

    def close(self) -> None:
        """Free the probe copy of the model."""
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def probe_loss_function(task, config, device):
    """``components.loss_function`` for a probe model under ``config`` (the run's under one ``Lever``: the same
    loss path training takes)."""
    # a stand-in for the Accelerator: the probe runs the bare model, under its own autocast (Probe.step)
    accelerator = SimpleNamespace(device=device, is_main_process=False, autocast=contextlib.nullcontext)
    return loss_function(task, config, accelerator)


def levers(config, recipe, device) -> list[Lever]:
    """The lever settings the planner considers: activation checkpointing off and on (only on when
    ``--activation_checkpointing`` was given), times, for causal LM, the plain and the chunked loss (only the
    given one when ``--loss_chunk_size`` was set)."""
    checkpointing = [True] if config.activation_checkpointing else [False, True]
    if isinstance(get_task(recipe.TASK), CausalLM):
        chunks = [config.loss_chunk_size] if config.loss_chunk_size is not None else [0, DEFAULT_LOSS_CHUNK_SIZE]
    else:
        chunks = [None]
    return [Lever(c, k) for c in checkpointing for k in chunks]


def agreed_seconds(measure: Callable[[], float], slowest_over_processes: Callable[[float], float]) -> float:
    """``measure()`` (seconds) on this rank, then the slowest rank's figure (``slowest_over_processes``, a MAX
    all-reduce every rank calls once). A rank whose ``measure`` raised sends infinity
    (``distributed.agreed_max``): the failed rank re-raises its own error, the others raise ``FinetuneError``
    ("another process failed ...")."""
    return agreed_max(lambda: float(measure()), slowest_over_processes,
                      "timing a batch plan for --auto_find_batch_size")


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
    """The fastest plan that fits. For every lever setting (``probes``: ``Lever`` -> ``Probe``-like object
    with ``fits(m)``, ``estimate(m)``, ``seconds_per_sample(m)``): the exact plans (``valid_plans``), whether
    each fits on every rank (``agreed_fits``: the largest that fits is found by ``plan_batch``; smaller ones
    fit too, ``fits`` being monotone), then a timed descent: from the largest fitting micro-batch down
    (``timed_micro_batches``), each one's time per sample is measured (the slowest rank's,
    ``slowest_over_processes``, so every rank sees the same figures and takes the same path) until one is
    slower than the one before it. Time per sample falls with the micro-batch while larger matrix products
    use the hardware better (a GPU) and may rise again once they outgrow the caches (measured on a 2-core CPU
    at 512 tokens: micro-batch 8 x 4 took 0.83x the time per sample of 32 x 1, docs/benchmarks.md), so the
    descent stops at the first rise. One timed pass per micro-batch where a pass is long (CPU) means a rise
    within noise can also stop it: that keeps the larger plan, the one timed before.

    Returns (the chosen candidate: the least measured time per sample, where a plan must be ``PROBE_MARGIN``
    (2%) faster than an earlier one to replace it, in the order timed: no checkpointing and the plain loss
    first, micro-batch descending. The probes time forward and backward only, on one pass; a smaller
    micro-batch has per-micro-batch costs they do not see (loading, collating, the loop), and plans closer than
    that swapped places between runs of ``bench/bench_planner.py``; every candidate considered, each with
    ``note`` saying why it was not timed). Every plan keeps ``total_batch_size`` exactly. Raises
    ``NothingFits`` when nothing fits under any setting; an error of a probe on any rank is raised on every
    rank (``agree``, ``agreed_seconds``)."""
    plans = valid_plans(total_batch_size, num_processes)
    largest: dict[Lever, int | None] = {}
    for lever, probe in probes.items():
        try:
            best = plan_batch(total_batch_size, num_processes, agreed_fits(probe.fits, max_over_processes))
            largest[lever] = best.per_device_train_batch_size
        except NothingFits:  # any other error (a probe that failed, on any rank) ends the planning on every rank
            largest[lever] = None
    candidates, measured = [], []
    for lever, probe in probes.items():
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
            seconds = agreed_seconds(lambda: probe.seconds_per_sample(m), slowest_over_processes)
            rows[m].seconds_per_sample = seconds
            measured.append(rows[m])
            if previous is not None and seconds > previous:
                break
            previous = seconds
        for m, row in rows.items():
            if row.fits and row.seconds_per_sample is None:
                row.note = ("checkpointing: fits without it" if without is not None and m <= without
                            else "smaller than a slower timed one")
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


def apply_batch_plan(config, recipe) -> None:
    """With ``--total_batch_size``, set ``config.per_device_train_batch_size`` and
    ``config.gradient_accumulation_steps`` before either engine builds anything (Accelerate fixes the
    accumulation steps when the Accelerator is created); the plan is printed.

    Without ``--auto_find_batch_size``: the given micro-batch must divide ``total_batch_size / processes``
    (else ``FinetuneError`` listing the valid micro-batches). With it: ``choose_plan`` over the lever settings
    (``levers``), each probed on every rank and agreed on (``agree``/``agreed_fits``: a plan fits only if it
    fits on every rank; the slowest rank's time counts), so every rank takes the same plan; the chosen lever
    setting is written into ``config`` too (``activation_checkpointing``, ``loss_chunk_size``). Raises
    ``FinetuneError``."""
    if not config.total_batch_size:
        return
    state = process_state()
    P, B = state.num_processes, config.total_batch_size
    plans = valid_plans(B, P)
    if not config.auto_find_batch_size:
        micro = config.per_device_train_batch_size
        if micro not in [m for m, _ in plans]:
            raise FinetuneError(
                f"--total_batch_size {B} with {P} process(es) cannot use --per_device_train_batch_size {micro}: it "
                f"must divide {B // P}. Valid micro-batches: {', '.join(str(m) for m, _ in plans)} (or pass "
                "--auto_find_batch_size).")
        plan = BatchPlan(micro, B // P // micro, P, B)
    else:
        started = time.perf_counter()
        max_codes = all_reduce_max(state)
        held = psutil.Process().memory_info().rss  # before any probe copy of the model exists
        probes = {}
        try:
            for lever in levers(config, recipe, state.device):
                def build(lever=lever) -> bool:  # may fail on one rank only (e.g. no room under --max_memory_mb)
                    probes[lever] = Probe(config, recipe, state.device, lever, held)
                    return True

                agree(build, max_codes)
            chosen, candidates = choose_plan(B, P, probes, max_codes,
                                             all_reduce_max(state, cast=float))
        finally:
            for probe in probes.values():
                probe.close()
        plan = chosen.plan
        config.activation_checkpointing = chosen.lever.activation_checkpointing
        if chosen.lever.loss_chunk_size is not None:
            config.loss_chunk_size = chosen.lever.loss_chunk_size
        if state.is_main_process:
            print(plan_table(chosen, candidates))
            print(f"Planning took {time.perf_counter() - started:.1f} s (memory probes and timed passes).")
    config.per_device_train_batch_size = plan.per_device_train_batch_size
    config.gradient_accumulation_steps = plan.gradient_accumulation_steps
    if state.is_main_process:
        print(f"Batch plan for --total_batch_size {B}: {plan}")

