"""Tiny models built from configs, for tests and benchmark smoke runs: real Hugging Face model directories
that load in well under a second, with the MiniLM WordPiece tokenizer that ships offline. Not for training
anything real. Also the engine's one test hook (``forced_overflow_steps``)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

# Comma-separated optimizer steps (1-based) whose loss the accelerate engine multiplies by infinity.
FORCE_OVERFLOW_ENV = "FINETUNE_TEST_FORCE_OVERFLOW_STEPS"


def forced_overflow_steps(environ=None) -> frozenset[int]:
    """The optimizer steps on which a test forces an overflow: ``FINETUNE_TEST_FORCE_OVERFLOW_STEPS`` (e.g.
    "2,3"; unset or empty: none). On those steps the engine back-propagates an infinite loss, so every
    gradient is inf/NaN: under fp16 the GradScaler (or DeepSpeed's loss scaler) must skip the step and the
    schedule must not advance; under fp32/bf16 the run must stop with a ``NumericalError``. This is how the
    GPU acceptance script reaches the fp16 skip path on purpose (a tiny ``--max_grad_norm`` cannot: clipping
    runs after the overflow check). Raises ``ValueError`` for a value that is not a list of integers >= 1."""
    value = (os.environ if environ is None else environ).get(FORCE_OVERFLOW_ENV, "").strip()
    if not value:
        return frozenset()
    steps = frozenset(int(part) for part in value.split(",") if part.strip())
    if any(step < 1 for step in steps):
        raise ValueError(f"{FORCE_OVERFLOW_ENV}={value!r}: optimizer steps are numbered from 1")
    return steps


def build_tiny_bert(path: Path) -> Path:
    """Save a 2-layer, 32-wide BERT (random weights, seed 0) and the all-MiniLM-L6-v2 tokenizer to
    ``path``: a real model directory that loads in well under a second."""
    from finetune.recipes.bbc_news import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_llama(path: Path) -> Path:
    """Save a 2-layer, 32-wide Llama (random weights, seed 0) with the MiniLM WordPiece tokenizer (any
    tokenizer serves a causal LM; this one ships offline) to ``path``."""
    from finetune.recipes.bbc_news import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                         eos_token_id=tokenizer.sep_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_variable_length_texts(path: Path, n: int, seed: int = 0) -> Path:
    """A JSON-lines file of ``n`` texts whose lengths vary from 2 to ~60 words (uneven token counts)."""
    rng = random.Random(seed)
    words = ("the market rose as shares in the bank fell after the match ended with a late goal from the "
             "striker while ministers said the election would be held in spring and the film won awards").split()
    with open(path, "w") as f:
        for _ in range(n):
            length = rng.choice([2, 3, 5, 8, 13, 21, 34, 55])
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(length))}) + "\n")
    return path
