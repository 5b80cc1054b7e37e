"""Preference rows in TRL's formats (finetune/data/preference.py): explicit and implicit prompts, each side
encoded as SFT encodes a prompt-completion pair, and one error line per malformed row."""

from __future__ import annotations

import pytest
from tiny_models import smollm2_like_tokenizer

from finetune.data.chat import NoFitError, _render, encode_conversation
from finetune.data.loading import IGNORE_INDEX
from finetune.data.preference import PAIR_COLUMNS, ImplicitPromptError, check_pair, encode_pair, split_pair
from finetune.errors import FinetuneError

USER = {"role": "user", "content": "Write the headline of this BBC News article."}
BLUE = {"role": "assistant", "content": "Shares in the bank rose"}
GREEN = {"role": "assistant", "content": "The striker scored a late goal"}


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_like_tokenizer()


def test_an_explicit_prompt_of_strings_becomes_a_user_turn_and_assistant_turns():
    prompt, chosen, rejected = split_pair({"prompt": USER["content"], "chosen": BLUE["content"],
                                           "rejected": GREEN["content"]})
    assert (prompt, chosen, rejected) == ([USER], [BLUE], [GREEN])


def test_an_implicit_prompt_is_the_turns_both_sides_share():
    """TRL 1.16 ``extract_prompt``: the longest common run of leading turns (here a system and a user turn)."""
    system = {"role": "system", "content": "Be brief."}
    row = {"chosen": [system, USER, BLUE], "rejected": [system, USER, GREEN]}
    assert split_pair(row) == ([system, USER], [BLUE], [GREEN])
    # a string prompt beside conversational sides is ignored, as TRL's maybe_extract_prompt does
    assert split_pair({"prompt": "ignored", **row}) == ([system, USER], [BLUE], [GREEN])
    # None keys (Arrow fills missing fields) are dropped before comparing
    assert split_pair({"chosen": [{**USER, "name": None}, BLUE], "rejected": [USER, GREEN]}) == ([USER], [BLUE], [GREEN])


def test_each_side_is_encoded_as_sft_encodes_its_prompt_and_completion(tokenizer):
    """The chosen side's ids and labels are exactly SFT's for (prompt, chosen) without ``assistant_only_loss``; the
    prompt's tokens are the same on both sides and untrained; each side trains all the template writes after the
    prompt, as TRL 1.16's DPOTrainer does: its completion, end-of-turn token and the newline after it."""
    pair = encode_pair(tokenizer, {"prompt": [USER], "chosen": [BLUE], "rejected": [GREEN]}, max_length=128)
    assert list(pair) == list(PAIR_COLUMNS)
    sft = encode_conversation(tokenizer, [USER], [BLUE], 128, assistant_only_loss=False)
    assert (pair["chosen_input_ids"], pair["chosen_labels"]) == (sft["input_ids"], sft["labels"])
    first = pair["chosen_labels"].index(next(t for t in pair["chosen_labels"] if t != IGNORE_INDEX))
    assert pair["rejected_input_ids"][:first] == pair["chosen_input_ids"][:first]  # the shared prompt
    assert all(t == IGNORE_INDEX for t in pair["rejected_labels"][:first])
    trained = [t for t in pair["rejected_labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(trained) == GREEN["content"] + "<|im_end|>\n"


@pytest.mark.parametrize("row,needle,implicit", [
    ({"prompt": "p", "chosen": "c"}, "needs 'chosen' and 'rejected'", False),
    ({"chosen": "a", "rejected": "b"}, "without 'prompt', 'chosen' and 'rejected' must be whole conversations", False),
    ({"chosen": [USER, BLUE], "rejected": [{"role": "user", "content": "other"}, GREEN]}, "share no leading turn", True),
    ({"chosen": [USER], "rejected": [USER, GREEN]}, "'chosen' is all prompt", True),
    ({"chosen": [USER, BLUE, USER, GREEN], "rejected": [USER, GREEN, USER, BLUE]},
     "part at turn 1, before a later user turn", True),
    ({"prompt": [USER], "chosen": "text", "rejected": "text"}, "all be strings or all be message lists", False),
    ({"prompt": [USER], "chosen": [], "rejected": [GREEN]}, "'chosen' must be a non-empty list", False),
])
def test_a_malformed_row_is_refused_with_one_line_naming_it(row, needle, implicit):
    with pytest.raises(FinetuneError) as caught:
        split_pair(row, "train.jsonl line 7")
    message = str(caught.value)
    assert message.startswith("train.jsonl line 7: ") and needle in message and "\n" not in message
    # an implicit prompt that is not a common prefix is told apart: check-data lists such rows
    assert isinstance(caught.value, ImplicitPromptError) == implicit


def test_a_side_that_is_not_the_assistants_or_too_long_names_the_row_and_side(tokenizer):
    with pytest.raises(FinetuneError, match=r"^row 3 \('rejected'\): 'completion' may hold only assistant turns"):
        encode_pair(tokenizer, {"prompt": [USER], "chosen": [BLUE], "rejected": [USER]}, 128, "row 3")
    with pytest.raises(FinetuneError, match=r"^row 4 \('chosen'\): "):
        encode_pair(tokenizer, {"prompt": [USER], "chosen": [BLUE], "rejected": [GREEN]}, 4, "row 4")


def test_check_pair_measures_the_cut_prompt_and_what_a_side_needs(tokenizer):
    """A 98-token prompt at --max_length 64: each side's cut is the prompt's rendering less what that side keeps,
    and both sides keep the prompt the longer rejected side keeps (54 tokens cut; the chosen side alone would keep
    11 more); at 24 neither side fits even with the user turn
    emptied, and what each needs is measured (as ``NoFitError`` counts it), not raised."""
    long_user = {"role": "user", "content": " ".join(["Shares in the bank rose after the market opened."] * 4)}
    row = {"prompt": [long_user], "chosen": [BLUE], "rejected": [{"role": "assistant", "content": GREEN["content"] * 2}]}
    check = check_pair(tokenizer, row, 64, "row 2")
    whole = len(_render(tokenizer, [long_user], add_generation_prompt=True))
    for side in ("chosen", "rejected"):
        labels = encode_pair(tokenizer, row, 64)[f"{side}_labels"]
        assert check.prompt_cut[side] == whole - labels.index(next(t for t in labels if t != IGNORE_INDEX)) > 0
    assert (check.prompt_cut["chosen"], check.prompt_cut["rejected"]) == (54, 54)
    pair = encode_pair(tokenizer, row, 64)
    prompts = [pair[f"{side}_input_ids"][:pair[f"{side}_labels"].index(next(t for t in pair[f"{side}_labels"]
                                                                             if t != IGNORE_INDEX))]
               for side in ("chosen", "rejected")]
    assert prompts[0] == prompts[1]  # one prompt: both log-probabilities are conditioned on the same text
    alone = encode_conversation(tokenizer, [long_user], [BLUE], 64)["labels"]
    assert whole - alone.index(next(t for t in alone if t != IGNORE_INDEX)) == 43  # the chosen side alone: 43 cut
    assert not check.refused and not check.identical and check.repeats_prompt == []
    short = check_pair(tokenizer, row, 24, "row 2")
    with pytest.raises(NoFitError) as caught:
        encode_pair(tokenizer, row, 24, "row 2")
    assert short.refused and short.no_fit["chosen"] == caught.value.tokens == 44 and short.no_fit["rejected"] == 55
    assert str(caught.value).startswith("row 2 ('chosen'): ")
