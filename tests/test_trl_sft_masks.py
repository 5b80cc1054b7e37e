"""Token ids and label masks equal to TRL 1.16 ``SFTTrainer``'s, row for row: the same raw rows prepared by
``trl.SFTTrainer`` (its ``_prepare_dataset``, run by its constructor: ShareGPT converted by
``maybe_convert_to_chatml``, ``tokenize_fn`` passing a row's ``tools`` (a JSON string parsed) to
``apply_chat_template``, ``build_labels`` masking with ``completion_mask`` under ``completion_only_loss`` and
``assistant_masks`` under ``assistant_only_loss``; trl/trainer/sft_trainer.py lines 1228-1463) and by ours
(``chat.rows_to_features`` under the same two settings). No training: the prepared ``train_dataset`` is compared.
What TRL does differently, and we do not test here: it refuses ShareGPT rows under ``assistant_only_loss`` (its
``is_conversational`` check, line 933, runs before its conversion), swaps a known template without ``{% generation
%}`` markers for its training copy or errors (``get_training_chat_template``), and cuts a long row's end where we cut
the last user turn."""

from __future__ import annotations

import copy
import json

import pytest
from test_your_data import SHAREGPT, TOOLS_TEMPLATE
from tiny_models import SMOLLM2_CHAT_TEMPLATE

trl = pytest.importorskip("trl")

# TOOLS_TEMPLATE with {% generation %} around each assistant message's text and its <|im_end|> (not the "\n")
MARKED_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tools(i: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"lookup_{i}", "description": "find a story by number"}}]


# multi-turn ShareGPT rows with a system turn; the same rows with a tools column (JSON strings, as TRL parses them;
# lists); prompt-completion rows with tools
SHAREGPT_MULTI = [{"conversations": [{"from": "system", "value": "be brief"}, *r["conversations"],
                                     {"from": "user", "value": "and more?"}, {"from": "assistant", "value": "no more"}]}
                  for r in SHAREGPT[:6]]
WITH_TOOLS_JSON = [{**r, "tools": json.dumps(_tools(i))} for i, r in enumerate(SHAREGPT_MULTI)]
WITH_TOOLS_LIST = [{**r, "tools": _tools(i)} for i, r in enumerate(SHAREGPT_MULTI)]
PROMPT_COMPLETION = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"story {i}?"}],
                      "completion": [{"role": "assistant", "content": f"topic {i % 5}"}],
                      "tools": json.dumps(_tools(i))} for i in range(6)]


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    from tiny_models import build_tiny_chat_llama

    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


def _both(chat_llama, tmp_path, rows, template, assistant_only_loss=False, completion_only_loss=None):
    """(TRL's prepared rows, ours) for ``rows`` under ``template`` and the two settings, as lists of
    ``(input_ids, labels)``."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.chat import rows_to_features

    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    tokenizer.chat_template = template
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", bf16=False,
                         max_length=1024, assistant_only_loss=assistant_only_loss,
                         completion_only_loss=completion_only_loss)
    trainer = trl.SFTTrainer(model=AutoModelForCausalLM.from_pretrained(chat_llama), args=args,
                             train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    ours = rows_to_features(datasets.Dataset.from_list(rows), tokenizer, 1024, assistant_only_loss=assistant_only_loss,
                            completion_only_loss=completion_only_loss)
    pairs = lambda ds: [(r["input_ids"], r["labels"]) for r in ds]  # noqa: E731
    return pairs(trainer.train_dataset), pairs(ours)


def _trained(prepared) -> int:
    return sum(label != -100 for _, labels in prepared for label in labels)


@pytest.mark.parametrize("rows, template, completion_only_loss, trained", [
    (SHAREGPT_MULTI, SMOLLM2_CHAT_TEMPLATE, None, 450),  # every token of each row (SmolLM2's template: no tools)
    (WITH_TOOLS_JSON, TOOLS_TEMPLATE, None, 984),  # every token, the tools' system turn included
    (WITH_TOOLS_LIST, TOOLS_TEMPLATE, None, 984),
    (PROMPT_COMPLETION, SMOLLM2_CHAT_TEMPLATE, None, 54),  # all after the prompt: "topic N<|im_end|>\n", 9 a row
    (PROMPT_COMPLETION, TOOLS_TEMPLATE, False, 750),  # every token
])
def test_ids_and_labels_equal_trls_by_default(chat_llama, tmp_path, rows, template, completion_only_loss, trained):
    """TRL's defaults (``assistant_only_loss`` off, ``completion_only_loss`` None): every row's ids and labels equal."""
    theirs, ours = _both(chat_llama, tmp_path, rows, template, completion_only_loss=completion_only_loss)
    assert len(theirs) == len(ours) == len(rows)
    assert [ids for ids, _ in ours] == [ids for ids, _ in theirs]
    assert [labels for _, labels in ours] == [labels for _, labels in theirs]
    assert _trained(ours) == trained


@pytest.mark.parametrize("rows, trained", [
    ([trl.maybe_convert_to_chatml(copy.deepcopy(r)) for r in WITH_TOOLS_JSON], 132),  # two turns a row, 22 tokens
    (PROMPT_COMPLETION, 48),  # "topic N<|im_end|>", 8 a row: the "\n" after it is outside the markers
])
def test_assistant_only_ids_and_labels_equal_trls_with_generation_markers(chat_llama, tmp_path, rows, trained):
    """``assistant_only_loss`` with a template that has ``{% generation %}`` markers: the template's assistant
    spans, as TRL takes them (``return_assistant_tokens_mask``); TRL 1.16 refuses ShareGPT rows under it, so they go
    in converted by its own ``maybe_convert_to_chatml``."""
    theirs, ours = _both(chat_llama, tmp_path, rows, MARKED_TEMPLATE, assistant_only_loss=True)
    assert ours == theirs
    assert _trained(ours) == trained


def test_assistant_only_without_markers_trains_each_turn_through_its_end(chat_llama, tmp_path):
    """SmolLM2's template has no ``{% generation %}`` markers: TRL 1.16 errors (it has no training copy of it);
    ours trains each assistant turn's text and ``<|im_end|>``, found by rendering, not the ``"\\n"`` after it."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.chat import rows_to_features

    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", bf16=False,
                         assistant_only_loss=True)
    rows = [trl.maybe_convert_to_chatml(copy.deepcopy(r)) for r in SHAREGPT_MULTI]
    with pytest.raises(ValueError, match="not training-compatible"):
        trl.SFTTrainer(model=AutoModelForCausalLM.from_pretrained(chat_llama), args=args,
                       train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    ours = rows_to_features(datasets.Dataset.from_list(rows), tokenizer, 1024, assistant_only_loss=True)
    for row, encoded in zip(rows, ours):
        trained = [t if t != -100 else None for t in encoded["labels"]]
        runs = tokenizer.decode([t for t in trained if t is not None], skip_special_tokens=False)
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert runs == "".join(f"{a}<|im_end|>" for a in answers)


@pytest.mark.parametrize("recipe", ["sft", "dpo"])
def test_add_eos_is_refused_where_it_has_no_effect(tmp_path, chat_llama, recipe):
    """``--add_eos`` on an SFT or DPO run: one error before anything is written (trl sft and trl dpo add no eos to
    conversational rows, and ours renders every row with the chat template)."""
    from test_your_data import _run_without_recipe

    from finetune.errors import FinetuneError

    row = ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
           if recipe == "sft" else
           {"prompt": "hi", "chosen": "hello", "rejected": "go away"})
    train = tmp_path / "rows.jsonl"
    train.write_text(json.dumps(row) + "\n")
    out = tmp_path / "out"
    with pytest.raises(FinetuneError, match="--add_eos"):
        _run_without_recipe(["--model_name_or_path", chat_llama, "--train_file", str(train), "--output_dir",
                             str(out), "--add_eos", "--max_length", "64"])
    assert not out.exists()


@pytest.mark.parametrize("recipe, flags", [
    ("clm", ["--assistant_only_loss"]),  # text rows: trl sft raises for both (sft_trainer.py lines 933-937, 353-361)
    ("clm", ["--completion_only_loss", "true"]),
    ("dpo", ["--assistant_only_loss"]),
    ("sft", []),  # accepted: nothing refused where the flags mean something
    ("sft", ["--assistant_only_loss", "--completion_only_loss", "false"]),
])
def test_the_sft_loss_flags_are_refused_where_they_mean_nothing(recipe, flags):
    from finetune.config import parse_config
    from finetune.errors import FinetuneError
    from finetune.recipes import load_recipe
    from finetune.tasks import run_task

    config = parse_config(["--recipe", recipe, "--model_name_or_path", "m", "--train_file", "rows.jsonl", *flags])
    if recipe == "sft":
        assert run_task(load_recipe(recipe), config).name == "sft"
        return
    with pytest.raises(FinetuneError, match=f"^{flags[0]} "):
        run_task(load_recipe(recipe), config)
