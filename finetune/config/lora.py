"""The LoRA section: training adapters (peft) instead of every weight, the LoRA family's variants (DoRA, rsLoRA,
peft's initialisations), a quantized base under them (QLoRA: bitsandbytes' 4-bit or 8-bit weights), and the merged
copy (TRL's ``ModelConfig`` names)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Literal

from finetune.config.flags import flag
from finetune.errors import FinetuneError


@dataclass
class LoraArguments:
    """``--use_peft`` and LoRA's rank, alpha, dropout and target modules; ``--merge_adapter``."""

    use_peft: bool = flag(
        False,
        "Train LoRA adapters (peft) instead of every weight: the base model stays "
        "frozen (no gradients, no optimizer state); a classifier head stays trainable.",
        step=True, trainer=None,
    )
    lora_r: int = flag(
        16, "LoRA rank (TRL's default).",
        step=True, trainer=None,
    )
    lora_alpha: int = flag(
        32, "LoRA alpha: the update is scaled by alpha / r.",
        step=True, trainer=None,
    )
    lora_dropout: float = flag(
        0.05, "Dropout on the LoRA branch.",
        step=True, trainer=None, verify=0.0,
    )
    lora_target_modules: str | None = flag(
        None,
        "Comma-separated module names to adapt, or 'all-linear' (default: peft's "
        "choice for the architecture, e.g. the attention projections).",
        step=True, trainer=None,
    )
    use_dora: bool = flag(
        False, "DoRA (peft's use_dora): the update split into a trained magnitude per output and LoRA's direction.",
        step=True, trainer=None,
    )
    use_rslora: bool = flag(
        False, "Rank-stabilized LoRA (peft's use_rslora): the update is scaled by alpha / sqrt(r), not alpha / r.",
        step=True, trainer=None,
    )
    lora_modules_to_save: str | None = flag(
        None, "Comma-separated module names trained in full beside the adapters and saved with them (peft's "
        "modules_to_save), e.g. 'lm_head'. A classifier's new head is one already.",
        step=True, trainer=None,
    )
    init_lora_weights: str = flag(
        "true", "How the adapters start (peft's init_lora_weights): 'true' (B = 0: the model starts unchanged), "
        "'gaussian', 'pissa', 'pissa_niter_N', 'olora', 'orthogonal', or 'false' (random B: the model starts "
        "changed).",
        step=True, trainer=None,
    )
    load_in_4bit: bool = flag(
        False, "QLoRA: the frozen base in 4-bit (bitsandbytes; --bnb_4bit_quant_type), the adapters in the compute "
        "dtype. Only with --use_peft. Needs the qlora extra.",
        step=True, trainer=None,
    )
    load_in_8bit: bool = flag(
        False, "The frozen base in 8-bit (bitsandbytes' LLM.int8()). Only with --use_peft. Needs the qlora extra.",
        step=True, trainer=None,
    )
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = flag(
        "nf4", "With --load_in_4bit: the 4-bit data type, NormalFloat4 (QLoRA's) or FP4.",
        step=True, trainer=None,
    )
    use_bnb_nested_quant: bool = flag(
        False, "With --load_in_4bit: quantize the quantization constants too (QLoRA's double quantization, "
        "~0.4 bit per weight less).",
        step=True, trainer=None,
    )
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] | None = flag(
        None, "With --load_in_4bit: the dtype a 4-bit layer de-quantizes to and multiplies in. Default: the precision "
        "the run runs in (no -> float32, bf16 -> bfloat16, fp16 -> float16; an fp16 request that runs fp32 on a CPU "
        "computes in float32).",
        step=True, trainer=None,
    )
    bnb_4bit_quant_storage: Literal["uint8", "float16", "bfloat16", "float32"] | None = flag(
        None, "With --load_in_4bit: the dtype the packed 4-bit weights are stored as (the same bytes; a sharding "
        "engine needs it to match the other weights). Default: uint8.",
        step=False, trainer=None,
    )
    merge_adapter: bool = flag(
        False,
        "With --use_peft: also write the base model with the adapter merged in, to "
        "<output_dir>/merged (a plain model directory).",
        step=False, trainer=None,
    )

    def _check_peft(self) -> None:
        """LoRA's settings and the merged copy."""
        if self.use_peft and (self.lora_r < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1):
            raise FinetuneError(f"LoRA needs --lora_r >= 1, --lora_alpha > 0 and --lora_dropout in [0, 1), got r="
                                f"{self.lora_r}, alpha={self.lora_alpha}, dropout={self.lora_dropout}.")
        if self.merge_adapter and not self.use_peft:
            raise FinetuneError("--merge_adapter needs --use_peft (there is no adapter to merge otherwise).")
        asked = [name for name, on in (("use_dora", self.use_dora), ("use_rslora", self.use_rslora),
                                       ("lora_modules_to_save", self.lora_modules_to_save),
                                       ("init_lora_weights", self.init_lora_weights != "true"),
                                       ("load_in_4bit", self.load_in_4bit), ("load_in_8bit", self.load_in_8bit)) if on]
        if asked and not self.use_peft:
            raise FinetuneError(f"--{asked[0]} is a LoRA setting: add --use_peft (a quantized base is frozen, so it "
                                "trains only under adapters), or drop it.")
        init_lora_value(self.init_lora_weights)
        self._check_quantization()

    def _check_quantization(self) -> None:
        """The quantized base's flags: one of 4-bit and 8-bit, the 4-bit options only with 4-bit, bitsandbytes
        installed."""
        if self.load_in_4bit and self.load_in_8bit:
            raise FinetuneError("--load_in_4bit and --load_in_8bit together: choose one (4-bit for QLoRA).")
        four_bit = [name for name, on in (("use_bnb_nested_quant", self.use_bnb_nested_quant),
                                          ("bnb_4bit_compute_dtype", self.bnb_4bit_compute_dtype),
                                          ("bnb_4bit_quant_storage", self.bnb_4bit_quant_storage),
                                          ("bnb_4bit_quant_type", self.bnb_4bit_quant_type != "nf4")) if on]
        if four_bit and not self.load_in_4bit:
            raise FinetuneError(f"--{four_bit[0]} applies to a 4-bit base: add --load_in_4bit, or drop it.")
        if self.load_in_8bit and self.use_dora:  # peft 0.21 get_weight_norm -> bitsandbytes 0.50.2 MatMul8bitFp
            raise FinetuneError("--use_dora on an 8-bit base fails inside peft and bitsandbytes (the int8 layer's "
                                "scales are not set up for DoRA's weight norm). Use --load_in_4bit with --use_dora, or "
                                "drop --use_dora.")
        if (self.load_in_4bit or self.load_in_8bit) and self.merge_adapter:
            raise FinetuneError("--merge_adapter with a quantized base: merging into 4-bit or 8-bit weights rounds the "
                                "adapter away. Drop --merge_adapter (the adapter is saved) and run finetune export, which "
                                "merges it into the de-quantized base.")
        if self.load_in_4bit or self.load_in_8bit:
            require_bitsandbytes("--load_in_4bit" if self.load_in_4bit else "--load_in_8bit")


INIT_LORA_NAMES = ("true", "false", "gaussian", "pissa", "olora", "orthogonal")
_PISSA_NITER = re.compile(r"^pissa_niter_([1-9][0-9]*)$")


def init_lora_value(name: str) -> bool | str:
    """peft's ``init_lora_weights`` for the flag's value ``name``: True/False for "true"/"false", else the name
    (``INIT_LORA_NAMES``, or "pissa_niter_N": PiSSA by N subspace iterations). Raises ``FinetuneError`` for any
    other name, and for peft's initialisations that need a config of their own (eva, corda, loftq)."""
    if name in ("eva", "corda", "loftq"):
        raise FinetuneError(f"--init_lora_weights {name}: peft's {name} needs a config of its own ({name}_config), "
                            "which finetune does not build. Use one of " + ", ".join(INIT_LORA_NAMES)
                            + ", pissa_niter_N.")
    if name not in INIT_LORA_NAMES and not _PISSA_NITER.match(name):
        raise FinetuneError(f"--init_lora_weights {name!r} is not one of peft's: " + ", ".join(INIT_LORA_NAMES)
                            + ", pissa_niter_N (N >= 1).")
    return {"true": True, "false": False}.get(name, name)


def require_bitsandbytes(flag_name: str) -> None:
    """Raise ``FinetuneError`` naming the ``qlora`` extra when the ``bitsandbytes`` package is not installed
    (``flag_name``: the flag that needs it)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise FinetuneError(f"{flag_name} needs the bitsandbytes package, which is not installed: "
                            'pip install -e ".[qlora]" in the clone (or pip install bitsandbytes).')
