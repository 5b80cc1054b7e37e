"""``finetune check-data`` on preference data (issue 38): each finding caught in the rows planted for it, counted
and named by file and line (the side too, where one side has it); the pairs training would stop on set aside and
the rest still checked; both sides of a sample shown with their trained tokens; a clean file and the shipped
recipe's data check without a failure."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tiny_models import build_tiny_chat_llama, smollm2_like_tokenizer

from finetune.commands.check_data import main
from finetune.data.chat import encode_conversation
from finetune.data.loading import IGNORE_INDEX
from finetune.data.preference import PairCheck
from finetune.tasks.preference import PreferenceTask, pair_findings
from finetune.tasks.preference_loss import CONSTANT_ON_TIES, PAIR_LOSS_TYPES, PreferenceLoss

WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()
SENTENCE = " ".join(WORDS)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# one row per line, each planting what its comment says (lines 1, 2 and 10 are clean)
ROWS = [
    {"prompt": [user("the market rose")], "chosen": [assistant("shares fell")], "rejected": [assistant("a late goal")]},
    {"chosen": [user("the bank fell"), assistant("after the match")],  # an implicit prompt
     "rejected": [user("the bank fell"), assistant("with a goal")]},
    {"prompt": [user("the match ended")], "chosen": [assistant("a late goal")],  # 3: chosen equals rejected
     "rejected": [assistant("a late goal")]},
    {"prompt": [user("Shares in the bank")], "chosen": [assistant("the market rose")],  # 4: the prompt repeated
     "rejected": [assistant("shares in the BANK  fell")]},
    {"chosen": [user("the market"), assistant("rose")],  # 5: no shared leading turn
     "rejected": [user("the bank"), assistant("fell")]},
    {"chosen": [user("the market"), assistant("rose"), user("and the bank"), assistant("fell")],  # 6: part at turn 1
     "rejected": [user("the market"), assistant("fell"), user("and the bank"), assistant("rose")]},
    {"prompt": [user("the late goal")], "chosen": [assistant("the match ended")],  # 7: an empty completion
     "rejected": [assistant("  ")]},
    {"prompt": [user("the late match")], "chosen": [assistant("ended")],  # 8: a completion longer than --max_length
     "rejected": [assistant(" ".join(WORDS * 3))]},
    {"prompt": [user(SENTENCE)], "chosen": [assistant("goal")],  # 9: the prompt cut, unequally
     "rejected": [assistant("shares in the bank fell")]},
    {"prompt": [user("as shares fell")], "chosen": [assistant("the bank")], "rejected": [assistant("the market")]},
]
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def check_data(tmp_path, chat_llama, train_rows, *extra):
    valid = [{"prompt": [user("a goal")], "chosen": [assistant("the match")], "rejected": [assistant("the bank")]},
             {"prompt": [user("a late")], "chosen": [assistant("goal")], "rejected": [assistant("match")]}]
    train = write_jsonl(tmp_path / "train.jsonl", train_rows)
    return main(["--recipe", "bbc-headlines-dpo", "--model_name_or_path", chat_llama, "--max_length", str(MAX_LENGTH),
                 "--train_file", train, "--validation_file", write_jsonl(tmp_path / "valid.jsonl", valid), *extra]), train


def problem(out: str, name: str) -> tuple[str, int, list[str]]:
    """The status, count and detail lines of the problem ``name`` in a report."""
    match = re.search(rf"^  (FAIL|warn|ok  )  {re.escape(name)}: (\d+)\n((?:        .*\n)*)", out + "\n", re.M)
    assert match, f"no problem {name!r} in:\n{out}"
    return match.group(1), int(match.group(2)), [line.strip() for line in match.group(3).splitlines()]


def test_each_finding_is_caught_in_its_rows(tmp_path, chat_llama, capsys):
    code, train = check_data(tmp_path, chat_llama, ROWS, "--samples", "1")
    out = capsys.readouterr().out
    assert code == 1
    # lines 5, 6, 7, 8 are set aside (training would stop on each); the other 6 are tokenized and checked
    assert "check-data: bbc-headlines-dpo: 10 training and 2 validation rows (6 training samples after tokenizing)" in out
    where = f"--train_file {train!r}"
    assert problem(out, "implicit prompt not a common prefix")[:2] == ("FAIL", 2)
    assert problem(out, "implicit prompt not a common prefix")[2][1] == \
        f"rows: {where} lines 5 (no shared turn), 6 (part at turn 1)"
    assert problem(out, "empty completion")[:2] == ("FAIL", 1)
    assert problem(out, "empty completion")[2][1] == f"rows: {where} line 7 (rejected)"
    status, count, detail = problem(out, f"completion does not fit --max_length {MAX_LENGTH}")
    # what line 8's rejected side needs with its prompt's user turn emptied, measured apart from check-data
    needed = len(encode_conversation(smollm2_like_tokenizer(), [user("")], ROWS[7]["rejected"], 10_000)["input_ids"])
    assert (status, count) == ("FAIL", 1) and needed > MAX_LENGTH
    assert f"a side needs up to {needed} tokens" in detail[0] and f"raise --max_length to {needed}" in detail[0]
    assert detail[1] == f"rows: {where} line 8 (rejected)"
    status, count, detail = problem(out, "chosen equals rejected")
    assert (status, count) == ("FAIL", 1) and detail[1] == f"rows: {where} line 3"
    assert "reward margin is 0" in detail[0] and "under --loss_type sigmoid its gradient is 0" in detail[0]
    assert problem(out, "prompt repeated in a response")[:2] == ("warn", 1)
    assert problem(out, "prompt repeated in a response")[2][1] == f"rows: {where} line 4 (rejected)"
    assert problem(out, f"prompt cut by --max_length {MAX_LENGTH}")[:2] == ("warn", 1)
    assert problem(out, f"prompt cut by --max_length {MAX_LENGTH}")[2][1] == f"rows: {where} line 9 (chosen, rejected)"
    assert problem(out, "nothing trained")[:2] == ("ok  ", 0)
    assert problem(out, "end-of-turn token not trained")[:2] == ("ok  ", 0)
    # both sides of the first pair, each with its own completion trained
    assert "--- sample 0 chosen" in out and "[[shares fell<|im_end|>\n]]" in out
    assert "--- sample 0 rejected" in out and "[[a late goal<|im_end|>\n]]" in out
    assert "check-data: 4 problem(s) that make the run wrong" in out
    assert check_data(tmp_path, chat_llama, ROWS, "--accept_problems")[0] == 0


def test_a_clean_file_checks_clean_with_its_trained_tokens_per_side(tmp_path, chat_llama, capsys):
    rows = [{"prompt": " ".join(WORDS[i:i + 4]), "chosen": " ".join(WORDS[i + 4:i + 5 + i % 3]),
             "rejected": " ".join(WORDS[i + 8:i + 9 + i % 4])} for i in range(6)]
    assert check_data(tmp_path, chat_llama, rows)[0] == 0
    out = capsys.readouterr().out
    assert "none: the data is clean" in out and "warn" not in out and "FAIL" not in out
    # each side trains its completion's tokens, <|im_end|> and the "\n" after it (as TRL's DPOTrainer takes a
    # completion): counted here by the tokenizer alone
    tokenizer = smollm2_like_tokenizer()
    for side in ("chosen", "rejected"):
        counts = sorted(len(tokenizer(r[side])["input_ids"]) + 2 for r in rows)
        assert f"{side} min {counts[0]}, p50 {counts[3]}, p90 {counts[5]}, p99 {counts[5]}, max {counts[-1]}" in out


def test_a_side_that_trains_nothing_is_caught(tmp_path, chat_llama, capsys, monkeypatch):
    """No row the encoder accepts trains nothing, so the tokenized pair is blanked here: its rejected side then
    trains no token, its end-of-turn token included."""
    tokenize = PreferenceTask.tokenize

    def blank_first_rejected(self, raw, tokenizer, config, text_columns=None):
        tokenized = tokenize(self, raw, tokenizer, config, text_columns)
        tokenized["train"] = tokenized["train"].map(
            lambda row, i: {"rejected_labels": [IGNORE_INDEX] * len(row["rejected_labels"])} if i == 0 else {},
            with_indices=True)
        return tokenized

    monkeypatch.setattr(PreferenceTask, "tokenize", blank_first_rejected)
    assert check_data(tmp_path, chat_llama, [ROWS[0], ROWS[9]])[0] == 1
    out = capsys.readouterr().out
    assert problem(out, "nothing trained")[:2] == ("FAIL", 1)
    assert problem(out, "end-of-turn token not trained")[:2] == ("FAIL", 1)
    assert "rejected min 0," in out


def test_identical_sides_have_no_gradient_exactly_for_the_types_said():
    """``CONSTANT_ON_TIES`` (what check-data says of chosen = rejected) is the set of loss types whose term has a
    zero gradient for a pair with identical sides, away from the reference."""
    zero = set()
    for loss_type in PAIR_LOSS_TYPES:
        loss = PreferenceLoss(loss_type, beta=0.1, label_smoothing=0.1 if loss_type == "exo_pair" else 0.0)
        logps = torch.tensor([-3.0, -10.0, -25.0], requires_grad=True)
        reference, tokens = torch.tensor([-5.0, -9.0, -25.5]), torch.tensor([4.0, 4.0, 4.0])
        loss(logps, logps, reference, reference, tokens, tokens).sum().backward()
        if logps.grad.abs().max().item() == 0.0:
            zero.add(loss_type)
    assert zero == set(CONSTANT_ON_TIES) and len(zero) == 8
    findings = {f.name: f for f in pair_findings([PairCheck(identical=True)], ["row 3"], 64, "bco_pair")}
    assert findings["chosen equals rejected"].rows == ["row 3"]
    assert "under --loss_type bco_pair its gradient is not 0" in findings["chosen equals rejected"].note


def test_the_shipped_recipes_pairs_check_without_a_failure(chat_llama, capsys):
    """bbc-headlines-dpo's own pairs (its articles, here with the tiny tokenizer): nothing that stops training, and
    its long articles cut to --max_length 192 (both sides of a pair keep the same prompt)."""
    assert main(["--recipe", "bbc-headlines-dpo", "--model_name_or_path", chat_llama, "--max_train_samples", "6",
                 "--max_eval_samples", "2", "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "6 training and 2 validation rows (6 training samples after tokenizing)" in out
    assert "--- sample 0 chosen" in out and "--- sample 0 rejected" in out and "FAIL" not in out
    assert problem(out, "prompt cut by --max_length 192")[:2] == ("warn", 8)
