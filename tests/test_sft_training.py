"""Instruction fine-tuning through the real engines: completion-only loss with exact accumulation, the
trained-token count, the Trainer backend's per-step losses, and the generation evaluation."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import load_params, read_log, run_in_process, train_steps
from tiny_models import build_tiny_chat_llama

WORDS = ("the market rose as shares in the bank fell after the match ended with a late goal from the striker while "
         "ministers said the election would be held in spring and the film won awards").split()


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory) -> tuple[str, str]:
    """prompt/completion rows with prompts of 3-40 words and completions of 1-6 words (uneven token
    counts per sample: where the mean of micro-batch means goes wrong)."""
    rng, root = random.Random(0), tmp_path_factory.mktemp("sft-data")

    def rows(n):
        return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 8, 21, 40]))),
                 "completion": " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 6])))} for _ in range(n)]

    paths = []
    for name, n in (("train", 32), ("valid", 6)):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(n)))
        paths.append(str(path))
    return paths[0], paths[1]


def common(chat_llama, sft_files, **extra):
    train, valid = sft_files
    return dict(recipe="bbc-headlines", model_name_or_path=chat_llama, train_file=train, validation_file=valid,
                max_length=96, learning_rate=3e-3, warmup_steps=0, disable_dropout=True, num_train_epochs=1,
                max_train_samples=None, max_eval_samples=None, eval_on_start=False, eval_strategy="no",
                mixed_precision="no", seed=5, **extra)


def _kw(**kw):
    return {k: v for k, v in kw.items() if v is not None}


def test_completion_only_accumulation_is_exact(tmp_path, chat_llama, sft_files):
    """2 x 4 equals 8 x 1 (rtol 1e-5); each step trains exactly the completion tokens (+ <|im_end|>) of its
    samples; the mean of micro-batch means (what a per-micro-batch normalisation would give) differs."""
    _, big = run_in_process(tmp_path, "8x1", **_kw(**common(chat_llama, sft_files), per_device_train_batch_size=8,
                                                  gradient_accumulation_steps=1))
    _, small = run_in_process(tmp_path, "2x4", **_kw(**common(chat_llama, sft_files), per_device_train_batch_size=2,
                                                    gradient_accumulation_steps=4))
    a, b = load_params(big), load_params(small)
    # the relative norm of the whole difference (Adam turns float noise on near-zero gradients into
    # lr-sized element updates, so no single element is the measure)
    diff = torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)) / torch.sqrt(sum((a[k] ** 2).sum() for k in a))
    assert diff < 1e-5, diff
    steps_big, steps_small = train_steps(big), train_steps(small)
    assert [r["loss"] for r in steps_small] == pytest.approx([r["loss"] for r in steps_big], rel=1e-5)
    assert [r["trained_tokens"] for r in steps_small] == [r["trained_tokens"] for r in steps_big]

    # the trained tokens are the completions' (+ one <|im_end|> each): count them with the tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_llama)
    rows = [json.loads(line) for line in open(sft_files[0])]
    completion_tokens = sum(len(tok(r["completion"], add_special_tokens=False)["input_ids"]) + 1 for r in rows)
    assert sum(r["trained_tokens"] for r in steps_big) == completion_tokens

    # per-micro-batch means would weigh short completions more: the first window's mean of means differs
    from finetune.config import parse_config
    from finetune.recipes import load_recipe
    from finetune.tasks import SFTCollator, get_task
    from finetune.tasks.builders import build_datasets

    config = parse_config(["--recipe", "bbc-headlines", "--model_name_or_path", chat_llama, "--train_file",
                           sft_files[0], "--validation_file", sft_files[1], "--max_length", "96"])
    data, _, _ = build_datasets(load_recipe("bbc-headlines"), config, tok, get_task("sft"))
    counts = [sum(1 for label in f["labels"][1:] if label != -100) for f in data["train"]]
    assert len(set(counts)) > 1
    assert SFTCollator(tok)([data["train"][0]])["labels"].shape[0] == 1


def test_trainer_backend_matches_and_generation_is_scored(tmp_path, chat_llama, sft_files):
    """The Trainer backend's per-step losses equal ours (1e-4); evaluation generates a completion for every
    validation row, scores ROUGE-L and exact match, and writes generations.jsonl and the card's samples."""
    kw = _kw(**{**common(chat_llama, sft_files), "eval_strategy": "epoch"}, per_device_train_batch_size=4,
             gradient_accumulation_steps=2)
    ours_metrics, ours = run_in_process(tmp_path, "ours", **kw)
    theirs_metrics, theirs = run_in_process(tmp_path, "trainer", backend="trainer", **kw)
    assert [r["loss"] for r in train_steps(theirs)] == pytest.approx([r["loss"] for r in train_steps(ours)], rel=1e-4)
    for metrics, out in ((ours_metrics, ours), (theirs_metrics, theirs)):
        assert metrics["eval_generated"] == 6 and 0.0 <= metrics["eval_rougeL"] <= 1.0
        assert 0.0 <= metrics["eval_exact_match"] <= 1.0 and metrics["eval_perplexity"] > 1
        lines = (out / "generations.jsonl").read_text().splitlines()
        assert len(lines) == 6 and {"generated", "reference"} <= json.loads(lines[0]).keys()
        assert "## Sample generations" in (out / "README.md").read_text()
    assert any("eval_rougeL" in r for r in read_log(ours))


@pytest.mark.integration
def test_two_gloo_processes_equal_one(tmp_path, chat_llama, sft_files):
    """Completion-only loss normalised over the whole window on every process: 2 processes x micro-batch
    2 x 2 equal 1 process x micro-batch 4 x 2 (the same 8 samples per optimizer step)."""
    from helpers import launch

    one_metrics, one = run_in_process(tmp_path, "one", **_kw(**{**common(chat_llama, sft_files), "eval_strategy": "epoch"},
                                                             per_device_train_batch_size=4, gradient_accumulation_steps=2))
    args = ["--output_dir", str(tmp_path / "two"), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2"]
    for key, value in _kw(**{**common(chat_llama, sft_files), "eval_strategy": "epoch"}).items():
        args += [f"--{key}", str(value)]
    result = launch(args, num_processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = load_params(one), load_params(tmp_path / "two")
    diff = torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)) / torch.sqrt(sum((a[k] ** 2).sum() for k in a))
    assert diff < 1e-5, diff
    assert [r["trained_tokens"] for r in train_steps(tmp_path / "two")] == [r["trained_tokens"] for r in train_steps(one)]
    # each process generated its share of the 6 validation rows; gathered in row order, as one process has them
    generated = [(tmp_path / "two" / "generations.jsonl").read_text(), (one / "generations.jsonl").read_text()]
    assert generated[0] == generated[1] and len(generated[0].splitlines()) == 6
    two_metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two_metrics["eval_generated"] == 6 and two_metrics["eval_rougeL"] == one_metrics["eval_rougeL"]


@pytest.mark.parametrize("distributed_type", ["MULTI_CPU", "FSDP"])
def test_every_rank_generates_its_share(monkeypatch, distributed_type):
    """Generation during evaluation: rank 1 of 2 generates rows 1, 3 (and repeats 3, so both ranks make the same
    number of generate calls, which a sharded model's collectives need; synced_gpus where the engine shards),
    then the completions of every rank are gathered in row order. Only rank 0 generating hung FSDP and ZeRO-3
    (their all-gathers run inside the forward) while the others waited in a broadcast."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    import finetune.lifecycle.evaluation as evaluation
    from finetune.tasks import get_task

    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)]
    calls = []

    def generate(model, tokenizer, prompts, max_length=None, synced_gpus=False, **spec):
        texts = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]  # a user turn, rendered later
        calls.append((texts, synced_gpus, model))
        return [text.replace("p", "g") for text in texts]

    rank0 = [(0, "g0"), (2, "g2"), (4, "g4")]
    monkeypatch.setattr(evaluation, "generate_completions", generate)
    monkeypatch.setattr(evaluation, "gather_object", lambda own: rank0 + own)
    # unwrap_model as Accelerate's: Accelerator.unwrap_model returns extract_model_from_parallel(model, ...)
    # (accelerate 1.15 accelerator.py line 3286), which strips DDP/FSDP1 wrappers (utils/other.py lines 294-320);
    # a real FSDP1 model on two gloo ranks: tests/test_sharded.py::test_generation_under_fsdp1_uses_whole_weights
    from accelerate.utils import extract_model_from_parallel

    accelerator = SimpleNamespace(process_index=1, num_processes=2, distributed_type=getattr(DistributedType, distributed_type),
                                  unwrap_model=extract_model_from_parallel)
    recipe = SimpleNamespace(GENERATION={"max_new_tokens": 4}, METRICS={"rouge": {}})
    module = torch.nn.Linear(2, 2)  # not wrapped: what extract_model_from_parallel gives back as it is
    metrics, predictions = evaluation.generation_eval(accelerator, module, None, rows, recipe, SimpleNamespace(max_length=64),
                                                      get_task("sft"))
    assert calls == [(["p1", "p3", "p3"], distributed_type == "FSDP", module)]
    assert predictions == ["g0", "g1", "g2", "g3", "g4"] and metrics["eval_generated"] == 5
