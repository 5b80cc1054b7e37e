"""Prompt-only rows (TRL's prompt-only format, for online RL such as GRPO): a ``prompt`` column holding a text or a
conversation (a list of ``{"role", "content"}`` messages, TRL's ``is_conversational``); every other column is the
row's own data, handed to reward functions as keyword lists. A conversation is rendered with the chat template's
generation prompt (``add_generation_prompt=True``, as TRL 1.16 ``GRPOTrainer._tokenize_prompts``); a text is
tokenized as the tokenizer does by default (``processing_class(text=prompts)``, the same function's other branch)."""

from __future__ import annotations

from pathlib import Path

import datasets

from finetune.data.chat import _render, require_chat_template
from finetune.data.loading import ROW_COLUMN, read_split_files, row_names
from finetune.errors import FinetuneError

PROMPT_COLUMNS = ("prompt_ids", "prompt_index")  # what tokenizing adds to a row (the rest stays, for the rewards)


def is_conversation(prompt) -> bool:
    """Whether ``prompt`` is a conversation (a list of role/content dicts), as TRL's ``is_conversational``."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "role" in m for m in prompt)


def check_prompt(prompt, row_name: str) -> None:
    """Raise ``FinetuneError`` naming ``row_name`` unless ``prompt`` is a non-empty text or a conversation."""
    if isinstance(prompt, str) and prompt.strip():
        return
    if is_conversation(prompt) and all(isinstance(m.get("content"), str) for m in prompt):
        return
    raise FinetuneError(f"{row_name}: 'prompt' must be a non-empty text or a list of {{role, content}} messages "
                        f"(TRL's prompt-only format), got {str(prompt)[:60]!r}.")


def check_prompt_rows(split) -> None:
    """Raise ``FinetuneError`` naming the first row of ``split`` whose prompt ``check_prompt`` refuses."""
    names = split[ROW_COLUMN] if ROW_COLUMN in split.column_names else [f"row {i}" for i in range(len(split))]
    for prompt, name in zip(split["prompt"], names):
        check_prompt(prompt, name)


def load_prompt_files(train_file: str, validation_file: str | None, cache_dir=None):
    """JSON-lines files of prompt-only rows as a ``DatasetDict`` (train, validation); without ``validation_file``
    20% of ``train_file`` is held out (seed 42, as ``loading.load_conversation_files``). Raises ``FinetuneError``
    for a missing, empty or unreadable file, or one without a ``prompt`` column."""
    def read(path_str: str, flag: str):
        path = Path(path_str)
        if not path.is_file() or path.stat().st_size == 0 or path.suffix.lower() not in (".json", ".jsonl"):
            raise FinetuneError(f"{flag} {path_str!r}: pass a non-empty JSON-lines file of prompt-only rows "
                                "(a 'prompt' column, text or messages).")
        try:
            ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir)
        except Exception as err:  # the datasets library raises many types for malformed files
            raise FinetuneError(f"{flag} {path_str!r} could not be read as JSON lines: {err}") from None
        if "prompt" not in ds.column_names:
            raise FinetuneError(f"{flag} {path_str!r} has columns {', '.join(ds.column_names)}; prompt-only rows "
                                "need a 'prompt' column.")
        return ds.add_column(ROW_COLUMN, row_names(path, flag, len(ds)))

    return read_split_files(read, train_file, validation_file)


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """The token ids generation continues: a conversation rendered with the generation prompt, a text tokenized."""
    if is_conversation(prompt):
        require_chat_template(tokenizer)
        return _render(tokenizer, prompt, add_generation_prompt=True)
    return list(tokenizer(prompt)["input_ids"])


def prompts_to_features(ds, tokenizer, max_length: int, desc: str = "Tokenizing prompts"):
    """``ds`` with ``PROMPT_COLUMNS`` added: each row's ``prompt_token_ids`` and its position in the split (the
    ``prompt`` index ``completions.jsonl`` records). Raises ``FinetuneError`` for a prompt longer than
    ``max_length`` tokens (prompts are never cut: raise --max_length or shorten the prompt)."""
    ids = [prompt_token_ids(tokenizer, p) for p in ds["prompt"]]
    long = next((i for i, x in enumerate(ids) if len(x) > max_length), None)
    if long is not None:
        name = ds[ROW_COLUMN][long] if ROW_COLUMN in ds.column_names else f"row {long}"
        raise FinetuneError(f"{name}: its prompt takes {len(ids[long])} tokens, over --max_length {max_length}; "
                            f"prompts are never cut: raise --max_length to {len(ids[long])} or shorten it.")
    return ds.add_column("prompt_ids", ids).add_column("prompt_index", list(range(len(ds))))
