"""The planner's probes: the run's model, built as training builds it, under one lever setting, asked
whether a micro-batch fits in memory and how long a sample takes.

On a GPU a probe runs a whole training step and catches out-of-memory (``oom_probe``); on a CPU, where there
is no out-of-memory error to catch, it measures the bytes autograd saves for backward (``saved_storages``)
at micro-batch 1 and 2 and fits the linear memory model of ``plans.estimate_fits_from_memory`` to a
``--max_memory_mb`` budget.

The timing probes cost about ``PROBE_SECONDS`` a plan whatever a pass costs (a large model, or bf16 emulated on a
CPU without bf16 instructions: hundreds of times fp32's matmul time): ``ProbeTiming`` chooses, once per planning
from short first passes, the sample length every plan is timed at (``timing_length``). The memory probes keep the
run's shapes (the answer depends on them) and say so where they cost more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from types import SimpleNamespace
from typing import Callable

import psutil
import torch
from accelerate.utils.memory import should_reduce_batch_size

from finetune.distributed import local_process_count, world_size
from finetune.engine import build_optimizer
from finetune.engine.precision import precision_that_runs
from finetune.errors import FinetuneError
from finetune.machine import bf16_support, native_bf16
from finetune.models.loading import load_tokenizer
from finetune.planner.agreement import agreed_seconds
from finetune.planner.memory import generation_memory, model_memory
from finetune.planner.plans import Lever, estimate_fits_from_memory
from finetune.tasks import run_task, task_of
from finetune.tasks.builders import build_model
from finetune.tasks.chunked_loss import DEFAULT_CHUNK_SIZE
from finetune.tasks.loss import loss_function

PROBE_SECONDS = 3.0  # what one probe may cost, about: a timed plan (a warm-up and its timed passes), a memory probe
SHORTEST = 8  # tokens a sample: timing_length's first length, and the shortest it chooses


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


def allocation_peak(run: Callable[[], object]) -> int:
    """The most bytes allocated and not yet freed at any moment while ``run()`` runs, counted from its start (what
    was allocated before and freed during it counts negative): the CPU allocator's allocations and frees as torch's
    profiler records them (``profile_memory=True``; its ``[memory]`` events in time order, ``kineto_results``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its RSS now (Linux: "5" into ``/proc/self/clear_refs``); False
    where the system does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """This process's peak RSS since it started or since ``reset_peak_rss`` (``VmHWM``, bytes)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return psutil.Process().memory_info().rss


def saved_tensor_bytes(run_step: Callable[[], "object"]) -> int:
    """Bytes of the distinct tensor storages autograd saves for backward while ``run_step()`` builds its
    graph (``saved_storages``): the activation memory of a training step, measured exactly (RSS cannot see
    it in a long-lived process, whose freed heap is reused silently). ``run_step`` returns the loss; it is
    back-propagated here to free the graph."""
    storages, loss = saved_storages(run_step)
    loss.backward()
    return sum(storages.values())


def oom_probe(model, optimizer, loss_at: Callable[[int], "torch.Tensor"],
              release: Callable[[], None] = lambda: None, bucket_bytes: int = 0) -> Callable[[int], bool]:
    """A ``fits(m)`` that tries a whole training step: ``loss_at(m)`` (forward at micro-batch m, returning
    the loss), backward, and ``optimizer.step()``; out-of-memory (Accelerate's ``should_reduce_batch_size``,
    as ``find_executable_batch_size`` recognises it) answers False, any other error propagates.

    The optimizer's state is allocated before the first probe (one step on zero gradients, on this probe
    copy of the model) and kept, as it is through training: AdamW holds two moments per parameter, as large
    as the weights, which a forward/backward probe alone leaves out. After each probe the gradients are
    freed (``zero_grad(set_to_none=True)``) and ``release()`` runs (e.g. ``torch.cuda.empty_cache``).
    ``bucket_bytes``: held during each probe, as DDP's gradient buckets (a copy of the gradients) are."""
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
            buckets = torch.empty(bucket_bytes, dtype=torch.uint8, device=model.device) if bucket_bytes else None
            loss_at(micro_batch).backward()
            optimizer.step()
            del buckets
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


@dataclasses.dataclass(frozen=True)
class PassCost:
    """A pass's seconds as ``timing_length`` models them: ``per_pass`` (seconds, whatever the batch: kernel launches,
    weight conversions) + ``per_token`` (seconds per token of the micro-batch: samples x tokens)."""

    per_pass: float
    per_token: float

    def plan_seconds(self, micro_batch: int, tokens: int) -> float:
        """Seconds of a timed plan (``Probe.seconds_per_sample``: a warm-up and a timed pass) of ``micro_batch``
        samples of ``tokens`` tokens."""
        return 2 * (self.per_pass + self.per_token * micro_batch * tokens)


def pass_cost(points: list[tuple[int, float]]) -> PassCost:
    """``PassCost`` through the last two of ``points`` ((tokens, seconds) of one-sample passes, tokens growing),
    each part at least 0 (where noise makes the longer pass the faster, all of it per token)."""
    (short, fast), (long, slow) = points[-2:]
    per_token = (slow - fast) / (long - short)
    if per_token <= 0 or fast - per_token * short < 0:
        return PassCost(0.0, slow / long)
    return PassCost(fast - per_token * short, per_token)


def timing_length(pass_seconds: Callable[[int], float], length: int, micro_batch: int,
                  seconds: float = PROBE_SECONDS) -> tuple[int, PassCost]:
    """(the sample length, tokens, at most ``length``, at which a timed plan of ``micro_batch`` samples costs about
    ``seconds``; the ``PassCost`` measured), from short first passes: ``pass_seconds(tokens)`` (seconds of a forward
    and backward of one sample of ``tokens`` tokens) after a warm-up at ``SHORTEST`` tokens, at ``SHORTEST`` and
    twice it, then doubling while the plan predicted at the next length fits ``seconds``
    (``PassCost.plan_seconds``, through the last two passes: ``pass_cost``). At least ``SHORTEST`` tokens, where
    even that is predicted over ``seconds``. Its passes hold one sample each: a few of them cost what one timed
    plan's pass does."""
    tokens = min(SHORTEST, length)
    pass_seconds(tokens)  # warm-up: first-call kernels, allocations
    points = [(tokens, pass_seconds(tokens))]
    cost = PassCost(0.0, points[0][1] / tokens)
    while tokens < length and (len(points) < 2 or cost.plan_seconds(micro_batch, min(2 * tokens, length)) <= seconds):
        tokens = min(2 * tokens, length)
        points.append((tokens, pass_seconds(tokens)))
        cost = pass_cost(points)
    if cost.plan_seconds(micro_batch, length) <= seconds:
        return length, cost
    fitting = int((seconds / 2 - cost.per_pass) / (cost.per_token * micro_batch))
    return max(min(SHORTEST, length), min(length, fitting)), cost


class ProbeTiming:
    """The sample length every timing probe of one planning uses (``Probe.seconds_per_sample``), so that all its
    plans, under every lever setting, are measured alike: decided by the first probe that times
    (``timing_length`` at ``micro_batch``, the largest plan's, with that probe's model; each pass the slowest
    rank's, ``slowest_over_processes``, so every rank takes the same length), printed with ``say`` where it is
    shorter than the run's. ``cost``: the ``PassCost`` measured then."""

    def __init__(self, micro_batch: int, slowest_over_processes=lambda seconds: seconds, say=print,
                 seconds: float = PROBE_SECONDS):
        self.micro_batch, self.slowest, self.say, self.seconds = micro_batch, slowest_over_processes, say, seconds
        self.tokens: int | None = None
        self.cost = PassCost(0.0, 0.0)

    def length(self, probe: "Probe") -> int:
        """The tokens a timed sample holds (decided at the first call, with ``probe``)."""
        if self.tokens is None:
            def agreed(tokens: int) -> float:
                return agreed_seconds(lambda: probe.pass_seconds(1, tokens), self.slowest)

            self.tokens, self.cost = timing_length(agreed, probe.length, self.micro_batch, self.seconds)
            if self.tokens < probe.length:
                self.say(f"Timing probes: samples of {self.tokens} tokens, not {probe.length}: a timed plan of "
                         f"{self.micro_batch} samples of {probe.length} tokens is predicted "
                         f"{self.cost.plan_seconds(self.micro_batch, probe.length):.1f} s ({self.cost.per_pass:.3g} s "
                         f"a pass + {self.cost.per_token:.3g} s a token, from one sample's passes), over the "
                         f"{self.seconds:g} s a probe may cost; every plan is timed at {self.tokens} tokens, its time "
                         + (f"beyond {self.cost.per_pass:.3g} s a pass " if self.cost.per_pass else "")
                         + f"scaled by {probe.length}/{self.tokens}")
        return self.tokens


class Probe:
    """Probe steps of the recipe's model on worst-case batches (every sample ``max_length`` tokens, or
    ``block_size``) under one ``Lever`` setting, on this process alone: the model is ``builders.build_model``'s
    for the run's config with the lever's fields replaced (``Lever.config_fields``), as training would build it.

    - ``fits(m)``: CUDA: a whole training step at micro-batch m (forward, backward, the run's AdamW step with
      its state allocated: ``oom_probe``) either runs or raises out-of-memory. CPU: no OOM to catch, so the
      budget is ``--max_memory_mb`` (default: the memory available now) above what the process holds before
      any model exists: activation bytes saved for backward at micro-batch 1 and 2 (``activation_bytes``) give
      a linear model (bytes per sample, plus a fixed part); the weights add their bytes by layout (a 4-bit or
      8-bit base with its constants; and what the task keeps beside the model: ``task.resident_bytes``, a
      preference task's frozen reference), the gradients the trainable parameters' bytes, the optimizer state
      ``--optim``'s (AdamW's two moments in 32 or 8 bits) and a 4-bit base's largest de-quantized layer
      (``memory.model_memory``, held as ``memory``; ``estimate(m)``); the optimizer step's peak and, for a task that
      generates (GRPO), the generation's (``memory.generation_memory``: the key/value cache and logits, held as
      ``generation``) are peaks of their own, whatever the micro-batch, and so is loading the model: the peak
      RSS's rise while the process's first probe built it (``loading``: the first's, passed to the later ones,
      whose builds reuse freed memory); what loading left in the RSS beyond the weights (``left_bytes``,
      ``left_behind``) is under every peak. Transient buffers (a layer's temporaries,
      the allocator's slack, the data pipeline) are not modelled, so the real peak runs above the estimate
      and a budget needs a margin (docs/speed.md, "The batch planner under two budgets").
      The memory probes run at the run's shapes, which the answer depends on: where one costs more than
      ``PROBE_SECONDS`` (a pass of one sample is timed first), a line says so.
    - ``seconds_per_sample(m)``: one warm-up and one to three timed forward/backward passes at micro-batch m
      (seconds per sample; the optimizer step, once per optimizer step whatever the plan, is left out), of samples
      of ``timing``'s length (a ``ProbeTiming`` shared by the planning's probes; None: the run's length).
    Raises ``FinetuneError`` when the budget leaves no room at all.
    """

    def __init__(self, config, recipe, device, lever: Lever, held: int | None = None,
                 timing: ProbeTiming | None = None, overhead: float | None = None, loading: int | None = None,
                 left: int | None = None):
        config = dataclasses.replace(config, **lever.config_fields())  # the run as it would be under this lever
        task = run_task(recipe, config)
        label_names = task.probe_label_names
        self.device, self.task, self.lever, self.timing = device, task, lever, timing
        if loading is None or left is None:  # measured below: garbage a caller left (an earlier probe, a test)
            gc.collect()  # would be freed during the build and hide what it left
        before_build = peak_rss() if reset_peak_rss() else None  # the RSS now
        # the process's first build loads the tokenizer first, as a run does (``builders.build_components``): a
        # GGUF's is parsed from the same file, and the model's load reuses what that parse freed
        self.tokenizer = load_tokenizer(config.model_name_or_path) if loading is None else None
        self.model = build_model(config, task, label_names, recipe=recipe).to(device)
        if loading is None:  # the process's first build: what its peak RSS rose by while the model loaded
            loading = max(peak_rss() - before_build, 0) if before_build is not None and device.type == "cpu" else 0
        self.loading_bytes = loading
        # the precision the run will train in: fp16 asked on a CPU runs fp32 there, and the probes must time and
        # measure that (fp16 autocast on a CPU is ~50x slower, and saves a third fewer activation bytes on bbc-news)
        precision = precision_that_runs(config.mixed_precision, device.type)
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
        # what the task keeps beside the model, as training attaches it (a preference task's frozen reference,
        # whose forward each probe step runs too); no data: the probe batches are the task's own
        task.attach(self.model, {}, None, config, contextlib.nullcontext, device, precision)
        self.model.train()
        self.length = config.block_size or config.max_length
        self.vocab = self.model.config.vocab_size
        self.loss_sum = probe_loss_function(task, config, device)
        self.memory = model_memory(self.model, config.optim)  # weights by layout, gradients, optimizer state
        # a task that trains completions it generates (GRPO) samples each prompt's group with the policy before the
        # window trains (``rollout.generate_group``: num_generations rows of a prompt of at most --max_length
        # tokens), no gradient held: the key/value cache and a step's logits, beside the weights and the state
        self.generation = (generation_memory(self.model, config.num_generations, self.length,
                                             config.max_completion_length) if task.generates else None)
        trainable = self.memory["gradients"]
        buckets = trainable if world_size() > 1 else 0  # DDP keeps its gradient buckets beside the gradients
        if device.type == "cuda":
            self.fits = oom_probe(self.model, build_optimizer(self.model, config), self.step,
                                  release=torch.cuda.empty_cache, bucket_bytes=buckets)
            self.estimate = lambda m: None
            return
        # the machine's free memory is shared by the processes on it; --max_memory_mb is per process
        budget = (config.max_memory_mb * 2**20 if config.max_memory_mb
                  else psutil.virtual_memory().available // local_process_count())
        weights = self.memory["weights"]["total"] + task.resident_bytes()
        if left is None:  # the process's first build: what loading left in its RSS beyond the weights
            left = self.left_behind(before_build, weights)
        self.left_bytes = left
        started = time.perf_counter()
        before = psutil.Process().memory_info().rss if reset_peak_rss() else None
        one = self.pass_bytes(1)
        if overhead is None:  # the process's first pass: what its RSS grew by, against the bytes live at the peak
            overhead = max(1.0, (peak_rss() - before) / one) if before is not None and one > 0 else 1.0
        self.overhead = overhead
        self.say_when_slow(time.perf_counter() - started, precision)
        two = self.pass_bytes(2)
        per_sample = int(max(two - one, 1) * overhead)
        memory = self.memory
        # holds the gradients and a 4-bit layer de-quantized
        self.fixed_pass_bytes = int(max(one - (two - one), 0) * overhead)
        fixed = self.fixed_pass_bytes + weights + left + memory["optimizer_state"] + buckets
        self.per_sample_bytes, self.fixed_bytes = per_sample, fixed
        held = psutil.Process().memory_info().rss if held is None else held
        self.held = held
        print(f"Memory probe ({lever}): {per_sample / 2**20:.1f} MiB per sample + {fixed / 2**20:.1f} MiB per step "
              f"(a training pass's peak at micro-batch 1 and 2: activations, gradients, transients, x {overhead:.2f} "
              f"the allocator's overhead; the weights and {memory['optimizer']} state); "
              f"budget {budget / 2**20:.0f} MiB, process holds {held / 2**20:.0f} MiB"
              + ("" if self.generation is None else
                 f"; generating {self.generation['sequences']} completions of a prompt: KV cache "
                 f"{self.generation['kv_cache'] / 2**20:.1f} MiB + logits {self.generation['logits'] / 2**20:.1f} MiB"))
        if budget <= held + fixed + per_sample:
            raise FinetuneError(f"--max_memory_mb {budget / 2**20:.0f} leaves no room: this process already holds "
                                f"{held / 2**20:.0f} MiB and one sample needs about {(fixed + per_sample) / 2**20:.0f} "
                                f"MiB more. Raise --max_memory_mb above {(held + fixed + per_sample) / 2**20:.0f}.")
        # the optimizer step holds every gradient, the weights and the state, and its own transient (activations are
        # freed by then): a peak of its own, whatever the micro-batch
        self.step_peak_bytes = (weights + left + trainable + memory["optimizer_state"] + memory["optimizer_step"]
                                + buckets)
        # generating (a task that does, between optimizer steps): the weights (and a 4-bit layer de-quantized), what
        # the task keeps (a frozen reference), the state, the cache and the logits
        self.generation_peak_bytes = (0 if self.generation is None else weights + left + memory["optimizer_state"]
                                      + memory["dequantized"] + self.generation["kv_cache"] + self.generation["logits"])
        # loading, measured: a GGUF base quantized for QLoRA is de-quantized to full precision first, and the
        # checkpoint transformers quantizes from is mapped while it does (docs/plan.md): above its training
        others = max(self.step_peak_bytes, self.generation_peak_bytes, self.loading_bytes)
        linear = estimate_fits_from_memory(per_sample, fixed, budget - held)
        self.fits = lambda m: linear(m) and others <= budget - held
        self.estimate = lambda m: int(held + max(fixed + m * per_sample, others))

    def left_behind(self, before_build: int | None, weights: int) -> int:
        """Bytes of RSS that loading the model left in this process beyond its weights (``weights``, bytes): memory
        freed to the allocator but not to the system (a GGUF base de-quantized from numpy arrays; docs/plan.md),
        and what the first forward leaves for good (bitsandbytes compiles its CPU
        de-quantization once per weight shape and grad mode, ``backends/default/ops.py`` ``_try_torch_compile``). A
        training pass of one sample of 8 tokens runs first (with gradients: a forward without them compiles for that
        mode only), so that the first pass at the run's shapes, whose growth gives the allocator's overhead, holds
        that pass alone. Every later peak holds this; 0 where ``before_build`` (the RSS before the build) is
        unknown."""
        gc.collect()
        self.pass_seconds(1, min(self.length, 8))
        if before_build is None or not reset_peak_rss():  # the RSS now, read as ``before_build`` was
            return 0
        return max(peak_rss() - before_build - weights, 0)

    def pass_bytes(self, m: int) -> int:
        """The most bytes one training pass at micro-batch ``m`` (forward and backward) holds above what was held
        before it (``allocation_peak``): the activations saved for backward, the gradients as backward writes them,
        and every transient (a layer's temporaries, the loss's logits and their gradient, a 4-bit layer
        de-quantized), which the bytes saved for backward alone (``activation_bytes``) leave out: on SmolLM2-135M at
        256 tokens the pass's peak is far above them (docs/plan.md). The gradients are freed after it."""
        try:
            return allocation_peak(lambda: self.step(m).backward())
        finally:
            self.model.zero_grad(set_to_none=True)

    def activation_bytes(self, m: int) -> int:
        """Bytes autograd saves for backward in one forward at micro-batch ``m`` (``saved_storages``), less the
        parameters' own storages among them (weights a layer keeps for its input's gradient: memory the model
        holds anyway, counted once as the weights). The forward alone: its graph is freed unrun (what it saved is
        counted as the forward saves it; a backward would add nothing to the count and cost twice the forward)."""
        storages, loss = saved_storages(lambda: self.step(m))
        del loss  # frees the graph and what it saved
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        return sum(size for ptr, size in storages.items() if ptr not in params)

    def say_when_slow(self, forward_seconds: float, precision: str) -> None:
        """Print that this memory probe costs more than ``PROBE_SECONDS`` where its training pass (forward and
        backward) of one sample took ``forward_seconds`` (the probe: that, and a pass of two samples, about three times
        it)."""
        if 3 * forward_seconds <= PROBE_SECONDS:
            return
        emulated = (f"; bf16 is {bf16_support()} on this CPU, where --mixed_precision no runs faster"
                    if precision == "bf16" and self.device.type == "cpu" and not native_bf16() else "")
        print(f"Memory probe ({self.lever}): a training pass of 1 sample of {self.length} tokens took {forward_seconds:.1f} "
              f"s, so this probe takes about {3 * forward_seconds:.1f} s, over the {PROBE_SECONDS:g} s a probe may "
              f"cost: the memory model needs the run's own shapes, so it is not shortened{emulated}")

    def step(self, m: int, length: int | None = None):
        """The summed loss of a worst-case micro-batch of ``m`` samples of ``length`` tokens (default the run's:
        ``block_size`` or ``max_length``); forward only, the caller backs it."""
        batch = self.task.probe_batch(m, length or self.length, self.vocab, self.device)
        with torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            return self.loss_sum(self.model, batch)

    def pass_seconds(self, m: int, length: int | None = None) -> float:
        """Seconds of one forward + backward at micro-batch ``m`` of ``length``-token samples (``step``),
        synchronised on a GPU; the gradients are freed after it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self.step(m, length).backward()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        took = time.perf_counter() - start
        self.model.zero_grad(set_to_none=True)
        return took

    def seconds_per_sample(self, m: int, min_seconds: float = 1.0, max_passes: int = 3) -> float:
        """Seconds per sample of forward + backward at micro-batch ``m``: after one untimed warm-up pass, the
        median of timed passes, repeated until they add up to ``min_seconds`` or ``max_passes`` were run (one
        pass where a pass is long, as on a CPU at 512 tokens; up to three where it is short, as on a GPU). The
        samples hold ``timing``'s tokens (``ProbeTiming.length``: the run's, or fewer where a plan at the run's
        would cost over ``PROBE_SECONDS``); at fewer, the pass's time beyond ``timing.cost.per_pass`` is scaled to
        the run's length in proportion (the per-pass part weighs as much at any length: scaled with the rest, it
        would favour large micro-batches)."""
        length = self.length if self.timing is None else self.timing.length(self)
        self.pass_seconds(m, length)  # warm-up: first-call kernels, allocations
        times = [self.pass_seconds(m, length)]
        while len(times) < max_passes and sum(times) < min_seconds:
            times.append(self.pass_seconds(m, length))
        seconds = statistics.median(times)
        if length < self.length:
            fixed = min(self.timing.cost.per_pass, seconds)
            seconds = fixed + (seconds - fixed) * self.length / length
        return seconds / m

    def first_measurements(self) -> dict:
        """What this process's first probe measured and its later probes reuse, as keyword arguments of ``Probe``:
        the allocator's ``overhead`` (a factor), the ``loading`` peak and what it ``left`` behind (bytes); None for
        what was not measured (a GPU's probe measures neither)."""
        return {"overhead": getattr(self, "overhead", None), "loading": self.loading_bytes,
                "left": getattr(self, "left_bytes", None)}

    def close(self) -> None:
        """Free the probe copy of the model, and its optimizer state held by the ``fits`` closure."""
        self.model = self.fits = self.estimate = self.loss_sum = self.tokenizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def probe_loss_function(task, config, device):
    """``loss.loss_function`` for a probe model under ``config`` (the run's under one ``Lever``: the same
    loss path training takes)."""
    # a stand-in for the Accelerator: the probe runs the bare model, under its own autocast (Probe.step)
    accelerator = SimpleNamespace(device=device, is_main_process=False, autocast=contextlib.nullcontext)
    return loss_function(task, config, accelerator)


def levers(config, recipe, device) -> list[Lever]:
    """The lever settings the planner considers: activation checkpointing off and on (only on when
    ``--activation_checkpointing`` was given), times, for causal LM, the plain and the chunked loss (only the
    given one when ``--loss_chunk_size`` was set)."""
    checkpointing = [True] if config.activation_checkpointing else [False, True]
    if task_of(recipe).chunked_loss:
        chunks = [config.loss_chunk_size] if config.loss_chunk_size is not None else [0, DEFAULT_CHUNK_SIZE]
    else:
        chunks = [None]
    return [Lever(c, k) for c in checkpointing for k in chunks]
