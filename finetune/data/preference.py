"""Preference pairs in TRL's formats (``trl.data_utils``; TRL is not a dependency): an explicit prompt
(``prompt``, ``chosen``, ``rejected``: strings or message lists) or an implicit one (``chosen`` and ``rejected``
whole conversations whose common leading turns are the prompt). Each side is encoded as a prompt-completion
conversation by the SFT encoder (``chat.encode_conversation``): the chat template, the generation prompt and the
same token-prefix check, so a side's trained tokens are found as SFT finds a completion's."""

from __future__ import annotations

import datasets

from finetune.data.chat import _check_messages, _describe, encode_conversation, require_chat_template
from finetune.data.loading import ROW_COLUMN
from finetune.errors import FinetuneError

PAIR_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def split_pair(row: dict, row_name: str = "row") -> tuple[list[dict], list[dict], list[dict]]:
    """One preference row -> ``(prompt, chosen, rejected)`` as message lists. Explicit prompt: strings become a
    user turn and assistant turns. Implicit prompt (no ``prompt``, or a string prompt beside conversational
    sides, as TRL's ``maybe_extract_prompt``): the longest run of leading turns the two sides share is the prompt,
    the rest of each side its completion (TRL 1.16 ``extract_prompt`` on message lists). Raises ``FinetuneError``
    naming ``row_name``: a side missing or empty, strings mixed with message lists, an implicit prompt with no
    shared turn or a side with nothing after it (``encode_pair`` refuses a side holding a turn that is not the
    assistant's)."""
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
            raise FinetuneError(f"{row_name}: 'chosen' and 'rejected' share no leading turn, so there is no implicit "
                                "prompt; add a 'prompt' column or start both sides with the same turns.")
        if shared == len(chosen) or shared == len(rejected):
            side = "chosen" if shared == len(chosen) else "rejected"
            raise FinetuneError(f"{row_name}: '{side}' is all prompt (every turn shared with the other side), so it "
                                "has no completion to score.")
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
    tokens each; labels ``IGNORE_INDEX`` (-100) except that side's completion and its end-of-turn token), the
    prompt rendered with the chat template and the generation prompt. Raises ``FinetuneError`` naming ``row_name``
    (``split_pair``'s errors, and ``chat.encode_conversation``'s: no chat template, a prompt that is not a token
    prefix, no fit in ``max_length``)."""
    prompt, chosen, rejected = split_pair(row, row_name)
    out = {}
    for side, completion in (("chosen", chosen), ("rejected", rejected)):
        try:
            encoded = encode_conversation(tokenizer, prompt, completion, max_length)
        except FinetuneError as err:
            raise FinetuneError(f"{row_name} ('{side}'): {str(err).removeprefix('the conversation: ')}") from None
        out[f"{side}_input_ids"], out[f"{side}_labels"] = encoded["input_ids"], encoded["labels"]
    return out


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
