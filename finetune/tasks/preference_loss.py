"""Preference (DPO-family) losses as per-pair terms, so that a window's loss is their sum over its pairs divided
by the window's pairs, whatever the micro-batches.

The formulas are TRL 1.16's ``DPOTrainer._compute_loss`` (``trl/trainer/dpo_trainer.py``, the ``loss_type``
branches) with its names; TRL then takes each micro-batch's *mean* over pairs, which is exact only when every
micro-batch holds as many pairs. Here the per-pair terms are returned unreduced and the caller sums them.
Loss types whose term for one pair depends on the other pairs of its micro-batch are refused
(``check_loss_type``). Style model: torchtune's ``DPOLoss`` (a small component taking the four log-probabilities).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from finetune.config.preference import (  # noqa: F401 - the loss types live with their flags (the config floor)
    BATCH_COUPLED,
    CONSTANT_ON_TIES,
    PAIR_LOSS_TYPES,
    SMOOTHED,
    check_loss_type,
)


@dataclass(frozen=True)
class PreferenceLoss:
    """A DPO-family loss per pair. ``beta``: the pull towards the reference (TRL's and DPO's beta);
    ``label_smoothing``: the assumed share of flipped labels ("robust"; EXO's epsilon); ``discopop_tau``: DiscoPOP's
    temperature (TRL's default 0.05)."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05

    def __post_init__(self):
        check_loss_type(self.loss_type, self.beta, self.label_smoothing)

    def __call__(self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
                 ref_rejected_logps: torch.Tensor, chosen_tokens: torch.Tensor | None = None,
                 rejected_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Per-pair loss terms, shape (pairs,), unreduced. Inputs, shape (pairs,): each side's completion
        log-probability summed over its trained tokens (nats), the policy's and the reference's;
        ``chosen_tokens``/``rejected_tokens``: each side's trained tokens (counts), needed by "ipo" and
        "sigmoid_norm" (which average per token, as TRL 1.16 does). Raises ``ValueError`` where those are missing."""
        chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
        delta = chosen_ratio - rejected_ratio
        if self.loss_type in ("ipo", "sigmoid_norm"):
            if chosen_tokens is None or rejected_tokens is None:
                raise ValueError(f"loss_type {self.loss_type} averages per token: pass chosen_tokens and rejected_tokens")
            delta = chosen_ratio / chosen_tokens.clamp(min=1.0) - rejected_ratio / rejected_tokens.clamp(min=1.0)
        return _TERMS[self.loss_type](delta, chosen_ratio, rejected_ratio, self)


def _exo(d, c, r, k):  # EXO (Ji et al. 2024, eq. 16): KL to the target distribution [1 - eps, eps]
    x = k.beta * d
    return (torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-k.label_smoothing))
            + torch.sigmoid(-x) * (F.logsigmoid(-x) - math.log(k.label_smoothing)))


def _discopop(d, c, r, k):  # DiscoPOP (Lu et al. 2024, eq. 5)
    x = k.beta * d
    mix = torch.sigmoid(x / k.discopop_tau)
    return -F.logsigmoid(x) * (1 - mix) + torch.exp(-x) * mix


# (delta, chosen log-ratio, rejected log-ratio, the loss) -> per-pair terms; delta per token for ipo, sigmoid_norm
_TERMS = {
    "sigmoid": lambda d, c, r, k: -F.logsigmoid(k.beta * d),  # DPO (Rafailov et al. 2023, eq. 7)
    "sigmoid_norm": lambda d, c, r, k: -F.logsigmoid(k.beta * d),
    "hinge": lambda d, c, r, k: torch.relu(1 - k.beta * d),  # SLiC (Zhao et al. 2023)
    "ipo": lambda d, c, r, k: (d - 1 / (2 * k.beta)) ** 2,  # IPO (Azar et al. 2023, eq. 17)
    "robust": lambda d, c, r, k: ((-(1 - k.label_smoothing) * F.logsigmoid(k.beta * d)  # rDPO (Chowdhury et al. 2024)
                                   + k.label_smoothing * F.logsigmoid(-k.beta * d)) / (1 - 2 * k.label_smoothing)),
    "exo_pair": _exo,
    "nca_pair": lambda d, c, r, k: (-F.logsigmoid(k.beta * c) - 0.5 * F.logsigmoid(-k.beta * c)  # NCA (Chen 2024)
                                    - 0.5 * F.logsigmoid(-k.beta * r)),
    "bco_pair": lambda d, c, r, k: -F.logsigmoid(k.beta * c) - F.logsigmoid(-k.beta * r),
    "sppo_hard": lambda d, c, r, k: (c - 0.5 / k.beta) ** 2 + (r + 0.5 / k.beta) ** 2,  # SPPO (Wu et al. 2024)
    "apo_zero": lambda d, c, r, k: 1 - torch.sigmoid(k.beta * c) + torch.sigmoid(k.beta * r),  # APO, eq. 7
    "apo_down": lambda d, c, r, k: torch.sigmoid(k.beta * c) + 1 - torch.sigmoid(k.beta * d),  # APO, eq. 8
    "discopop": _discopop,
}


PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")


def pair_metric_vector(beta: float, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                       ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor) -> torch.Tensor:
    """The sums over a micro-batch's pairs of TRL's per-pair metrics (``PAIR_METRICS``: the implicit rewards
    beta x (policy - reference log-probability) of each side, whether chosen's reward is the larger, the margin,
    and each side's summed log-probability in nats), as one (6,) float64 tensor without gradients (no sync: the loop
    adds it up over the window and reduces it once). Divided by the window's pairs over every process they give the
    window's means, not a mean of micro-batch means. Inputs: shape (pairs,)."""
    chosen = beta * (chosen_logps - ref_chosen_logps).detach().double()
    rejected = beta * (rejected_logps - ref_rejected_logps).detach().double()
    values = (chosen, rejected, (chosen > rejected).double(), chosen - rejected, chosen_logps.detach().double(),
              rejected_logps.detach().double())
    return torch.stack([v.sum() for v in values])


def pair_metric_sums(beta: float, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                     ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor) -> dict[str, float]:
    """``pair_metric_vector`` as {``PAIR_METRICS`` name: sum}."""
    vector = pair_metric_vector(beta, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    return dict(zip(PAIR_METRICS, vector.tolist()))
