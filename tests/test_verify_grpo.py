"""``finetune verify`` on GRPO (issue 54): every way replays one recorded set of completions (the user's record, or
one the reference's window generates first), so B x 1, B/2 x 2 and 1 x B differ in their split only; verify says
exact for dapo, dr_grpo and grpo with unequal completion lengths and a partial last window (one process, in-process;
two processes through the real launcher, generating), its mean-of-means control (bnpo's aggregation on 1 x B)
departs by at least 100 x the tolerance, bnpo itself is judged split-dependent by definition with its departure
measured, and a wrong engine (the mean of the micro-batch means, ``tests/faults/mutants.py``) exits 1 naming the
splits."""

from __future__ import annotations

import json
import random

import pytest
from faults.mutants import install_mutant
from helpers import REPO, launch
from test_verify import rows
from tiny_models import build_tiny_chat_llama, build_tiny_chat_llama_that_stops

from finetune.commands import verify

G, L, EOS, PROMPTS = 4, 6, 2, 8  # B = 4 prompts, 2 steps: windows of 4 and 2 prompts (verify keeps 6)
WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()
REWARDS = ",".join(f"{REPO / 'tests' / 'grpo_rewards.py'}:{name}" for name in ("token_parity", "topic_named",
                                                                                "id_sum_parity"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """Prompt-only rows of 2, 5 or 11 words, and a record of completions for 2 steps x every prompt: 1-6 tokens,
    about half ending in EOS, the rest cut at L."""
    rng, root = random.Random(0), tmp_path_factory.mktemp("grpo-verify")
    prompts = [{"prompt": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.choice(
        [2, 5, 11])))}], "topic": i % 5} for i in range(PROMPTS)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    (root / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts[:3]))
    records = []
    for step in (1, 2):
        for prompt in range(PROMPTS):
            for g in range(G):
                ended = rng.random() < 0.5
                ids = [rng.randrange(3, 300) for _ in range(rng.randrange(0, L) if ended else L)] + [EOS] * ended
                records.append({"step": step, "prompt": prompt, "generation": g, "completion_ids": ids,
                                "rewards": {}})
    (root / "replay.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"train": str(root / "train.jsonl"), "valid": str(root / "valid.jsonl"), "replay": str(root / "replay.jsonl")}


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


def grpo_args(model: str, data: dict, *extra: str) -> list[str]:
    return ["--recipe", "grpo", "--model_name_or_path", model, "--train_file", data["train"], "--validation_file",
            data["valid"], "--reward_funcs", REWARDS, "--num_generations", str(G), "--max_completion_length", str(L),
            "--verify_steps", "2", "--learning_rate", "1e-3", "--warmup_steps", "0", "--mixed_precision", "no",
            "--max_length", "64", *extra]


def run_verify(tmp_path, model: str, data: dict, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "verify"
    code = verify.main([*grpo_args(model, data, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
                                   "2", "--replay_completions", data["replay"], *extra), "--output_dir", str(out)])
    return code, json.loads((out / "verify.json").read_text())


def assert_grpo_exact(code: int, report: dict, splits: set[str]) -> None:
    """Exact: the splits named, their gradients within the tolerance; the mean-of-means control 100 x out; no
    Trainer way (the task runs on the accelerate backend only), and the report says so."""
    assert code == 0 and report["verdict"] == "exact", json.dumps(report, indent=1)[-3000:]
    assert {r["way"] for r in rows(report, "split") if r["verdict"] == "exact"} == splits
    assert all(r["gradient_difference"] <= report["tolerance"]["gradients"] for r in rows(report, "split"))
    assert report["last_window_samples"] == 2 and report["effective_batch"] == 4  # a partial last window of prompts
    [control] = rows(report, "control")
    assert control["way"].endswith("mean of micro-batch means") and "bnpo's aggregation" in control["verdict"]
    assert report["control_margin"] >= 100, report["control_margin"]  # issue 54: at least 100 x its tolerance
    assert not rows(report, "engine") and any(n.startswith("Trainer backend: not run: the grpo task runs on "
                                                           "--backend accelerate only") for n in report["notes"])
    print(f"control {report['control_margin']:.3g} x the gradient tolerance {report['tolerance']['gradients']:.2e}; "
          f"noise floor {report['noise_floor']['gradients']:.2e}; seconds "
          f"{sum(r['seconds'] for r in report['rows']):.1f}")


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
def test_verify_says_exact_on_replayed_completions(tmp_path, chat_llama, data, loss_type):
    """B = 4 prompts x 4 completions of 1-6 tokens: 4 x 1, 2 x 2 and 1 x 4 on the replayed record, exact; their
    per-step items (dapo: the completion tokens) are unequal and the last window holds 2 prompts."""
    code, report = run_verify(tmp_path, chat_llama, data, "--loss_type", loss_type)
    assert_grpo_exact(code, report, {"2 x 2", "1 x 4"})
    reference = next(r for r in report["rows"] if r["verdict"] == "reference")
    assert [r["items"] for r in rows(report, "split")] == [reference["items"]] * 2
    assert any(f"replayed by every way from {data['replay']}" in n for n in report["notes"])


def test_bnpo_is_split_dependent_by_definition_and_measured(tmp_path, chat_llama, data):
    """--loss_type bnpo: the splits depart (TRL normalises each micro-batch by its own tokens) and verify says so as
    bnpo's definition, with the departure measured, not as a fault (no way in ``not_exact``); exit 1."""
    code, report = run_verify(tmp_path, chat_llama, data, "--loss_type", "bnpo")
    assert code == 1 and report["verdict"] == "split-dependent" and report["not_exact"] == []
    splits = rows(report, "split")
    assert splits and all(r["verdict"].startswith("split-dependent by definition: step 1's gradients differ")
                          for r in splits)
    worst = max(r["gradient_difference"] for r in splits)
    assert worst > 100 * report["tolerance"]["gradients"]
    [cause] = report["causes"]
    assert cause.startswith("--loss_type bnpo is split-dependent by definition") and "not a fault" in cause
    assert "measured: 1 x 4 departs by" in cause and f"gradients {worst:.2e} at step 1" in cause
    assert not any("chunks" in r["way"] for r in report["rows"])  # a mean per micro-batch: chunks would change it
    print(f"bnpo: 1 x 4 departs by {worst:.2e} (gradients, step 1) against a tolerance of "
          f"{report['tolerance']['gradients']:.2e}")


def test_a_mean_of_micro_batch_means_engine_is_caught(tmp_path, monkeypatch, chat_llama, data):
    """The accelerate backend's normalisation line mutated to the mean of the micro-batch means
    (``tests/faults/mutants.py`` ``mean-of-means``): on GRPO's dapo every split departs; exit 1 naming them."""
    install_mutant("mean-of-means", monkeypatch.setattr)
    code, report = run_verify(tmp_path, chat_llama, data)
    assert code == 1 and report["verdict"] == "not exact", json.dumps(report, indent=1)[-3000:]
    assert set(report["not_exact"]) >= {"2 x 2", "1 x 4"}
    assert all("step 1's gradients differ" in r["verdict"] for r in rows(report, "split"))


def test_two_processes_generate_once_and_verify_exact(tmp_path_factory, tmp_path, data):
    """2 gloo processes x 2 prompts per window (B = 4), no record given: the reference's window generates the
    completions (a tiny Llama that often samples its stop token: unequal lengths), every other way replays them;
    the generating run equals its replay, and verify says exact with the control 100 x out."""
    model = str(build_tiny_chat_llama_that_stops(tmp_path_factory.mktemp("tiny-chat-llama-stops")))
    out = tmp_path / "verify"
    result = launch([*grpo_args(model, data, "--per_device_train_batch_size", "1", "--gradient_accumulation_steps",
                                "2"), "--output_dir", str(out)], num_processes=2, module="finetune.commands.verify")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "verify.json").read_text())
    assert report["processes"] == 2
    assert_grpo_exact(0, report, {"1 x 2"})
    [generation] = rows(report, "generation")
    assert generation["way"] == "2 x 1, generated" and generation["verdict"] == "exact"
    assert generation["gradient_difference"] == 0 and generation["weight_difference"] == 0  # its replay, bit for bit
    records = [json.loads(line) for line in (out / "generation-2x1" / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 6 * G and len({len(r["completion_ids"]) for r in records}) > 1  # unequal lengths
