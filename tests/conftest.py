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
