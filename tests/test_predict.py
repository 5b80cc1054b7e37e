"""finetune.commands.predict: the library function and the CLI (``python -m finetune.commands.predict``, or ``main()``
in-process) on tiny models: a classifier trained in-process, a random GPT-2, and PEFT adapters on both."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_user_error, run_in_process

from finetune.commands.predict import Predictor, predict
from finetune.errors import FinetuneError

TEXTS = [
    "Chelsea beat Arsenal 2-1 in the cup final on Saturday.",
    "Shares in the bank fell sharply after profits dropped.",
    "The new mobile phone has a faster chip and a better camera.",
    "The prime minister faces a vote in parliament next week.",
    "The film won three awards at the ceremony in London. " * 20,  # longer than max_length: truncated
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_bert) -> Path:
    """A tiny bbc-news classifier (5 labels), trained 2 optimizer steps with max_length 32, with the
    checkpoint of step 1 (``checkpoints/step_00000001``; the last step is the final model)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    tmp = tmp_path_factory.mktemp("predict")
    _, out = run_in_process(tmp, "run", model_name_or_path=tiny_bert, max_train_samples=24, max_eval_samples=8,
                            per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=2,
                            max_length=32, learning_rate=5e-3, warmup_steps=0, checkpointing_steps=1)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    return out


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory, tiny_bert) -> Path:
    """A 2-layer, 32-wide GPT-2 (random weights, seed 0) with the tiny BERT's tokenizer: a causal LM."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("tiny-gpt2")
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    config = GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=128,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _randomize_lora(model, seed: int) -> None:
    """LoRA's B matrices start at zero (the adapter is a no-op): give them, and the trained copy of a
    classifier head, random values so that the adapter changes every prediction."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.normal_(0.0, 0.5)


@pytest.fixture(scope="module")
def lora_classifier(tmp_path_factory, tiny_bert):
    """(adapter directory, the PEFT model in memory, the base directory): LoRA on a tiny 3-label BERT
    classifier, saved without a tokenizer (predict takes the base model's)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoTokenizer, BertForSequenceClassification

    root = tmp_path_factory.mktemp("lora-classifier")
    labels = {0: "sport", 1: "business", 2: "tech"}
    torch.manual_seed(0)
    base = BertForSequenceClassification.from_pretrained(tiny_bert, num_labels=3, id2label=labels,
                                                         label2id={v: k for k, v in labels.items()})
    base.save_pretrained(root / "base")
    AutoTokenizer.from_pretrained(tiny_bert).save_pretrained(root / "base")
    model = peft.get_peft_model(BertForSequenceClassification.from_pretrained(root / "base"),
                                peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"]))
    _randomize_lora(model, seed=1)
    model.save_pretrained(root / "adapter")
    return root / "adapter", model.eval(), root / "base"


@pytest.fixture(scope="module")
def lora_gpt2(tmp_path_factory, tiny_gpt2):
    """(adapter directory, the PEFT model in memory): LoRA on the tiny GPT-2, saved with its tokenizer."""
    peft = pytest.importorskip("peft")
    from transformers import AutoTokenizer, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("lora-gpt2")
    model = peft.get_peft_model(GPT2LMHeadModel.from_pretrained(tiny_gpt2),
                                peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["c_attn"],
                                                fan_in_fan_out=True))
    _randomize_lora(model, seed=2)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_gpt2).save_pretrained(path)
    return path, model.eval()


def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int, max_length: int = 128) -> str:
    """``model.generate`` run by hand on one prompt (left-truncated to ``max_length`` tokens), decoded."""
    tokenizer.truncation_side = "left"
    inputs = tokenizer([prompt], truncation=True, max_length=max_length, return_tensors="pt",
                       return_token_type_ids=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def class_probabilities(model, tokenizer, text, max_length: int) -> dict[str, float]:
    """label name -> softmax probability for one text (or (first, second) pair), the model run by hand."""
    args = (list(text[:1]), list(text[1:])) if isinstance(text, tuple) else ([text],)
    with torch.no_grad():
        logits = model(**tokenizer(*args, truncation=True, max_length=max_length, return_tensors="pt")).logits
    probs = torch.softmax(logits.float(), dim=-1)[0].tolist()
    return {model.config.id2label[i]: p for i, p in enumerate(probs)}


def assert_same_scores(result: dict, expected: dict[str, float], atol: float = 1e-5) -> None:
    assert result["label"] == max(expected, key=expected.get)
    assert set(result["scores"]) == set(expected)
    for name, p in expected.items():
        assert abs(result["scores"][name] - p) <= atol, (name, result["scores"][name], p)


def run_predict(args: list[str], stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m finetune.commands.predict ARGS`` (in the repository root) with ``stdin`` (text) as its standard input."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "finetune.commands.predict", *args], input=stdin or "",
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def output_lines(result) -> list[list[str]]:
    assert result.returncode == 0, result.stderr[-3000:]
    return [line.split("\t") for line in result.stdout.splitlines() if line.strip()]


def run_main(args: list[str], monkeypatch, capsys, stdin: str = "") -> tuple[int, list[list[str]], str]:
    """``finetune.commands.predict.main(ARGS)`` in-process (no interpreter start-up): (exit code, stdout lines split
    on tabs, stderr)."""
    import io

    from finetune.commands import predict as predict_module

    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    code = predict_module.main(args)
    captured = capsys.readouterr()
    return code, [line.split("\t") for line in captured.out.splitlines() if line.strip()], captured.err


# ------------------------------------------------------------------------------------------ library
def test_predict_gives_one_probability_distribution_per_text(trained):
    from transformers import AutoConfig

    labels = set(AutoConfig.from_pretrained(trained).id2label.values())
    results = predict(trained, TEXTS)
    assert len(results) == len(TEXTS)
    for text, result in zip(TEXTS, results):
        assert result["text"] == text
        assert result["label"] in labels and set(result["scores"]) == labels
        assert abs(sum(result["scores"].values()) - 1.0) < 1e-5
        assert all(0.0 <= p <= 1.0 for p in result["scores"].values())
        assert result["score"] == max(result["scores"].values()) == result["scores"][result["label"]]


def test_predict_equals_transformers_run_directly(trained):
    """Same argmax labels and probabilities (atol 1e-5) as the saved model run by hand, one text at a time,
    truncated to the run's max_length (32, read from run_config.json)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    predictor = Predictor(trained)
    assert predictor.max_length == json.loads((trained / "run_config.json").read_text())["max_length"] == 32
    results = predictor.predict(TEXTS, batch_size=2)  # batches mix lengths: padding must not matter

    model = AutoModelForSequenceClassification.from_pretrained(trained).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained)
    for text, result in zip(TEXTS, results):
        with torch.no_grad():
            logits = model(**tokenizer([text], truncation=True, max_length=32, return_tensors="pt")).logits
        probs = torch.softmax(logits.float(), dim=-1)[0]
        expected = {model.config.id2label[i]: p for i, p in enumerate(probs.tolist())}
        assert result["label"] == model.config.id2label[int(probs.argmax())]
        got = torch.tensor([result["scores"][name] for name in expected])
        torch.testing.assert_close(got, torch.tensor(list(expected.values())), rtol=0, atol=1e-5)


def test_batch_size_and_order_do_not_change_results(trained):
    one = predict(trained, TEXTS, batch_size=1)
    many = predict(trained, TEXTS, batch_size=32)
    reverse = predict(trained, TEXTS[::-1], batch_size=3)[::-1]
    for a, b, c in zip(one, many, reverse):
        assert a["label"] == b["label"] == c["label"]
        for name in a["scores"]:
            assert abs(a["scores"][name] - b["scores"][name]) < 1e-5
            assert abs(a["scores"][name] - c["scores"][name]) < 1e-5


def test_predict_user_errors(tmp_path, trained, tiny_bert):
    with pytest.raises(FinetuneError, match="--model .*no such directory"):
        predict(tmp_path / "missing", ["x"])
    with pytest.raises(FinetuneError, match="no config.json"):
        predict(tmp_path, ["x"])
    with pytest.raises(FinetuneError, match="no sequence-classification or causal-LM head"):
        predict(tiny_bert, ["x"])  # a bare BertModel
    with pytest.raises(FinetuneError, match="no texts"):
        predict(trained, [])
    with pytest.raises(FinetuneError, match="--max_length 4096 exceeds"):
        predict(trained, ["x"], max_length=4096)
    with pytest.raises(FinetuneError, match="--batch_size"):
        predict(trained, ["x"], batch_size=0)


def test_causal_lm_generates_a_greedy_continuation(tiny_gpt2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = ["the match ended", "shares in the bank fell sharply after"]
    results = predict(tiny_gpt2, prompts, max_new_tokens=5)
    assert [r["text"] for r in results] == prompts
    assert all(isinstance(r["generated"], str) and r["generated"] for r in results)

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2)
    inputs = tokenizer([prompts[0]], return_tensors="pt", return_token_type_ids=False)
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    expected = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert predict(tiny_gpt2, prompts[:1], max_new_tokens=5)[0]["generated"] == expected


def test_causal_lm_batches_and_truncates_like_generate_by_hand(tiny_gpt2):
    """Prompts of different lengths in one batch (left-padded by the pipeline) continue as each alone does;
    a prompt longer than max_length keeps its last max_length tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2)
    prompts = ["the match", "shares in the bank fell sharply after profits dropped at the end of the year"]
    results = predict(tiny_gpt2, prompts, batch_size=2, max_new_tokens=6)
    assert [r["generated"] for r in results] == [greedy_continuation(model, tokenizer, p, 6) for p in prompts]
    long = predict(tiny_gpt2, prompts[1:], max_length=8, max_new_tokens=6)[0]["generated"]
    assert long == greedy_continuation(model, tokenizer, prompts[1], 6, max_length=8)


def test_sentence_pairs_are_encoded_as_pairs(trained):
    """(first, second) pairs give the probabilities of the model run on tokenizer(first, second)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    pairs = [("Chelsea beat Arsenal.", "The cup final was on Saturday."), ("Shares fell.", "Profits dropped " * 30)]
    model = AutoModelForSequenceClassification.from_pretrained(trained).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained)
    for pair, result in zip(pairs, predict(trained, pairs, batch_size=2)):
        assert result["text"] == pair
        assert_same_scores(result, class_probabilities(model, tokenizer, pair, max_length=32))
    with pytest.raises(FinetuneError, match="mix single texts and sentence pairs"):
        predict(trained, [pairs[0], "a single text"])


def test_checkpoint_directory_predicts_with_that_steps_weights(trained):
    """--model <run>/checkpoints/step_N: the run's config and tokenizer with step N's weights: the
    probabilities of the model with step 1's weights run by hand, not those of the final model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    first = trained / "checkpoints" / "step_00000001"
    final = predict(trained, TEXTS)
    model = AutoModelForSequenceClassification.from_pretrained(trained).eval()
    model.load_state_dict(load_file(first / "model.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(trained)
    early = Predictor(first)
    assert early.max_length == 32  # the run's, from its run_config.json
    results = early.predict(TEXTS)
    for text, result in zip(TEXTS, results):
        assert_same_scores(result, class_probabilities(model, tokenizer, text, max_length=32))
    assert max(abs(r["scores"][k] - f["scores"][k]) for r, f in zip(results, final) for k in r["scores"]) > 1e-4


def test_checkpoint_user_errors(tmp_path, trained):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained / "checkpoints" / "step_00000001", run / "checkpoints" / "step_00000001")
    # a checkpoint is a loadable model of its own (config, tokenizer, weights): it predicts before the run ends
    assert predict(run / "checkpoints" / "step_00000001", ["x"])[0]["label"]
    (run / "checkpoints" / "step_00000001" / "config.json").unlink()  # one written before checkpoints held it
    with pytest.raises(FinetuneError, match="holds no finished model .*Let the run finish"):
        predict(run / "checkpoints" / "step_00000001", ["x"])
    (run / "checkpoints" / "step_00000001" / "COMPLETE").unlink()
    with pytest.raises(FinetuneError, match="incomplete checkpoint .*Pass another checkpoint"):
        predict(run / "checkpoints" / "step_00000001", ["x"])


def test_peft_classifier_adapter_gives_the_peft_models_probabilities(lora_classifier):
    """An adapter directory loads with AutoPeftModelForSequenceClassification (base + LoRA + trained head)
    and predicts what the PEFT model it was saved from predicts, which differs from the base model."""
    from transformers import AutoTokenizer

    adapter, model, base = lora_classifier
    tokenizer = AutoTokenizer.from_pretrained(base)
    predictor = Predictor(adapter)
    assert type(predictor.pipe.model).__name__ == "PeftModelForSequenceClassification"
    results = predictor.predict(TEXTS, batch_size=2)
    for text, result in zip(TEXTS, results):
        assert_same_scores(result, class_probabilities(model, tokenizer, text, max_length=128))
        assert abs(sum(result["scores"].values()) - 1.0) < 1e-5
    base_results = predict(base, TEXTS)
    assert max(abs(r["scores"][k] - b["scores"][k]) for r, b in zip(results, base_results) for k in r["scores"]) > 1e-2


def test_peft_causal_lm_adapter_continues_like_the_peft_model(lora_gpt2, tiny_gpt2):
    from transformers import AutoTokenizer

    adapter, model = lora_gpt2
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    prompts = ["the match ended", "shares in the bank fell sharply after"]
    results = predict(adapter, prompts, max_new_tokens=5, batch_size=2)
    expected = [greedy_continuation(model, tokenizer, p, 5) for p in prompts]
    assert [r["generated"] for r in results] == expected
    assert expected != [r["generated"] for r in predict(tiny_gpt2, prompts, max_new_tokens=5)]  # the adapter matters


def test_adapter_user_errors(tmp_path, lora_classifier):
    import shutil

    (tmp_path / "token" / "adapter_config.json").parent.mkdir()
    (tmp_path / "token" / "adapter_config.json").write_text(json.dumps({"task_type": "TOKEN_CLS"}))
    with pytest.raises(FinetuneError, match="task_type 'TOKEN_CLS'; predict handles SEQ_CLS and CAUSAL_LM"):
        predict(tmp_path / "token", ["x"])
    moved = shutil.copytree(lora_classifier[0], tmp_path / "adapter")
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")  # the base model moved away
    (moved / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(FinetuneError, match="base model .*gone.* could not be loaded.*Point base_model_name_or_path"):
        predict(moved, ["x"])


# ------------------------------------------------------------------------------------------ CLI
def test_cli_prints_one_line_per_text(trained, monkeypatch, capsys):
    result = run_predict(["--model", str(trained), "text one", "text two"])
    lines = output_lines(result)
    assert len(lines) == 2
    expected = predict(trained, ["text one", "text two"])
    for line, exp in zip(lines, expected):
        assert line[0] == exp["label"]
        assert abs(float(line[1]) - exp["score"]) < 1e-4
        assert line[-1] == exp["text"]
    assert "Predicting" not in result.stderr  # no progress bar for a handful of texts

    code, top, _ = run_main(["--model", str(trained), "--top_k", "3", "text one"], monkeypatch, capsys)
    assert code == 0 and len(top) == 1 and len(top[0]) == 3 * 2 + 1
    probs = [float(p) for p in top[0][1:6:2]]
    assert probs == sorted(probs, reverse=True)


def test_cli_stdin_file_and_output(tmp_path, trained, monkeypatch, capsys):
    texts = ["the striker scored twice", "profits fell at the bank", "a new phone chip"]
    multiline = "a new phone chip,\n\"faster\" and cheaper"  # CSV and JSONL keep texts with newlines whole
    expected = [r["label"] for r in predict(trained, texts)]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")

    # the real script: stdin, and a file of more than one batch (with a progress bar)
    lines = output_lines(run_predict(["--model", str(trained)], stdin="\n".join(texts) + "\n\n"))
    assert [line[0] for line in lines] == expected
    result = run_predict(["--model", str(trained), "--file", str(tmp_path / "texts.txt"), "--batch_size", "2"])
    assert [line[0] for line in output_lines(result)] == expected
    assert "Predicting" in result.stderr

    for args in (["-"], ["--file", "-"]):
        code, lines, _ = run_main(["--model", str(trained), *args], monkeypatch, capsys, stdin="\n".join(texts) + "\n")
        assert code == 0 and [line[0] for line in lines] == expected, args

    with open(tmp_path / "texts.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "text"])
        writer.writerows(enumerate(texts))
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": t, "label": "x"}) + "\n" for t in texts))
    for name in ("texts.txt", "texts.csv", "texts.jsonl"):
        out = tmp_path / f"{name}.out.jsonl"
        code, lines, _ = run_main(["--model", str(trained), "--file", str(tmp_path / name), "--output", str(out)],
                                  monkeypatch, capsys)
        assert code == 0 and [line[0] for line in lines] == expected, name
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["text"] for r in records] == texts
        assert [r["label"] for r in records] == expected
        for r in records:
            assert set(r) == {"text", "label", "score", "scores"}
            assert abs(sum(r["scores"].values()) - 1.0) < 1e-5
            assert r["score"] == r["scores"][r["label"]]

    with open(tmp_path / "multi.csv", "w", newline="") as f:
        csv.writer(f).writerows([["text"], [multiline], [texts[0]]])
    (tmp_path / "multi.jsonl").write_text(json.dumps({"text": multiline}) + "\n" + json.dumps({"text": texts[0]}) + "\n")
    want = [r["label"] for r in predict(trained, [multiline, texts[0]])]
    for name in ("multi.csv", "multi.jsonl"):
        out = tmp_path / f"{name}.out.jsonl"
        code, lines, _ = run_main(["--model", str(trained), "--file", str(tmp_path / name), "--output", str(out)],
                                  monkeypatch, capsys)
        assert code == 0 and [line[0] for line in lines] == want, name
        assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == [multiline, texts[0]]


def test_cli_user_errors(tmp_path, trained, monkeypatch, capsys):
    missing = run_predict(["--model", str(tmp_path / "no-such-run"), "text"])
    assert missing.returncode == 2
    assert_user_error(missing, "--model", "no such directory")

    def error(args, stdin=""):
        code, lines, err = run_main(args, monkeypatch, capsys, stdin=stdin)
        assert code == 2 and not lines, (code, lines)
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in err, err
        return errors[0]

    assert "--model" in error(["--model", str(tmp_path), "text"])  # not a model directory
    (tmp_path / "empty.txt").write_text("\n\n")
    message = error(["--model", str(trained), "--file", str(tmp_path / "empty.txt")])
    assert "--file" in message and "empty" in message
    (tmp_path / "bad.csv").write_text("sentence,label\nhello,x\n")
    message = error(["--model", str(trained), "--file", str(tmp_path / "bad.csv")])
    assert "--file" in message and "no 'text' column" in message and "sentence" in message
    assert "no texts" in error(["--model", str(trained)], stdin="")
    assert "not both" in error(["--model", str(trained), "--file", "x.txt", "text"])
    assert "--top_k" in error(["--model", str(trained), "--top_k", "0", "text"])


def test_cli_causal_lm(tiny_gpt2, monkeypatch, capsys):
    code, lines, _ = run_main(["--model", str(tiny_gpt2), "--max_new_tokens", "4", "the match", "shares fell"],
                              monkeypatch, capsys)
    assert code == 0 and len(lines) == 2 and [line[0] for line in lines] == ["the match", "shares fell"]


def test_cli_peft_adapter(lora_classifier, monkeypatch, capsys):
    adapter, _, _ = lora_classifier
    code, lines, err = run_main(["--model", str(adapter), "--top_k", "3", TEXTS[0], TEXTS[1]], monkeypatch, capsys)
    assert code == 0, err
    for line, expected in zip(lines, predict(adapter, TEXTS[:2])):
        ranked = sorted(expected["scores"].items(), key=lambda kv: -kv[1])
        assert line[0:6:2] == [name for name, _ in ranked]
        assert [float(p) for p in line[1:6:2]] == pytest.approx([p for _, p in ranked], abs=1e-4)


@pytest.mark.integration
def test_accelerate_launch_two_processes_gives_the_same_lines(tmp_path, trained):
    """Under ``accelerate launch`` with 2 CPU processes, each predicts half and the main process prints
    every result once, in input order."""
    texts = [f"text number {i} about football and shares" for i in range(5)]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    single = output_lines(run_predict(["--model", str(trained), "--file", str(tmp_path / "texts.txt")]))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", "0", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--module", "finetune.commands.predict", "--model", str(trained), "--file", str(tmp_path / "texts.txt")]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    lines = output_lines(result)
    assert "Predicting on 2 processes (cpu)" in result.stderr, result.stderr[-3000:]
    assert [line[0] for line in lines] == [line[0] for line in single]
    assert [line[-1] for line in lines] == texts
    for a, b in zip(lines, single):
        assert abs(float(a[1]) - float(b[1])) < 1e-4


def test_an_instruction_tuned_model_is_prompted_through_its_chat_template(tmp_path):
    """A model from an SFT run (its run_config.json names a recipe whose TASK is "sft") answers the text as a
    user turn rendered with the chat template, stopping at its end-of-turn token, as the run's evaluation
    generated; before, predict sent the raw text and the headline model just continued the article. A
    causal-LM run's model still continues raw text."""
    from tiny_models import build_tiny_chat_llama

    from finetune.commands.predict import Predictor
    from finetune.data.chat import generate_completions

    model_dir = build_tiny_chat_llama(tmp_path / "sft")
    (model_dir / "run_config.json").write_text(json.dumps({"recipe": "bbc-headlines", "max_length": 64}))
    predictor = Predictor(model_dir)
    texts = ["Shares in the bank fell after the match", "The minister resigned"]
    got = [r["generated"] for r in predictor.predict(texts, batch_size=2, max_new_tokens=6)]
    expected = generate_completions(predictor.pipe.model, predictor.pipe.tokenizer, texts, 6, 2, 64)
    assert predictor.chat and got == expected
    (model_dir / "run_config.json").write_text(json.dumps({"recipe": "bbc-news-clm", "max_length": 64}))
    assert not Predictor(model_dir).chat
