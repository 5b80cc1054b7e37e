"""The preference section: the flags only a preference-tuning recipe (``TASK = "preference"``, e.g.
``bbc-headlines-dpo``) reads, with TRL 1.16 ``DPOConfig``'s names and defaults: ``beta``, ``loss_type``,
``label_smoothing``, ``precompute_ref_log_probs``."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.config.flags import flag
from finetune.config.grpo import GRPO_LOSS_TYPES
from finetune.errors import FinetuneError

# per-pair terms: a pair's loss reads only that pair's log-probabilities (and token counts)
PAIR_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
                   "apo_down", "discopop", "sigmoid_norm")
# TRL's other loss types, and why a pair's term is not its own
BATCH_COUPLED = {
    "aot": "it sorts the log-ratios across the micro-batch, so a pair's term depends on the other pairs",
    "aot_unpaired": "it sorts the log-ratios across the micro-batch, so a pair's term depends on the other pairs",
    "sft": "it is a mean over the micro-batch's chosen tokens, not a term per pair",
}
SMOOTHED = ("robust", "exo_pair")  # the per-pair types that read label_smoothing
# the per-pair types whose term is a constant for a pair with identical sides (chosen log-ratio = rejected's): the
# margin types, and apo_zero (1 - sigmoid(x) + sigmoid(x)); such a pair's gradient is 0. The others read each side's
# log-ratio alone, so an identical pair still moves the policy (nca_pair, bco_pair, sppo_hard: towards the
# reference; apo_down: both sides down).
CONSTANT_ON_TIES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "robust", "exo_pair", "discopop", "apo_zero")


def check_loss_type(loss_type: str, beta: float, label_smoothing: float = 0.0) -> None:  # noqa: C901 - one check a line
    """Refuse what cannot be a sum of per-pair terms, or is undefined: raises ``FinetuneError`` with one line
    naming the problem and the fix (a batch-coupled or unknown ``loss_type``; ``beta`` <= 0; ``label_smoothing``
    outside [0, 0.5) for "robust", outside (0, 1) for "exo_pair" (log of 0), or set for a type that ignores it)."""
    if loss_type in BATCH_COUPLED:
        raise FinetuneError(f"--loss_type {loss_type} cannot accumulate exactly: {BATCH_COUPLED[loss_type]}. "
                            f"Use one of {', '.join(PAIR_LOSS_TYPES)}.")
    if loss_type in GRPO_LOSS_TYPES:
        raise FinetuneError(f"--loss_type {loss_type} is a GRPO aggregation (--recipe grpo); preference tuning takes "
                            f"one of {', '.join(PAIR_LOSS_TYPES)}.")
    if loss_type not in PAIR_LOSS_TYPES:
        raise FinetuneError(f"unknown --loss_type {loss_type!r}: use one of {', '.join(PAIR_LOSS_TYPES)}.")
    if not beta > 0:
        raise FinetuneError(f"--beta must be positive (the strength of the pull towards the reference), got {beta}.")
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise FinetuneError(f"--label_smoothing must lie in [0, 0.5) for --loss_type robust, got {label_smoothing}.")
    if loss_type == "exo_pair" and not 0.0 < label_smoothing < 1.0:
        raise FinetuneError(f"--loss_type exo_pair needs --label_smoothing in (0, 1) (its target distribution's "
                            f"epsilon; 1e-3 is usual), got {label_smoothing}.")
    if label_smoothing and loss_type not in SMOOTHED:
        raise FinetuneError(f"--loss_type {loss_type} does not use --label_smoothing (TRL 1.16's neither): leave it "
                            f"at 0, or use --loss_type robust or exo_pair, got {label_smoothing}.")


@dataclass
class PreferenceArguments:
    """DPO and its per-pair relatives (``finetune.tasks.preference``)."""

    beta: float = flag(
        0.1,
        "Preference tuning (DPOConfig's name and default): the pull towards the reference model; the implicit "
        "reward of a response is beta x (its policy log-probability - its reference log-probability). GRPO: the "
        "per-token KL penalty's weight (GRPOConfig's default 0.0 under --recipe grpo: no reference).",
        step=True, trainer=None,
    )
    loss_type: str = flag(
        "sigmoid",
        "Preference tuning (DPOConfig's names): the per-pair loss, one of sigmoid (DPO), hinge, ipo, robust, "
        "exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, discopop, sigmoid_norm. TRL's aot, "
        "aot_unpaired and sft couple the pairs of a micro-batch and are refused: they cannot accumulate exactly. "
        "GRPO (GRPOConfig's names): dapo (default of --recipe grpo), dr_grpo, grpo, bnpo.",
        step=True, trainer=None,
    )
    label_smoothing: float = flag(
        0.0,
        "Preference tuning, --loss_type robust or exo_pair only (DPOConfig's name): the assumed share of pairs "
        "whose preference is flipped.",
        step=True, trainer=None,
    )
    precompute_ref_log_probs: bool = flag(
        False,
        "Preference tuning (DPOConfig's name): compute the reference model's log-probabilities of every pair "
        "once, before training, and keep them in <output_dir>/reference_logps (keyed by model and data, reused on "
        "resume); no reference forward, and no reference copy in memory, while training.",
        step=True, trainer=None,
    )

    def _check_preference(self) -> None:
        """The loss type, beta and label smoothing (``check_loss_type``); a GRPO aggregation (``GRPO_LOSS_TYPES``)
        is the GRPO task's to check (``tasks.grpo``), with ``beta`` >= 0 (0: no reference)."""
        if self.loss_type in GRPO_LOSS_TYPES:
            if not self.beta >= 0 or self.label_smoothing:
                raise FinetuneError(f"--loss_type {self.loss_type} (GRPO) takes --beta >= 0 (the KL penalty's weight) "
                                    f"and no --label_smoothing, got beta {self.beta}, label_smoothing "
                                    f"{self.label_smoothing}.")
            return
        check_loss_type(self.loss_type, self.beta, self.label_smoothing)
