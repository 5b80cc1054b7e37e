"""The model section: which model the recipe builds on, and how it computes attention (TRL's ``ModelConfig``
names)."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.config.flags import flag


@dataclass
class ModelArguments:
    """The base model and its attention implementation."""

    model_name_or_path: str | None = flag(
        None, "Hub id or local model directory. Default: the recipe's model.",
        step=True, trainer=None,
    )
    attn_implementation: str | None = flag(
        None, "The model's attention implementation (TRL's ModelConfig name; transformers' attn_implementation): "
        "'sdpa', 'eager', 'flash_attention_2', 'flex_attention', ... Default: transformers' choice (sdpa where "
        "torch has it).",
        step=False, trainer=None,
    )
