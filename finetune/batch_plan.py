"""The batch planner: from a global batch size to a micro-batch and an accumulation count.

The user fixes ``total_batch_size`` B, the samples that make up one optimizer step across all
processes. With P processes, a plan is a micro-batch m (``per_device_train_batch_size``, samples per
process per forward/backward) and N micro-batches per optimizer step (``gradient_accumulation_steps``)
with ``m * N * P == B`` exactly, so the optimisation does not depend on the hardware. Among the exact
plans we pick the largest m that fits in memory: fewest forward/backward passes per step.

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

import math
import numbers
from dataclasses import dataclass
from typing import Callable

import gc

import psutil
import torch
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env
from accelerate.utils.memory import should_reduce_batch_size

from finetune.builders import get_task
from finetune.components import build_optimizer
from finetune.errors import FinetuneError


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
    integer, if B is not a multiple of P (naming the nearest valid --total_batch_size values), or if
    even a micro-batch of 1 sample does not fit. Raises ``ValueError`` if ``max_micro_batch`` < 1.
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
        raise FinetuneError(
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

    ``max_over_processes(code)``: the maximum of an int over all ranks (a collective every rank must call
    the same number of times; the identity for one process). The codes: ``FITS`` 0, ``DOES_NOT_FIT`` 1,
    ``FAILED`` 2 (``answer()`` raised). An error is agreed on too, so no rank is left waiting in the next
    collective: the rank that failed re-raises its own exception, the others raise ``FinetuneError``
    ("another process failed ..."). Exceptions other than ``Exception`` (KeyboardInterrupt) propagate at
    once."""
    error = None
    try:
        code = FITS if answer() else DOES_NOT_FIT
    except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks know
        code, error = FAILED, err
    worst = max_over_processes(code)
    if error is not None:
        raise error
    if worst == FAILED:
        raise FinetuneError("another process failed while probing the batch size for --auto_find_batch_size; "
                            "its error is printed above.")
    return worst == FITS


def agreed_fits(fits: Callable[[int], bool], max_over_processes: Callable[[int], int]) -> Callable[[int], bool]:
    """``fits`` agreed over all ranks (``agree``): m fits only if it fits on every rank. Called in the same
    order on every rank (``plan_batch`` is deterministic given the answers, and the answers are the same
    everywhere), it keeps the ranks' collectives in step and gives every rank the same plan."""
    def fits_everywhere(micro_batch: int) -> bool:
        return agree(lambda: fits(micro_batch), max_over_processes)

    return fits_everywhere


def all_reduce_max(state) -> Callable[[int], int]:
    """``max_over_processes`` for ``agree`` over Accelerate ``state``'s processes (a ``PartialState``): a MAX
    all-reduce of one integer on ``state.device`` (NCCL needs a GPU tensor, gloo a CPU one); the identity
    for one process."""
    if state.num_processes == 1:
        return lambda code: code

    def reduce(code: int) -> int:
        value = torch.tensor([code], dtype=torch.int64, device=state.device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return int(value.item())

    return reduce


# ----------------------------------------------------------------------------------------- probing
def saved_tensor_bytes(run_step: Callable[[], "object"]) -> int:
    """Bytes of the distinct tensor storages autograd saves for backward while ``run_step()`` builds its
    graph (``torch.autograd.graph.saved_tensors_hooks``): the activation memory of a training step,
    measured exactly (RSS cannot see it in a long-lived process, whose freed heap is reused silently).
    ``run_step`` returns the loss; it is back-propagated here to free the graph."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = run_step()
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


def probe_fits(config, recipe, num_processes: int, device, total_batch_size: int) -> Callable[[int], bool]:
    """A ``fits(m)`` for ``plan_batch`` from real probe steps of the recipe's model on worst-case batches
    (every sample ``max_length`` tokens, or ``block_size``), on this process alone (``resolve_batch_plan``
    agrees the answers over the ranks).

    - CUDA: a whole training step at micro-batch m, forward, backward and the run's AdamW step with its
      state allocated (``oom_probe``), either runs or raises out-of-memory. The probe runs the unwrapped
      model: DDP's gradient buckets (about one more copy of the gradients) are not in it, and FSDP or
      DeepSpeed, which shard, need less than it measures.
    - CPU: no OOM to catch, so the budget is ``--max_memory_mb`` (default: the memory available now).
      Activation bytes saved for backward at micro-batch 1 and 2 give a linear model (bytes per sample,
      plus a fixed part); gradients and AdamW's two moments add 3x the parameter bytes. A micro-batch fits
      if what the process holds now, plus that, stays under the budget. Transient buffers are not
      modelled: keep a margin.
    """
    task = get_task(recipe.TASK)
    label_names = ["a", "b"] if task.name == "sequence-classification" else None
    model = task.load_model(config, label_names).to(device)
    model.train()
    length = config.block_size or config.max_length
    vocab = model.config.vocab_size
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.mixed_precision)

    def step(m: int):
        ids = torch.randint(0, vocab, (m, length), device=device)
        labels = ids if task.name == "causal-lm" else torch.zeros(m, dtype=torch.long, device=device)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            return task.loss_sum(logits, labels)

    if device.type == "cuda":
        return oom_probe(model, build_optimizer(model, config), step, release=torch.cuda.empty_cache)

    budget = (config.max_memory_mb * 2**20) if config.max_memory_mb else psutil.virtual_memory().available
    one, two = saved_tensor_bytes(lambda: step(1)), saved_tensor_bytes(lambda: step(2))
    per_sample = max(two - one, 1)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fixed = max(one - per_sample, 0) + 3 * param_bytes
    model = None  # free the probe copy before measuring what the process holds
    gc.collect()
    held = psutil.Process().memory_info().rss
    print(f"Memory probe: {per_sample / 2**20:.1f} MiB per sample + {fixed / 2**20:.1f} MiB per step "
          f"(activations saved for backward at micro-batch 1 and 2, gradients, AdamW state); budget "
          f"{budget / 2**20:.0f} MiB, process holds {held / 2**20:.0f} MiB")
    if budget <= held + fixed + per_sample:
        raise FinetuneError(f"--max_memory_mb {budget / 2**20:.0f} leaves no room: this process already holds "
                            f"{held / 2**20:.0f} MiB and one sample needs about {(fixed + per_sample) / 2**20:.0f} MiB "
                            f"more. Raise --max_memory_mb above {(held + fixed + per_sample) / 2**20:.0f}.")
    return estimate_fits_from_memory(per_sample, fixed, budget - held)


def resolve_batch_plan(config, recipe, num_processes: int, device,
                       max_over_processes: Callable[[int], int] = lambda code: code) -> BatchPlan | None:
    """The (micro-batch, accumulation) for ``--total_batch_size``, or None when it is not set.

    Without ``--auto_find_batch_size``: the given ``per_device_train_batch_size`` must divide
    ``total_batch_size / processes`` (else ``FinetuneError`` listing the valid micro-batches). With it: the
    largest valid micro-batch that fits on every rank (``probe_fits`` on each, answers agreed with
    ``max_over_processes``, see ``agree``), accumulation raised to keep the total exact; every rank returns
    the same plan. The probe model is freed before returning.
    """
    if not config.total_batch_size:
        return None
    plans = valid_plans(config.total_batch_size, num_processes)
    if config.auto_find_batch_size:
        probe = {}

        def build_probe() -> bool:  # may fail on one rank only (e.g. --max_memory_mb leaves no room there)
            probe["fits"] = probe_fits(config, recipe, num_processes, device, config.total_batch_size)
            return True

        agree(build_probe, max_over_processes)
        try:
            return plan_batch(config.total_batch_size, num_processes, agreed_fits(probe["fits"], max_over_processes))
        finally:
            probe.clear()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    micro = config.per_device_train_batch_size
    for m, n in plans:
        if m == micro:
            return BatchPlan(m, n, num_processes, config.total_batch_size)
    raise FinetuneError(
        f"--total_batch_size {config.total_batch_size} with {num_processes} process(es) cannot use "
        f"--per_device_train_batch_size {micro}: it must divide {config.total_batch_size // num_processes}. "
        f"Valid micro-batches: {', '.join(str(m) for m, _ in plans)} (or pass --auto_find_batch_size).")


def apply_batch_plan(config, recipe) -> None:
    """With ``--total_batch_size``, set ``config.per_device_train_batch_size`` and
    ``config.gradient_accumulation_steps`` from the batch planner before either engine builds anything
    (Accelerate fixes the accumulation steps when the Accelerator is created). Called once by
    ``run.main``; the plan is printed. Raises ``FinetuneError`` as ``resolve_batch_plan``."""
    if not config.total_batch_size:
        return
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    plan = resolve_batch_plan(config, recipe, state.num_processes, state.device, all_reduce_max(state))
    config.per_device_train_batch_size = plan.per_device_train_batch_size
    config.gradient_accumulation_steps = plan.gradient_accumulation_steps
    if state.is_main_process:
        print(f"Batch plan for --total_batch_size {config.total_batch_size}: {plan}")
