"""The kill-anywhere campaign's CI variant (``bench/kill_anywhere.py --smoke``): five SIGKILLs at seeded moments,
two of them inside a checkpoint write, through the real launcher; every directory stays resumable, nothing hangs,
and the run resumed after every kill ends with the uninterrupted run's weights and losses, bit for bit. The full
campaign (30 kills on one process, 10 on two) runs from ``bench/``; its report is docs/resume.md. The Trainer
variant (``--backend trainer``) makes the same kills on the Trainer backend, whose checkpoints Trainer writes in
place and the lifecycle seals (docs/backends.md): resumed from its own checkpoints, bit for bit too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_kill_anywhere_smoke(tmp_path, backend):
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "kill_anywhere.py"), "--smoke", "--seed", "3",
                             "--backend", backend, "--json", str(report), "--work_dir", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(report.read_text())["summary"]
    assert summary["backend"] == backend
    assert summary["kills"] == 5 and summary["kills_inside_save"] >= 1, summary
    assert summary["unresumable_directories"] == 0 and summary["hangs"] == 0 and summary["failures"] == []
    assert summary["rounds"] and all(r["weights_bit_exact"] and r["losses_equal"] for r in summary["rounds"])
    assert sum(r["kills"] for r in summary["rounds"]) == 5
