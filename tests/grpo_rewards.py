"""Reward functions for the GRPO tests, with TRL 1.16's signature (``reward_func(prompts, completions,
completion_ids, **columns) -> list[float | None]``)."""

from __future__ import annotations


def token_parity(prompts, completions, completion_ids, **columns):
    """1.0 for a completion of an even number of tokens, else 0.0: rewards that differ within a group."""
    return [float(len(ids) % 2 == 0) for ids in completion_ids]


def topic_named(prompts, completions, completion_ids, topic, **columns):
    """The completion's text length mod 5 against the row's ``topic`` column (a keyword column reaches the
    function); None for a completion of one token (no reward from this function)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if len(ids) == 1 else float(len(t) % 5 == int(k)) + 0.1 * len(ids)
            for t, ids, k in zip(texts, completion_ids, topic)]


def id_sum_parity(prompts, completions, completion_ids, **columns):
    """1.0 for a completion whose token ids sum to an even number, else 0.0: rewards that differ within a group of
    sampled completions even where every one runs to --max_completion_length."""
    return [float(sum(ids) % 2 == 0) for ids in completion_ids]


def letters(prompts, completions, **columns):
    """The share of the completion's characters that are letters, from its text alone (so a test can score a shown
    completion again); None for an empty text."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isalpha() for ch in t) / len(t) if t else None for t in texts]
