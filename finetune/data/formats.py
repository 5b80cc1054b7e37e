"""TRL's dataset formats as rows arrive: ShareGPT's ``conversations`` converted to ChatML ``messages`` as TRL 1.16's
``maybe_convert_to_chatml`` does, and what a row passes to the chat template beside its messages (``tools``,
``chat_template_kwargs``). Plain dicts and ``datasets.Dataset``s; no tokenizer."""

from __future__ import annotations

import json

# TRL's keys that may hold message lists (trl 1.16 data_utils.py, maybe_convert_to_chatml)
_MESSAGE_KEYS = ("prompt", "completion", "chosen", "rejected", "messages", "conversations")


def to_chatml(row: dict) -> dict:
    """A row in ShareGPT's form (``conversations`` of ``from``/``value`` messages) as TRL 1.16's
    ``maybe_convert_to_chatml`` converts it (trl/data_utils.py): in every message list, ``from`` becomes ``role`` and
    ``value`` becomes ``content``; ``conversations`` becomes ``messages``. Role names are kept as they are (TRL does
    not map ``human``/``gpt``). A new dict; other keys unchanged."""
    out = dict(row)
    for key in _MESSAGE_KEYS:
        if isinstance(out.get(key), list):
            out[key] = [{("role" if k == "from" else "content" if k == "value" else k): v for k, v in m.items()}
                        if isinstance(m, dict) else m for m in out[key]]
    if "conversations" in out:
        out["messages"] = out.pop("conversations")
    return out


def needs_chatml(ds) -> bool:
    """Whether a ``datasets.Dataset``'s rows are in ShareGPT's form (a ``conversations`` column, or messages with
    ``from``/``value`` keys in a message column), as ``to_chatml`` converts them."""
    if "conversations" in ds.column_names:
        return True
    for key in _MESSAGE_KEYS:
        feature = ds.features.get(key)
        inner = getattr(feature, "feature", None)  # a list of structs: datasets' List(feature=dict)
        if isinstance(inner, dict) and ("from" in inner or "value" in inner):
            return True
    return False


def chatml_dataset(ds):
    """``ds`` with every row through ``to_chatml`` where it needs it (``needs_chatml``), else ``ds`` itself."""
    if not needs_chatml(ds):
        return ds
    return ds.map(to_chatml, remove_columns=[c for c in ("conversations",) if c in ds.column_names],
                  desc="ShareGPT to ChatML")


def template_kwargs(row: dict) -> dict:
    """What a row passes to ``apply_chat_template`` beside its messages, as TRL 1.16's SFTTrainer does: its
    ``tools`` (function schemas) and its ``chat_template_kwargs`` (a dict), where present and not None."""
    kwargs = dict(row.get("chat_template_kwargs") or {})
    tools = row.get("tools")
    if tools is not None:  # a JSON string is parsed, as TRL 1.16 does (trainer/sft_trainer.py, tokenize_fn)
        kwargs["tools"] = json.loads(tools) if isinstance(tools, str) else tools
    return kwargs
