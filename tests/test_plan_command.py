"""``finetune plan``: the planner's table without training: every exact plan under every lever setting, the
memory parts, and with ``--time`` the same plans ``--auto_find_batch_size`` chooses among (its own table)."""

from __future__ import annotations

import re

from finetune.commands.plan import main
from finetune.planner.plans import valid_plans


def test_plan_lists_every_exact_plan_under_every_lever_and_times_the_same(tmp_path, tiny_bert, capsys):
    code = main(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--total_batch_size", "8",
                 "--max_length", "32", "--output_dir", str(tmp_path / "out"), "--time"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written
    blocks = re.findall(r"^(no checkpointing|checkpointing): weights (\d+) MiB, gradients (\d+) MiB, optimizer state "
                        r"\(AdamW\) (\d+) MiB", out, flags=re.M)
    assert [b[0] for b in blocks] == ["no checkpointing", "checkpointing"]
    assert all(int(b[3]) == 2 * int(b[2]) for b in blocks)  # AdamW's two moments: twice the gradients
    listed = re.findall(r"^\s+(\d+)\s+(\d+)\s+\d+\s+\d+\s+-\s+(yes|no)$", out, flags=re.M)
    assert [(int(m), int(n)) for m, n, _ in listed] == valid_plans(8, 1) * 2
    # --time: the planner's own table (what --auto_find_batch_size prints) covers the same plans
    timed = re.findall(r"^(no checkpointing|checkpointing)\s+(\d+)\s+(\d+)\s+\d+\s+(?:yes|no)", out, flags=re.M)
    assert sorted((lever, int(m), int(n)) for lever, m, n in timed) == sorted(
        (lever, m, n) for lever in ("no checkpointing", "checkpointing") for m, n in valid_plans(8, 1))
    assert "--auto_find_batch_size would choose: micro-batch" in out


def test_plan_needs_a_total_batch_size(capsys):
    assert main(["--recipe", "bbc-news"]) == 2
    assert capsys.readouterr().err.startswith("error: finetune plan needs --total_batch_size")
