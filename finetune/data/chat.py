"""Instruction fine-tuning (SFT): TRL-format rows (https://huggingface.co/docs/trl/dataset_formats) rendered
with the chat template; labels masked as TRL 1.16's SFTTrainer masks them (``assistant_only_loss``,
``completion_only_loss``), with our own assistant masking where a template has no ``{% generation %}`` markers.
Truncation cuts only the last user turn's content, never the completion. The rules and the differences from TRL and
torchtune: docs/recipes.md#rows-labels-and-length-in-detail; why: docs/design-notes.md#completion-only-sft."""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence

import datasets
import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from finetune.data.formats import chatml_dataset, template_kwargs, to_chatml
from finetune.data.loading import IGNORE_INDEX, ROW_COLUMN
from finetune.errors import FinetuneError
from finetune.metrics import load_metric

FORMATS = ("prompt-completion", "messages")
_NO_TEMPLATE_FIX = ("use an instruction-tuned (chat) model whose tokenizer has a chat template, such as the default "
                    "SmolLM2-135M-Instruct (`python -m finetune.fetch smollm2-gguf`), or set `tokenizer.chat_template` "
                    "to a Jinja chat template before tokenizing")


def _supports_sanitizing() -> bool:
    """Whether ``apply_chat_template`` takes ``sanitize_control_tokens`` (recent transformers 5.x)."""
    return "sanitize_control_tokens" in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters


# Control tokens typed inside a message (an article quoting "<|im_end|>") are encoded as text, so only the
# template itself can open or close a turn. Older transformers lack the option and encode them as written.
_SANITIZE = {"sanitize_control_tokens": True} if _supports_sanitizing() else {}


# ----------------------------------------------------------------------------------------- rows -> turns

def _check_messages(messages, row: str, field: str) -> list[dict]:
    """``messages`` as ``{"role": str, "content": str}`` dicts (``None`` values dropped, as
    ``apply_chat_template`` does); ``FinetuneError`` naming ``row`` and ``field`` if malformed."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise FinetuneError(f"{row}: {field!r} must be a non-empty list of {{'role', 'content'}} messages, "
                            f"got {_describe(messages)}.")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise FinetuneError(f"{row}: {field}[{i}] must be a dict with 'role' and 'content', "
                                f"got {_describe(message)}.")
        message = {k: v for k, v in message.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise FinetuneError(f"{row}: {field}[{i}][{key!r}] must be a string, got {_describe(message.get(key))}"
                                    + (" (multimodal content parts are not supported)" if key == "content"
                                       and isinstance(message.get(key), list) else "") + ".")
        checked.append(message)
    return checked


def _describe(value) -> str:
    if value is None:
        return "nothing (missing or null)"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def row_format(row: dict, row_name: str = "row") -> str:
    """The TRL format of one row: ``"prompt-completion"`` (``prompt`` and ``completion`` keys) or
    ``"messages"``. Raises ``FinetuneError`` naming ``row_name`` if it has neither, or both."""
    if not isinstance(row, dict):
        raise FinetuneError(f"{row_name}: expected a dict with 'prompt' and 'completion', or 'messages'; "
                            f"got {_describe(row)}.")
    has_pc, has_messages = "prompt" in row or "completion" in row, "messages" in row
    if has_pc and has_messages:
        raise FinetuneError(f"{row_name}: has both 'messages' and 'prompt'/'completion'; keep one format per dataset.")
    if has_messages:
        return "messages"
    if has_pc:
        return "prompt-completion"
    raise FinetuneError(f"{row_name}: has neither 'prompt' + 'completion' nor 'messages' (keys: {sorted(row)}); "
                        "see https://huggingface.co/docs/trl/dataset_formats.")


def check_conversation_rows(ds) -> None:
    """Check every raw row of an instruction dataset (``row_to_conversation``) where it came from, before any
    split or shuffle: a ``FinetuneError`` names the row's file and line (``data.ROW_COLUMN``) or its index."""
    keys = [c for c in ("prompt", "completion", "messages") if c in ds.column_names]
    names = ds[ROW_COLUMN] if ROW_COLUMN in ds.column_names else [f"row {i}" for i in range(len(ds))]
    for i, row in enumerate(ds.select_columns(keys)):
        row_to_conversation({k: v for k, v in row.items() if v is not None}, names[i])


def empty_completion(row: dict) -> bool:
    """Whether an SFT row has nothing to learn but the end-of-turn token: an empty ``completion``, or an empty
    assistant message (``completion`` or ``messages`` as lists of messages). ``row_to_conversation`` refuses it;
    ``finetune check-data`` lists such rows first."""
    completion = row.get("completion")
    if isinstance(completion, str) or (completion is None and "completion" in row):
        return not (completion or "").strip()
    messages = completion if isinstance(completion, list) else row.get("messages") or []
    return any(isinstance(m, dict) and m.get("role") == "assistant" and not str(m.get("content") or "").strip()
               for m in messages)


def row_to_conversation(row: dict, row_name: str = "row") -> tuple[list[dict], list[int]]:
    """One dataset row -> ``(messages, trained)``: the conversation and the indices of the assistant
    turns to train on (the completion's turns; for ``messages``, every assistant turn). Raises
    ``FinetuneError`` naming ``row_name`` and the problem (missing field, mixed types, no or empty assistant turn)."""
    if row_format(row, row_name) == "messages":
        messages = _check_messages(row["messages"], row_name, "messages")
        trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not trained:
            raise FinetuneError(f"{row_name}: 'messages' has no assistant turn, so there is nothing to train on.")
    else:
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            prompt = [{"role": "user", "content": prompt}]
            completion = [{"role": "assistant", "content": completion}]
        elif isinstance(prompt, str) or isinstance(completion, str):
            raise FinetuneError(f"{row_name}: 'prompt' and 'completion' must both be strings or both be message lists; "
                                f"got prompt={_describe(prompt)}, completion={_describe(completion)}.")
        prompt = _check_messages(prompt, row_name, "prompt")
        completion = _check_messages(completion, row_name, "completion")
        wrong = [m["role"] for m in completion if m["role"] != "assistant"]
        if wrong:
            raise FinetuneError(f"{row_name}: 'completion' may hold only assistant turns, found role {wrong[0]!r}.")
        messages, trained = prompt + completion, list(range(len(prompt), len(prompt) + len(completion)))
    if trained[0] == 0:
        raise FinetuneError(f"{row_name}: the conversation starts with an assistant turn; put a user (or system) turn "
                            "before it.")
    empty = [i for i in trained if not messages[i]["content"].strip()]
    if empty:
        raise FinetuneError(f"{row_name}: assistant turn {empty[0]} is empty; there is nothing to learn but the "
                            "end-of-turn token. Drop the row or fill in the completion.")
    return messages, trained


def dropped_by_template(tokenizer, row: dict) -> tuple[list[str], list[str]]:
    """What the chat template leaves out of one raw row (either TRL format, ShareGPT converted): ``(turns, tools)``,
    the turns whose content (stripped) is not in the rendered text (``"turn 0 (system)"``) and the names of the row's
    tools (``tools[i]["function"]["name"]``, or ``["name"]``) that are not in it. ``([], [])`` when nothing is left
    out; ``finetune check-data`` reports such rows. Raises ``FinetuneError`` for a malformed row."""
    row = to_chatml(row)
    messages, _ = row_to_conversation(row, "row")
    kwargs = template_kwargs(row)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    turns = [f"turn {i} ({m['role']})" for i, m in enumerate(messages)
             if m["content"].strip() and m["content"].strip() not in text]
    names = [(t.get("function") or t).get("name") if isinstance(t, dict) else None for t in kwargs.get("tools") or []]
    return turns, [name for name in names if isinstance(name, str) and name not in text]


# --------------------------------------------------------------------------------- rendering, encoding

class NoFitError(FinetuneError):
    """A conversation longer than ``max_length`` even with the last user turn before its completion emptied (the
    completion is never cut). ``tokens``: the tokens it needs then (a ``max_length`` of at least that fits it)."""

    def __init__(self, message: str, tokens: int = 0):
        super().__init__(message)
        self.tokens = tokens


def require_chat_template(tokenizer) -> None:
    """Raise ``FinetuneError`` naming the fix if ``tokenizer`` has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise FinetuneError(f"the tokenizer ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '')!r}) "
                            f"has no chat template, so conversations cannot be rendered. Fix: {_NO_TEMPLATE_FIX}.")


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template (no special tokens beyond the template's);
    ``kwargs``: the row's ``template_kwargs`` (``tools``, ``chat_template_kwargs``)."""
    if not messages:  # an empty conversation: apply_chat_template refuses it, the rendering is empty
        return []
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                              return_dict=True, **_SANITIZE, **kwargs)["input_ids"])


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _check_prefix(tokenizer, prefix: list[int], full: list[int], what: str, row_name: str) -> None:
    """Raise ``FinetuneError`` unless ``prefix`` is a token prefix of ``full``."""
    if full[:len(prefix)] == prefix:
        return
    at = _first_difference(prefix, full)
    show = lambda ids: repr(tokenizer.decode(ids[max(0, at - 3):at + 3], skip_special_tokens=False))  # noqa: E731
    raise FinetuneError(
        f"{row_name}: {what} is not a token prefix of the rendered conversation (they differ at token {at}: "
        f"{show(prefix)} vs {show(full)}), so the completion's tokens cannot be located. The chat template renders "
        "earlier turns differently once later turns follow (or the generation prompt differs from the assistant "
        "header, or text merges into one token across the boundary). Fix: use a chat template whose rendering of "
        "the prompt with add_generation_prompt=True is a prefix of the full conversation (ChatML, as SmolLM2's).")


def _is_trailing_whitespace(tokenizer, token_id: int) -> bool:
    """A non-special token that decodes to whitespace only (the ``"\\n"`` after ``<|im_end|>``)."""
    return token_id not in tokenizer.all_special_ids and not tokenizer.decode([token_id]).strip()


def _is_control_token(tokenizer, token_id: int) -> bool:
    """A special token, or an added token marked special (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``)."""
    if token_id in tokenizer.all_special_ids:
        return True
    added = tokenizer.added_tokens_decoder.get(token_id)
    return bool(added is not None and added.special)


def _turn_spans(tokenizer, messages: list[dict], trained: list[int], ids: list[int],
                row_name: str, kwargs: dict | None = None) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: each trained turn's token range in ``ids``, its end-of-turn token included,
    the whitespace the template writes after it excluded (see docs/recipes.md#rows-labels-and-length-in-detail)."""
    spans = []
    for turn in trained:
        prompt = _render(tokenizer, messages[:turn], add_generation_prompt=True, **(kwargs or {}))
        through = _render(tokenizer, messages[:turn + 1], **(kwargs or {}))
        _check_prefix(tokenizer, prompt, through, f"the prompt of assistant turn {turn} rendered with "
                      "add_generation_prompt=True", row_name)
        _check_prefix(tokenizer, through, ids, f"the conversation through assistant turn {turn}", row_name)
        start, end = len(prompt), len(through)
        while end > start and _is_trailing_whitespace(tokenizer, ids[end - 1]):
            end -= 1
        if end <= start or not _is_control_token(tokenizer, ids[end - 1]):
            last = tokenizer.decode(ids[end - 1:end], skip_special_tokens=False) if end > start else ""
            raise FinetuneError(
                f"{row_name}: the chat template does not close assistant turn {turn} with a special end-of-turn token "
                f"(the turn ends with {last!r}), so the model could not learn to stop. Fix: use a chat model's "
                "tokenizer whose template ends each assistant turn with a special token (e.g. ChatML's <|im_end|>).")
        spans.append((start, end))
    return spans


def _content_cut_points(tokenizer, content: str) -> list[int]:
    """Character offsets at which ``content`` can be cut after k = 1, 2, ... of its tokens."""
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(content, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return [end for _, end in offsets]
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]  # slow tokenizer: decode prefixes
    return [len(tokenizer.decode(ids[:k], clean_up_tokenization_spaces=False)) for k in range(1, len(ids) + 1)]


def _fit(tokenizer, messages: list[dict], cut: int | None, budget: int, render, row_name: str, what: str):
    """``(messages, ids)`` with ``render(messages)`` at most ``budget`` tokens, ``messages[cut]``'s content cut
    from its end. Raises ``NoFitError`` if even an empty ``messages[cut]`` (or ``cut=None``) is too long."""
    ids = render(messages)
    if len(ids) <= budget:
        return messages, ids
    if cut is not None:
        content = messages[cut]["content"]
        cuts = _content_cut_points(tokenizer, content)
        keep = len(cuts)
        while keep > 0:  # each pass removes at least the excess, so this ends; usually after one pass
            keep = max(0, keep - (len(ids) - budget))
            shortened = [*messages[:cut], {**messages[cut], "content": content[:cuts[keep - 1]] if keep else ""},
                         *messages[cut + 1:]]
            ids = render(shortened)
            if len(ids) <= budget:
                return shortened, ids
        cause = "with the last user turn emptied"
    else:
        cause = "and there is no user turn before it to shorten"
    raise NoFitError(
        f"{row_name}: {what} and the chat template need {len(ids)} tokens {cause}, more than the limit of {budget}. "
        "The completion is never cut. Fix: raise --max_length (at least to that count), or drop or shorten such rows.",
        len(ids))


def _last_user_turn(messages: list[dict], before: int) -> int | None:
    return next((i for i in range(before - 1, -1, -1) if messages[i]["role"] == "user"), None)


def has_generation_markers(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks assistant text with ``{% generation %}`` (TRL 1.16
    ``chat_template_utils.has_generation_markers``: whitespace-trim variants count; a dict of named templates is
    judged by its ``default``)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("default", "")
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def _assistant_mask(tokenizer, messages: list[dict], trained: list[int], ids: list[int], row_name: str,
                    kwargs: dict) -> list[bool]:
    """Which of ``ids`` are assistant text: the template's ``{% generation %}`` spans
    (``return_assistant_tokens_mask``, as TRL 1.16's SFTTrainer asks for them under ``assistant_only_loss``) where it
    has the markers; else each trained turn through its end-of-turn token, found by rendering (``_turn_spans``).
    Raises ``FinetuneError`` where the markers mark nothing (TRL raises too)."""
    if has_generation_markers(tokenizer):
        # transformers refuses sanitize_control_tokens beside the mask: the same ids unless a message types a control
        # token, which this row then cannot be masked around
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                            **kwargs)
        if list(out["input_ids"]) != ids:
            raise FinetuneError(f"{row_name}: a message holds a control token (such as <|im_end|>) as text, which "
                                "--assistant_only_loss cannot mask with the template's {% generation %} markers (they "
                                "need it read as a token). Fix: drop or clean the row, or drop --assistant_only_loss.")
        if 1 not in out["assistant_masks"]:
            raise FinetuneError(f"{row_name}: --assistant_only_loss, but the chat template's {{% generation %}} markers "
                                "mark no token of this conversation. Fix: mark each assistant message's text (and its "
                                "end-of-turn token) with {% generation %}...{% endgeneration %}, or drop "
                                "--assistant_only_loss.")
        return [bool(m) for m in out["assistant_masks"]]
    mask = [False] * len(ids)
    for start, end in _turn_spans(tokenizer, messages, trained, ids, row_name, kwargs):
        mask[start:end] = [True] * (end - start)
    return mask


def _encode(tokenizer, messages: list[dict], trained: list[int], max_length: int, row_name: str,
            kwargs: dict | None = None, prompt_turns: int | None = None, assistant_only_loss: bool = True,
            completion_only_loss: bool | None = None) -> dict:
    """``{"input_ids", "labels"}`` of one conversation, labels masked as TRL 1.16's SFTTrainer masks them
    (``_prepare_dataset``'s ``tokenize_fn`` and ``build_labels``): a token is trained where every mask that applies
    holds it. ``prompt_turns``: the prompt's turns of a prompt-completion row (None: a ``messages`` row); its
    completion mask (everything after the prompt rendered with ``add_generation_prompt=True``) applies unless
    ``completion_only_loss`` is False; ``assistant_only_loss``: the assistant mask (``_assistant_mask``) applies."""
    require_chat_template(tokenizer)
    kwargs = kwargs or {}
    if max_length < 1:
        raise FinetuneError(f"max_length must be a positive number of tokens, got {max_length}.")
    messages, ids = _fit(tokenizer, messages, _last_user_turn(messages, trained[-1]), max_length,
                         lambda m: _render(tokenizer, m, **kwargs), row_name, "the completion")
    mask = [True] * len(ids)
    if prompt_turns is not None and completion_only_loss is not False:
        prompt = _render(tokenizer, messages[:prompt_turns], add_generation_prompt=True, **kwargs)
        _check_prefix(tokenizer, prompt, ids, "the prompt rendered with add_generation_prompt=True", row_name)
        mask[:len(prompt)] = [False] * len(prompt)
    if assistant_only_loss:
        mask = [m and a for m, a in zip(mask, _assistant_mask(tokenizer, messages, trained, ids, row_name, kwargs))]
    return {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]}


def _as_messages(value, role: str) -> list[dict]:
    return [{"role": role, "content": value}] if isinstance(value, str) else value


def encode_conversation(tokenizer, prompt_messages, completion_messages, max_length: int,
                        assistant_only_loss: bool = True) -> dict:
    """One prompt-completion pair (strings or message lists) -> ``{"input_ids": [int] * n, "labels": [int] * n}``,
    ``n <= max_length`` tokens; labels are ``IGNORE_INDEX`` (-100) on the prompt. The rest is trained: with
    ``assistant_only_loss``, the completion's turns through their end-of-turn token (SmolLM2: ``<|im_end|>``, not
    the ``"\\n"`` after it; ``_assistant_mask``); without, everything the template writes after the prompt, as TRL
    1.16 trains a conversational completion (the ``"\\n"`` included). Raises ``FinetuneError`` for no chat template,
    a malformed pair, a prompt that is not a token prefix, a turn without a special end token, or no fit in
    ``max_length``."""
    messages, trained = row_to_conversation({"prompt": _as_messages(prompt_messages, "user"),
                                             "completion": _as_messages(completion_messages, "assistant")},
                                            "the conversation")
    return _encode(tokenizer, messages, trained, max_length, "the conversation", prompt_turns=trained[0],
                   assistant_only_loss=assistant_only_loss)


def fitted_prompt(tokenizer, prompt_messages, completion_messages, max_length: int) -> list[dict]:
    """The prompt's messages as ``encode_conversation`` keeps them beside this completion in ``max_length`` tokens:
    the last user turn's content cut from its end where the whole does not fit, else the prompt unchanged. Raises
    as ``encode_conversation`` (``NoFitError`` where even an emptied last user turn does not fit)."""
    completion = _as_messages(completion_messages, "assistant")
    messages, trained = row_to_conversation({"prompt": _as_messages(prompt_messages, "user"), "completion": completion},
                                            "the conversation")
    require_chat_template(tokenizer)
    fitted, _ = _fit(tokenizer, messages, _last_user_turn(messages, trained[-1]), max_length,
                     lambda m: _render(tokenizer, m), "the conversation", "the completion")
    return fitted[:len(messages) - len(completion)]


def encode_messages(tokenizer, messages, max_length: int, assistant_only_loss: bool = True) -> dict:
    """``encode_conversation`` for a ``messages`` conversation: with ``assistant_only_loss``, every assistant turn
    trained (``_assistant_mask``), else every token (TRL 1.16's default). Returns and raises as
    ``encode_conversation``."""
    messages, trained = row_to_conversation({"messages": messages}, "the conversation")
    return _encode(tokenizer, messages, trained, max_length, "the conversation", assistant_only_loss=assistant_only_loss)


def encode_row(tokenizer, row: dict, max_length: int, row_name: str = "row", assistant_only_loss: bool = True,
               completion_only_loss: bool | None = None) -> dict:
    """``encode_conversation`` or ``encode_messages`` for one dataset row in either TRL format (ShareGPT's converted
    by ``to_chatml``), its ``tools`` and ``chat_template_kwargs`` passed to the template (``template_kwargs``), its
    labels masked as TRL 1.16's SFTTrainer masks them under the same ``assistant_only_loss`` and
    ``completion_only_loss`` (``_encode``); errors name ``row_name``."""
    row = to_chatml(row)
    messages, trained = row_to_conversation(row, row_name)
    prompt_turns = trained[0] if row_format(row, row_name) == "prompt-completion" else None
    return _encode(tokenizer, messages, trained, max_length, row_name, template_kwargs(row), prompt_turns,
                   assistant_only_loss, completion_only_loss)


def loss_on(tokenizer, columns, assistant_only_loss: bool, completion_only_loss: bool | None) -> str:
    """What a run trains of rows with ``columns`` (the banner's "Loss on:" line), in TRL 1.16's terms."""
    completion = "prompt" in columns and completion_only_loss is not False
    if assistant_only_loss:
        how = ("the template's {% generation %} spans" if has_generation_markers(tokenizer) else
               "each turn through its end-of-turn token, found by rendering: the template has no {% generation %} "
               "markers")
        return (f"the {'completion' if completion else 'assistant'} turns (--assistant_only_loss; {how})")
    if completion:
        return ("the completions: all the template writes after the prompt (TRL's default for prompt-completion rows;"
                " --completion_only_loss false for all tokens, --assistant_only_loss for the turns alone)")
    return "all tokens (TRL's default; --assistant_only_loss for the assistant turns)"


def rows_to_features(rows, tokenizer, max_length: int, desc: str = "Rendering conversations",
                     assistant_only_loss: bool = True, completion_only_loss: bool | None = None):
    """``rows`` (a ``datasets.Dataset`` or list of dicts, one TRL format) -> a ``datasets.Dataset`` of ``input_ids``
    and ``labels`` (int lists, equal lengths, <= ``max_length`` tokens; masked as ``encode_row`` masks them), one
    row per row, in order (``Dataset.map``).
    Raises ``FinetuneError`` naming the row (0-based) if malformed or of another format, or without chat template."""
    require_chat_template(tokenizer)
    if not isinstance(rows, datasets.Dataset):
        rows = [to_chatml(row) if isinstance(row, dict) else row for row in rows]
        formats = [row_format(row, f"row {i}") for i, row in enumerate(rows)]
        for i, row in enumerate(rows):  # validate before Arrow sees the rows: it would fail on mixed types
            if formats[i] != formats[0]:
                raise FinetuneError(f"row {i}: is in the {formats[i]} format but row 0 is in the {formats[0]} format; "
                                    "use one format for the whole dataset.")
            row_to_conversation(row, f"row {i}")
        rows = datasets.Dataset.from_list(rows)
    rows = chatml_dataset(rows)
    if not len(rows):  # map would return no columns at all
        features = datasets.Features({k: datasets.List(datasets.Value("int64")) for k in ("input_ids", "labels")})
        return datasets.Dataset.from_dict({"input_ids": [], "labels": []}, features=features)
    columns = rows.column_names
    if "messages" not in columns and not {"prompt", "completion"} <= set(columns):
        raise FinetuneError(f"the dataset has columns {columns}; it needs 'prompt' and 'completion', or 'messages' "
                            "(see https://huggingface.co/docs/trl/dataset_formats).")

    def encode(batch, indices):
        out = {"input_ids": [], "labels": []}
        for offset, index in enumerate(indices):
            row = {c: batch[c][offset] for c in columns
                   if c in ("prompt", "completion", "messages", "tools", "chat_template_kwargs")}
            name = batch[ROW_COLUMN][offset] if ROW_COLUMN in columns else f"row {index}"
            encoded = encode_row(tokenizer, row, max_length, name, assistant_only_loss, completion_only_loss)
            out["input_ids"].append(encoded["input_ids"])
            out["labels"].append(encoded["labels"])
        return out

    return rows.map(encode, batched=True, with_indices=True, remove_columns=columns, desc=desc)




# ------------------------------------------------------------------------------------------ generation

def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: the template's end-of-turn token (as training labels it) and
    eos, deduplicated."""
    probe = encode_conversation(tokenizer, "Hi", "Hello", max_length=1 << 20)
    trained = [t for t in probe["labels"] if t != IGNORE_INDEX]
    ids = [trained[-1]] + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    return list(dict.fromkeys(ids))


def _prompt_ids(tokenizer, prompt, budget: int | None) -> list[int]:
    messages = _check_messages(_as_messages(prompt, "user"), "prompt", "prompt")
    render = lambda m: _render(tokenizer, m, add_generation_prompt=True)  # noqa: E731
    if budget is None:
        return render(messages)
    return _fit(tokenizer, messages, _last_user_turn(messages, len(messages)), budget, render, "prompt",
                "the prompt")[1]


def generate_completions(model, tokenizer, prompts_messages: Sequence, max_new_tokens: int = 32, batch_size: int = 8,
                         max_length: int | None = None, synced_gpus: bool = False) -> list[str]:
    """Greedy completions, in order, for prompts (strings or message lists, rendered with
    ``add_generation_prompt=True``, left-padded in batches of ``batch_size``), stopping at ``end_of_turn_ids``.
    Returns the decoded new tokens per prompt (<= ``max_new_tokens``, special tokens dropped, stripped). ``model``:
    unwrapped; eval mode, restored after. With ``max_length``, a prompt's last user turn is cut to ``max_length -
    max_new_tokens`` tokens; ``synced_gpus``: transformers' flag for a sharded model. Raises ``FinetuneError``
    for no chat template, non-positive sizes, or a prompt too long."""
    require_chat_template(tokenizer)
    if max_new_tokens < 1 or batch_size < 1:
        raise FinetuneError(f"max_new_tokens and batch_size must be positive, got {max_new_tokens} and {batch_size}.")
    budget = None if max_length is None else max_length - max_new_tokens
    if budget is not None and budget < 1:
        raise FinetuneError(f"max_length {max_length} leaves no room for a prompt with max_new_tokens "
                            f"{max_new_tokens}.")
    stop_ids = end_of_turn_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop_ids,
                              pad_token_id=pad_id)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    completions = []
    try:
        for begin in range(0, len(prompts_messages), batch_size):
            encoded = [_prompt_ids(tokenizer, p, budget) for p in prompts_messages[begin:begin + batch_size]]
            width = max(len(ids) for ids in encoded)
            input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in encoded], device=device)
            attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=device)
            with torch.no_grad():
                output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                                        synced_gpus=synced_gpus)
            for row in output[:, width:].tolist():
                stop = next((i for i, t in enumerate(row) if t in stop_ids), len(row))
                completions.append(tokenizer.decode(row[:stop], skip_special_tokens=True).strip())
    finally:
        model.train(was_training)
    return completions


def prompt_and_reference(row: dict, row_name: str = "row") -> tuple[list[dict], str]:
    """``(prompt messages, reference text)`` of a row for generation eval (prompt-completion: the completion's
    turns joined by newlines; messages: the last assistant turn; a preference pair: ``preference.pair_prompt_and_reference``).
    Raises ``FinetuneError`` if malformed."""
    messages, trained = row_to_conversation(row, row_name)
    if row_format(row, row_name) == "messages":
        return messages[:trained[-1]], messages[trained[-1]]["content"]
    return messages[:trained[0]], "\n".join(messages[i]["content"] for i in trained)


def generation_metrics(model, tokenizer, rows, metric_specs: dict, max_new_tokens: int = 32, batch_size: int = 8,
                       max_length: int | None = None) -> tuple[dict, list[str]]:
    """Generate for every raw row (``generate_completions``) and score against its reference
    (``score_completions``). Returns ``(metrics, predictions)``, predictions in row order."""
    pairs = [prompt_and_reference(row, f"row {i}") for i, row in enumerate(rows)]
    predictions = generate_completions(model, tokenizer, [p for p, _ in pairs], max_new_tokens, batch_size, max_length)
    return score_completions(predictions, [r for _, r in pairs], metric_specs), predictions


def score_completions(predictions: list[str], references: list[str], metric_specs: dict) -> dict:
    """Each shipped metric of ``metric_specs`` (name -> compute kwargs, e.g. ``{"rouge": {}}``) over the
    predictions: ``{"eval_<key>": float, ..., "eval_generated": n}`` (NaN for every key of the ``rouge`` metric
    when there are none)."""
    results = {"eval_generated": len(predictions)}
    for name, kwargs in metric_specs.items():
        computed = load_metric(name).compute(predictions=predictions, references=references, **kwargs)
        results.update({f"eval_{k}": v for k, v in (computed or {}).items()})
    return results
