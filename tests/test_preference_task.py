"""The preference task (finetune/tasks/preference.py) on the tests' tiny chat Llama: ln 2 at the first step
with each of the three references, which agree; a window's loss and gradients the same over any split of its
pairs; a repeated pair counts and trains nothing."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tiny_models import build_tiny_chat_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.data.preference import encode_pair
from finetune.errors import FinetuneError
from finetune.tasks.preference import PreferenceCollator, PreferenceTask
from finetune.tasks.preference_loss import PreferenceLoss

USER = "Write the headline of this BBC News article."
HEADLINES = [("Shares in the bank rose", "The film won three awards"),
             ("Ministers said the election would be held in the spring", "The striker scored"),
             ("The striker scored a late goal", "Shares rose"),
             ("The film won three awards at the ceremony in London on Sunday", "Ministers said"),
             ("Shares", "The election would be held in the spring after the market opened")]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama"))
    return AutoModelForCausalLM.from_pretrained(path).float().eval(), AutoTokenizer.from_pretrained(path)


def features(tokenizer, pairs=HEADLINES) -> list[dict]:
    return [encode_pair(tokenizer, {"prompt": USER, "chosen": c, "rejected": r}, 128, f"row {i}")
            for i, (c, r) in enumerate(pairs)]


def test_at_the_first_step_each_reference_gives_ln_2_and_they_agree(chat_model):
    """Policy = reference: the loss per pair is ln 2 (within 1e-6) and every reward 0 for the frozen copy, the
    disabled LoRA adapter and the precomputed log-probabilities, which agree within 1e-6."""
    peft = pytest.importorskip("peft")
    model, tokenizer = chat_model
    rows = features(tokenizer)
    collate = PreferenceCollator(tokenizer)
    batch = collate(rows)
    frozen = PreferenceTask(PreferenceLoss("sigmoid", beta=0.1), reference_model=copy.deepcopy(model))
    out = frozen.forward(model, batch)
    assert frozen.count(batch) == 5 and frozen.samples(batch) == 5
    assert float(frozen.loss_sum(model, batch).detach()) / 5 == pytest.approx(math.log(2), abs=1e-6)
    sums = frozen.metric_sums(model, batch)
    assert sums["rewards/chosen"] == sums["rewards/rejected"] == sums["rewards/margins"] == 0.0
    # LoRA: the adapter moved off zero, so the policy differs; disabled, it is the base
    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    adapter = PreferenceTask(PreferenceLoss("sigmoid", beta=0.1)).forward(lora, batch)
    assert torch.allclose(adapter["ref_chosen_logps"], out["ref_chosen_logps"], atol=1e-6, rtol=0)
    assert torch.allclose(adapter["ref_rejected_logps"], out["ref_rejected_logps"], atol=1e-6, rtol=0)
    assert not torch.allclose(adapter["chosen_logps"], out["chosen_logps"], atol=1e-3)
    # precomputed: the frozen copy's, carried in the rows
    for row, c, r in zip(rows, out["ref_chosen_logps"].tolist(), out["ref_rejected_logps"].tolist()):
        row.update(ref_chosen_logps=c, ref_rejected_logps=r)
    carried = PreferenceTask(PreferenceLoss("sigmoid", beta=0.1))
    pre = collate(rows)
    assert float(carried.loss_sum(model, pre).detach()) / 5 == pytest.approx(math.log(2), abs=1e-6)
    assert torch.equal(carried.forward(model, pre)["ref_chosen_logps"], out["ref_chosen_logps"])


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_a_window_of_pairs_trains_the_same_over_any_split(chat_model, loss_type):
    """5 pairs of unequal lengths: the window's loss and gradients (sum of micro-batch loss sums / the window's
    pairs) from one micro-batch of 5 equal those from 2 + 2 + 1 and 1 x 5 (fp32, loss rtol 1e-5, each gradient
    tensor within 1e-5 of its norm), the policy moved
    off the reference so that every term and gradient is non-trivial."""
    model, tokenizer = chat_model
    policy = copy.deepcopy(model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    task = PreferenceTask(PreferenceLoss(loss_type, beta=0.1), reference_model=copy.deepcopy(model))
    collate, rows = PreferenceCollator(tokenizer), features(tokenizer)

    def window(sizes):
        policy.zero_grad()
        batches = [collate(rows[a:a + n]) for a, n in zip([sum(sizes[:i]) for i in range(len(sizes))], sizes)]
        pairs = sum(int(task.count(b)) for b in batches)
        total = 0.0
        for b in batches:
            loss = task.loss_sum(policy, b) / pairs
            loss.backward()
            total += float(loss)
        return total, {n: p.grad.clone() for n, p in policy.named_parameters()}

    whole, reference = window([5])
    assert whole > 0
    for sizes in ([2, 2, 1], [1] * 5):
        loss, grads = window(sizes)
        assert loss == pytest.approx(whole, rel=1e-5)
        worst = max(float((g - reference[n]).norm() / reference[n].norm()) for n, g in grads.items())
        assert worst < 1e-5, (sizes, worst)  # per tensor, relative to its norm: fp32 rounding at other shapes


def test_a_repeated_pair_counts_and_trains_nothing(chat_model):
    """The loop masks a repeated row's ``labels`` (``window.mask_repeats``): that pair counts 0 and adds 0, so
    the micro-batch trains as its other pairs alone."""
    model, tokenizer = chat_model
    task = PreferenceTask(PreferenceLoss("sigmoid", beta=0.5), reference_model=copy.deepcopy(model))
    policy = copy.deepcopy(model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    collate, rows = PreferenceCollator(tokenizer), features(tokenizer)
    batch = collate(rows[:3])
    batch["labels"][2] = -100
    assert int(task.count(batch)) == 2
    alone = collate(rows[:2])
    assert float(task.loss_sum(policy, batch)) == pytest.approx(float(task.loss_sum(policy, alone)), rel=1e-6)


def test_no_reference_is_refused_with_one_line(chat_model):
    model, tokenizer = chat_model
    batch = PreferenceCollator(tokenizer)(features(tokenizer)[:1])
    with pytest.raises(FinetuneError, match="the preference task has no reference"):
        PreferenceTask().loss_sum(model, batch)
