"""The batch planner: exact plans (micro x accumulation x processes == total), the largest micro-batch
that fits, few memory probes, and clear errors."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest

from finetune.errors import FinetuneError
from finetune.planner.agreement import agreed_seconds
from finetune.planner.plans import (
    BatchPlan,
    Lever,
    NothingFits,
    choose_plan,
    estimate_fits_from_memory,
    plan_batch,
    plan_table,
    valid_plans,
)


class CountingLimit:
    """A fake memory limit: micro-batch m fits iff m <= limit. Records every m asked."""

    def __init__(self, limit: int):
        self.limit = limit
        self.asked: list[int] = []

    def __call__(self, m: int) -> bool:
        self.asked.append(m)
        return m <= self.limit


def test_valid_plans_are_exact_and_sorted():
    assert valid_plans(32, 1) == [(32, 1), (16, 2), (8, 4), (4, 8), (2, 16), (1, 32)]
    assert valid_plans(48, 2) == [(24, 1), (12, 2), (8, 3), (6, 4), (4, 6), (3, 8), (2, 12), (1, 24)]
    assert valid_plans(7, 7) == [(1, 1)]
    for total, processes in [(1, 1), (36, 3), (97, 1), (360, 4), (1024, 8)]:
        plans = valid_plans(total, processes)
        assert all(m * n * processes == total for m, n in plans)
        micro = [m for m, _ in plans]
        assert micro == sorted(micro, reverse=True) and len(set(micro)) == len(micro)
        per_process = total // processes
        assert set(micro) == {d for d in range(1, per_process + 1) if per_process % d == 0}


@pytest.mark.parametrize("total,processes,limit,expected", [
    (32, 1, 10, (8, 4)),
    (32, 2, 100, (16, 1)),
    (48, 2, 5, (4, 6)),
    (32, 1, 32, (32, 1)),
    (32, 1, 31, (16, 2)),
    (32, 1, 1, (1, 32)),
    (48, 2, 23, (12, 2)),
    (97, 1, 96, (1, 97)),  # a prime: only 97 x 1 and 1 x 97 are exact
    (64, 8, 3, (2, 4)),
])
def test_plan_picks_largest_micro_batch_that_fits(total, processes, limit, expected):
    fits = CountingLimit(limit)
    plan = plan_batch(total, processes, fits)
    assert (plan.per_device_train_batch_size, plan.gradient_accumulation_steps) == expected
    assert plan.per_device_train_batch_size * plan.gradient_accumulation_steps * processes == total
    assert plan.num_processes == processes and plan.total_batch_size == total
    # it is the largest exact micro-batch within the limit
    assert plan.per_device_train_batch_size == max(m for m, _ in valid_plans(total, processes) if m <= limit)


@pytest.mark.parametrize("total,processes", [(32, 1), (48, 2), (360, 1), (720720, 1), (1024, 4), (97, 1), (1, 1)])
def test_plan_asks_fits_few_times(total, processes):
    candidates = len(valid_plans(total, processes))
    bound = math.ceil(math.log2(candidates)) + 1
    per_process = total // processes
    for limit in range(0, per_process + 2, max(1, per_process // 50)):
        fits = CountingLimit(limit)
        try:
            plan_batch(total, processes, fits)
        except FinetuneError:
            assert limit == 0
        assert len(fits.asked) <= bound, (limit, fits.asked)
        assert len(set(fits.asked)) == len(fits.asked)  # never the same m twice
        assert all(per_process % m == 0 for m in fits.asked)  # only exact micro-batches are tried


def test_largest_is_tried_first_and_costs_one_call():
    fits = CountingLimit(1000)
    plan = plan_batch(64, 2, fits)
    assert fits.asked == [32]
    assert plan == BatchPlan(32, 1, 2, 64)


def test_max_micro_batch_caps_the_candidates():
    fits = CountingLimit(1000)
    plan = plan_batch(64, 1, fits, max_micro_batch=20)
    assert (plan.per_device_train_batch_size, plan.gradient_accumulation_steps) == (16, 4)
    assert max(fits.asked) <= 20
    with pytest.raises(ValueError):
        plan_batch(64, 1, fits, max_micro_batch=0)


def test_total_not_divisible_by_processes_names_nearest_values_and_flag():
    with pytest.raises(FinetuneError) as info:
        plan_batch(30, 4, CountingLimit(100))
    message = str(info.value)
    assert "28" in message and "32" in message and "--total_batch_size" in message
    with pytest.raises(FinetuneError, match="--total_batch_size") as info:
        valid_plans(3, 4)  # below 4 there is no valid value: only 4 is offered
    assert "4" in str(info.value)


@pytest.mark.parametrize("bad", [0, -8, 2.5, 32.0, "32", None, True])
def test_total_must_be_a_positive_integer(bad):
    with pytest.raises(FinetuneError, match="--total_batch_size must be a positive integer"):
        plan_batch(bad, 1, CountingLimit(100))


def test_processes_must_be_a_positive_integer():
    with pytest.raises(FinetuneError, match="processes"):
        valid_plans(32, 0)


def test_nothing_fits_says_memory_and_what_to_do():
    fits = CountingLimit(0)
    with pytest.raises(FinetuneError) as info:
        plan_batch(32, 2, fits)
    message = str(info.value)
    assert "memory" in message and "--max_length" in message
    assert 1 in fits.asked  # it really tried a micro-batch of 1


def test_batch_plan_is_frozen_and_consistent():
    plan = BatchPlan(per_device_train_batch_size=4, gradient_accumulation_steps=6, num_processes=2,
                     total_batch_size=48)
    with pytest.raises(AttributeError):
        plan.gradient_accumulation_steps = 3  # type: ignore[misc]
    with pytest.raises(ValueError):
        BatchPlan(4, 6, 2, 50)
    assert str(plan) == "micro-batch 4 x accumulation 6 x 2 processes = 48 samples per optimizer step"
    assert BatchPlan.__doc__


def test_estimate_fits_from_memory_arithmetic():
    mib = 1024 ** 2
    fits = estimate_fits_from_memory(bytes_per_sample=10 * mib, fixed_bytes=100 * mib, budget_bytes=200 * mib)
    assert fits(10)  # 100 + 10 x 10 = 200 MiB: exactly at the budget
    assert not fits(11)  # 210 MiB
    assert fits(0) and fits(1)
    plan = plan_batch(64, 1, fits)
    assert (plan.per_device_train_batch_size, plan.gradient_accumulation_steps) == (8, 8)
    # fixed memory alone over budget: nothing fits, with the memory error
    with pytest.raises(FinetuneError, match="memory"):
        plan_batch(8, 1, estimate_fits_from_memory(1.0, 300.0, 200.0))
    # zero activation memory: everything fits
    assert estimate_fits_from_memory(0.0, 10.0, 10.0)(10 ** 9)


def test_estimate_fits_rejects_bad_inputs():
    with pytest.raises(FinetuneError, match="--max_memory_mb"):
        estimate_fits_from_memory(1.0, 1.0, 0)
    with pytest.raises(ValueError):
        estimate_fits_from_memory(-1.0, 1.0, 100.0)
    with pytest.raises(ValueError):
        estimate_fits_from_memory(1.0, float("nan"), 100.0)


# ----------------------------------------------------------------------------- through the engine
class FakeProbe:
    """A lever setting's probe: micro-batch m fits iff m <= limit; ``seconds[m]`` is its time per sample.
    Records the micro-batches timed."""

    def __init__(self, limit: int, seconds: dict[int, float]):
        self.limit, self.seconds, self.timed = limit, seconds, []

    def fits(self, m: int) -> bool:
        return m <= self.limit

    def estimate(self, m: int) -> int:
        return m * 2**20

    def seconds_per_sample(self, m: int) -> float:
        self.timed.append(m)
        return self.seconds[m]


OFF, ON = Lever(False, None), Lever(True, None)
# time per sample falling then rising with the micro-batch (the CPU at 512 tokens: 8 beats 32)
U_SHAPE = {32: 0.49, 16: 0.46, 8: 0.44, 4: 0.45, 2: 0.50, 1: 0.60}


def test_planner_descends_until_slower_and_takes_the_fastest_plan_that_fits():
    """Everything fits without checkpointing: its plans are timed from 32 down until one is slower (4, after
    8), so the faster 8 x 4 is chosen over the largest 32 x 1; checkpointing is never timed (at an equal
    micro-batch it only adds a forward); every candidate keeps the effective batch exact."""
    off, on = FakeProbe(32, U_SHAPE), FakeProbe(32, {m: 1.4 * s for m, s in U_SHAPE.items()})
    chosen, candidates = choose_plan(32, 1, {OFF: off, ON: on})
    assert off.timed == [32, 16, 8, 4] and on.timed == []
    assert (chosen.lever, chosen.plan.per_device_train_batch_size, chosen.plan.gradient_accumulation_steps) == (OFF, 8, 4)
    assert len(candidates) == 12 and all(c.plan.per_device_train_batch_size * c.plan.gradient_accumulation_steps
                                         == 32 for c in candidates)
    table = plan_table(chosen, candidates)
    assert table.count("<- chosen") == 1 and "(checkpointing: fits without it)" in table
    assert "(smaller than a slower timed one)" in table


def test_a_smaller_micro_batch_must_be_clearly_faster_to_be_chosen():
    """Probes time forward + backward on one pass: a plan within 2% of an earlier (larger micro-batch, or
    without checkpointing) one does not replace it; the descent still goes on past it while times fall."""
    off = FakeProbe(32, {32: 0.500, 16: 0.495, 8: 0.492, 4: 0.60})
    chosen, _ = choose_plan(32, 1, {OFF: off})
    assert off.timed == [32, 16, 8, 4] and chosen.plan.per_device_train_batch_size == 32
    off = FakeProbe(32, {32: 0.500, 16: 0.495, 8: 0.40, 4: 0.60})
    chosen, _ = choose_plan(32, 1, {OFF: off})
    assert chosen.plan.per_device_train_batch_size == 8  # a flat step does not stop the descent
    chosen, _ = choose_plan(32, 1, {OFF: FakeProbe(4, {4: 0.50, 2: 0.60}), ON: FakeProbe(32, {32: 0.495, 16: 0.6})})
    assert (chosen.lever, chosen.plan.per_device_train_batch_size) == (OFF, 4)  # checkpointing 1% faster: not chosen


def test_checkpointing_is_timed_only_where_it_fits_a_larger_micro_batch():
    """A budget that fits 4 without checkpointing and 32 with it: checkpointing's 32, 16, 8 are timed (not 4
    and below), and it wins only where its larger micro-batch is faster than the best plan without it."""
    off = FakeProbe(4, {4: 0.60, 2: 0.70, 1: 0.90})
    on = FakeProbe(32, {32: 0.58, 16: 0.55, 8: 0.56, 4: 9.0})
    chosen, candidates = choose_plan(32, 1, {OFF: off, ON: on})
    assert off.timed == [4, 2] and on.timed == [32, 16, 8]
    assert (chosen.lever, chosen.plan.per_device_train_batch_size) == (ON, 16)
    assert [c.fits for c in candidates if c.lever == OFF] == [False, False, False, True, True, True]
    slow_on = FakeProbe(32, {32: 0.80, 16: 0.75, 8: 0.70})
    chosen, _ = choose_plan(32, 1, {OFF: FakeProbe(4, {4: 0.60, 2: 0.70}), ON: slow_on})
    assert (chosen.lever, chosen.plan.per_device_train_batch_size) == (OFF, 4)  # never slower than the best fit
    assert slow_on.timed == [32, 16, 8]


def test_planner_uses_the_slowest_rank_time_and_errors_when_nothing_fits():
    """Each measured time goes through ``slowest_over_processes`` (every rank then follows the same descent);
    when no micro-batch fits under any setting the error says what to do."""
    seen = []

    def slowest(seconds):
        seen.append(seconds)
        return {0.44: 0.47}.get(seconds, seconds)  # another rank was slower at 8 (0.47) than at 16 (0.46)

    off = FakeProbe(32, U_SHAPE)
    chosen, _ = choose_plan(32, 2, {OFF: off}, slowest_over_processes=slowest)
    assert off.timed == [16, 8] and seen == [U_SHAPE[16], U_SHAPE[8]]  # 2 processes: m <= 16; 8 was slower
    assert chosen.plan.per_device_train_batch_size == 16
    with pytest.raises(FinetuneError, match="does not fit in memory"):
        choose_plan(32, 1, {OFF: FakeProbe(0, {}), ON: FakeProbe(0, {})})


def test_a_failing_probe_is_an_error_not_a_plan_that_does_not_fit():
    """Only ``NothingFits`` means "does not fit": any other error of a probe (here a FinetuneError from the loss)
    ends the planning with that error, and a timing failure on any rank reaches every rank."""
    class Broken(FakeProbe):
        def fits(self, m):
            raise FinetuneError("--loss_chunk_size needs a model with an output embedding")

    with pytest.raises(FinetuneError, match="output embedding"):
        choose_plan(32, 1, {OFF: Broken(32, U_SHAPE), ON: FakeProbe(32, U_SHAPE)})
    with pytest.raises(NothingFits, match="does not fit in memory.*without activation checkpointing"):
        choose_plan(32, 1, {OFF: FakeProbe(0, {})})
    reduced = []

    def slowest(seconds):
        reduced.append(seconds)
        return max(seconds, float("inf"))  # another rank failed: it sent infinity

    with pytest.raises(FinetuneError, match="another process failed while timing"):
        agreed_seconds(lambda: 0.5, slowest)

    def timing_fails():
        raise RuntimeError("out of memory while timing")

    with pytest.raises(RuntimeError, match="while timing"):
        agreed_seconds(timing_fails, lambda s: reduced.append(s) or s)
    assert reduced == [0.5, float("inf")]  # the failed rank still joined the all-reduce
    assert agreed_seconds(lambda: 0.25, lambda s: max(s, 0.5)) == 0.5  # the slowest rank's time


def test_the_probe_under_lora_counts_only_the_adapters_gradients_and_optimizer_state(tiny_bert):
    """Under --use_peft the planner probes the model as training builds it: LoRA adapters on a frozen model, so
    the per-step part of its memory estimate (gradients + AdamW state: 3 x the trainable bytes) is the adapters',
    far below the full model's."""
    import torch

    from finetune.config import parse_config
    from finetune.planner.probes import Probe
    from finetune.recipes import load_recipe

    fixed = {}
    for use_peft in (False, True):
        config = parse_config(["--model_name_or_path", tiny_bert, "--max_length", "32", "--use_peft", str(use_peft),
                               "--lora_r", "2"])
        # what loading left pinned: measured per probe, it moves with the worker's history, not with the adapters
        probe = Probe(config, load_recipe("bbc-news"), torch.device("cpu"), OFF, held=0, left=0)
        trainable = sum(p.numel() for p in probe.model.parameters() if p.requires_grad)
        assert probe.fixed_bytes >= 3 * 4 * trainable
        fixed[use_peft] = (probe.fixed_bytes, trainable)
        probe.close()
    assert fixed[True][1] < fixed[False][1] / 10
    assert fixed[True][0] < fixed[False][0] / 2


def test_total_batch_size_sets_the_accumulation(tmp_path, tiny_bert):
    from helpers import run_in_process, train_steps

    metrics, out = run_in_process(tmp_path, "plan", model_name_or_path=tiny_bert, total_batch_size=12,
                                  per_device_train_batch_size=4, max_train_samples=24, max_eval_samples=4,
                                  max_length=16, num_train_epochs=1)
    assert (metrics["per_device_train_batch_size"], metrics["gradient_accumulation_steps"]) == (4, 3)
    assert metrics["effective_batch_size"] == 12
    assert [r["samples"] for r in train_steps(out)] == [12, 12]
    config = json.loads((out / "run_config.json").read_text())  # the plan is recorded with the run
    assert config["batch_plan"] == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3,
                                    "num_processes": 1, "total_batch_size": 12, "lever": None}
    assert (config["per_device_train_batch_size"], config["gradient_accumulation_steps"]) == (4, 3)


def test_total_batch_size_with_an_impossible_micro_batch(tmp_path, tiny_bert):
    from helpers import run_in_process

    from finetune.errors import FinetuneError

    with pytest.raises(FinetuneError, match="must divide 12. Valid micro-batches: 12, 6, 4, 3, 2, 1"):
        run_in_process(tmp_path, "bad", model_name_or_path=tiny_bert, total_batch_size=12,
                       per_device_train_batch_size=5, max_train_samples=24, max_length=16)


def test_saved_tensor_bytes_grow_linearly_with_the_micro_batch():
    import torch

    from finetune.planner.probes import saved_tensor_bytes

    layer = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    sizes = [saved_tensor_bytes(lambda m=m: layer(torch.randn(m, 64)).sum()) for m in (1, 2, 8)]
    per_sample = sizes[1] - sizes[0]
    assert per_sample >= (64 + 256 + 256) * 4  # the input, the pre-activation and the GELU output, fp32
    assert sizes[2] - sizes[0] == 7 * per_sample  # exactly linear


def plan_rows(table: str) -> list[tuple[bool, int, bool, float | None, bool]]:
    """The planner's printed table as rows (checkpointing, micro-batch, fits, seconds per sample or None, chosen)."""
    rows = []
    for line in table.splitlines():
        for prefix, checkpointing in (("no checkpointing", False), ("checkpointing", True)):
            if line.startswith(prefix):
                cells = line[len(prefix):].split()
                rows.append((checkpointing, int(cells[0]), cells[3] == "yes",
                             None if cells[4] == "-" else float(cells[4]), line.rstrip().endswith("<- chosen")))
                break
    return rows


def test_auto_find_batch_size_on_cpu_respects_the_memory_budget(tmp_path, tiny_bert, monkeypatch, capsys):
    """With the process size pinned, a budget with room for ~5 samples without checkpointing leaves the planner
    micro-batch 4 x 8 there, and more with checkpointing (fewer activation bytes per sample); whichever it
    picks keeps the effective batch at 32 and is the fastest of the plans it timed (checkpointing timed only
    above 4); no room is a clear error."""
    import psutil
    from helpers import run_in_process

    from finetune.errors import FinetuneError
    from finetune.planner import probes

    class Pinned:
        rss = 1000 * 2**20

    monkeypatch.setattr(psutil.Process, "memory_info", lambda self: Pinned())
    # and the peak RSS, which the pin does not reach, unreadable: what loading raised and left (0, not the worker's
    # imports and history: they failed this test once) and the allocator's overhead (1.0) are not measured
    monkeypatch.setattr(probes, "reset_peak_rss", lambda: False)
    # dropout on, as this test was sized (the recipe's default is off): with it off, what checkpointing keeps per
    # sample of this tiny BERT prints as 0.0 MiB in the probe's line
    common = dict(model_name_or_path=tiny_bert, total_batch_size=32, auto_find_batch_size=True, disable_dropout=False,
                  max_train_samples=32, max_eval_samples=4, max_length=128, max_steps=1, eval_strategy="no",
                  use_peft=True)  # adapters: the pass peaks before backward writes the gradients, on activations
    generous, _ = run_in_process(tmp_path, "big", max_memory_mb=64 * 1024, **common)
    out = capsys.readouterr().out
    rows = plan_rows(out)
    assert len(rows) == 12 and all(fits for _, _, fits, _, _ in rows)  # 6 exact plans of 32 x 2 lever settings
    timed = [(c, m, sec) for c, m, _, sec, _ in rows if sec is not None]
    assert timed[0][:2] == (False, 32) and not any(c for c, _, _ in timed)  # checkpointing fits nothing larger
    chosen = [(m, sec) for c, m, _, sec, is_chosen in rows if is_chosen]
    assert chosen == [(generous["per_device_train_batch_size"], min(sec for _, _, sec in timed))]
    assert generous["per_device_train_batch_size"] * generous["gradient_accumulation_steps"] == 32
    # the probe's model line (a line saying the probe is slow may come first, on a busy machine)
    per_sample, fixed = (float(x) * 2**20 for x in re.search(
        r"Memory probe \(no checkpointing\): ([\d.]+) MiB per sample \+ ([\d.]+) MiB per step", out).groups())
    with_ckpt = float(re.search(r"Memory probe \(checkpointing\): ([\d.]+) MiB per sample", out).group(1)) * 2**20
    assert 0 <= with_ckpt < per_sample and fixed > 0  # checkpointing keeps fewer activations per sample
    budget_mb = (Pinned.rss + fixed + 5.5 * per_sample) / 2**20
    tight, _ = run_in_process(tmp_path, "small", max_memory_mb=int(budget_mb + 0.5), **common)
    rows = plan_rows(capsys.readouterr().out)
    assert len(rows) == 12
    assert max(m for c, m, fits, _, _ in rows if not c and fits) == 4  # the budget's limit without checkpointing
    largest_ckpt = max(m for c, m, fits, _, _ in rows if c and fits)
    assert largest_ckpt > 4  # checkpointing fits a larger micro-batch
    timed = [(c, m, sec) for c, m, _, sec, _ in rows if sec is not None]
    assert [m for c, m, _ in timed if not c][0] == 4
    assert [m for c, m, _ in timed if c][0] == largest_ckpt and all(m > 4 for c, m, _ in timed if c)
    chosen = [(c, m, sec) for c, m, _, sec, is_chosen in rows if is_chosen]
    assert len(chosen) == 1 and chosen[0][2] == min(sec for _, _, sec in timed)  # the fastest plan timed
    assert tight["per_device_train_batch_size"] == chosen[0][1]
    assert tight["per_device_train_batch_size"] * tight["gradient_accumulation_steps"] == 32
    with pytest.raises(FinetuneError, match="--max_memory_mb 900 leaves no room"):
        run_in_process(tmp_path, "none", max_memory_mb=900, **common)


def test_oom_in_evaluation_splits_eval_batches_not_the_training_micro_batch(tmp_path, tiny_bert, monkeypatch):
    """Evaluation batches of 8 'run out of memory' above 3 samples: they are split and retried, the eval
    metrics equal an unconstrained run's, and training keeps its micro-batch."""
    from helpers import run_in_process, train_steps
    from transformers import BertForSequenceClassification

    kw = dict(model_name_or_path=tiny_bert, max_train_samples=16, max_eval_samples=13, per_device_eval_batch_size=8,
              per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=2, max_length=32,
              eval_strategy="epoch")  # one epoch: one evaluation, at the end
    reference, _ = run_in_process(tmp_path, "ref", **kw)
    original = BertForSequenceClassification.forward
    evaluated_sizes = []

    def forward(self, input_ids=None, **kwargs):
        if not self.training:
            if input_ids.shape[0] > 3:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            evaluated_sizes.append(input_ids.shape[0])
        return original(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(BertForSequenceClassification, "forward", forward)
    metrics, out = run_in_process(tmp_path, "oom", **kw)
    assert sum(evaluated_sizes) == 13 and max(evaluated_sizes) <= 3
    assert metrics["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)
    assert metrics["eval_accuracy"] == reference["eval_accuracy"]
    assert metrics["per_device_train_batch_size"] == 8
    assert [r["samples"] for r in train_steps(out)] == [8, 8]


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_planner_chooses_among_checkpointing_and_the_chunked_loss_for_causal_lm(tmp_path, tiny_llama, clm_texts,
                                                                                capsys, backend):
    """Causal LM: 2 checkpointing x 2 loss settings, each plain-or-chunked loss timed from its largest fitting
    plan down; the chosen one is written into the run's configuration, and the effective batch stays exact."""
    from helpers import run_in_process

    train, valid = clm_texts
    metrics, out = run_in_process(tmp_path, "clm", recipe="bbc-news-clm", model_name_or_path=tiny_llama,
                                  train_file=train, validation_file=valid, total_batch_size=8,
                                  auto_find_batch_size=True, max_memory_mb=64 * 1024, max_length=64, max_steps=1,
                                  eval_strategy="no", mixed_precision="no", backend=backend)
    table = capsys.readouterr().out
    assert table.count("<- chosen") == 1
    for setting in ("no checkpointing, plain loss", "no checkpointing, chunked loss 1024",
                    "checkpointing, plain loss", "checkpointing, chunked loss 1024"):
        assert sum(line.startswith(setting) for line in table.splitlines()) == 4  # plans 8x1, 4x2, 2x4, 1x8
    chosen = next(line for line in table.splitlines() if line.rstrip().endswith("<- chosen"))
    config = json.loads((out / "run_config.json").read_text())
    assert config["activation_checkpointing"] == (not chosen.startswith("no checkpointing"))
    assert config["loss_chunk_size"] == (1024 if "chunked loss" in chosen else 0)
    assert metrics["effective_batch_size"] == 8
    assert (metrics["per_device_train_batch_size"], metrics["gradient_accumulation_steps"]) == (
        config["per_device_train_batch_size"], config["gradient_accumulation_steps"])
    cells = re.split(r"\s{2,}", chosen.strip())  # levers, micro-batch, accumulation, est. MiB, fits, s/sample, mark
    assert (int(cells[1]), int(cells[2])) == (config["per_device_train_batch_size"], config["gradient_accumulation_steps"])
    # the plan and the precision's source are fields of the run's configuration, not attributes set on the side
    assert config["batch_plan"] == {
        "per_device_train_batch_size": int(cells[1]), "gradient_accumulation_steps": int(cells[2]), "num_processes": 1,
        "total_batch_size": 8, "lever": {"activation_checkpointing": config["activation_checkpointing"],
                                         "loss_chunk_size": config["loss_chunk_size"]}}
    assert config["precision_source"] == "--mixed_precision"


def test_a_resume_takes_the_recorded_plan_and_never_probes_again(tmp_path, tiny_bert, monkeypatch):
    """A resume under --auto_find_batch_size reuses the plan in run_config.json: timing noise in a second
    probe could pick another micro-batch, which the resume check would refuse, so a requeued job would fail
    at random. Here the probing is made to fail on resume: the resume must not call it."""
    from helpers import run_in_process

    import finetune.planner as planner

    common = dict(model_name_or_path=tiny_bert, total_batch_size=8, auto_find_batch_size=True,
                  max_memory_mb=64 * 1024, max_train_samples=32, max_eval_samples=4, max_length=32,
                  eval_strategy="no", save_steps=2, max_steps=4)
    first, out = run_in_process(tmp_path, "run", **common)
    recorded = json.loads((out / "run_config.json").read_text())["batch_plan"]
    shutil.rmtree(out / "checkpoints" / "step_00000004", ignore_errors=True)

    def must_not_probe(*args, **kwargs):
        raise AssertionError("the planner probed again on resume")

    monkeypatch.setattr(planner, "probe_and_choose", must_not_probe)
    resumed, _ = run_in_process(tmp_path, "run", resume_from_checkpoint="latest", **common)
    assert resumed["optimizer_steps"] == 4 and resumed["resumed_from"].endswith("step_00000002")
    assert json.loads((out / "run_config.json").read_text())["batch_plan"] == recorded
    assert resumed["per_device_train_batch_size"] == recorded["per_device_train_batch_size"]


def test_one_probe_model_is_alive_at_a_time():
    """choose_plan builds each lever setting's probe only after the previous one is closed, so the planner
    never holds two probe models (with their optimizer state) at once."""
    alive, most = [], []

    class Probe:
        def __init__(self, room):
            self.room = room
            alive.append(self)
            most.append(len(alive))

        def fits(self, m):
            return m <= self.room

        def estimate(self, m):
            return None

        def seconds_per_sample(self, m):
            return 1.0 / m

        def close(self):
            alive.remove(self)

    probes = {Lever(False, None): lambda: Probe(4), Lever(True, None): lambda: Probe(8)}
    chosen, candidates = choose_plan(8, 1, probes)
    assert max(most) == 1 and alive == []
    assert chosen.plan.per_device_train_batch_size == 8 and chosen.lever == Lever(True, None)


def test_the_cpu_budget_is_shared_by_the_processes_of_a_machine(tmp_path, tiny_bert, monkeypatch, capsys):
    """Without --max_memory_mb each of P local processes budgets 1/P of the machine's free memory, not all of
    it; with several processes DDP's gradient buckets (the trainable bytes once more) join the fixed part."""
    import psutil
    import torch

    from finetune.config import TrainConfig
    from finetune.planner.probes import Probe
    from finetune.recipes import load_recipe

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 64 * 2**30})())
    config = TrainConfig(recipe="bbc-news", output_dir=str(tmp_path), model_name_or_path=tiny_bert, max_length=32)
    config.validate()
    seen = {}
    for processes in (1, 4):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
        monkeypatch.setenv("WORLD_SIZE", str(processes))
        # the allocator's overhead and what loading left are measured on a process's first probe only when not
        # given: fixed ones keep this comparison off the order the probes ran in (alone in a fresh process, the
        # first measured x1.6) and off the worker's history
        probe = Probe(config, load_recipe("bbc-news"), torch.device("cpu"), Lever(False, None), held=0, overhead=1.0,
                      left=0)
        trainable = sum(p.numel() * p.element_size() for p in probe.model.parameters() if p.requires_grad)
        budget = int(re.search(r"budget (\d+) MiB", capsys.readouterr().out).group(1))
        seen[processes] = (budget, probe.fixed_bytes, probe.per_sample_bytes)
        probe.close()
    assert seen[1][0] == 64 * 1024 and seen[4][0] == 16 * 1024
    assert seen[4][1] - seen[1][1] == trainable and seen[4][2] == seen[1][2]


def test_the_probes_run_the_precision_the_run_trains_in(tiny_bert):
    """A recipe asking fp16 trains in fp32 on a CPU (Accelerate turns autocast on only off the CPU); the probes must
    measure and time that, not fp16 autocast (~50x slower on a CPU, and half the activation bytes): the memory
    probe's bytes per sample under --mixed_precision fp16 equal those under no, and bf16's are smaller."""
    import torch

    from finetune.config import parse_config
    from finetune.engine.precision import precision_that_runs
    from finetune.planner.probes import Probe
    from finetune.recipes import load_recipe

    assert [precision_that_runs(p, "cpu") for p in ("no", "fp16", "bf16")] == ["no", "no", "bf16"]
    assert [precision_that_runs(p, "cuda") for p in ("no", "fp16", "bf16")] == ["no", "fp16", "bf16"]
    recipe = load_recipe("bbc-news")
    per_sample = {}
    for precision in ("no", "fp16", "bf16"):
        config = parse_config(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--max_length", "32",
                               "--mixed_precision", precision])
        probe = Probe(config, recipe, torch.device("cpu"), Lever(activation_checkpointing=False, loss_chunk_size=None),
                      overhead=1.0)  # the bytes a pass allocates, without this process's allocator's factor
        # the bytes its forward saves for backward per sample (a pass's peak is set by fp32 gradients here)
        per_sample[precision] = (probe.activation_bytes(2) - probe.activation_bytes(1), probe.dtype)
        probe.close()
    assert per_sample["fp16"] == per_sample["no"] and per_sample["no"][1] is None
    assert per_sample["bf16"][1] is torch.bfloat16 and per_sample["bf16"][0] < per_sample["no"][0]


# ------------------------------------------------------------------- probes cost seconds whatever a pass costs (issue 50)
def _slow_probes(monkeypatch, seconds_per_token: float, clock: list) -> None:
    """The planner's probes on a clock of the test's (``probes.time``), where a probe step of m samples of ``tokens``
    tokens costs 0.01 s + m x tokens x ``seconds_per_token``: passes as slow as emulated bf16's, whatever the machine's
    load, while the tiny model runs for real."""
    from types import SimpleNamespace

    from finetune.planner import probes

    real_step = probes.Probe.step

    def slow_step(self, m, length=None):
        clock[0] += 0.01 + m * (length or self.length) * seconds_per_token
        return real_step(self, m) if length is None else real_step(self, m, length)

    monkeypatch.setattr(probes.Probe, "step", slow_step)
    monkeypatch.setattr(probes, "time", SimpleNamespace(perf_counter=lambda: clock[0]))


def test_the_timing_probes_cost_seconds_whatever_a_pass_costs(tiny_bert, monkeypatch, capsys):
    """Issue 50: the planner timed every plan at the run's micro-batch and length, so with bf16 emulated on a CPU
    (hundreds of times fp32's matmul time) a timed plan took minutes. Short first passes now choose one sample length
    for every plan of the planning: on a clock where a pass costs 0.01 s + 0.5 s a 64-token sample, each timed plan
    (its warm-up and timed passes) costs at most ``PROBE_SECONDS`` (3 s; 16 s before), every plan is timed at the
    same 11 tokens, its figure scaled to 64 tokens is the clock's, and the faster plan is still chosen."""
    from types import SimpleNamespace

    import torch

    from finetune.config import parse_config
    from finetune.planner import probe_and_choose, probes
    from finetune.recipes import load_recipe

    clock, costs = [0.0], {}
    _slow_probes(monkeypatch, 1 / 128, clock)
    real_seconds = probes.Probe.seconds_per_sample

    def timed(self, m, *args, **kwargs):
        started = clock[0]
        seconds = real_seconds(self, m, *args, **kwargs)
        costs[(str(self.lever), m)] = (clock[0] - started, seconds)
        return seconds

    monkeypatch.setattr(probes.Probe, "seconds_per_sample", timed)
    config = parse_config(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--max_length", "64",
                           "--total_batch_size", "16", "--max_memory_mb", "65536", "--mixed_precision", "no"])
    state = SimpleNamespace(device=torch.device("cpu"), num_processes=1, is_main_process=True)
    plan = probe_and_choose(config, load_recipe("bbc-news"), state)
    out = capsys.readouterr().out
    assert list(costs) == [("no checkpointing", 16), ("no checkpointing", 8)], costs  # 8 slower: the descent stops
    # PROBE_SECONDS; the first plan's includes the 0.28 s of one-sample passes that chose the length
    assert costs[("no checkpointing", 16)][0] <= 3.0 + 0.28 and costs[("no checkpointing", 8)][0] <= 3.0, costs
    assert ("Timing probes: samples of 11 tokens, not 64: a timed plan of 16 samples of 64 tokens is predicted 16.0 s "
            "(0.01 s a pass + 0.00781 s a token, from one sample's passes)") in out
    # every plan timed at 11 tokens, its time beyond 0.01 s a pass scaled by 64 / 11: the clock's (0.01 + m x 0.5) / m
    assert costs[("no checkpointing", 16)][1] == pytest.approx((0.01 + 16 * 0.5) / 16)
    assert costs[("no checkpointing", 8)][1] == pytest.approx((0.01 + 8 * 0.5) / 8)
    assert (plan.per_device_train_batch_size, plan.lever) == (16, OFF)
    # the length: one-sample passes at 8 and 16 tokens (0.0725, 0.135 s) give 0.01 s a pass + 1/128 s a token; a plan
    # (two passes) of 16 samples fits 3 s at (1.5 - 0.01) / (16 / 128) = 11 tokens. A fast pass, or one slow for its
    # per-pass part only (a plan of 16 x 256 tokens: 1.8 s), keeps the run's length; the shortest is 8 tokens
    length, cost = probes.timing_length(lambda tokens: 0.01 + tokens / 128, 64, 16)
    assert (length, cost.per_pass, cost.per_token) == (11, pytest.approx(0.01), pytest.approx(1 / 128))
    assert probes.timing_length(lambda tokens: 1e-5 * tokens, 512, 32)[0] == 512
    assert probes.timing_length(lambda tokens: 0.5 + 1e-4 * tokens, 256, 16)[0] == 256
    assert probes.timing_length(lambda tokens: 10.0, 512, 32)[0] == probes.SHORTEST


def test_a_memory_probe_over_the_budget_says_so_and_keeps_its_answer(tiny_bert, monkeypatch, capsys):
    """Issue 50: the memory model needs the run's shapes, so the memory probe is not shortened: where its forward of
    one sample costs seconds (bf16 emulated on a CPU), a line says what it costs and why, and the bytes measured are
    those of the fast machine."""
    import torch

    from finetune import machine
    from finetune.config import parse_config
    from finetune.planner.probes import Probe
    from finetune.recipes import load_recipe

    config = parse_config(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--max_length", "64",
                           "--mixed_precision", "bf16"])
    recipe = load_recipe("bbc-news")
    fast = Probe(config, recipe, torch.device("cpu"), OFF, held=0)
    # the second reuses the first's measurements, as a planning's later probes do
    answer, first = (fast.per_sample_bytes, fast.fixed_bytes), fast.first_measurements()
    fast.close()
    assert "took" not in capsys.readouterr().out
    monkeypatch.setattr(machine, "_cpuinfo_field", lambda name: {"flags": "avx2 fma"}.get(name))  # no bf16 instructions
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    clock = [0.0]
    _slow_probes(monkeypatch, 1 / 32, clock)  # a 64-token sample: 2 s
    slow = Probe(config, recipe, torch.device("cpu"), OFF, held=0, **first)
    assert (slow.per_sample_bytes, slow.fixed_bytes) == answer
    slow.close()
    assert ("Memory probe (no checkpointing): a training pass of 1 sample of 64 tokens took 2.0 s, so this probe takes about "
            "6.0 s, over the 3 s a probe may cost: the memory model needs the run's own shapes, so it is not shortened; "
            "bf16 is emulated (no avx512_bf16, no AMX) on this CPU, where --mixed_precision no runs faster") \
        in capsys.readouterr().out
