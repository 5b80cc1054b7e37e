"""Fault injection in processes that tests (and ``bench/gpu_acceptance.py``) launch: Python imports this
module at start-up when this folder is on ``PYTHONPATH``. It installs the faults that ``FAULT_CPU_FP16``,
``FAULT_OVERFLOW_STEPS`` and ``FAULT_SAVE_ERROR`` ask for, each when the process imports the module it wraps (see
``finetune_faults.install_on_import``), then runs the ``sitecustomize`` this one shadows, if there is one
further on ``sys.path``."""

import importlib.machinery
import importlib.util
import os
import sys

import finetune_faults

finetune_faults.install_on_import()

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
