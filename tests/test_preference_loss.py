"""The preference losses' per-pair terms (finetune/tasks/preference_loss.py): their values where the policy is
the reference, the decomposition over micro-batches that makes accumulation exact, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.errors import FinetuneError
from finetune.tasks.preference_loss import (
    BATCH_COUPLED,
    PAIR_LOSS_TYPES,
    PAIR_METRICS,
    PreferenceLoss,
    check_loss_type,
    pair_metric_sums,
)


def logps(pairs: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Policy and reference log-probabilities (nats, summed over 3-40 tokens) and token counts, shape (pairs,)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 40, (2, pairs), generator=g).double()
    ref = -tokens * (1.0 + torch.rand(2, pairs, generator=g, dtype=torch.float64))
    policy = ref + 0.5 * torch.randn(2, pairs, generator=g, dtype=torch.float64)
    return policy[0], policy[1], ref[0], ref[1], tokens[0], tokens[1]


def smoothing(kind: str) -> float:
    return {"robust": 0.1, "exo_pair": 1e-3}.get(kind, 0.0)


def test_at_the_first_step_dpo_is_ln_2_and_every_reward_0():
    """Policy = reference: the sigmoid loss is ln 2 per pair (0.693147, within 1e-6 in fp32), every reward 0."""
    _, _, ref_c, ref_r, tc, tr = logps(6)
    c, r = ref_c.float(), ref_r.float()
    terms = PreferenceLoss("sigmoid", beta=0.1)(c, r, c, r)
    assert terms.dtype == torch.float32 and terms.shape == (6,)
    assert torch.allclose(terms, torch.full((6,), math.log(2)), atol=1e-6, rtol=0)
    sums = pair_metric_sums(0.1, c, r, c, r)
    assert [sums[k] for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")] == [0.0] * 4
    assert sums["logps/chosen"] == pytest.approx(float(c.double().sum()))


@pytest.mark.parametrize("kind,at_zero", [("sigmoid", math.log(2)), ("hinge", 1.0), ("ipo", 1 / (4 * 0.1**2)),
                                          ("robust", math.log(2)), ("sigmoid_norm", math.log(2)),
                                          ("bco_pair", 2 * math.log(2)), ("nca_pair", 2 * math.log(2)),
                                          ("sppo_hard", 2 * (0.5 / 0.1) ** 2), ("apo_zero", 1.0),
                                          ("apo_down", 1.0), ("discopop", 0.5 * math.log(2) + 0.5),
                                          ("exo_pair", math.log(0.5 / (1 - 1e-3)) / 2 + math.log(0.5 / 1e-3) / 2)])
def test_each_loss_at_the_reference_takes_its_closed_form_value(kind, at_zero):
    """Where policy = reference (every log-ratio 0) each term reduces to a constant of beta = 0.1 alone: the
    formulas of TRL 1.16's loss_type branches (dpo_trainer.py) evaluated at 0 by hand."""
    _, _, c, r, tc, tr = logps(5)
    terms = PreferenceLoss(kind, beta=0.1, label_smoothing=smoothing(kind))(c, r, c, r, tc, tr)
    assert torch.allclose(terms, torch.full((5,), at_zero, dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", PAIR_LOSS_TYPES)
def test_a_window_of_pairs_is_the_sum_of_its_micro_batches_terms(kind):
    """Each pair's term reads only that pair: the window's loss (sum over its 7 pairs / 7) is the same from one
    micro-batch of 7 or from micro-batches of 4, 2 and 1 pairs (bit for bit: the terms are identical), and
    TRL's mean of micro-batch means is not (it weights the 1-pair micro-batch's pair 4x the others)."""
    c, r, rc, rr, tc, tr = logps(7, seed=3)
    loss = PreferenceLoss(kind, beta=0.2, label_smoothing=smoothing(kind))
    whole = loss(c, r, rc, rr, tc, tr)
    parts = [loss(c[a:b], r[a:b], rc[a:b], rr[a:b], tc[a:b], tr[a:b]) for a, b in ((0, 4), (4, 6), (6, 7))]
    assert torch.equal(torch.cat(parts), whole)
    mean_of_means = sum(p.mean() for p in parts) / 3
    assert not math.isclose(float(mean_of_means), float(whole.mean()), rel_tol=1e-6)


def test_the_sigmoid_gradient_is_dpos():
    """d/d(policy chosen log-prob) of -log sigmoid(beta delta) is -beta sigmoid(-beta delta) (DPO, eq. 7's
    gradient), and the rejected side's is its negative."""
    c, r, rc, rr, _, _ = logps(4, seed=5)
    c, r = c.clone().requires_grad_(), r.clone().requires_grad_()
    PreferenceLoss("sigmoid", beta=0.3)(c, r, rc, rr).sum().backward()
    delta = (c - rc) - (r - rr)
    assert torch.allclose(c.grad, -0.3 * torch.sigmoid(-0.3 * delta.detach()), rtol=1e-12)
    assert torch.allclose(r.grad, -c.grad, rtol=1e-12)


def test_the_metric_sums_are_trls_metrics_times_the_pairs():
    """Summed over the pairs, TRL's per-pair metrics (rewards beta x log-ratio, accuracy chosen > rejected,
    margin, log-probabilities); 7 pairs in micro-batches of 4 and 3 add up to the window's."""
    c, r, rc, rr, _, _ = logps(7, seed=7)
    whole = pair_metric_sums(0.1, c, r, rc, rr)
    parts = [pair_metric_sums(0.1, c[a:b], r[a:b], rc[a:b], rr[a:b]) for a, b in ((0, 4), (4, 7))]
    assert list(whole) == list(PAIR_METRICS)
    for name in PAIR_METRICS:
        assert whole[name] == pytest.approx(parts[0][name] + parts[1][name], rel=1e-12)
    chosen, rejected = 0.1 * (c - rc), 0.1 * (r - rr)
    assert whole["rewards/accuracies"] == float((chosen > rejected).sum())
    assert whole["rewards/margins"] == pytest.approx(float((chosen - rejected).sum()), rel=1e-12)


@pytest.mark.parametrize("kind", sorted(BATCH_COUPLED))
def test_batch_coupled_losses_are_refused_with_one_line(kind):
    with pytest.raises(FinetuneError) as caught:
        check_loss_type(kind, beta=0.1)
    message = str(caught.value)
    assert message.startswith(f"--loss_type {kind} cannot accumulate exactly") and "\n" not in message
    assert "sigmoid" in message  # the fix names the per-pair types


@pytest.mark.parametrize("args,needle", [(("nope", 0.1, 0.0), "unknown --loss_type 'nope'"),
                                         (("sigmoid", 0.0, 0.0), "--beta must be positive"),
                                         (("robust", 0.1, 0.5), "[0, 0.5) for --loss_type robust"),
                                         (("exo_pair", 0.1, 0.0), "exo_pair needs --label_smoothing"),
                                         (("sigmoid", 0.1, 0.1), "does not use --label_smoothing")])
def test_bad_settings_are_refused(args, needle):
    with pytest.raises(FinetuneError, match=None) as caught:
        PreferenceLoss(*args)
    assert needle in str(caught.value)


def test_per_token_types_need_the_token_counts():
    c, r, rc, rr, _, _ = logps(2)
    with pytest.raises(ValueError, match="averages per token"):
        PreferenceLoss("ipo")(c, r, rc, rr)
