"""Runs over several machines (``accelerate launch --num_machines M --machine_rank R ...`` on each), with
or without a shared filesystem, and the agreement every process of a run needs before it goes on.

Storage: at start the machines find out whether they see one output directory (a shared filesystem:
global rank 0 writes the run's files, as on one machine) or each its own (each machine's local main
process writes a full copy: ``run_config.json``, ``log.jsonl``, checkpoints, the final model). A mix
(some machines share a directory, others do not) is refused.

Agreement: a check whose answer can differ between machines (the output directory, the checkpoint to
resume from) must end the same way on every process. If one process raised while the others went on,
they would wait for it in the next collective until the process-group timeout (30 minutes with gloo).
So each process runs the check, whether any failed is agreed on (``agreed_max``: one MAX all-reduce of a
plain number, ``all_reduce_max``, the primitive every agreement of the package uses, the batch planner's
included), and if any failed, the messages are exchanged (``accelerate.utils.gather_object``) and every
process raises the same ``FinetuneError`` naming which machine and rank failed how.

Process state: ``process_state`` is the one place Accelerate's ``PartialState`` is constructed.
"""

from __future__ import annotations

import gc
import importlib
import math
import os
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, TypeVar

import torch
from accelerate import PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import gather_object, parse_flag_from_env

from finetune.errors import FinetuneError, together

# The prefix of every write probe the package leaves in an output directory (``output.check_output_dir``'s, the
# storage layout's here, the save-speed probe's): no rank mistakes one for content, and no upload takes one.
WRITE_PROBE = ".write_test"
T = TypeVar("T")


def process_state(cpu: bool = False, timeout_seconds: int | None = None) -> PartialState:
    """Accelerate's process-wide ``PartialState`` (starting the process group if the launcher asked for
    several processes): on the CPU when ``ACCELERATE_USE_CPU`` is set (``accelerate launch --cpu``, or the
    tests' gloo ranks) or ``cpu`` is True. The only place the package constructs one. ``timeout_seconds``:
    the collective timeout (``--ddp_timeout``), effective only where this call starts the process group."""
    kwargs = {} if timeout_seconds is None else {"timeout": timedelta(seconds=timeout_seconds)}
    # torch.distributed.nn before the group starts: imported after (the first DistributedDataParallel imports it,
    # through torch._dynamo and FSDP's modules), its functions take the group's handle as a default argument
    # (``group=group.WORLD``, torch/distributed/nn/functional.py) and own the group for the life of the process.
    if torch.distributed.is_available() and not torch.distributed.is_initialized():
        importlib.import_module("torch.distributed.nn")
    return PartialState(cpu=cpu or parse_flag_from_env("ACCELERATE_USE_CPU"), **kwargs)


def reset_state() -> None:
    """Forget Accelerate's process-wide states (``AcceleratorState``, ``GradientState``, ``PartialState``) so the
    next run in this process builds its own Accelerator; a started process group stays (``PartialState`` reuses
    it). For several runs in one process: ``finetune verify``."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def leave() -> None:
    """End this process's part in its process group once every process is done (a command that finished, a run
    stopped by a signal, or ``--resume_from_checkpoint auto`` over a finished run), after dropping its
    ``DistributedDataParallel`` models: ``gc.collect``, a barrier, then ``destroy_process_group``, which then
    releases the group's last owner and joins gloo's threads here. Why: docs/resume.md#leaving-the-process-group.
    Nothing without a process group; a second call does nothing."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gc.collect()  # a model in a reference cycle goes now, while the group's Python handles still own the group
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def leaving_together(work: Callable[[], T]) -> T:
    """``work()``'s value; if it raises a ``FinetuneError`` that every process raises together (``every_rank``: a
    numerical error, a failed checkpoint write, an empty window, an agreed check), leave the process group first
    (``leave``, as a finished command does), then raise it. Its traceback and chained exceptions are dropped before
    ``leave``: their frames may hold the model, whose DDP ``Reducer`` must not outlive the group's Python handle
    (docs/resume.md#leaving-the-process-group). Any other exception is raised as it is, without a barrier:
    this process may be failing alone. A command that returns leaves the group itself."""
    try:
        return work()
    except FinetuneError as err:
        if not err.every_rank:
            raise
        failed = err.with_traceback(None)
    failed.__context__ = failed.__cause__ = None
    leave()
    raise failed


def distributed_state():
    """``process_state()`` when the launcher started several processes, or None for a single process,
    where there is nothing to agree on."""
    if world_size() <= 1:
        return None
    return process_state()


# The launcher's facts about this process, read from the environment torchrun (and accelerate's simple launcher)
# exports: no process group is started, nothing is imported, so a command may ask before it decides to start one.
def world_size() -> int:
    """Processes in the run, from the launcher's ``WORLD_SIZE`` (1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's global rank, from the launcher's ``RANK`` (0 when not launched)."""
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    """Whether this is global rank 0 (``rank()``): the process that prints and writes, without a process state."""
    return rank() == 0


def local_process_count() -> int:
    """Processes of the run on this machine, from the launcher's ``LOCAL_WORLD_SIZE`` (1 when not launched)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def machine_index(state) -> int:
    """This process's machine (node rank, 0-based): torchrun's ``GROUP_RANK``, else the process index
    divided by the processes per machine."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))  # torchrun's, else the state's
    return state.process_index // max(per_machine, 1)


def num_machines(state) -> int:
    """How many machines the run spans (``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``, homogeneous machines)."""
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))
    return max(state.num_processes // max(per_machine, 1), 1)


def _ranges(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else ("ranks " + ", ".join(str(r) for r in ranks))


def describe(where: list[tuple[int, int]], machines: int) -> str:
    """Name a group of processes given as (machine, rank) pairs: "machine 1 (rank 1)", or "rank 1" on one
    machine."""
    if machines <= 1:
        return _ranges([rank for _, rank in where])
    by_machine: dict[int, list[int]] = {}
    for machine, rank in where:
        by_machine.setdefault(machine, []).append(rank)
    return ", ".join(f"machine {m} ({_ranges(r)})" for m, r in sorted(by_machine.items()))


def group_outcomes(outcomes: list[dict], key: str) -> dict[str, list[tuple[int, int]]]:
    """``outcomes`` (one dict per process, with ``machine`` and ``rank``) grouped by their value of ``key``: that
    value -> the (machine, rank) pairs that gave it, for messages naming who saw what (``describe``)."""
    groups: dict[str, list[tuple[int, int]]] = {}
    for o in outcomes:
        if o.get(key) is not None:
            groups.setdefault(o[key], []).append((o["machine"], o["rank"]))
    return groups


def all_reduce_max(state) -> Callable[[float], float]:
    """The maximum of one plain number over ``state``'s processes (an ``Accelerator`` or ``PartialState``;
    None: one process), as a function ``value -> maximum``: a MAX all-reduce of a float64 on ``state.device``
    (NCCL needs a GPU tensor, gloo a CPU one), returned as a float (an int code comes back equal to itself).
    Collective: every process must call the returned function the same number of times. The identity for
    one process."""
    if state is None or state.num_processes <= 1:
        return lambda value: value

    def reduce(value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=state.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return tensor.item()

    return reduce


def agreed_max(measure: Callable[[], float], max_over_processes: Callable, what: str, failed: float = math.inf):
    """``measure()`` on this process (a plain number below ``failed``), then its maximum over every process
    (``max_over_processes``: ``all_reduce_max``, or a stand-in; one call per process). A process whose
    ``measure`` raised an ``Exception`` sends ``failed`` instead, so no process waits in a collective the
    failed one never reaches: the failed process re-raises its own exception, the others raise
    ``FinetuneError`` ("another process failed while {what}; its error is printed above."). Exceptions
    other than ``Exception`` (KeyboardInterrupt) propagate at once. Returns the maximum."""
    error = None
    try:
        value = measure()
    except Exception as err:  # noqa: BLE001 - re-raised below, after the other processes know
        value, error = failed, err
    worst = max_over_processes(value)
    if error is not None:
        raise error
    if worst >= failed:
        raise FinetuneError(f"another process failed while {what}; its error is printed above.")
    return worst


def agree(check, state=None):
    """Run ``check()`` on every process and return its value; if it raised ``FinetuneError`` on any
    process, raise on every process a ``FinetuneError`` with the same message: the error itself when every
    process failed alike (so one process, or one machine, sees what it always saw), else each distinct
    message prefixed with the machine(s) and rank(s) it came from. Any other exception is agreed on too
    (``agreed_max``): its process re-raises it, the others raise ``FinetuneError`` ("another process
    failed ...").

    ``state``: an ``Accelerator`` or ``PartialState``; None takes ``distributed_state()``. Collective when
    there are several processes (one MAX all-reduce, and one ``gather_object`` when a check failed): every
    process must call it.
    """
    state = distributed_state() if state is None else state
    outcome = {"value": None, "error": None}

    def run() -> int:  # 0: passed, 1: FinetuneError (its message is exchanged below)
        try:
            outcome["value"] = check()
            return 0
        except FinetuneError as err:
            outcome["error"] = err
            return 1

    if not agreed_max(run, all_reduce_max(state), "checking what every process must agree on"):
        return outcome["value"]
    caught = outcome["error"]
    if state is None or state.num_processes <= 1:
        raise together(caught)
    error = None if caught is None else str(caught)
    outcomes = gather_object([{"machine": machine_index(state), "rank": state.process_index, "error": error}])
    failed = group_outcomes(outcomes, "error")
    if len(failed) == 1 and all(o["error"] is not None for o in outcomes):
        raise together(caught)
    machines = num_machines(state)
    text = " / ".join(f"on {describe(where, machines)}: {message}" for message, where in failed.items())
    fine = [(o["machine"], o["rank"]) for o in outcomes if o["error"] is None]
    if fine:
        text += f" ({describe(fine, machines)} had no error, but the run needs every process: all stop.)"
    raise together(FinetuneError(text)) from None


@dataclass(frozen=True)
class StorageLayout:
    """Who writes the run's files. ``writes``: this process writes ``run_config.json``, ``log.jsonl``,
    the checkpoints' shared files and the final model into its ``--output_dir``. ``per_machine``: each
    machine keeps its own copy (no shared filesystem); else one process (global rank 0) writes for all.
    ``machine``: this process's machine index; ``machines``: how many."""

    writes: bool
    per_machine: bool
    machine: int = 0
    machines: int = 1


def machine_flags(layout: StorageLayout) -> list[str]:
    """The ``accelerate launch`` flags that start this machine's part of the run again (``--num_machines M
    --machine_rank R --main_process_ip IP --main_process_port P``, from torchrun's ``MASTER_ADDR`` and
    ``MASTER_PORT``); empty on one machine."""
    if layout.machines <= 1:
        return []
    flags = ["--num_machines", str(layout.machines), "--machine_rank", str(layout.machine)]
    if "MASTER_ADDR" in os.environ:
        flags += ["--main_process_ip", os.environ["MASTER_ADDR"]]
    if "MASTER_PORT" in os.environ:
        flags += ["--main_process_port", os.environ["MASTER_PORT"]]
    return flags


def plan_storage(state, output_dir) -> StorageLayout:
    """Find out whether the machines share ``output_dir`` (collective; every process calls it).

    On one machine: global rank 0 writes. On several: each machine's local main process drops a probe
    file (``.write_test-machine<M>-<token>``) into its ``output_dir`` and lists the probes it sees. If every
    machine sees all of them, the directory is shared and global rank 0 writes; if each sees only its
    own, each machine's local main process writes its own copy. Raises ``FinetuneError`` (on every
    process) when some machines share a directory and others do not.
    """
    machines = num_machines(state) if state.num_processes > 1 else 1
    if machines <= 1:
        return StorageLayout(writes=state.is_main_process, per_machine=False)
    machine, out = machine_index(state), Path(output_dir)
    token = gather_object([uuid.uuid4().hex])[0]  # rank 0's
    probe = out / f"{WRITE_PROBE}-machine{machine}-{token}"
    if state.is_local_main_process:
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe.write_text("probe\n")
        except OSError:
            pass  # check_output_dir has shown the directory writable; a failure here only hides the probe
    state.wait_for_everyone()
    seen = None
    if state.is_local_main_process:
        seen = sorted(int(p.name.split("-")[1].removeprefix("machine"))
                      for p in out.glob(f"{WRITE_PROBE}-machine*-{token}"))
    state.wait_for_everyone()
    if state.is_local_main_process:
        probe.unlink(missing_ok=True)
    views = {m: s for m, s in gather_object([(machine, seen)]) if s is not None}
    everyone = sorted(views)
    if all(s == everyone for s in views.values()):
        return StorageLayout(writes=state.is_main_process, per_machine=False, machine=machine, machines=machines)
    if all(s == [m] for m, s in views.items()):
        return StorageLayout(writes=state.is_local_main_process, per_machine=True, machine=machine,
                             machines=machines)
    shared = "; ".join(f"machine {m} sees the output dirs of machines {', '.join(map(str, s))}"
                       for m, s in sorted(views.items()))
    raise FinetuneError(f"--output_dir: some machines share it and others do not ({shared}). Give every machine "
                        "the same directory on one shared filesystem, or each machine a directory of its own.")
