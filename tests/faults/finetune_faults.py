"""Fault injection for finetune's tests and the GPU acceptance script: faults that a real run cannot be made
to produce on demand, injected from outside the package by wrapping methods of ``accelerate.Accelerator``
(and, for fp16 in the Trainer backend, one finetune function); ``finetune/`` has no test hook of its own.

Five faults, and one observer (``FAULT_SYNC_LOG``, ``install_sync_log``: which backwards DDP all-reduced in):

- CPU fp16 (``FAULT_CPU_FP16=1``): an ``Accelerator`` created with ``mixed_precision="fp16"`` on a CPU
  (Accelerate 1.15 leaves it ``native_amp=False`` and ``scaler=None``: it runs fp32) gets what Accelerate
  gives a GPU: fp16 autocast and a ``torch.amp.GradScaler("cpu")``, so CI exercises the fp16 code paths
  (loss scaling, unscale before clipping, overflow skips). Wraps ``Accelerator.__init__``, so it reaches
  every Accelerator: the accelerate engine's and ``transformers.Trainer``'s. For the Trainer backend it
  also wraps ``finetune.backends.trainer.training_arguments``, which asks Trainer for fp16 only on CUDA
  (see ``install_trainer_fp16``: the one patch point outside the libraries). fp16 matmuls are ~50x slower
  than fp32 on a CPU: tiny models only.
- forced overflow (``FAULT_OVERFLOW_STEPS=2,3``): on those optimizer steps (1-based) every micro-batch's
  loss is multiplied by infinity before ``Accelerator.backward``, so every gradient is inf/NaN: under fp16 the
  GradScaler (or DeepSpeed's loss scaler) must skip the step and the schedule must not advance; under
  fp32/bf16 the run must stop with a ``NumericalError``. (A tiny ``--max_grad_norm`` cannot cause an
  overflow: clipping runs after the overflow check.) Wraps ``Accelerator.backward``.
- a failing checkpoint write (``FAULT_SAVE_ERROR=RuntimeError@rank1@step2``): on that global rank, the first
  write into the checkpoint folder of that optimizer step (``.tmp-step_00000002``) raises what the writer
  raises on a full disk: ``RuntimeError`` (``torch.save``), ``SafetensorError`` (``safetensors``' ``save_file``),
  ``OSError`` (ENOSPC) or a plain ``Exception`` (the ``tokenizers`` library). Wraps ``torch.save`` and
  ``accelerate.utils.other.safe_save_file`` (the names ``Accelerator.save_state`` writes through).

- a diverging learning rate (``FAULT_LEARNING_RATE=4:1.5``): runs with that many accumulation steps get
  their learning rate multiplied by that factor: one split of ``finetune verify`` then trains other weights,
  which verify must catch. Wraps ``finetune.engine.plain.build_optimizer`` (AdamW of the plain/DDP engine).
- a slow benchmark (``FAULT_SLOW_BENCHMARK=0.5``): every forward lm-eval's ``HFLM`` runs (``_model_call``: each
  batch of log-likelihood requests) and every generation (``_model_generate``) first sleeps that many seconds, so
  an ``--eval_tasks`` benchmark of a tiny model on a few documents outlasts a short ``--ddp_timeout``, as a real
  benchmark of hundreds of documents outlasts the default. Wraps ``lm_eval.models.huggingface.HFLM``.

Two ways in:

- in-process, with pytest's ``monkeypatch.setattr`` as ``set_attr`` (undone after the test): the ``faults``
  fixture of ``tests/conftest.py`` calls ``install_cpu_fp16``, ``install_trainer_fp16`` and
  ``install_overflow``;
- in a launched process: this folder first on its ``PYTHONPATH`` plus the variables (``tests/helpers.py:
  fault_env``; ``bench/gpu_acceptance.py`` does the same), and ``sitecustomize.py`` here calls
  ``install_on_import``: each wrapper is installed when the process imports the module it wraps.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import os
import re
import sys

CPU_FP16_ENV = "FAULT_CPU_FP16"  # "1": fp16 on a CPU really runs fp16
OVERFLOW_STEPS_ENV = "FAULT_OVERFLOW_STEPS"  # comma-separated optimizer steps (1-based) that overflow
LEARNING_RATE_ENV = "FAULT_LEARNING_RATE"  # ACCUMULATION:FACTOR: those runs train at FACTOR x the learning rate
SAVE_ERROR_ENV = "FAULT_SAVE_ERROR"  # TYPE@rankR@stepS: that rank's checkpoint write of step S raises TYPE
SYNC_LOG_ENV = "FAULT_SYNC_LOG"  # a folder: each rank logs, per backward, whether DDP all-reduced in it
LEAVE_LOG_ENV = "FAULT_LEAVE_LOG"  # a folder: each rank records whether leave() ended its process group's handle
SLOW_STEP_ENV = "FAULT_SLOW_STEP"  # seconds each accumulation window (optimizer step) of the accelerate loop sleeps first
SLOW_BENCHMARK_ENV = "FAULT_SLOW_BENCHMARK"  # seconds each lm-eval HFLM forward or generation sleeps first
LAYOUT_COST_ENV = "FAULT_LAYOUT_COST"  # "A,B,C": --packing's measured layout cost is this one (seconds per
# micro-batch, per position, per attention score), so a packed run's layouts do not depend on the machine's timings
FAULTS_DIR = os.path.dirname(os.path.abspath(__file__))  # what goes first on a launched process's PYTHONPATH

_STEPS_DONE = "_fault_optimizer_steps_done"  # attribute the overflow wrapper keeps on each Accelerator


def _accelerator_class():
    from accelerate import Accelerator

    return Accelerator


# ------------------------------------------------------------------------------------------ CPU fp16
def enable_cpu_fp16(accelerator) -> bool:
    """Give a CPU ``accelerator`` created with ``mixed_precision="fp16"`` what Accelerate gives a GPU.
    Does nothing, and returns False, unless fp16 was asked for and the device is a CPU without a scaler.
    Returns True when it switched fp16 on (and says so on stderr, from the local main process).

    Accelerate 1.15 keeps ``mixed_precision == "fp16"`` on a CPU but leaves ``native_amp`` False and
    ``scaler`` None (``accelerate/accelerator.py`` lines 563-584: the fp16 branch requires
    ``device.type != "cpu"``), so it runs fp32. Setting ``native_amp`` makes ``accelerator.autocast()`` and
    the forward that ``prepare()`` wraps run ``torch.autocast("cpu", dtype=torch.float16)`` (so
    ``finetune.engine.precision.effective_mixed_precision`` measures "fp16"), and ``unscale_gradients`` /
    ``clip_grad_norm_`` unscale; ``scaler`` is what ``backward`` scales the loss with (line 2857) and what
    ``prepare()`` hands the ``AcceleratedOptimizer`` (whose ``step`` calls ``scaler.step`` and
    ``scaler.update``), and what ``save_state``/``load_state`` (and Trainer's ``_save_scaler``) checkpoint.
    So it must happen before ``prepare()``: at the end of ``__init__``.
    """
    if not (accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu" and accelerator.scaler is None):
        return False
    import torch

    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu")
    if accelerator.is_local_main_process:
        print(f"{CPU_FP16_ENV}: TEST ONLY fp16 autocast and GradScaler on the CPU (tests/faults; slow; not for real "
              "runs).", file=sys.stderr)
    return True


def install_cpu_fp16(set_attr=setattr, accelerator_class=None) -> None:
    """Wrap ``Accelerator.__init__`` so that every Accelerator goes through ``enable_cpu_fp16`` once built.
    ``set_attr``: ``setattr``, or ``monkeypatch.setattr`` to have it undone."""
    cls = accelerator_class or _accelerator_class()
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        enable_cpu_fp16(self)

    set_attr(cls, "__init__", __init__)


def install_trainer_fp16(set_attr=setattr, trainer_backend=None) -> None:
    """Wrap ``finetune.backends.trainer.training_arguments`` (``trainer_backend``: that module) so that fp16
    asked for on a CPU gives ``TrainingArguments(fp16=True)``, as on a GPU.

    finetune asks Trainer for fp16 only where it runs (a CUDA device): on a CPU the request becomes
    ``fp16=False``, Trainer creates its Accelerator with ``mixed_precision="no"`` and ``enable_cpu_fp16`` has
    nothing to act on. The request never reaches a library there, so this is the one patch point inside
    finetune. ``dataclasses.replace`` runs ``TrainingArguments.__init__`` again with ``fp16=True``: the same
    arguments as constructing them so (checked field by field with transformers 5.23), whose
    ``__post_init__`` sets ``mixed_precision = "fp16"`` (``transformers/training_args.py`` lines 1614-1616),
    which Trainer passes to its Accelerator (``trainer.py`` line 744)."""
    if trainer_backend is None:
        import finetune.backends.trainer as trainer_backend
    original = trainer_backend.training_arguments

    @functools.wraps(original)
    def training_arguments(config, *args, **kwargs):
        arguments = original(config, *args, **kwargs)
        if config.mixed_precision == "fp16" and not arguments.fp16 and arguments.use_cpu:
            arguments = dataclasses.replace(arguments, fp16=True)
        return arguments

    set_attr(trainer_backend, "training_arguments", training_arguments)


# ------------------------------------------------------------------------------------------ forced overflow
def parse_steps(value: str) -> frozenset[int]:
    """The optimizer steps of ``FAULT_OVERFLOW_STEPS`` (e.g. "2,3"; empty or blank: none). Raises
    ``ValueError`` for a value that is not a list of integers >= 1."""
    steps = frozenset(int(part) for part in value.split(",") if part.strip())
    if any(step < 1 for step in steps):
        raise ValueError(f"{OVERFLOW_STEPS_ENV}={value!r}: optimizer steps are numbered from 1")
    return steps


def install_overflow(steps, set_attr=setattr, accelerator_class=None) -> None:
    """Wrap ``Accelerator.backward`` so that the loss of every micro-batch of the optimizer steps in
    ``steps`` (1-based) is multiplied by infinity.

    Optimizer steps are counted per Accelerator from the micro-batches that end a window: a backward with
    ``accelerator.sync_gradients`` true is the last of its optimizer step (the accelerate engine aligns
    Accelerate's counter so the window's last micro-batch syncs, also a short last window; Trainer sets
    the flag itself; under DeepSpeed, ``backward`` passes the same flag to the engine, which steps then:
    ``accelerate/accelerator.py`` line 2853). Skipped fp16 steps count, as in the run's own step counter.
    The count starts at 0 with each Accelerator: a resumed run counts from its first step after the resume
    as step 1 (no test combines the two). Raises ``ValueError`` for a step below 1.
    """
    steps = frozenset(steps)
    if any(step < 1 for step in steps):
        raise ValueError(f"overflow steps {sorted(steps)}: optimizer steps are numbered from 1")
    cls = accelerator_class or _accelerator_class()
    original = cls.backward

    @functools.wraps(original)
    def backward(self, loss, **kwargs):
        done = getattr(self, _STEPS_DONE, 0)
        last_of_step = self.sync_gradients  # read before: the backward may run the optimizer step (DeepSpeed)
        if done + 1 in steps:
            loss = loss * float("inf")
        result = original(self, loss, **kwargs)
        if last_of_step:
            setattr(self, _STEPS_DONE, done + 1)
        return result

    set_attr(cls, "backward", backward)


# ------------------------------------------------------------------------------------------ DDP sync log
def install_sync_log(folder: str, set_attr=setattr, accelerator_class=None) -> None:
    """An observer, not a fault: log, per ``Accelerator.backward``, whether DDP all-reduced gradients in it.

    Wraps ``Accelerator.prepare_model`` to register a comm hook on the ``DistributedDataParallel`` it returns
    (``register_comm_hook``: DDP calls the hook for each gradient bucket it all-reduces, and only then; the hook
    counts the call and all-reduces as DDP's default does, ``default_hooks.allreduce_hook``), and
    ``Accelerator.backward`` to append ``{"sync_gradients": the flag before the backward, "all_reduced": whether
    the hook ran during it}`` to ``FOLDER/rank<RANK>.jsonl``. Both backends backward through the Accelerator
    (Trainer calls ``self.accelerator.backward``), so both are observed. Processes without DDP log
    ``all_reduced`` false."""
    cls = accelerator_class or _accelerator_class()
    original_prepare, original_backward = cls.prepare_model, cls.backward
    calls = [0]

    def counting_allreduce(state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        calls[0] += 1
        return allreduce_hook(state, bucket)

    @functools.wraps(original_prepare)
    def prepare_model(self, *args, **kwargs):
        model = original_prepare(self, *args, **kwargs)
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel) and not getattr(model, "_fault_sync_log", False):
            model.register_comm_hook(None, counting_allreduce)
            model._fault_sync_log = True
        return model

    @functools.wraps(original_backward)
    def backward(self, loss, **kwargs):
        import json

        before, flag = calls[0], bool(self.sync_gradients)
        result = original_backward(self, loss, **kwargs)
        path = os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps({"sync_gradients": flag, "all_reduced": calls[0] > before}) + "\n")
        return result

    set_attr(cls, "prepare_model", prepare_model)
    set_attr(cls, "backward", backward)


def install_leave_log(folder: str, set_attr=setattr, distributed_module=None) -> None:
    """An observer, not a fault: wrap ``finetune.distributed.leave`` so that each call writes, after the real one,
    ``FOLDER/leave-rank<RANK>-<n>.json``: ``{"group_started": whether a process group was up, "handle_alive":
    whether its Python handle (``torch.distributed.group.WORLD``, held through a weak reference) outlived the
    call}``. A dead handle means nothing else held the group: ``destroy_process_group`` released its last owner,
    so gloo's worker threads were joined inside ``leave`` (docs/resume.md#leaving-the-process-group)."""
    import importlib
    import json
    import weakref

    module = distributed_module or importlib.import_module("finetune.distributed")
    original = module.leave
    calls = [0]

    @functools.wraps(original)
    def leave():
        import torch.distributed as dist

        started = dist.is_available() and dist.is_initialized()
        handle = weakref.ref(dist.group.WORLD) if started else None
        original()
        calls[0] += 1
        path = os.path.join(folder, f"leave-rank{os.environ.get('RANK', '0')}-{calls[0]}.json")
        with open(path, "w") as f:
            json.dump({"group_started": started, "handle_alive": handle is not None and handle() is not None}, f)

    set_attr(module, "leave", leave)


# ------------------------------------------------------------------------------------------ failing checkpoint write
def _save_error(kind: str):
    """An exception of ``kind`` with the message the real writer gives on a full disk (measured on a full
    tmpfs with torch 2.13, safetensors 0.8.0, tokenizers 0.23.3)."""
    import errno

    if kind == "RuntimeError":  # torch.save: its zip writer's C++ check (c10::Error)
        return RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534 (injected: "
                            f"{SAVE_ERROR_ENV})")
    if kind == "SafetensorError":  # a subclass of Exception only
        from safetensors import SafetensorError

        return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28) "
                               f"(injected: {SAVE_ERROR_ENV})")
    if kind == "OSError":
        return OSError(errno.ENOSPC, f"No space left on device (injected: {SAVE_ERROR_ENV})")
    if kind == "Exception":  # tokenizers' Tokenizer.save
        return Exception(f"No space left on device (os error 28) (injected: {SAVE_ERROR_ENV})")
    raise ValueError(f"{SAVE_ERROR_ENV}: unknown error type {kind!r} (RuntimeError, SafetensorError, OSError, "
                     "Exception)")


def parse_save_error(value: str) -> tuple[str, int, int]:
    """``FAULT_SAVE_ERROR``'s (type, global rank, optimizer step), from "RuntimeError@rank1@step2". Raises
    ``ValueError`` for another form or an unknown type."""
    match = re.fullmatch(r"(\w+)@rank(\d+)@step(\d+)", value.strip())
    if match is None:
        raise ValueError(f"{SAVE_ERROR_ENV}={value!r}: expected TYPE@rankR@stepS, e.g. RuntimeError@rank1@step2")
    _save_error(match[1])  # checks the type
    return match[1], int(match[2]), int(match[3])


def install_save_error(kind: str, rank: int, step: int, set_attr=setattr, torch_module=None,
                       accelerate_other=None) -> None:
    """Wrap ``torch.save`` and ``accelerate.utils.other.safe_save_file`` so that, in the process of global
    ``rank`` (``RANK``; 0 without a launcher), a write to a path inside ``.tmp-step_<step, 8 digits>`` raises
    ``_save_error(kind)`` before writing anything: from the writer that raises that type (``RuntimeError``:
    ``torch.save`` only; ``SafetensorError``: ``safe_save_file`` only; ``OSError``, ``Exception``: both). The product is not touched: these are the functions
    ``Accelerator.save_state`` writes with (``accelerate/checkpointing.py``: ``torch.save`` for the random
    states and the scaler, ``accelerate/utils/other.py`` ``save``: ``safe_save_file`` for the weights,
    ``torch.save`` for optimizer and scheduler)."""
    if torch_module is None:
        import torch as torch_module
    if accelerate_other is None:
        import accelerate.utils.other as accelerate_other
    folder = f".tmp-step_{step:08d}"

    def failing(original):
        @functools.wraps(original)
        def write(obj, f, *args, **kwargs):
            if int(os.environ.get("RANK", "0")) == rank and isinstance(f, (str, os.PathLike)) and folder in str(f):
                raise _save_error(kind)
            return original(obj, f, *args, **kwargs)

        return write

    if kind != "SafetensorError":
        set_attr(torch_module, "save", failing(torch_module.save))
    if kind != "RuntimeError":
        set_attr(accelerate_other, "safe_save_file", failing(accelerate_other.safe_save_file))


# ------------------------------------------------------------------------------------------ from the environment
class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the callbacks registered for a module right after it has executed; steps aside when none is
    left. Finds the module with ``PathFinder`` (the modules it serves are submodules of ordinary packages)."""

    def __init__(self):
        self.callbacks: dict[str, list] = {}

    def find_spec(self, fullname, path, target=None):
        callbacks = self.callbacks.pop(fullname, None)
        if callbacks is None:
            return None
        if not self.callbacks:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            raise ImportError(f"{__name__}: cannot wrap {fullname}: no loader found for it")
        exec_module = spec.loader.exec_module

        def exec_then_callbacks(module):
            exec_module(module)
            for callback in callbacks:
                callback(module)

        spec.loader.exec_module = exec_then_callbacks
        return spec


def install_learning_rate(accumulation: int, factor: float, set_attr=setattr, plain_module=None) -> None:
    """Wrap ``build_optimizer`` of ``finetune.engine.plain`` (``plain_module``) so that a run with
    ``gradient_accumulation_steps == accumulation`` builds AdamW at ``factor`` x its learning rate (its schedule
    follows the optimizer's)."""
    if plain_module is None:
        import finetune.engine.plain as plain_module
    original = plain_module.build_optimizer

    @functools.wraps(original)
    def build_optimizer(model, config, groups=None):
        if config.gradient_accumulation_steps == accumulation:
            config = dataclasses.replace(config, learning_rate=config.learning_rate * factor)
        return original(model, config, groups)

    set_attr(plain_module, "build_optimizer", build_optimizer)


def install_inexact_trainer_packer(set_attr=setattr, trainer_backend=None) -> None:
    """Break the Trainer backend's packing: its packer built with ``exact=False`` (a packed window's micro-batch
    count then differs from the window's, and Trainer, which counts micro-batches to find the optimizer step, steps
    at the wrong places: 2 optimizer steps instead of 4 in issue 36). ``finetune.data.packing`` itself is untouched:
    the Trainer backend gets a view of it whose ``packer_for`` ignores ``exact``."""
    if trainer_backend is None:
        import finetune.backends.trainer as trainer_backend
    real = trainer_backend.packing

    class InexactPacking:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def packer_for(*args, **kwargs):
            kwargs["exact"] = False
            return real.packer_for(*args, **kwargs)

    set_attr(trainer_backend, "packing", InexactPacking())


def install_layout_cost(value: str, set_attr=setattr, cost_module=None) -> None:
    """Replace ``finetune.data.packing_cost.measure`` (``cost_module``) with one that returns the ``LayoutCost`` of
    ``value`` ("per micro-batch,per position,per score", seconds), with the key the real one gives: a packed run
    then chooses its layouts the same way on every machine (the timings of a tiny model are noise)."""
    if cost_module is None:
        import finetune.data.packing_cost as cost_module
    coefficients = [float(x) for x in value.split(",")]
    if len(coefficients) != 3:
        raise ValueError(f"{LAYOUT_COST_ENV} must be three numbers A,B,C, got {value!r}")

    def measure(model, loss_sum, row_length, budget, precision="no", *args, **kwargs):
        return cost_module.LayoutCost(*coefficients, key=cost_module.cost_key(model, row_length, budget, precision))

    set_attr(cost_module, "measure", measure)


def install_slow_benchmark(seconds: float, set_attr=setattr, hflm_class=None) -> None:
    """Make lm-eval's ``HFLM`` (``hflm_class``) sleep ``seconds`` before each forward (``_model_call``) and each
    generation (``_model_generate``): a benchmark that takes as long as one over many documents."""
    import time

    if hflm_class is None:
        from lm_eval.models.huggingface import HFLM as hflm_class
    for name in ("_model_call", "_model_generate"):
        original = getattr(hflm_class, name)

        def slowed(self, *args, _original=original, **kwargs):
            time.sleep(seconds)
            return _original(self, *args, **kwargs)

        set_attr(hflm_class, name, functools.wraps(original)(slowed))


def parse_learning_rate(value: str) -> tuple[int, float]:
    """``"4:1.5"`` -> (4, 1.5). Raises ``ValueError`` naming the expected form."""
    try:
        accumulation, factor = value.split(":")
        return int(accumulation), float(factor)
    except ValueError:
        raise ValueError(f"{LEARNING_RATE_ENV} must be ACCUMULATION:FACTOR (e.g. 4:1.5), got {value!r}") from None


def after_import(name: str, callback) -> None:
    """Call ``callback(module)`` once the module ``name`` has been imported (at once if it has been)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport)), None)
    if finder is None:
        finder = _AfterImport()
        sys.meta_path.insert(0, finder)
    finder.callbacks.setdefault(name, []).append(callback)


def install_slow_steps(seconds: float, loop_module) -> None:
    """Make the accelerate backend's loop (``loop_module``: ``finetune.backends.accelerate``) sleep ``seconds`` before
    each window it reads (``iter_windows``), so that a tiny model's run lasts long enough for a signal sent after its
    first steps to land inside training; nothing it computes changes."""
    import time

    original = loop_module.iter_windows

    def iter_windows(*args, **kwargs):
        for window in original(*args, **kwargs):
            time.sleep(seconds)
            yield window

    loop_module.iter_windows = iter_windows


def install_on_import(environ=None, after=after_import) -> None:
    """For ``sitecustomize``: install the faults the environment asks for, each when the process imports
    the module it wraps (``after``: ``after_import``). ``FAULT_CPU_FP16=1``: ``install_cpu_fp16`` on
    ``accelerate.accelerator`` and ``install_trainer_fp16`` on ``finetune.backends.trainer``;
    ``FAULT_OVERFLOW_STEPS``: ``install_overflow`` on ``accelerate.accelerator``; ``FAULT_SAVE_ERROR``:
    ``install_save_error`` on ``accelerate.checkpointing``; ``FAULT_SLOW_BENCHMARK``: ``install_slow_benchmark`` on
    ``lm_eval.models.huggingface``. Nothing is imported, and nothing changes, when no
    fault is asked for. A malformed ``FAULT_OVERFLOW_STEPS`` or ``FAULT_SAVE_ERROR`` fails the import of
    accelerate, loudly (an error in ``sitecustomize`` itself would only be printed)."""
    environ = os.environ if environ is None else environ
    if environ.get(CPU_FP16_ENV) == "1":
        after("accelerate.accelerator", lambda module: install_cpu_fp16(accelerator_class=module.Accelerator))
        after("finetune.backends.trainer", lambda module: install_trainer_fp16(trainer_backend=module))
    value = environ.get(OVERFLOW_STEPS_ENV, "")
    if value.strip():
        after("accelerate.accelerator",
              lambda module: install_overflow(parse_steps(value), accelerator_class=module.Accelerator))
    learning_rate = environ.get(LEARNING_RATE_ENV, "")
    if learning_rate.strip():
        after("finetune.engine.plain",
              lambda module: install_learning_rate(*parse_learning_rate(learning_rate), plain_module=module))
    mutant = environ.get("FAULT_MUTANT", "")
    if mutant.strip():  # a wrong accelerate backend for verify (tests/faults/mutants.py)
        from mutants import mutate

        after("finetune.backends.accelerate", lambda module: mutate(module, mutant.strip()))
    sync_log = environ.get(SYNC_LOG_ENV, "")
    if sync_log.strip():
        after("accelerate.accelerator",
              lambda module: install_sync_log(sync_log.strip(), accelerator_class=module.Accelerator))
    leave_log = environ.get(LEAVE_LOG_ENV, "")
    if leave_log.strip():
        after("finetune.distributed", lambda module: install_leave_log(leave_log.strip(), distributed_module=module))
    layout_cost = environ.get(LAYOUT_COST_ENV, "")
    if layout_cost.strip():
        after("finetune.data.packing_cost", lambda module: install_layout_cost(layout_cost, cost_module=module))
    slow_step = environ.get(SLOW_STEP_ENV, "")
    if slow_step.strip():
        after("finetune.backends.accelerate", lambda module: install_slow_steps(float(slow_step), loop_module=module))
    slow_benchmark = environ.get(SLOW_BENCHMARK_ENV, "")
    if slow_benchmark.strip():
        after("lm_eval.models.huggingface",
              lambda module: install_slow_benchmark(float(slow_benchmark), hflm_class=module.HFLM))
    save_error = environ.get(SAVE_ERROR_ENV, "")
    if save_error.strip():
        after("accelerate.checkpointing", lambda module: install_save_error(*parse_save_error(save_error)))
