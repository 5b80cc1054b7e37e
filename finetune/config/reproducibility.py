"""The reproducibility section: the seed, and dropout off for runs that must compare number for number."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.config.flags import flag


@dataclass
class ReproducibilityArguments:
    """``--seed`` and ``--disable_dropout``."""

    seed: int = flag(
        42, "Seed for initialisation, data order and dropout.",
        step=True, trainer=("seed", "data_seed"),
    )
    disable_dropout: bool = flag(
        False, "Set every dropout probability to 0 (deterministic, comparable runs).",
        step=False, trainer=None, verify=True,
    )
