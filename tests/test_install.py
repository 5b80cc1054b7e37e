"""The package installs like the tools users know: a non-editable ``pip install .`` into a fresh virtual
environment gives a ``finetune`` command that trains, lists recipes and predicts from any directory; and
the package's modules import one way (no cycles)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.integration


def test_non_editable_install_runs_from_another_directory(tmp_path, tiny_bert):
    venv = tmp_path / "venv"
    # the heavy dependencies come from this interpreter's site-packages; the package itself is a real copy
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python, finetune = venv / "bin" / "python", venv / "bin" / "finetune"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                              str(REPO)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import finetune, finetune.recipes; print(finetune.__file__)"],
                           capture_output=True, text=True, cwd=elsewhere, check=True).stdout
    assert str(venv) in where  # the installed copy, not the repository

    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1",
           "HOME": str(tmp_path)}
    recipes = subprocess.run([str(finetune), "recipes"], capture_output=True, text=True, cwd=elsewhere, env=env)
    assert recipes.returncode == 0 and "bbc-news" in recipes.stdout and "offline" in recipes.stdout

    out = elsewhere / "run"
    train = subprocess.run([str(finetune), "train", "--recipe", "bbc-news", "--model_name_or_path", tiny_bert,
                            "--output_dir", str(out), "--max_train_samples", "16", "--max_eval_samples", "8",
                            "--per_device_train_batch_size", "4", "--max_steps", "2", "--max_length", "32"],
                           capture_output=True, text=True, cwd=elsewhere, env=env, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 2 and 0 <= metrics["eval_accuracy"] <= 1
    card = (out / "README.md").read_text()
    assert "finetune train --recipe bbc-news" in card  # the reproduce command works outside the repository

    predict = subprocess.run([str(finetune), "predict", "--model", str(out), "The striker scored twice"],
                             capture_output=True, text=True, cwd=elsewhere, env=env, timeout=300)
    assert predict.returncode == 0, predict.stderr[-3000:]
    labels = json.loads((out / "config.json").read_text())["id2label"].values()
    assert any(label in predict.stdout for label in labels)

    bad = subprocess.run([str(finetune), "train", "--recipe", "bbc-news", "--learnig_rate", "1e-4"],
                         capture_output=True, text=True, cwd=elsewhere, env=env, timeout=300)
    assert bad.returncode == 2 and "Did you mean --learning_rate?" in bad.stderr
    assert "Traceback" not in bad.stderr and "CalledProcessError" not in bad.stderr


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_no_import_cycles_among_the_packages_modules():
    root = REPO / "finetune"
    modules = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    cycles = [c for c in map(cycle_from, graph) if c]
    assert not cycles, cycles
