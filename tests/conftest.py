"""Shared fixtures: a tiny BERT built from a config (with the real MiniLM vocabulary), a reset of
Accelerate's process-wide state between in-process runs, the fault injectors of ``tests/faults``, trained
runs shared by the whole test run, and the CPU share of each parallel worker (``pytest -n``)."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the hub

from helpers import HOST_CPUS_ENV  # noqa: E402
from tiny_models import build_tiny_bert, build_tiny_llama, write_variable_length_texts  # noqa: E402

PIN_ENV = "FINETUNE_TEST_PIN"  # "1": each parallel worker is pinned to its own share of the CPUs


def worker_cpus(worker: str, workers: int, cpus: set[int]) -> set[int]:
    """The CPUs xdist worker ``worker`` ("gw0", "gw1", ...) of ``workers`` keeps out of ``cpus`` (its affinity
    set): a disjoint share (round-robin), or one CPU where there are fewer CPUs than workers."""
    index, ordered = int(worker.removeprefix("gw")), sorted(cpus)
    return set(ordered[index::workers]) if len(ordered) >= workers else {ordered[index % len(ordered)]}


def pytest_configure(config):
    """With ``FINETUNE_TEST_PIN=1`` under ``pytest -n N``, each worker (and every process it starts, which inherits
    the affinity) runs on its own share of this host's CPUs (finetune sizes its torch threads from the cores it may
    use, ``finetune/lifecycle/resolve.py``). Off by default: unpinned, a worker waiting on a launched process leaves its
    core to the other (docs/contributing.md)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and os.environ.get(PIN_ENV, "0") == "1" and hasattr(os, "sched_setaffinity"):
        os.environ.setdefault(HOST_CPUS_ENV, ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0))))
        cpus = worker_cpus(worker, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus)


# The slowest test files, slowest first (summed test time on 2 AMD cores, 2026-11-26: test_bench 460 s ...
# test_fp16 64 s). Under ``-n 2 --dist loadfile --no-loadscope-reorder`` workers take whole files in collection
# order, so these start first and the short files fill in around them: a long file started last is the run's
# tail. Regenerate from ``--junitxml`` times when a file's cost changes by minutes.
# test_bench.py: 460 s before the smokes forked their runs from a fork server (bench/benchlib.py); now ~45 s serial
# on a quiet machine, ~100 s in the units above by the same ratio, placed by that estimate (2026-11-26, session 4).
SLOW_FILES = ("test_kill_anywhere.py", "test_verify.py", "test_activation_checkpointing.py", "test_machines.py",
              "test_resume.py", "test_bench.py", "test_packing.py", "test_verify_mutants.py",
              "test_run_semantics.py", "test_hub_check.py", "test_elastic_resume.py", "test_predict.py",
              "test_fp16.py", "test_batch_plan.py", "test_slurm.py")


def pytest_collection_modifyitems(config, items):
    """Collect the ``SLOW_FILES`` first, slowest first, the other files after them in their own order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: tests keep their order in a file


def once_per_run(tmp_path_factory, name: str, make):
    """``make(DIR)``'s result, computed once per test run: serially in a fresh temporary ``DIR``; under xdist by
    the first worker that asks, holding a file lock, in ``DIR`` beside the workers' temporary directories
    (``getbasetemp().parent``, the run's own), the result pickled there for the other workers."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent
    result = root / f"{name}.pickle"
    with FileLock(str(root / f"{name}.lock")):
        if not result.is_file():
            shutil.rmtree(root / name, ignore_errors=True)  # what a worker that failed to make it left
            (root / name).mkdir()
            result.write_bytes(pickle.dumps(make(root / name)))
    return pickle.loads(result.read_bytes())


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """Path of a tiny Llama model directory (one for the whole test run)."""
    return once_per_run(tmp_path_factory, "tiny-llama", lambda root: str(build_tiny_llama(root)))


@pytest.fixture(scope="session")
def clm_texts(tmp_path_factory) -> tuple[str, str]:
    """(train, validation) JSON-lines files of variable-length texts: 48 and 12 rows."""
    return once_per_run(tmp_path_factory, "clm-data", lambda root: (
        str(write_variable_length_texts(root / "train.jsonl", 48, seed=1)),
        str(write_variable_length_texts(root / "valid.jsonl", 12, seed=2))))


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> str:
    """Path of a tiny BERT model directory (one for the whole test run)."""
    return once_per_run(tmp_path_factory, "tiny-bert", lambda root: str(build_tiny_bert(root)))


@pytest.fixture(autouse=True)
def _reset_accelerate_state():
    """Accelerate keeps process-wide singletons; each in-process run must start from a clean state."""
    yield
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """A test that stops a run in-process (GracefulStop) must not leave this worker's SIGTERM/SIGINT handlers
    changed for the tests after it (a worker ignoring SIGTERM passes that on to every process it starts)."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    from finetune import signals

    signals.release_sigterm()
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.fixture
def faults():
    """The fault injectors of ``tests/faults/finetune_faults.py``, installed in this process on demand and
    undone after the test: ``faults.cpu_fp16()`` (fp16 on a CPU really runs fp16, in both engines),
    ``faults.overflow({2})`` (optimizer step 2's loss times infinity), ``faults.save_error("RuntimeError", 0, 2)``
    (rank 0's checkpoint write of step 2 raises torch.save's error), ``faults.undo()`` (remove all now)."""
    from faults import finetune_faults

    patch = pytest.MonkeyPatch()

    def cpu_fp16():
        finetune_faults.install_cpu_fp16(patch.setattr)
        finetune_faults.install_trainer_fp16(patch.setattr)

    yield SimpleNamespace(cpu_fp16=cpu_fp16,
                          overflow=lambda steps: finetune_faults.install_overflow(steps, patch.setattr),
                          save_error=lambda kind, rank, step: finetune_faults.install_save_error(
                              kind, rank, step, patch.setattr),
                          undo=patch.undo)
    patch.undo()


class _SharedRuns:
    """Trained runs several tests read, each trained once per test run (all xdist workers together,
    ``once_per_run``): an in-process run (``helpers.run_in_process``) or a launched one (``helpers.launch``),
    keyed by everything that decides it (the shared ``tiny_bert``'s path is the same in every worker). The output
    directories are the tests' to read, never to change: a test that resumes or damages a run copies it first."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.runs: dict = {}

    def _once(self, key: tuple, train):
        """``train(output dir)``'s result for ``key``: computed once per test run, kept for this worker."""
        if key not in self.runs:
            name = "shared-run-" + hashlib.sha256(repr(key).encode()).hexdigest()[:16]
            self.runs[key] = once_per_run(self.tmp_path_factory, name, train)
        return self.runs[key]

    def in_process(self, **overrides) -> tuple[dict, Path]:
        """``run_in_process(ROOT, NAME, **overrides)``, once per distinct ``overrides``: (metrics, output dir)."""
        from helpers import run_in_process

        key = ("in-process", tuple(sorted((k, str(v)) for k, v in overrides.items())))
        return self._once(key, lambda root: run_in_process(root, "run", **overrides))

    def launched(self, args: list[str], num_processes: int = 1, timeout: int = 600) -> Path:
        """``launch([*args, "--output_dir", DIR], num_processes)``, once per distinct arguments: DIR (asserting
        the launch exited 0)."""
        from helpers import launch

        def train(root: Path) -> Path:
            out = root / "run"
            result = launch([*args, "--output_dir", str(out)], num_processes=num_processes, timeout=timeout)
            assert result.returncode == 0, result.stderr[-3000:]
            return out

        return self._once(("launched", tuple(args), num_processes), train)


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> _SharedRuns:
    """Trained runs shared by the tests of a test run (``shared_runs.in_process(**flags)``,
    ``shared_runs.launched(args, num_processes)``): the same run is trained once, not once per test that reads it
    nor once per parallel worker."""
    return _SharedRuns(tmp_path_factory)
