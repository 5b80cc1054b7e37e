"""Shared fixtures: a tiny BERT built from a config (with the real MiniLM vocabulary), a reset of
Accelerate's process-wide state between in-process runs, and the fault injectors of ``tests/faults``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the hub

from tiny_models import build_tiny_bert, build_tiny_llama, write_variable_length_texts  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """Path of a tiny Llama model directory (session-wide)."""
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def clm_texts(tmp_path_factory) -> tuple[str, str]:
    """(train, validation) JSON-lines files of variable-length texts: 48 and 12 rows."""
    root = tmp_path_factory.mktemp("clm-data")
    return (str(write_variable_length_texts(root / "train.jsonl", 48, seed=1)),
            str(write_variable_length_texts(root / "valid.jsonl", 12, seed=2)))


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> str:
    """Path of a tiny BERT model directory (session-wide)."""
    return str(build_tiny_bert(tmp_path_factory.mktemp("tiny-bert")))


@pytest.fixture(autouse=True)
def _reset_accelerate_state():
    """Accelerate keeps process-wide singletons; each in-process run must start from a clean state."""
    yield
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


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
    """Trained runs several tests read, each trained once per session: an in-process run (``helpers.run_in_process``)
    or a launched one (``helpers.launch``), keyed by everything that decides it. The output directories are the
    tests' to read, never to change: a test that resumes or damages a run copies it first."""

    def __init__(self, root: Path):
        self.root = root
        self.runs: dict = {}

    def _name(self) -> str:
        return f"run{len(self.runs)}"

    def in_process(self, **overrides) -> tuple[dict, Path]:
        """``run_in_process(ROOT, NAME, **overrides)``, once per distinct ``overrides``: (metrics, output dir)."""
        from helpers import run_in_process

        key = ("in-process", tuple(sorted((k, str(v)) for k, v in overrides.items())))
        if key not in self.runs:
            self.runs[key] = run_in_process(self.root, self._name(), **overrides)
        return self.runs[key]

    def launched(self, args: list[str], num_processes: int = 1, timeout: int = 600) -> Path:
        """``launch([*args, "--output_dir", DIR], num_processes)``, once per distinct arguments: DIR (asserting
        the launch exited 0)."""
        from helpers import launch

        key = ("launched", tuple(args), num_processes)
        if key not in self.runs:
            out = self.root / self._name()
            result = launch([*args, "--output_dir", str(out)], num_processes=num_processes, timeout=timeout)
            assert result.returncode == 0, result.stderr[-3000:]
            self.runs[key] = out
        return self.runs[key]


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> _SharedRuns:
    """Trained runs shared by the tests of a session (``shared_runs.in_process(**flags)``,
    ``shared_runs.launched(args, num_processes)``): the same run is trained once, not once per test that reads it."""
    return _SharedRuns(tmp_path_factory.mktemp("shared-runs"))
