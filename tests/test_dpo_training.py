"""Preference tuning (DPO) through the real engines (issue 38): ln 2 at the first step for each reference, a
resume that reads the precomputed reference log-probabilities back bit for bit, and exact accumulation over pairs
(B x 1, B/2 x 2, 1 x B, a partial last window, unequal pair lengths) in both backends, on 1 and 2 processes."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from helpers import launch, load_params, read_log, run_in_process, train_steps
from tiny_models import build_tiny_chat_llama

WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()
PAIRS = 10  # windows of 4, 4 and 2 pairs at B = 4


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory) -> tuple[str, str]:
    """Preference rows with prompts of 3-21 words, chosen of 1-6 and rejected of 1-5 words: pairs of unequal
    lengths, so a mean of micro-batch means would weigh them unequally."""
    rng, root = random.Random(0), tmp_path_factory.mktemp("pairs")

    def rows(n):
        return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 8, 21]))),
                 "chosen": " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 6]))),
                 "rejected": " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 5])))} for _ in range(n)]

    paths = []
    for name, n in (("train", PAIRS), ("valid", 4)):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(n)))
        paths.append(str(path))
    return paths[0], paths[1]


def flags(chat_llama, pair_files, **extra) -> dict:
    train, valid = pair_files
    return {**dict(recipe="bbc-headlines-dpo", model_name_or_path=chat_llama, train_file=train, validation_file=valid,
                   max_length=96, learning_rate=1e-3, warmup_steps=0, num_train_epochs=1, max_train_samples=1000,
                   max_eval_samples=1000, eval_strategy="no", eval_on_start=True, mixed_precision="no", seed=5,
                   per_device_train_batch_size=2, gradient_accumulation_steps=2), **extra}


def relative_difference(a: dict, b: dict) -> float:
    """The norm of the whole weight difference over the norm of ``a`` (Adam turns float noise on near-zero
    gradients into lr-sized element updates, so no single element is the measure)."""
    return float(torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)) / torch.sqrt(sum((a[k] ** 2).sum() for k in a)))


def launch_two_processes(flags_: dict, out) -> object:
    """``flags_`` as 2 gloo processes x 1 pair x 2 micro-batches (B = 4) through ``accelerate launch``, into ``out``."""
    args = []
    for key, value in {**flags_, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2,
                       "output_dir": str(out)}.items():
        args += [f"--{key}", str(value)]
    result = launch(args, num_processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def eval_at_start(out) -> dict:
    return next(r for r in read_log(out) if "eval_loss" in r and r.get("step") == 0)


def test_under_bf16_the_reference_runs_the_policy_s_autocast(tmp_path, chat_llama, pair_files):
    """--mixed_precision bf16 (CPU autocast): the frozen copy and the precomputed log-probabilities run under the
    policy's autocast, so at the first step the loss is still ln 2 within 1e-6 (an fp32 reference would differ
    from the bf16 policy by bf16's rounding: rewards ~1e-3)."""
    for name, extra in (("frozen", {}), ("precomputed", {"precompute_ref_log_probs": True})):
        _, out = run_in_process(tmp_path, name, **flags(chat_llama, pair_files, max_steps=1, mixed_precision="bf16",
                                                        eval_on_start=False, **extra))
        first = train_steps(out)[0]
        assert first["loss"] == pytest.approx(math.log(2), abs=1e-6), name
        assert abs(first["rewards/margins"]) <= 1e-6, name


def test_first_step_is_ln_2_for_each_reference_and_they_agree(tmp_path, chat_llama, pair_files):
    """Policy = reference at the first step: the loss is ln 2 within 1e-6 and every reward 0 for the frozen copy,
    the disabled LoRA adapter and the precomputed log-probabilities (within 1e-6: computed in other micro-batches);
    their log-probabilities agree within 1e-6, on the held-out pairs too, and the rewards are 0 there."""
    runs = {}
    for name, extra in (("frozen", {}), ("adapter", {"use_peft": True}), ("precomputed", {"precompute_ref_log_probs": True})):
        _, runs[name] = run_in_process(tmp_path, name, **flags(chat_llama, pair_files, max_steps=1, **extra))
    for name, out in runs.items():
        first = train_steps(out)[0]
        assert first["loss"] == pytest.approx(math.log(2), abs=1e-6), name
        # the two forwards in the same micro-batch: exactly 0; the precomputed ones were padded in other
        # micro-batches, so their float sums differ in the last bits
        tolerance = 1e-6 if name == "precomputed" else 0.0
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert abs(first[key]) <= tolerance, (name, key, first[key])
        assert first["rewards/accuracies"] == 0.0 and first["samples"] == 4, name
        start = eval_at_start(out)
        assert start["eval_loss"] == pytest.approx(math.log(2), abs=1e-6), name
        assert abs(start["eval_rewards/chosen"]) <= 1e-6 and abs(start["eval_rewards/rejected"]) <= 1e-6, name
    # the card: a text-generation model, its held-out rewards, the loss and where the reference came from
    for name, reference in (("frozen", "a frozen copy of the starting model"),
                            ("adapter", "the starting model with the LoRA adapter disabled"),
                            ("precomputed", "precomputed before training")):
        card = (runs[name] / "README.md").read_text()
        assert "pipeline_tag: text-generation" in card and "| preference loss (loss_type, beta) | sigmoid, beta 0.1 |" in card
        assert reference in card and "name: eval rewards/accuracies" in card, name
    logps = {name: (train_steps(out)[0]["logps/chosen"], train_steps(out)[0]["logps/rejected"],
                    eval_at_start(out)["eval_logps/chosen"]) for name, out in runs.items()}
    for name in ("adapter", "precomputed"):
        assert logps[name] == pytest.approx(logps["frozen"], abs=1e-6), (name, logps)


def test_a_resume_reads_the_precomputed_reference_back_bit_for_bit(tmp_path, chat_llama, pair_files, capsys):
    """--precompute_ref_log_probs writes every pair's reference log-probabilities once, under the output directory;
    a resume from step 1 reads the same file (not recomputed: its bytes and time unchanged) and trains steps 2-3
    to the uninterrupted run's losses and weights, bit for bit."""
    common = flags(chat_llama, pair_files, precompute_ref_log_probs=True, save_strategy="steps", save_steps=1,
                   eval_on_start=False)
    _, out = run_in_process(tmp_path, "run", **common)
    assert "computed into" in capsys.readouterr().out
    files = sorted((out / "reference_logps").glob("*.safetensors"))
    assert [f.name.split("-")[0] for f in files] == ["train", "validation"]
    before = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files}
    losses, weights = [r["loss"] for r in train_steps(out)], load_params(out)

    _, resumed = run_in_process(tmp_path, "run", **common,
                                resume_from_checkpoint=str(out / "checkpoints" / "step_00000001"))
    assert "read back from" in capsys.readouterr().out
    assert {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files} == before
    assert [r["loss"] for r in train_steps(resumed)] == losses
    again = load_params(resumed)
    assert all(torch.equal(again[k], weights[k]) for k in weights)


def test_reordered_pairs_get_their_own_reference_and_a_run_keeps_the_file_it_reads(tmp_path, chat_llama, pair_files,
                                                                                   capsys):
    """The reference columns are attached by position, so the file is keyed by the pairs in order: the same 10
    pairs reversed in place and rerun with --overwrite_output_dir into the same directory compute their own
    reference (step 1: ln 2 within 1e-6; another pair's reference gave 5.9), written after the directory is
    cleared; a third run on them reads that file back (ln 2 again) and leaves it in place, byte for byte."""
    train = tmp_path / "train.jsonl"
    lines = open(pair_files[0]).read().splitlines(keepends=True)
    train.write_text("".join(lines))
    common = flags(chat_llama, (str(train), pair_files[1]), precompute_ref_log_probs=True, max_steps=1,
                   eval_on_start=False, save_strategy="no")
    _, out = run_in_process(tmp_path, "run", **common)
    common["overwrite_output_dir"] = True
    assert "computed into" in capsys.readouterr().out
    first = {f.name for f in (out / "reference_logps").glob("train-*.safetensors")}
    assert len(first) == 1

    train.write_text("".join(reversed(lines)))  # the same pairs, reversed in place
    for run, how in ((2, "computed into"), (3, "read back from")):
        _, out = run_in_process(tmp_path, "run", **common)
        printed = capsys.readouterr().out
        assert train_steps(out)[0]["loss"] == pytest.approx(math.log(2), abs=1e-6), run
        line = next(line for line in printed.splitlines() if "reference log-probabilities of 10 train pairs" in line)
        assert how in line, (run, line)
        path = Path(line.split(f"{how} ", 1)[1])
        assert path.name not in first, run  # not the first order's file
        assert path.is_file(), run  # written after --overwrite_output_dir cleared the directory, kept by its reader
        assert {f.name for f in (out / "reference_logps").glob("train-*")} == {path.name}, run
        if run == 2:
            written = path.read_bytes()
        else:
            assert path.read_bytes() == written


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_any_split_of_the_pairs_gives_the_same_weights(tmp_path, chat_llama, pair_files, backend):
    """B = 4 pairs as 4 x 1, 2 x 2 and 1 x 4 over 10 pairs of unequal lengths (a partial last window of 2): the same
    losses, rewards and weights (fp32, rtol 1e-5); each window's loss is a sum over its pairs divided by its
    pairs (the last step's 2, not 4)."""
    runs = {}
    for m, n in ((4, 1), (2, 2), (1, 4)):
        _, runs[(m, n)] = run_in_process(tmp_path, f"{m}x{n}", **{**flags(chat_llama, pair_files, backend=backend,
                                                                          eval_on_start=False),
                                                                   "per_device_train_batch_size": m,
                                                                   "gradient_accumulation_steps": n})
    big = runs[(4, 1)]
    steps = train_steps(big)
    assert [r["samples"] for r in steps] == [4, 4, 2]
    for split, out in runs.items():
        assert relative_difference(load_params(big), load_params(out)) < 1e-5, split
        for a, b in zip(train_steps(big), train_steps(out)):
            for key in ("loss", "logps/chosen", "logps/rejected"):
                assert b[key] == pytest.approx(a[key], rel=1e-5), (split, key)
            # a reward is beta x a difference of log-probabilities of ~100 nats, whose fp32 spacing is ~1e-5
            for key in ("rewards/chosen", "rewards/margins"):
                assert b[key] == pytest.approx(a[key], abs=2e-6), (split, key)
            assert b["rewards/accuracies"] == a["rewards/accuracies"]


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_two_processes_train_what_one_does(tmp_path, chat_llama, pair_files, backend):
    """2 processes x 1 pair x 2 micro-batches against one process's 4 x 1 (B = 4), with the epoch's last window
    of 2 pairs and the precomputed reference (the main process computes, the other receives its columns): the same
    weights (rtol 1e-5) and per-step losses and rewards."""
    common = {**flags(chat_llama, pair_files, backend=backend, eval_on_start=False, precompute_ref_log_probs=True)}
    _, one = run_in_process(tmp_path, "one", **{**common, "per_device_train_batch_size": 4,
                                                "gradient_accumulation_steps": 1})
    two = launch_two_processes(common, tmp_path / "two")
    assert relative_difference(load_params(one), load_params(two)) < 1e-5
    for a, b in zip(train_steps(one), train_steps(two), strict=True):
        assert b["samples"] == a["samples"]
        for key in ("loss", "logps/rejected"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
        assert b["rewards/chosen"] == pytest.approx(a["rewards/chosen"], abs=2e-6)
        if a["step"] > 1:  # at step 1 every reward is 0 up to float noise: which side is larger is noise
            assert b["rewards/accuracies"] == a["rewards/accuracies"]


def test_the_planner_probes_the_reference_as_training_runs_it(chat_llama, pair_files):
    """The planner's probe (``planner.probes.Probe``) of a preference recipe: its batches are pairs (two sequences
    per item) and each step runs the reference as training does; the frozen copy's bytes are counted beside the
    model's weights, the disabled adapter and the precomputed log-probabilities add none."""
    from finetune.config import parse_config
    from finetune.planner.plans import Lever
    from finetune.planner.probes import Probe
    from finetune.recipes import load_recipe

    recipe = load_recipe("bbc-headlines-dpo")
    fixed, weights = {}, None
    for name, extra in (("frozen", []), ("adapter", ["--use_peft"]), ("precomputed", ["--precompute_ref_log_probs"])):
        train, valid = pair_files
        config = parse_config(["--recipe", "bbc-headlines-dpo", "--model_name_or_path", chat_llama, "--max_length", "64",
                               "--train_file", train, "--validation_file", valid, "--mixed_precision", "no",
                               "--output_dir", "unused", *extra])
        # what loading leaves and the allocator's overhead pinned: measured per probe, they move with the worker's
        # history (tests/test_plan_memory.py measures them in a fresh process)
        probe = Probe(config, recipe, torch.device("cpu"), Lever(False, None), held=0, overhead=1.0, loading=0, left=0)
        batch = probe.task.probe_batch(2, 64, probe.vocab, torch.device("cpu"))
        assert batch["input_ids"].shape == batch["rejected_input_ids"].shape == (2, 64)
        assert torch.isfinite(probe.step(2))
        if name == "frozen":
            weights = sum(t.numel() * t.element_size() for t in (*probe.model.parameters(), *probe.model.buffers()))
            assert probe.task.resident_bytes() == weights
        else:
            assert probe.task.resident_bytes() == 0
        fixed[name] = probe.fixed_bytes
        probe.close()
    assert fixed["frozen"] - fixed["precomputed"] >= weights


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_group_by_length_orders_pairs_by_their_longer_side(tmp_path, chat_llama, pair_files, backend):
    """--train_sampling_strategy group_by_length on pairs (no ``input_ids`` column: each pair's length is its longer
    side's): it trains, the epoch's 10 pairs once each."""
    _, out = run_in_process(tmp_path, "grouped", **flags(chat_llama, pair_files, backend=backend, eval_on_start=False,
                                                          train_sampling_strategy="group_by_length"))
    assert [r["samples"] for r in train_steps(out)] == [4, 4, 2]


@pytest.mark.parametrize("flag", ["packing", "padding_free"])
def test_packing_pairs_is_refused_in_one_line(tmp_path, chat_llama, pair_files, flag):
    from finetune.errors import FinetuneError

    with pytest.raises(FinetuneError, match="a preference recipe keeps padded micro-batches .a pair's two sides"):
        run_in_process(tmp_path, flag, **flags(chat_llama, pair_files, **{flag: True}))


@pytest.mark.parametrize("dpo_lora", [False, True])
def test_from_an_sft_adapter_run_the_reference_is_the_sft_model(tmp_path, chat_llama, pair_files, dpo_lora):
    """DPO from a LoRA SFT run's directory (an adapter on the tiny Llama, trained 4 steps): the adapter is merged,
    so the starting model and the reference are the SFT model (held-out rewards 0 at the start, its
    log-probabilities the SFT model's), not the base under it (whose log-probabilities differ), with the frozen
    copy and with a new LoRA adapter (whose disabled state is the SFT model)."""
    train, valid = pair_files
    sft_rows = tmp_path / "sft.jsonl"
    rows = [json.loads(line) for line in open(train)]
    sft_rows.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen"]}) + "\n" for r in rows))
    _, sft = run_in_process(tmp_path, "sft", recipe="bbc-headlines", model_name_or_path=chat_llama,
                            train_file=str(sft_rows), validation_file=str(sft_rows), use_peft=True, max_length=96,
                            learning_rate=3e-2, warmup_steps=0, max_steps=4, per_device_train_batch_size=2,
                            gradient_accumulation_steps=1, eval_strategy="no", eval_on_start=False,
                            max_train_samples=1000, max_eval_samples=2, mixed_precision="no", disable_dropout=True)
    assert (sft / "adapter_config.json").is_file()
    _, base = run_in_process(tmp_path, "from-base", **flags(chat_llama, pair_files, max_steps=1))
    _, dpo = run_in_process(tmp_path, "from-sft", **flags(str(sft), pair_files, max_steps=1, use_peft=dpo_lora))
    start, base_start = eval_at_start(dpo), eval_at_start(base)
    assert start["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(start["eval_rewards/chosen"]) <= 1e-6 and abs(start["eval_rewards/rejected"]) <= 1e-6
    # the SFT adapter moved the model: its log-probabilities are not the base's (by far more than float noise)
    assert abs(start["eval_logps/chosen"] - base_start["eval_logps/chosen"]) > 1e-2
    assert train_steps(dpo)[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_tensorboard_gets_each_step_s_rewards(tmp_path, chat_llama, pair_files, backend):
    """--report_to tensorboard: every optimizer step's ``rewards/*`` and ``logps/*`` (the window's means) as scalars,
    equal to log.jsonl's, in both backends (Trainer's record carries them: ``FinetuneTrainer.log``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = run_in_process(tmp_path, "tb", **flags(chat_llama, pair_files, backend=backend, report_to="tensorboard",
                                                     eval_on_start=False))
    scalars = {}
    for path in out.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(path.parent))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars[tag] = [e.value for e in accumulator.Scalars(tag)]
    steps = train_steps(out)
    for key in ("rewards/chosen", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert scalars[f"train/{key}"] == pytest.approx([r[key] for r in steps], rel=1e-6, abs=1e-9), key


def test_an_elastic_resume_reads_the_precomputed_reference_back(tmp_path, chat_llama, pair_files):
    """Two processes write the precomputed reference and checkpoint each step; one process resumes from step 1
    (another split of the same B = 4: 2 x 2 instead of 1 x 2 x 2 processes), reads the file back untouched and
    trains steps 2-3 to the two-process run's losses and weights (rtol 1e-5: another split's float order)."""
    common = {**flags(chat_llama, pair_files, precompute_ref_log_probs=True, save_strategy="steps", save_steps=1,
                      eval_on_start=False)}
    two = launch_two_processes(common, tmp_path / "run")
    files = sorted((two / "reference_logps").glob("*.safetensors"))
    before = {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files}
    losses, weights = [r["loss"] for r in train_steps(two)], load_params(two)
    _, resumed = run_in_process(tmp_path, "run", **{**common, "per_device_train_batch_size": 2,
                                                    "gradient_accumulation_steps": 2},
                                resume_from_checkpoint=str(two / "checkpoints" / "step_00000001"))
    assert len(files) == 2 and {f: (f.read_bytes(), f.stat().st_mtime_ns) for f in files} == before
    assert [r["loss"] for r in train_steps(resumed)] == pytest.approx(losses, rel=1e-5)
    assert relative_difference(weights, load_params(resumed)) < 1e-5


@pytest.mark.parametrize("extra", [{}, {"use_peft": True}])
def test_activation_checkpointing_trains_the_same_pairs_to_the_same_weights(tmp_path, chat_llama, pair_files, extra):
    """--activation_checkpointing recomputes the policy's forward in backward (the frozen reference, in eval mode
    without gradients, is never checkpointed): the same weights as without (rtol 1e-5), full and LoRA."""
    common = flags(chat_llama, pair_files, eval_on_start=False, **extra)
    _, plain = run_in_process(tmp_path, "plain", **common)
    _, checkpointed = run_in_process(tmp_path, "checkpointed", **common, activation_checkpointing=True)
    from safetensors.torch import load_file

    assert abs(train_steps(checkpointed)[-1]["rewards/margins"]) > 1e-6  # it trained: the policy left the reference
    name = "adapter_model.safetensors" if extra else "model.safetensors"
    assert relative_difference(load_file(plain / name), load_file(checkpointed / name)) < 1e-5
    assert [r["loss"] for r in train_steps(checkpointed)] == pytest.approx([r["loss"] for r in train_steps(plain)],
                                                                           rel=1e-6)
