"""The preference section: the flags only a preference-tuning recipe (``TASK = "preference"``, e.g.
``bbc-headlines-dpo``) reads, with TRL 1.16 ``DPOConfig``'s names and defaults: ``beta``, ``loss_type``,
``label_smoothing``, ``precompute_ref_log_probs``."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.config.flags import flag


@dataclass
class PreferenceArguments:
    """DPO and its per-pair relatives (``finetune.tasks.preference``)."""

    beta: float = flag(
        0.1,
        "Preference tuning (DPOConfig's name and default): the pull towards the reference model; the implicit "
        "reward of a response is beta x (its policy log-probability - its reference log-probability).",
        step=True, trainer=None,
    )
    loss_type: str = flag(
        "sigmoid",
        "Preference tuning (DPOConfig's names): the per-pair loss, one of sigmoid (DPO), hinge, ipo, robust, "
        "exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, discopop, sigmoid_norm. TRL's aot, "
        "aot_unpaired and sft couple the pairs of a micro-batch and are refused: they cannot accumulate exactly.",
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
        """The loss type, beta and label smoothing (``preference_loss.check_loss_type``)."""
        from finetune.tasks.preference_loss import check_loss_type  # torch: the config stays light to import

        check_loss_type(self.loss_type, self.beta, self.label_smoothing)
