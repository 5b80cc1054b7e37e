"""Models and tokenizers: hub ids, local directories and GGUF files, with fast, clear failures when the hub is
out of reach (``finetune.data.loading.require_hub``). See docs/recipes.md#hold-out-blocks-and-the-hub-check."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from finetune.data.loading import require_hub
from finetune.errors import FinetuneError
from finetune.models.dropout import disable_dropout as disable_dropout_in_model
from finetune.models.dropout import zero_config_dropout
from finetune.models.gguf import load_gguf_causal_lm, load_gguf_tokenizer
from finetune.models.quantization import load_kwargs, off_the_checkpoint, quantize_built


def _from_pretrained(loader, name_or_path: str, **kwargs):
    """``loader.from_pretrained`` with clear errors: a local path must be a model directory; a hub id is
    taken from the local cache if there, else needs the hub (checked fast)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        # a LoRA run's adapter directory holds its tokenizer (lora.save_adapter), not the model's config
        adapter_tokenizer = loader is AutoTokenizer and (path / "adapter_config.json").is_file()
        if not (path / "config.json").is_file() and not adapter_tokenizer:
            raise FinetuneError(
                f"--model_name_or_path {name_or_path!r} is not a Hugging Face model directory (no config.json). "
                "Point it at a directory written by save_pretrained, or at a hub id."
            )
        return loader.from_pretrained(str(path), **kwargs)
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise FinetuneError(f"--model_name_or_path {name_or_path!r}: no such directory.")
    try:
        return loader.from_pretrained(name_or_path, local_files_only=True, **kwargs)
    except OSError:
        pass
    require_hub(
        f"model {name_or_path!r}",
        "download it elsewhere (e.g. `hf download " + name_or_path + " --local-dir DIR`) and pass "
        "--model_name_or_path DIR",
    )
    try:
        return loader.from_pretrained(name_or_path, **kwargs)
    except OSError as err:
        raise FinetuneError(f"--model_name_or_path {name_or_path!r} could not be loaded: {err}") from None


def load_tokenizer(name_or_path: str):
    """The ``AutoTokenizer`` of a hub id, a model directory or a ``.gguf`` file; without a pad token it pads
    with eos. Errors as ``_from_pretrained``."""
    if name_or_path.endswith(".gguf"):
        tokenizer = load_gguf_tokenizer(name_or_path)
    else:
        tokenizer = _from_pretrained(AutoTokenizer, name_or_path)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(name_or_path: str, disable_dropout: bool = False, attn_implementation: str | None = None,
                   quantization=None):
    """``AutoModelForCausalLM`` from a hub id, a model directory, or a ``.gguf`` file (de-quantized to
    fp32 by transformers through the ``gguf`` package); ``quantization``: a ``BitsAndBytesConfig`` (a quantized
    base, ``quantization.bnb_config``; a GGUF file is de-quantized first, then quantized by it) or None; ``disable_dropout`` sets every dropout probability of its
    config to 0 before it is built (``finetune.models.dropout.zero_config_dropout``; ``build_model`` then turns off the
    built model's dropout, ``finetune.models.dropout.disable_dropout``); ``attn_implementation``: set on the loaded model
    (``set_attention``; None: transformers' default). Errors as ``_from_pretrained`` and ``set_attention``; a
    ``.gguf`` path that does not exist names the command that fetches the default one."""
    if name_or_path.endswith(".gguf"):
        if quantization is None:
            model, _ = load_gguf_causal_lm(name_or_path)
        else:  # the fp32 model only lives until it is saved for the quantized load
            model = quantize_built(lambda: load_gguf_causal_lm(name_or_path)[0], quantization)
        if disable_dropout:
            disable_dropout_in_model(model)  # built already: its modules, attributes and config
        return set_attention(model, attn_implementation)
    config = _from_pretrained(AutoConfig, name_or_path)
    if disable_dropout:
        zero_config_dropout(config)
    model = _from_pretrained(AutoModelForCausalLM, name_or_path, config=config, **load_kwargs(quantization))
    return set_attention(off_the_checkpoint(model, quantization), attn_implementation)


def set_attention(model, attn_implementation: str | None):
    """``model`` with its attention implementation set to ``attn_implementation`` (None: left as loaded), through
    transformers' ``PreTrainedModel.set_attn_implementation``, which checks the name as ``from_pretrained`` does
    (transformers 5.24 ``modeling_utils.py``: ``ValueError`` for an unknown name or one the model does not support,
    line 1872; ``ImportError`` for a kernel that is not installed, line 1558). Raises ``FinetuneError`` (one line)
    for those, and for a model that cannot switch (transformers only logs a warning then, line 1993)."""
    if not attn_implementation or getattr(model.config, "_attn_implementation", None) == attn_implementation:
        return model
    try:
        model.set_attn_implementation(attn_implementation)
    except (ImportError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FinetuneError(f"--attn_implementation {attn_implementation}: transformers cannot use it for "
                            f"{type(model).__name__} here ({first}). Leave it unset for transformers' default, or "
                            "name another.") from None
    if model.config._attn_implementation != attn_implementation:
        raise FinetuneError(f"--attn_implementation {attn_implementation}: {type(model).__name__} cannot change its "
                            f"attention implementation (it stays {model.config._attn_implementation!r}). Leave the "
                            "flag unset.")
    return model


def load_classifier(name_or_path: str, label_names: list[str], disable_dropout: bool = False,
                    attn_implementation: str | None = None, quantization=None):
    """``AutoModelForSequenceClassification`` with ``len(label_names)`` named outputs (``config.id2label``);
    ``disable_dropout`` sets every dropout probability of the config to 0 (``*dropout*``, ``*_pdrop``, ...:
    ``finetune.models.dropout.zero_config_dropout``); ``attn_implementation`` and ``quantization`` as
    ``load_causal_lm``'s. Errors as
    ``_from_pretrained`` and ``set_attention``."""
    config = _from_pretrained(
        AutoConfig,
        name_or_path,
        num_labels=len(label_names),
        id2label=dict(enumerate(label_names)),
        label2id={name: i for i, name in enumerate(label_names)},
    )
    if disable_dropout:
        zero_config_dropout(config)
    model = _from_pretrained(AutoModelForSequenceClassification, name_or_path, config=config,
                             **load_kwargs(quantization))
    return set_attention(off_the_checkpoint(model, quantization), attn_implementation)


def check_max_length(max_length: int, model_config) -> None:
    """Raise ``FinetuneError`` if ``max_length`` (tokens) exceeds the model's position limit."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and max_length > limit:
        raise FinetuneError(f"--max_length {max_length} exceeds this model's position limit of {limit} tokens; "
                            f"use --max_length {limit} or less.")
