"""``--disable_dropout`` turns off every dropout of the built model, whatever its family calls it (GPT-2's
``*_pdrop``, Llama's float ``attention_dropout`` attribute, Bloom's ``hidden_dropout``, LoRA's dropout), leaves
non-probabilities alone, refuses a dropout it cannot turn off, and the banner says dropout is off only when it is.

The first test fails on the code before this change (config keys containing "dropout" zeroed before loading):
GPT-2's ``resid_pdrop``/``embd_pdrop``/``attn_pdrop`` stayed 0.1, and two train-mode passes differed by ~0.3."""

from __future__ import annotations

import pytest
import torch
from families import BY_NAME, CAUSAL_LM, FAMILIES, build

from finetune.config import parse_config
from finetune.models.loading import load_tokenizer
from finetune.tasks import get_task
from finetune.tasks.builders import build_model


def built(model_dir, task_name: str, *flags: str):
    """The model as training builds it (``builders.build_model``) from a family's directory, in train mode."""
    recipe = "bbc-news-clm" if task_name == CAUSAL_LM else "bbc-news"
    config = parse_config(["--recipe", recipe, "--model_name_or_path", str(model_dir), "--max_length", "32",
                           "--output_dir", str(model_dir) + "-out", *flags])
    labels = None if task_name == CAUSAL_LM else ["business", "sport", "tech"]
    model = build_model(config, get_task(task_name), labels)
    return model.train()


def two_passes(model, model_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of two forward passes in train mode over the same padded batch, other RNG seeds."""
    tokenizer = load_tokenizer(str(model_dir))
    batch = tokenizer(["the market rose as shares in the bank fell", "a late goal"], padding=True, return_tensors="pt")
    outputs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        outputs.append(model(**batch).logits.detach())
    return outputs[0], outputs[1]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return build("gpt2", tmp_path_factory.mktemp("gpt2") / "model")


def test_gpt2_with_disable_dropout_gives_the_same_logits_twice(gpt2_dir):
    on = built(gpt2_dir, CAUSAL_LM)
    a, b = two_passes(on, gpt2_dir)
    assert (a - b).abs().max().item() > 1e-2  # dropout is on (p = 0.1 under GPT-2's *_pdrop names)
    off = built(gpt2_dir, CAUSAL_LM, "--disable_dropout")
    a, b = two_passes(off, gpt2_dir)
    assert torch.equal(a, b)
    assert off.config.resid_pdrop == off.config.embd_pdrop == off.config.attn_pdrop == 0.0
    assert [m.p for m in off.modules() if isinstance(m, torch.nn.Dropout)] == [0.0] * 7  # drop + 3 per layer x 2


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_every_family_has_no_dropout_left(tmp_path, family):
    """Each family of the matrix (dropout 0.1 under its own names): nothing left, two passes equal."""
    from finetune.models.dropout import dropout_left

    model_dir = build(family, tmp_path / family)
    model = built(model_dir, BY_NAME[family].task, "--disable_dropout")
    assert dropout_left(model) == []
    a, b = two_passes(model, model_dir)
    assert torch.equal(a, b)


def test_float_attributes_read_at_call_time_are_zeroed(tmp_path):
    """Llama copies config.attention_dropout into each attention module at init and passes it to SDPA in
    training; Bloom copies hidden_dropout and calls F.dropout with it: no nn.Dropout module holds either."""
    from finetune.models.dropout import disable_dropout

    for family, attribute in (("llama", "attention_dropout"), ("bloom", "hidden_dropout")):
        model = built(build(family, tmp_path / family), CAUSAL_LM)
        holders = [m for m in model.modules() if isinstance(getattr(m, attribute, None), float)]
        assert holders and all(getattr(m, attribute) == 0.1 for m in holders)
        off = disable_dropout(model)
        assert all(getattr(m, attribute) == 0.0 for m in holders)
        assert len(off.attributes) == len(holders) and off.config_fields  # attributes and config both


def test_non_probabilities_are_left_alone():
    from finetune.models.dropout import is_dropout_probability

    assert is_dropout_probability("resid_pdrop", 0.1) and is_dropout_probability("layerdrop", 0.2)
    assert is_dropout_probability("drop_path_rate", 1.0) and is_dropout_probability("hidden_dropout_prob", 0.1)
    assert not is_dropout_probability("initializer_range", 0.02)  # a float in (0, 1], not a dropout
    assert not is_dropout_probability("layer_norm_epsilon", 1e-5)
    assert not is_dropout_probability("token_dropout", True)  # ESM: a switch
    assert not is_dropout_probability("attention_dropout", 0)  # an int 0 is off already
    assert not is_dropout_probability("classifier_dropout", None)
    assert not is_dropout_probability("drop_rate", (0.1, 0.2))
    assert not is_dropout_probability("dropout_scale", 2.0)  # above 1: not a probability


def test_gpt2_config_keeps_its_other_floats(gpt2_dir):
    model = built(gpt2_dir, CAUSAL_LM, "--disable_dropout")
    assert model.config.initializer_range == 0.02 and model.config.layer_norm_epsilon == 1e-5


def test_lora_dropout_is_off_too(tmp_path, gpt2_dir):
    model = built(gpt2_dir, CAUSAL_LM, "--disable_dropout", "--use_peft", "--lora_r", "4", "--lora_dropout", "0.1",
                  "--lora_target_modules", "c_attn")
    lora = [m for n, m in model.named_modules() if "lora_dropout" in n and isinstance(m, torch.nn.Dropout)]
    assert len(lora) == 2 and all(m.p == 0.0 for m in lora)  # one per layer's c_attn


def test_a_dropout_it_cannot_turn_off_is_refused(gpt2_dir):
    """A family's own dropout class, not a torch Dropout, with a probability under a name without "drop"."""
    from finetune.errors import FinetuneError
    from finetune.models.dropout import disable_dropout, dropout_left

    class StableDropout(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rate = 0.1

    model = built(gpt2_dir, CAUSAL_LM)
    model.transformer.h[0].extra = StableDropout()
    with pytest.raises(FinetuneError, match=r"transformer\.h\.0\.extra\.rate=0\.1"):
        disable_dropout(model)
    assert dropout_left(model) == ["transformer.h.0.extra.rate=0.1"]  # the rest was turned off


def test_the_banner_says_dropout_is_off_only_when_it_is(gpt2_dir):
    from finetune.lifecycle.window import StepPlan
    from finetune.outputs.reporting import run_banner

    config = parse_config(["--recipe", "bbc-news-clm", "--model_name_or_path", str(gpt2_dir), "--disable_dropout"])
    plan = StepPlan(steps_per_epoch=2, micro_batches_per_epoch=4, max_steps=2, num_epochs=1)
    off = run_banner(config, 1, plan, "no", "cpu", built(gpt2_dir, CAUSAL_LM, "--disable_dropout"))
    assert off.splitlines()[-1] == ("Dropout: off (--disable_dropout; checked: no dropout module, attribute or config "
                                    "probability above 0)")
    still = run_banner(config, 1, plan, "no", "cpu", built(gpt2_dir, CAUSAL_LM))  # a model built without it
    assert still.splitlines()[-1].startswith("Dropout: --disable_dropout asked, but still on: transformer.drop.p=0.1")
    quiet = parse_config(["--recipe", "bbc-news-clm", "--model_name_or_path", str(gpt2_dir)])
    assert "Dropout" not in run_banner(quiet, 1, plan, "no", "cpu", built(gpt2_dir, CAUSAL_LM))
