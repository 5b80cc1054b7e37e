"""Each launched process imports only what its path uses (issue 26, suite speed): the training entry point alone
(``--help``, ``--list_recipes``, a flag refused while parsing) imports no torch; ``finetune train``'s launcher process
no model code; a default run (the accelerate backend) neither matplotlib (``compare``), nor peft (``--use_peft``),
evaluate (a metric computed), nor ``transformers.trainer`` (``--backend trainer``). Figures: docs/contributing.md#imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO

LAZY = ("matplotlib", "peft", "evaluate", "transformers.trainer")

# One fresh interpreter, the stages in the order a run reaches them; after each, which of the watched modules are
# imported. The last stage takes the lazy paths themselves: the watched names must then show up, or the check
# above it would pass for a misspelt module name.
PROBE = """
import json, sys
watched = ("torch", "matplotlib", "peft", "evaluate", "transformers.trainer", "finetune.engine")
seen = {}
def stage(name):
    seen[name] = sorted(m for m in watched if m in sys.modules)
import finetune.run
stage("entry point")
import finetune.commands.launch
stage("launcher")
import finetune.lifecycle.resolve, finetune.backends.accelerate, finetune.outputs.reporting
stage("default run")
import finetune.commands.compare, finetune.models.lora, finetune.metrics, finetune.backends.trainer
finetune.commands.compare.pyplot()
from finetune.config import TrainConfig
finetune.models.lora.lora_config(TrainConfig(lora_target_modules=None, lora_r=2, lora_alpha=4, lora_dropout=0.0), "CAUSAL_LM")
finetune.metrics.load_metric("accuracy")
stage("lazy paths taken")
print(json.dumps(seen))
"""


def test_a_default_run_imports_only_what_it_uses():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["entry point"] == []  # `python -m finetune.run --list_recipes` / `--help`: no torch
    assert seen["launcher"] == ["torch"]  # `finetune train`: Accelerate's launcher, no model code, no engine
    assert seen["default run"] == ["finetune.engine", "torch"]
    assert [m for m in seen["lazy paths taken"] if m in LAZY] == sorted(LAZY)
