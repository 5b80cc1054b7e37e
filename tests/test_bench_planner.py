"""bench/bench_planner.py: its --smoke mode end to end (real CLI runs, a tiny BERT), the verdict's arithmetic and
the parsing of the planner's table. A file of its own so that ``pytest -n 2 --dist loadfile`` runs its smoke, the
longest of the bench scripts', beside the others of tests/test_bench.py."""

from __future__ import annotations

import json

import pytest
from test_bench import check_header, positive, run_bench, table_row


@pytest.mark.integration
def test_bench_planner_smoke(tmp_path, tiny_bert):
    """Every exact plan of 4 under checkpointing off/on is run, the planner under a generous and a tight budget;
    the report names each budget's pick and the fastest plan that fits, with the ratio of their measured times."""
    js = tmp_path / "planner.json"
    out = run_bench("bench_planner.py", "--smoke", "--model_name_or_path", tiny_bert, "--json", str(js)).stdout
    check_header(out)
    labels = ["4x1", "2x2", "1x4", "4x1 + checkpointing", "2x2 + checkpointing", "1x4 + checkpointing"]
    for label in labels:
        cells = table_row(out, label)
        positive(cells[1]), positive(cells[2])  # s/sample, peak RSS MiB
    data = json.loads(js.read_text())
    plans, budgets = data["results"]["plans"], data["results"]["budgets"]
    assert list(plans) == labels and set(budgets) == {"generous", "tight"}
    assert budgets["tight"]["budget_mb"] < budgets["generous"]["budget_mb"]
    assert set(budgets["generous"]["fitting"]) == set(labels)  # everything fits the machine's memory
    assert budgets["tight"]["fitting"]  # smoke: the tight budget has slack (a tiny model's samples are too small)
    for name, b in budgets.items():
        assert b["pick"] in b["fitting"] and b["best"] in b["fitting"] and b["planning_seconds"] > 0
        assert b["ratio_pick_over_best"] == pytest.approx(plans[b["pick"]]["seconds_per_sample"]
                                                          / plans[b["best"]]["seconds_per_sample"])
        assert b["ratio_pick_over_best"] >= 1.0 and isinstance(b["met"], bool)
        row = table_row(out, name)
        assert row[2] == ", ".join(b["picks"]) and row[3] == b["best"]


def test_bench_planner_verdict_compares_the_pick_with_the_fastest_fitting_plan():
    """The verdict: the pick against the fastest plan that fits (not one that does not), per round too."""
    import bench_planner as bp
    from benchlib import Config

    def config(label, *seconds):
        return Config(label, [], [{"train_samples_per_second": 1 / s, "peak_memory_bytes": 1} for s in seconds])

    configs = [config("4x1", 0.10, 0.10), config("2x2", 0.20, 0.30), config("1x4", 0.40, 0.40)]
    rows = {"4x1": {"fits": False}, "2x2": {"fits": True}, "1x4": {"fits": True}}
    run = {"rows": rows, "budget_mb": 100, "planning_seconds": 1.0}
    result = bp.summarize(configs, {"tight": [run | {"chosen": "1x4"}, run | {"chosen": "1x4"}]})["budgets"]["tight"]
    assert result["best"] == "2x2" and result["pick"] == "1x4" and not result["met"]
    assert result["ratio_pick_over_best"] == pytest.approx(0.40 / 0.25)
    assert result["ratio_per_round"] == pytest.approx([2.0, 0.40 / 0.30])
    result = bp.summarize(configs, {"tight": [run | {"chosen": "2x2"}]})["budgets"]["tight"]
    assert result["met"] and result["ratio_pick_over_best"] == 1.0


def test_bench_planner_reads_the_planner_table():
    """``parse_planner_output`` reads what ``plan_table`` prints (rows, fits, timed seconds, the choice) and says
    what is missing from an output that lacks it."""
    import bench_planner as bp
    from benchlib import BenchError
    from test_batch_plan import OFF, ON, U_SHAPE, FakeProbe

    from finetune.planner.plans import choose_plan, plan_table

    chosen, candidates = choose_plan(32, 1, {OFF: FakeProbe(4, U_SHAPE), ON: FakeProbe(32, U_SHAPE)})
    text = ("Memory probe (no checkpointing): 100.0 MiB per sample + 250.5 MiB per step (...); budget 2000 MiB, "
            f"process holds 1300 MiB\n{plan_table(chosen, candidates)}\nPlanning took 12.5 s (memory probes ...).")
    parsed = bp.parse_planner_output(text)
    assert len(parsed["rows"]) == 12 and parsed["planning_seconds"] == 12.5
    assert parsed["probe_mib"] == {"per_sample": 100.0, "fixed": 250.5, "held": 1300.0}
    assert parsed["chosen"] == bp.plan_label("checkpointing" if chosen.lever.activation_checkpointing
                                             else "no checkpointing", chosen.plan.per_device_train_batch_size,
                                             chosen.plan.gradient_accumulation_steps)
    assert [label for label, row in parsed["rows"].items() if row["fits"]] == [
        "4x8", "2x16", "1x32", "32x1 + checkpointing", "16x2 + checkpointing", "8x4 + checkpointing",
        "4x8 + checkpointing", "2x16 + checkpointing", "1x32 + checkpointing"]
    assert parsed["rows"]["4x8"]["planner_seconds_per_sample"] == U_SHAPE[4]
    with pytest.raises(BenchError, match="lacks the CPU memory probe"):
        bp.parse_planner_output(text.split("\n", 1)[1])


def test_bench_planner_estimates_read_what_finetune_plan_prints():
    """``--estimates``: ``parse_plan_estimate`` reads the block ``finetune plan`` renders (``commands.plan.render``,
    a 4-bit base and an 8-bit optimizer) at the run's micro-batch; the error is (estimate - measured) / measured."""
    import bench_planner as bp
    from benchlib import MIB, BenchError, Config

    from finetune.commands.plan import render
    from finetune.planner.plans import Lever

    parts = {"weights": 230 * MIB, "quantized_weights": 118 * MIB, "full_weights": 112 * MIB,
             "quantization": "NF4 (4-bit, bitsandbytes; compute float32; 210 linear layers)", "gradients": 4 * MIB,
             "optimizer_state": 2.5 * MIB, "optimizer": "AdamW 8-bit, bitsandbytes", "dequantized": 13 * MIB,
             "ddp_buckets": 0, "activations_per_sample": 330.5 * MIB, "fixed": 250 * MIB, "held": 600 * MIB,
             "optimizer_step_peak": 300 * MIB}
    rows = [{"micro_batch": m, "accumulation": 4 // m, "activations": m * 330.5 * MIB,
             "estimated_peak": 600 * MIB + 250 * MIB + m * 330.5 * MIB, "measured_peak": None, "fits": True}
            for m in (4, 2, 1)]
    text = render(Lever(False, 1024), parts, rows) + "\n" + render(Lever(True, 1024), parts, rows)
    parsed = bp.parse_plan_estimate(text, 2)
    assert parsed["estimate_mib"] == 1511 and parsed["weights_mib"] == 230 and parsed["held_mib"] == 600
    assert parsed["optimizer"] == "AdamW 8-bit, bitsandbytes" and parsed["activations_per_sample_mib"] == 330.5
    with pytest.raises(BenchError, match="no row of micro-batch 8"):
        bp.parse_plan_estimate(text, 8)
    config = Config("QLoRA", [], [{"peak_memory_bytes": 2000 * MIB, "train_samples_per_second": 0.5}])
    result = bp.summarize_estimates([config], {"QLoRA": parsed})["settings"]["QLoRA"]
    assert result["error"] == pytest.approx((1511 - 2000) / 2000) and not result["met"]
