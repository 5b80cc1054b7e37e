"""Our preference task against its peer, TRL 1.16's ``DPOTrainer`` (issue 38, "Peer"): on the tiny chat Llama,
fp32, dropout off, the same initial weights, the same tokenised pairs in the same order, every optimizer step's
loss, gradient norm, ``rewards/*`` and ``logps/*`` equal within 2e-6 (sigmoid, ipo, hinge; full fine-tuning and
LoRA; the reference as a frozen copy, a disabled adapter, or precomputed); and on a partial last window TRL
departs from its own large batch where we do not. How TRL is given the same run, with the lines of TRL's code
relied on: ``tests/trl_peer.py``. Figures: docs/dpo.md#equal-to-trls-dpotrainer (``pytest tests/test_dpo_peer.py
-s`` prints them).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from tiny_models import build_tiny_chat_llama

trl = pytest.importorskip("trl", reason="trl is not installed: the peer comparison needs TRL 1.16's DPOTrainer "
                                        "(pip install -e '.[test]' installs trl==1.16.0)")
from trl_peer import Run, order_of, reset_accelerate_state, run_ours, run_trl, trl_config, trl_pair  # noqa: E402

WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()
TOLERANCE = 2e-6
METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
# Relative for the loss, the gradient norm and logps/*, absolute for rewards/*. The loss and the norm are O(1) for
# sigmoid and hinge but ~25 for ipo at beta 0.1 ((delta - 1/(2 beta))^2, whose fp32 spacing is 1.9e-6), and
# logps/* are means of sums of ~10 token log-probabilities, -20 to -100 nats (fp32 spacing 2e-6 to 8e-6; 1.5e-5 for
# a micro-batch's sum of two): two float orders differ there by more than 2e-6 absolute. rewards/* are beta x
# differences of those log-probabilities, exactly 0 at the first step: relative differences mean nothing there.
RELATIVE = ("loss", "grad_norm", "logps/chosen", "logps/rejected")
COMMON = dict(max_length=256, learning_rate=1e-3, warmup_steps=0, lr_scheduler_type="linear", weight_decay=0.0,
              max_grad_norm=1.0, beta=0.1, seed=5)
LORA = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0)


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def fresh_accelerate_state():
    """Accelerate's state is process-wide and TRL's Trainer builds its own Accelerator: the tests after these
    start from a clean one."""
    yield
    reset_accelerate_state()


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


def write_pairs(path, n: int, seed: int) -> str:
    """``n`` preference rows of unequal lengths (prompts of 3-21 words, sides of 1-6), as JSON lines."""
    rng = random.Random(seed)
    rows = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 8, 21]))),
             "chosen": " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 6]))),
             "rejected": " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 5])))} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    """12 pairs (three full windows of 4), 11 (the last window 3: at 2 x 2 one micro-batch of 2 and one of 1), 10
    (the last window 2: one micro-batch at 2 x 2), and 2 held-out pairs."""
    root = tmp_path_factory.mktemp("pairs")
    return {n: write_pairs(root / f"train{n}.jsonl", n, seed=n) for n in (12, 11, 10)} | {
        "valid": write_pairs(root / "valid.jsonl", 2, seed=1)}


# ------------------------------------------------------------------------------------------ the two runs
def ours(tmp_path, name: str, train_file: str, valid_file: str, model_dir: str, micro_batch: int, accumulation: int,
         loss_type: str = "sigmoid", peft: bool = False, precompute: bool = False) -> tuple[Run, list[dict]]:
    """Our run (``trl_peer.run_ours``) of the bbc-headlines-dpo recipe on these pairs and settings."""
    flags = dict(recipe="bbc-headlines-dpo", output_dir=tmp_path / name, model_name_or_path=model_dir,
                 train_file=train_file, validation_file=valid_file, num_train_epochs=1, max_train_samples=1000,
                 eval_strategy="no", eval_on_start=False, save_strategy="no", mixed_precision="no", loss_type=loss_type,
                 per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
                 precompute_ref_log_probs=precompute, use_peft=peft, **COMMON, **(LORA if peft else {}))
    return run_ours([arg for flag, value in flags.items() for arg in (f"--{flag}", str(value))])


def theirs(tmp_path, name: str, rows: list[dict], order: list[int], model_dir: str, micro_batch: int,
           accumulation: int, loss_type: str = "sigmoid", peft: bool = False, precompute: bool = False) -> Run:
    """TRL's ``DPOTrainer`` (``trl_peer.run_trl``) on ``rows`` in ``order``, with our run's settings."""
    from peft import LoraConfig

    args = trl_config(tmp_path / name, per_device_train_batch_size=micro_batch,
                      gradient_accumulation_steps=accumulation, loss_type=loss_type,
                      precompute_ref_log_probs=precompute, **{k: v for k, v in COMMON.items() if k != "max_length"})
    lora = LoraConfig(task_type="CAUSAL_LM", r=LORA["lora_r"], lora_alpha=LORA["lora_alpha"],
                      lora_dropout=LORA["lora_dropout"])  # peft's default target modules, as ours
    return run_trl(model_dir, rows, order, args, lora if peft else None)


# ------------------------------------------------------------------------------------------ measures
def _at_zero(x: dict, y: dict) -> bool:
    """Whether every reward of both steps is rounding noise (within TOLERANCE of 0: the policy still equals the
    reference, the first step): then which side's reward is larger, rewards/accuracies, is decided by the float
    order alone (TRL's precomputed reference is scored in other micro-batches than its policy, 1.9e-7 apart)."""
    return all(abs(step[k]) <= TOLERANCE for step in (x, y) for k in ("rewards/chosen", "rewards/rejected"))


def differences(a: list[dict], b: list[dict]) -> dict[str, tuple[float, float]]:
    """Per metric: (max absolute, max relative) difference over the steps of two runs (rewards/accuracies over the
    steps whose rewards are not all rounding noise, ``_at_zero``)."""
    assert len(a) == len(b), (len(a), len(b))
    found = {}
    for k in METRICS:
        steps = [(x, y) for x, y in zip(a, b) if k != "rewards/accuracies" or not _at_zero(x, y)] or [(a[0], a[0])]
        found[k] = (max(abs(x[k] - y[k]) for x, y in steps), max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-30)
                                                                 for x, y in steps))
    return found


def assert_equal_steps(a: list[dict], b: list[dict], what, tolerance: float = TOLERANCE) -> dict:
    """Every step's METRICS equal within ``tolerance`` (relative for RELATIVE, else absolute: a pair whose reward
    accuracy flips moves rewards/accuracies by 1/pairs). Returns ``differences``."""
    found = differences(a, b)
    for k, (absolute, relative) in found.items():
        assert (relative if k in RELATIVE else absolute) <= tolerance, (what, k, absolute, relative)
    return found


def relative_difference(a: dict, b: dict) -> float:
    """The norm of the whole difference of two sets of weights over the norm of ``a``."""
    assert a.keys() == b.keys()
    return float(torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)) / torch.sqrt(sum((a[k] ** 2).sum() for k in a)))


def report(what: str, found: dict) -> None:
    print(f"\n{what}: " + ", ".join(f"{k} {absolute:.1e} abs / {relative:.1e} rel"
                                   for k, (absolute, relative) in found.items()))


# ------------------------------------------------------------------------------------------ the tests
def test_the_peer_is_trl_1_16():
    """The formulas and the line numbers cited here are TRL 1.16.0's (the test extra pins it)."""
    assert trl.__version__ == "1.16.0", f"the peer is TRL 1.16.0 (pyproject's test extra), found {trl.__version__}"


CASES = [("sigmoid", False, False), ("ipo", False, False), ("hinge", False, False),
         ("sigmoid", True, False), ("ipo", True, False), ("hinge", True, False),
         ("sigmoid", False, True), ("sigmoid", True, True)]


@pytest.mark.parametrize("loss_type,peft,precompute", CASES,
                         ids=[f"{t}-{'lora' if p else 'full'}{'-precomputed' if c else ''}" for t, p, c in CASES])
def test_every_step_equals_trls(tmp_path, chat_llama, pairs, loss_type, peft, precompute):
    """12 pairs of unequal lengths, B = 4 as 2 x 2 (three full windows): TRL computes the same micro-batches of
    the same pairs from the same initial weights (the LoRA adapter too), and every step's loss, gradient norm,
    rewards and log-probabilities equal ours within 2e-6 (relative; rewards/* absolute); the trained weights
    agree within 1e-5 (relative, whole model)."""
    run, rows = ours(tmp_path, "ours", pairs[12], pairs["valid"], chat_llama, 2, 2, loss_type, peft, precompute)
    peer = theirs(tmp_path, "trl", rows, order_of(run.batches, rows), chat_llama, 2, 2, loss_type, peft, precompute)
    assert peer.batches == run.batches  # the same pairs, micro-batch by micro-batch
    assert peer.precomputed == {precompute}
    assert (tmp_path / "ours" / "reference_logps").is_dir() == precompute
    assert peer.initial.keys() == run.initial.keys()
    assert all(torch.equal(peer.initial[k], run.initial[k]) for k in run.initial)
    assert [r["step"] for r in run.steps] == [1, 2, 3] and len(peer.steps) == 3
    found = assert_equal_steps(run.steps, peer.steps, (loss_type, peft, precompute))
    weights = relative_difference(run.final, peer.final)
    assert weights < 1e-5
    report(f"{loss_type} {'LoRA' if peft else 'full'}{' precomputed' if precompute else ''} (weights {weights:.1e})",
           found)


@pytest.mark.parametrize("n", [11, 10])
def test_a_partial_last_window(tmp_path, chat_llama, pairs, n):
    """B = 4 as 2 x 2 and 4 x 1 (sigmoid, full fine-tuning). 11 pairs: the last window holds 3, at 2 x 2 a
    micro-batch of 2 and one of 1. TRL's loss is each micro-batch's mean divided by the window's micro-batches, so
    there its 2 x 2 weighs the lone pair 1/2 and the others 1/4 each where its 4 x 1 weighs each 1/3, and its
    logged metrics are means of the micro-batches' means: its last step departs from its own large batch (the loss,
    the gradient norm, logps/*, the final weights), its full windows do not. Ours divides the window's sum by its
    3 pairs: 2 x 2 equals 4 x 1 (rtol 1e-5) and both equal TRL's 4 x 1 within 2e-6. 10 pairs: the last window is
    one micro-batch of 2 at 2 x 2 (transformers 5.24 divides it by 1), and TRL's 2 x 2 departs from nothing."""
    runs = {}
    for micro_batch, accumulation in ((2, 2), (4, 1)):
        name = f"{micro_batch}x{accumulation}"
        run, rows = ours(tmp_path, f"ours-{name}", pairs[n], pairs["valid"], chat_llama, micro_batch, accumulation)
        runs["ours", micro_batch] = run
        runs["trl", micro_batch] = theirs(tmp_path, f"trl-{name}", rows, order_of(run.batches, rows), chat_llama,
                                          micro_batch, accumulation)
        assert runs["trl", micro_batch].batches == run.batches
    assert [r["samples"] for r in runs["ours", 4].steps] == [4, 4, n - 8]
    big = runs["trl", 4].steps  # TRL's large batch: one micro-batch per window, its mean is the window's mean
    for split in (4, 2):
        assert_equal_steps(runs["ours", split].steps, big, ("ours", split, "trl", 4))
        assert relative_difference(runs["trl", 4].final, runs["ours", split].final) < 1e-5
    assert relative_difference(runs["ours", 4].final, runs["ours", 2].final) < 1e-5
    trl_2x2 = runs["trl", 2]
    assert_equal_steps(trl_2x2.steps[:2], big[:2], "trl's full windows")
    departs = relative_difference(runs["trl", 4].final, trl_2x2.final)
    last = {k: abs(trl_2x2.steps[-1][k] - big[-1][k]) / abs(big[-1][k]) for k in ("loss", "grad_norm", "logps/chosen")}
    ours_last = {k: abs(runs["ours", 2].steps[-1][k] - runs["ours", 4].steps[-1][k]) / abs(runs["ours", 4].steps[-1][k])
                 for k in last}
    print(f"\n{n} pairs, 2 x 2 against 4 x 1: TRL weights {departs:.1e}, last step "
          + ", ".join(f"{k} {v:.1e}" for k, v in last.items()) + f"; ours weights "
          f"{relative_difference(runs['ours', 4].final, runs['ours', 2].final):.1e}, last step "
          + ", ".join(f"{k} {v:.1e}" for k, v in ours_last.items()))
    assert max(ours_last.values()) < 1e-5
    if n == 11:  # measured: weights 5.6e-4; loss 2.9e-4, grad_norm 6.3e-2, logps/chosen 1.2e-1 (relative)
        assert departs > 2e-4
        assert last["loss"] > 1e-4 and last["grad_norm"] > 2e-2 and last["logps/chosen"] > 5e-2
    else:
        assert departs < 1e-5
        assert_equal_steps(trl_2x2.steps, big, "trl, 10 pairs")


def test_trls_own_tokenisation_equals_ours_the_newline_after_the_turn_included(tmp_path, chat_llama):
    """On conversational rows TRL 1.16's own tokenisation (``DPOTrainer._prepare_dataset``) gives our prompt tokens
    and our trained tokens: every token after the prompt, the "\\n" the chat template puts after ``<|im_end|>``
    included (before, ours stopped at ``<|im_end|>``)."""
    import datasets
    from transformers import AutoTokenizer

    from finetune.data.preference import encode_pair

    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    row = {"prompt": [{"role": "user", "content": "the market rose as shares fell"}],
           "chosen": [{"role": "assistant", "content": "shares fell"}],
           "rejected": [{"role": "assistant", "content": "the match ended"}]}
    args = trl_config(tmp_path)
    # the method reads its trainer only for strings (adding EOS): none is built here
    theirs = trl.DPOTrainer._prepare_dataset(None, datasets.Dataset.from_list([row]), tokenizer, args, "train")[0]
    mine = encode_pair(tokenizer, row, max_length=256)
    cut = trl_pair(*(mine[c] for c in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")))
    newline = tokenizer.encode("\n")
    assert {k: theirs[k] for k in cut} == cut
    assert cut["chosen_ids"][-2:] == tokenizer.encode("<|im_end|>") + newline
    assert mine["chosen_input_ids"] == cut["prompt_ids"] + cut["chosen_ids"]
