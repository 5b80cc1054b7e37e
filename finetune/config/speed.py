"""The speed section: precision, compilation and activation checkpointing, the levers that change how fast a step
runs and how much memory it takes, never which samples it trains on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from finetune.config.flags import flag
from finetune.errors import FinetuneError

MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16")
# The precision this project is defined by: Accelerator(mixed_precision="fp16"), loss scaling included.
DEFAULT_MIXED_PRECISION = "fp16"


def is_bf16(mixed_precision: str) -> bool:
    """``--mixed_precision`` as ``TrainingArguments(bf16=...)``."""
    return mixed_precision == "bf16"


@dataclass
class SpeedArguments:
    """Mixed precision, ``torch.compile``, activation checkpointing."""

    # Trainer's fp16 is asked for on CUDA only, in backends.trainer.training_arguments (a CPU runs fp32)
    mixed_precision: Literal["no", "fp16", "bf16"] | None = flag(
        None,
        "Autocast precision; fp16 uses loss scaling (on a CPU it does not run: fp32). "
        "Default: the accelerate config's or launcher's fp16/bf16, else fp16.",
        step=False, trainer="bf16", to_trainer=is_bf16,
    )
    torch_compile: bool = flag(
        False, "Compile the model with torch.compile (inductor) through Accelerate's dynamo plugin.",
        step=False, trainer="torch_compile",
    )
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune"] | None = flag(
        None, "torch.compile mode (implies --torch_compile).",
        step=False, trainer="torch_compile_mode",
    )
    activation_checkpointing: bool = flag(
        False,
        "Recompute each layer's activations in the backward pass instead of keeping "
        "them (less memory, about one more forward of time); non-reentrant.",
        step=False, trainer=None,
    )
    gradient_checkpointing: bool | None = flag(
        None, "Deprecated alias of --activation_checkpointing (as in TrainingArguments).",
        step=False, trainer=None,
    )
    activation_checkpointing_kwargs: str | None = flag(
        None,
        "JSON object, as TrainingArguments takes it: \"every_n_layers\" (checkpoint "
        "only every n-th layer: less recompute, more memory) and \"offload\" (saved "
        "activations in host memory) for activation_checkpointing_enable, the other "
        "keys for torch.utils.checkpoint (default {\"use_reentrant\": false}).",
        step=False, trainer=None,
    )

    def _resolve_speed(self) -> None:
        """The deprecated ``--gradient_checkpointing`` folded into ``--activation_checkpointing``; a compile mode
        implies compilation."""
        if self.gradient_checkpointing is not None:  # the deprecated alias, folded into the new name once
            self.activation_checkpointing = self.activation_checkpointing or self.gradient_checkpointing
            self.gradient_checkpointing = None
        if self.torch_compile_mode is not None:
            self.torch_compile = True  # as TrainingArguments: a mode implies compilation

    def _check_precision(self) -> None:
        """``--mixed_precision`` is one of ``MIXED_PRECISION_CHOICES``."""
        if self.mixed_precision not in MIXED_PRECISION_CHOICES:
            raise FinetuneError(
                f"--mixed_precision must be one of {', '.join(MIXED_PRECISION_CHOICES)}, got {self.mixed_precision!r}."
            )

    def _check_activation_checkpointing(self) -> None:
        """``--activation_checkpointing_kwargs``: a JSON object whose ``every_n_layers`` and ``offload`` are usable."""
        if self.activation_checkpointing_kwargs is not None:
            try:
                kwargs = json.loads(self.activation_checkpointing_kwargs)
                if not isinstance(kwargs, dict):
                    raise ValueError("not an object")
            except ValueError as err:
                raise FinetuneError(f"--activation_checkpointing_kwargs must be a JSON object such as "
                                    f"'{{\"use_reentrant\": false}}', got {self.activation_checkpointing_kwargs!r} "
                                    f"({err}).") from None
            every = kwargs.get("every_n_layers", 1)
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise FinetuneError(f"--activation_checkpointing_kwargs: \"every_n_layers\" must be a positive "
                                    f"integer (1 checkpoints every layer), got {every!r}.")
            if not isinstance(kwargs.get("offload", False), bool):
                raise FinetuneError(f"--activation_checkpointing_kwargs: \"offload\" must be true or false, got "
                                    f"{kwargs['offload']!r}.")
