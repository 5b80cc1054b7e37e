"""Preference pairs in TRL's formats (``trl.data_utils``; TRL is not a dependency): an explicit prompt
(``prompt``, ``chosen``, ``rejected``: strings or message lists) or an implicit one (``chosen`` and ``rejected``
whole conversations whose common leading turns are the prompt). Each side is encoded as a prompt-completion
conversation by the SFT encoder (``chat.encode_conversation``): the chat template, the generation prompt and the
same token-prefix check; a side's trained tokens are all the template writes after the prompt, as TRL's DPOTrainer
takes them."""

from __future__ import annotations

from dataclasses import dataclass, field

import datasets

from finetune.data.chat import (
    NoFitError,
    _check_messages,
    _describe,
    _render,
    encode_conversation,
    fitted_prompt,
    require_chat_template,
)
from finetune.data.loading import IGNORE_INDEX, ROW_COLUMN
from finetune.errors import FinetuneError

PAIR_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
PAIR_SIDES = ("chosen", "rejected")


class ImplicitPromptError(FinetuneError):
    """A row without an explicit prompt whose sides' common leading turns are no prompt: they share none, one side
    is all shared turns, or the sides part before their last user turn. ``reason``: which, in a few words."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def split_pair(row: dict, row_name: str = "row") -> tuple[list[dict], list[dict], list[dict]]:
    """One preference row -> ``(prompt, chosen, rejected)`` as message lists. Explicit prompt: strings become a
    user turn and assistant turns. Implicit prompt (no ``prompt``, or a string prompt beside conversational
    sides, as TRL's ``maybe_extract_prompt``): the longest run of leading turns the two sides share is the prompt,
    the rest of each side its completion (TRL 1.16 ``extract_prompt`` on message lists). Raises ``FinetuneError``
    naming ``row_name``: a side missing or empty, strings mixed with message lists; ``ImplicitPromptError`` for an
    implicit prompt that is not a common prefix: no shared turn, a side with nothing after it, or sides that part
    before a later user turn (TRL would train that user turn as part of a completion; ``encode_pair`` refuses a
    side holding a turn that is not the assistant's)."""
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        keys = sorted(row) if isinstance(row, dict) else _describe(row)
        raise FinetuneError(f"{row_name}: a preference row needs 'chosen' and 'rejected' (and 'prompt' unless the "
                            f"sides are whole conversations), got {keys}; see "
                            "https://huggingface.co/docs/trl/dataset_formats#preference.")
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    conversational = _is_messages(chosen) and _is_messages(rejected)
    if prompt is None or (conversational and isinstance(prompt, str)):
        if not conversational:
            raise FinetuneError(f"{row_name}: without 'prompt', 'chosen' and 'rejected' must be whole conversations "
                                f"(message lists) whose first turns are the prompt; got chosen={_describe(chosen)}.")
        chosen = _check_messages(chosen, row_name, "chosen")
        rejected = _check_messages(rejected, row_name, "rejected")
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise ImplicitPromptError(f"{row_name}: 'chosen' and 'rejected' share no leading turn, so there is no "
                                      "implicit prompt; add a 'prompt' column or start both sides with the same turns.",
                                      "no shared turn")
        if shared == len(chosen) or shared == len(rejected):
            side = "chosen" if shared == len(chosen) else "rejected"
            raise ImplicitPromptError(f"{row_name}: '{side}' is all prompt (every turn shared with the other side), "
                                      "so it has no completion to score.", f"'{side}' all prompt")
        late = next((m["role"] for m in chosen[shared:] + rejected[shared:] if m["role"] != "assistant"), None)
        if late is not None:
            raise ImplicitPromptError(f"{row_name}: 'chosen' and 'rejected' part at turn {shared}, before a later "
                                      f"{late} turn, so their common leading turns are not the whole prompt; start "
                                      "both sides with the same turns up to the answers, or add a 'prompt' column.",
                                      f"part at turn {shared}")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    kinds = {isinstance(v, str) for v in (prompt, chosen, rejected)}
    if len(kinds) > 1:
        raise FinetuneError(f"{row_name}: 'prompt', 'chosen' and 'rejected' must all be strings or all be message "
                            f"lists; got prompt={_describe(prompt)}, chosen={_describe(chosen)}.")
    if kinds == {True}:
        prompt = [{"role": "user", "content": prompt}]
        chosen, rejected = [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
    return (_check_messages(prompt, row_name, "prompt"), _check_messages(chosen, row_name, "chosen"),
            _check_messages(rejected, row_name, "rejected"))


def encode_pair(tokenizer, row: dict, max_length: int, row_name: str = "row") -> dict:
    """One preference row -> ``PAIR_COLUMNS``: each side's ``input_ids`` and ``labels`` (int lists, <= ``max_length``
    tokens each; labels ``IGNORE_INDEX`` (-100) except that side's completion: all the template writes after the
    prompt, as TRL 1.16's DPOTrainer takes it, ``_encode_completion``), the
    prompt rendered with the chat template and the generation prompt, the same prompt for both sides (a prompt too
    long for a side is cut as that side needs, and both sides keep the shorter cut). Raises ``FinetuneError`` naming ``row_name``
    (``split_pair``'s errors, and ``chat.encode_conversation``'s: no chat template, a prompt that is not a token
    prefix; ``chat.NoFitError`` for a side that does not fit in ``max_length``)."""
    prompt, chosen, rejected = split_pair(row, row_name)
    sides = dict(zip(PAIR_SIDES, (chosen, rejected)))
    # one prompt for both sides: the one cut for the side that needs the most room (a longer side keeps less of a
    # too-long prompt), so that both log-probabilities are conditioned on the same text
    fitted = [_encode_side(tokenizer, prompt, completion, max_length, f"{row_name} ('{side}')", fitted_prompt)
              for side, completion in sides.items()]
    shared = min(fitted, key=lambda messages: sum(len(m["content"]) for m in messages))
    out = {}
    for side, completion in sides.items():
        encoded = _encode_side(tokenizer, shared, completion, max_length, f"{row_name} ('{side}')", _encode_completion)
        out[f"{side}_input_ids"], out[f"{side}_labels"] = encoded["input_ids"], encoded["labels"]
    return out


def _encode_completion(tokenizer, prompt: list[dict], completion: list[dict], max_length: int) -> dict:
    """``chat.encode_conversation`` training all the template writes after the prompt, as TRL 1.16's DPOTrainer
    takes a conversational side's completion (``_prepare_dataset``'s ``tokenize_fn``: ``prompt_chosen_ids[prompt_len:]``,
    the ``"\\n"`` after ``<|im_end|>`` included)."""
    return encode_conversation(tokenizer, prompt, completion, max_length, assistant_only_loss=False)


def _encode_side(tokenizer, prompt: list[dict], completion: list[dict], max_length: int, where: str,
                 encode=encode_conversation):
    """``encode(tokenizer, prompt, completion, max_length)`` (``chat.encode_conversation``, or ``chat.fitted_prompt``)
    of one side, its errors (their type kept: ``NoFitError``) naming ``where``."""
    try:
        return encode(tokenizer, prompt, completion, max_length)
    except NoFitError as err:
        raise NoFitError(f"{where}: {str(err).removeprefix('the conversation: ')}", err.tokens) from None
    except FinetuneError as err:
        raise FinetuneError(f"{where}: {str(err).removeprefix('the conversation: ')}") from None


def _said(messages: list[dict]) -> str:
    """The messages' text, lower case, whitespace collapsed, padded with a space each side (for word-bounded
    ``in``)."""
    return " " + " ".join(" ".join(m["content"] for m in messages).lower().split()) + " "


@dataclass
class PairCheck:
    """What ``check_pair`` finds in one preference row. ``implicit_prompt``: the ``ImplicitPromptError`` training
    would stop on, else None (then nothing else is looked at); ``empty``: sides whose completion is empty (training
    stops on them); ``no_fit``: side -> the tokens it needs with the prompt's last user turn emptied, where that is
    more than ``max_length`` (training stops on it); ``identical``: chosen and rejected are the same turns;
    ``repeats_prompt``: sides whose completion holds the prompt's text (its last user turn, case and whitespace
    aside); ``prompt_cut``: side -> prompt tokens cut to fit ``max_length`` (both sides share the prompt
    ``encode_pair`` cuts for the side that needs the most room, so both count the same cut)."""

    implicit_prompt: ImplicitPromptError | None = None
    empty: list[str] = field(default_factory=list)
    no_fit: dict[str, int] = field(default_factory=dict)
    identical: bool = False
    repeats_prompt: list[str] = field(default_factory=list)
    prompt_cut: dict[str, int] = field(default_factory=dict)

    @property
    def refused(self) -> bool:
        """Whether training stops on this row (``check_pair_rows`` or ``encode_pair`` raises)."""
        return bool(self.implicit_prompt or self.empty or self.no_fit)


def check_pair(tokenizer, row: dict, max_length: int, row_name: str = "row") -> PairCheck:
    """``finetune check-data``'s look at one preference row, encoded as training encodes it (``encode_pair``; each
    side's prompt cut to ``max_length`` tokens): a ``PairCheck``. The problems training stops on that are in the
    data rather than its format (an implicit prompt that is not a common prefix, an empty completion, a side that
    does not fit) are returned, so that every such row can be listed; any other ``FinetuneError`` of ``split_pair``
    or ``chat.encode_conversation`` is raised, naming ``row_name`` (a malformed row, a chat template that cannot
    locate a completion or closes no turn with a special token)."""
    try:
        prompt, chosen, rejected = split_pair(row, row_name)
    except ImplicitPromptError as err:
        return PairCheck(implicit_prompt=err)
    sides = dict(zip(PAIR_SIDES, (chosen, rejected)))
    said = [m for m in prompt if m["role"] == "user"][-1:] or prompt[-1:]
    check = PairCheck(identical=chosen == rejected,
                      empty=[side for side, turns in sides.items()
                             if any(m["role"] == "assistant" and not m["content"].strip() for m in turns)],
                      repeats_prompt=[side for side, turns in sides.items()
                                      if _said(said).strip() and _said(said) in _said(turns)])
    if check.empty:
        return check
    for side, completion in sides.items():
        try:
            _encode_side(tokenizer, prompt, completion, max_length, f"{row_name} ('{side}')", fitted_prompt)
        except NoFitError as err:
            check.no_fit[side] = err.tokens
    if check.no_fit:
        return check
    whole = len(_render(tokenizer, prompt, add_generation_prompt=True))
    encoded = encode_pair(tokenizer, row, max_length, row_name)  # the prompt both sides share, as training cuts it
    for side in PAIR_SIDES:
        labels = encoded[f"{side}_labels"]
        start = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
        if start < whole:
            check.prompt_cut[side] = whole - start
    return check


def check_pair_rows(ds) -> None:
    """Check every raw preference row of ``ds`` (``split_pair``) where it came from: a ``FinetuneError`` names
    the row's file and line (``loading.ROW_COLUMN``) or its index."""
    keys = [c for c in ("prompt", "chosen", "rejected") if c in ds.column_names]
    names = ds[ROW_COLUMN] if ROW_COLUMN in ds.column_names else [f"row {i}" for i in range(len(ds))]
    for i, row in enumerate(ds.select_columns(keys)):
        split_pair({k: v for k, v in row.items() if v is not None}, names[i])


def pairs_to_features(rows, tokenizer, max_length: int, desc: str = "Rendering preference pairs"):
    """A ``datasets.Dataset`` of preference rows -> one of ``PAIR_COLUMNS`` (``encode_pair``), one row per pair, in
    order (``Dataset.map``). Raises ``FinetuneError`` naming the row, or for a tokenizer without chat template."""
    require_chat_template(tokenizer)
    columns = rows.column_names
    if not len(rows):
        features = datasets.Features({k: datasets.List(datasets.Value("int64")) for k in PAIR_COLUMNS})
        return datasets.Dataset.from_dict({k: [] for k in PAIR_COLUMNS}, features=features)

    def encode(batch, indices):
        out = {k: [] for k in PAIR_COLUMNS}
        for offset, index in enumerate(indices):
            row = {c: batch[c][offset] for c in ("prompt", "chosen", "rejected")
                   if c in columns and batch[c][offset] is not None}
            name = batch[ROW_COLUMN][offset] if ROW_COLUMN in columns else f"row {index}"
            for key, value in encode_pair(tokenizer, row, max_length, name).items():
                out[key].append(value)
        return out

    return rows.map(encode, batched=True, with_indices=True, remove_columns=columns, desc=desc)


def pair_prompt_and_reference(row: dict, row_name: str = "row") -> tuple[list[dict], str]:
    """``chat.prompt_and_reference`` for a preference row: (prompt messages, its chosen side's turns joined by
    newlines), the reference a generated completion is scored against. Raises ``split_pair``'s errors."""
    prompt, chosen, _ = split_pair({k: v for k, v in row.items() if v is not None}, row_name)
    return prompt, "\n".join(m["content"] for m in chosen)
