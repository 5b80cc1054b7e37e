"""Shared fixtures: a tiny BERT built from a config (with the real MiniLM vocabulary), and a reset of
Accelerate's process-wide state between in-process runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the hub


def build_tiny_bert(path: Path) -> Path:
    """Save a 2-layer, 32-wide BERT (random weights, seed 0) and the all-MiniLM-L6-v2 tokenizer to
    ``path``: a real model directory that loads in well under a second."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from recipes.bbc_news import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> str:
    """Path of a tiny BERT model directory (session-wide)."""
    return str(build_tiny_bert(tmp_path_factory.mktemp("tiny-bert")))


@pytest.fixture(autouse=True)
def _reset_accelerate_state():
    """Accelerate keeps process-wide singletons; each in-process run must start from a clean state."""
    yield
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
