"""GRPO as a task (issue 54): advantages as TRL 1.16 computes them, and exact accumulation over completions: with the
same completions (replayed from a record), B x 1, B/2 x 2 and 1 x B train the same weights for grpo, dr_grpo and
dapo (unequal prompt and completion lengths, truncated completions, a partial last window), a mean of micro-batch
means does not, and bnpo (TRL's per-micro-batch mean) is measured split-dependent. The record a run writes replays
to the same weights; prompt-only data with --reward_funcs is GRPO's; the Trainer backend refuses it."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from faults.mutants import MUTANT_ENV
from helpers import fault_env, launch, load_params, read_log, run_in_process, train_steps
from safetensors.torch import load_file
from tiny_models import build_tiny_chat_llama

from finetune.config import parse_config
from finetune.errors import FinetuneError
from finetune.recipes import load_recipe
from finetune.tasks import grpo_loss, run_task
from finetune.tasks.grpo import GRPOTask

WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()
PROMPTS, G, L, EOS = 10, 4, 6, 2  # windows of 4, 4 and 2 prompts at B = 4; completions of at most L tokens
REWARDS = "grpo_rewards:token_parity,grpo_rewards:topic_named"


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """Prompt-only rows of 2, 5 or 11 words (conversational, a ``topic`` column for the rewards), and a record of
    completions for 3 steps x every prompt: 1-6 tokens, about half ending in EOS, the rest cut at L (truncated)."""
    rng, root = random.Random(0), tmp_path_factory.mktemp("prompts")
    rows = [{"prompt": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 5, 11])))}],
             "topic": i % 5} for i in range(PROMPTS)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    records = []
    for step in range(1, 7):  # 3 steps, or 3 generations at steps 1, 3 and 5 (--num_iterations 2)
        for prompt in range(PROMPTS):
            for g in range(G):
                if rng.random() < 0.5:
                    ids = [rng.randrange(3, 300) for _ in range(rng.randrange(0, L))] + [EOS]
                else:
                    ids = [rng.randrange(3, 300) for _ in range(L)]
                records.append({"step": step, "prompt": prompt, "generation": g, "completion_ids": ids,
                                "rewards": {}})
    (root / "replay.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"train": str(root / "train.jsonl"), "valid": str(root / "valid.jsonl"), "replay": str(root / "replay.jsonl")}


def flags(chat_llama, data, **extra) -> dict:
    return {**dict(recipe="grpo", model_name_or_path=chat_llama, train_file=data["train"],
                   validation_file=data["valid"], reward_funcs=REWARDS, num_generations=G, max_completion_length=L,
                   learning_rate=1e-3, warmup_steps=0, num_train_epochs=1, mixed_precision="no", seed=5,
                   replay_completions=data["replay"], per_device_train_batch_size=2,
                   gradient_accumulation_steps=2), **extra}


def relative_difference(a: dict, b: dict) -> float:
    """The norm of the whole weight difference over the norm of ``a``."""
    return float(torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)) / torch.sqrt(sum((a[k] ** 2).sum() for k in a)))


def max_abs(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


SPLITS = {"Bx1": (4, 1), "B/2x2": (2, 2), "1xB": (1, 4)}


def train_split(tmp_path, chat_llama, data, name, split, **extra) -> tuple[dict, list]:
    m, n = SPLITS[split]
    _, out = run_in_process(tmp_path, f"{name}-{split.replace('/', '_')}",
                            **flags(chat_llama, data, per_device_train_batch_size=m, gradient_accumulation_steps=n,
                                    **extra))
    return weights(out), train_steps(out)


def weights(out) -> dict:
    """The run's trained tensors: the whole model's, or a LoRA adapter's."""
    adapter = out / "adapter_model.safetensors"
    return load_file(str(adapter)) if adapter.is_file() else load_params(out)


# ------------------------------------------------------------------------------------------ advantages
def test_group_advantages_are_trls_on_hand_computed_numbers():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 4.0])  # two groups of 4
    adv, std = grpo_loss.advantages(rewards, 4, "group")
    s1, s2 = math.sqrt(1 / 3), 1.0  # Bessel-corrected stds: group 1 mean 0.5, group 2 mean 2.5
    expected = [0.5 / (s1 + 1e-4), -0.5 / (s1 + 1e-4), -0.5 / (s1 + 1e-4), 0.5 / (s1 + 1e-4),
                -0.5 / (s2 + 1e-4), -0.5 / (s2 + 1e-4), -0.5 / (s2 + 1e-4), 1.5 / (s2 + 1e-4)]
    assert torch.allclose(adv, torch.tensor(expected), rtol=1e-6)
    assert torch.allclose(std, torch.tensor([s1] * 4 + [s2] * 4), rtol=1e-6)


def test_batch_and_none_scaling_and_an_unscorable_completion():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 4.0])
    batch_std = float(torch.std(rewards))  # Bessel-corrected over all 8: TRL's nanstd
    adv, _ = grpo_loss.advantages(rewards, 4, "batch")
    means = torch.tensor([0.5] * 4 + [2.5] * 4)
    assert torch.allclose(adv, (rewards - means) / (batch_std + 1e-4), rtol=1e-6)
    adv, _ = grpo_loss.advantages(rewards, 4, "none")
    assert torch.equal(adv, rewards - means)
    per_func = torch.tensor([[1.0, float("nan")], [float("nan"), float("nan")], [0.0, 2.0], [3.0, 1.0]])
    summed = grpo_loss.weighted_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert summed[0] == 1.0 and math.isnan(summed[1]) and summed[2] == 1.0 and summed[3] == 3.5
    adv, _ = grpo_loss.advantages(summed, 4, "none")  # the group mean skips the unscorable one: 5.5 / 3
    assert adv[1] == 0.0 and torch.allclose(adv[[0, 2, 3]], torch.tensor([1.0, 1.0, 3.5]) - 5.5 / 3)


def test_each_aggregation_counts_what_its_definition_names():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    real = torch.tensor([True, True, False])
    loss = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert grpo_loss.aggregate(loss, mask, "dapo") == 0 + 1 + 2 + 4
    assert grpo_loss.items(mask, real, "dapo", 6) == 4 and grpo_loss.items(mask, real, "dr_grpo", 6) == 12
    assert grpo_loss.aggregate(loss, mask, "grpo") == 1.0 + 4.0 and grpo_loss.items(mask, real, "grpo", 6) == 2
    assert grpo_loss.aggregate(loss, mask, "bnpo") == 7 / 4 and grpo_loss.items(mask, real, "bnpo", 6) == 1


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
def test_any_split_of_a_window_of_completions_trains_the_same_weights(tmp_path, chat_llama, data, loss_type):
    """B x 1, B/2 x 2, 1 x B on the replayed completions: the same weights (fp32, relative 1e-5), the same step
    losses and metrics; the partial last window (2 prompts) included."""
    runs = {split: train_split(tmp_path, chat_llama, data, loss_type, split, loss_type=loss_type) for split in SPLITS}
    ref_params, ref_steps = runs["Bx1"]
    assert [r["samples"] for r in ref_steps] == [4, 4, 2]
    for split, (params, steps) in runs.items():
        assert relative_difference(ref_params, params) < 1e-5, (split, relative_difference(ref_params, params),
                                                                max_abs(ref_params, params))
        for a, b in zip(ref_steps, steps):
            for key in ("loss", "reward", "reward_std", "completions/mean_length", "completions/clipped_ratio",
                        "entropy", "rewards/topic_named/mean"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (split, key)
    assert relative_difference(ref_params, load_params(tmp_path / f"{loss_type}-Bx1")) == 0
    moved = relative_difference(ref_params, runs["1xB"][0])
    print(f"{loss_type}: max |dW| between splits {max(max_abs(ref_params, p) for p, _ in runs.values()):.2e}, "
          f"relative {moved:.2e}")


def test_a_mean_of_micro_batch_means_breaks_it_and_bnpo_depends_on_the_split(tmp_path, chat_llama, data,
                                                                             monkeypatch):
    """The control: each micro-batch's dapo loss divided by its own tokens, then averaged over micro-batches, moves
    the weights by far more than the tolerance between B x 1 and 1 x B; TRL's bnpo (that very mean) likewise."""
    exact, _ = train_split(tmp_path, chat_llama, data, "exact", "Bx1")
    original_loss, original_count = GRPOTask.loss_sum, GRPOTask.count
    bnpo_b, _ = train_split(tmp_path, chat_llama, data, "bnpo", "Bx1", loss_type="bnpo")
    bnpo_1, _ = train_split(tmp_path, chat_llama, data, "bnpo", "1xB", loss_type="bnpo")
    monkeypatch.setattr(GRPOTask, "loss_sum", lambda self, model, batch, forward=None:
                        original_loss(self, model, batch, forward) / original_count(self, batch).clamp(min=1))
    monkeypatch.setattr(GRPOTask, "count", lambda self, batch: torch.tensor(1))
    mutant, _ = train_split(tmp_path, chat_llama, data, "mutant", "1xB")
    mutant_difference, bnpo_difference = relative_difference(exact, mutant), relative_difference(bnpo_b, bnpo_1)
    print(f"mean of means vs exact: {mutant_difference:.2e} (max |dW| {max_abs(exact, mutant):.2e}); "
          f"bnpo Bx1 vs 1xB: {bnpo_difference:.2e}")
    assert mutant_difference > 100 * 1e-5 and bnpo_difference > 100 * 1e-5


# ------------------------------------------------------------------------------------------ record and replay
def test_the_record_replays_to_the_same_weights_and_holds_each_completion(tmp_path, chat_llama, data):
    generated = dict(flags(chat_llama, data), replay_completions=None, max_steps=2, max_completion_length=3)
    _, out = run_in_process(tmp_path, "generated", **{k: v for k, v in generated.items() if v is not None})
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4 * G and [r["step"] for r in records] == [1] * 16 + [2] * 16
    assert sorted({r["generation"] for r in records}) == list(range(G))
    assert all(1 <= len(r["completion_ids"]) <= 3 and set(r["rewards"]) == {"token_parity", "topic_named"}
               for r in records)
    steps = train_steps(out)
    rewards = [r["rewards"]["token_parity"] + r["rewards"]["topic_named"] for r in records if r["step"] == 1]
    assert steps[0]["reward"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-6)
    _, again = run_in_process(tmp_path, "replayed", **dict(generated, replay_completions=str(out / "completions.jsonl"),
                                                         per_device_train_batch_size=1, gradient_accumulation_steps=4))
    assert relative_difference(load_params(out), load_params(again)) < 1e-5
    replayed = [json.loads(line) for line in (again / "completions.jsonl").read_text().splitlines()]
    assert sorted(map(json.dumps, replayed)) == sorted(map(json.dumps, records))  # the same records, rewards too


def test_a_replay_without_a_step_is_refused_in_one_line(tmp_path, chat_llama, data):
    short = tmp_path / "short.jsonl"
    short.write_text("".join(line + "\n" for line in open(data["replay"]).read().splitlines()
                             if json.loads(line)["step"] == 1))
    with pytest.raises(FinetuneError, match=r"has no completion 0 of prompt \d+ at step 2"):
        run_in_process(tmp_path, "short", **flags(chat_llama, data, replay_completions=str(short)))


# ------------------------------------------------------------------------------------------ flags and data
def test_prompt_only_rows_with_reward_funcs_are_grpo_and_without_them_refused(data):
    config = parse_config(["--train_file", data["train"], "--model_name_or_path", "m", "--reward_funcs", REWARDS])
    assert config.recipe == "grpo" and config.loss_type == "dapo" and config.beta == 0.0
    with pytest.raises(FinetuneError, match="pass --reward_funcs module:function"):
        parse_config(["--train_file", data["train"], "--model_name_or_path", "m"])


def test_the_trainer_backend_and_a_pair_loss_are_refused_in_one_line(tmp_path, chat_llama, data):
    with pytest.raises(FinetuneError, match=r"^the grpo task runs on --backend accelerate only"):
        run_in_process(tmp_path, "trainer", **flags(chat_llama, data, backend="trainer"))
    assert not (tmp_path / "trainer").exists()
    with pytest.raises(FinetuneError, match="not a GRPO aggregation"):
        run_in_process(tmp_path, "sigmoid", **flags(chat_llama, data, loss_type="sigmoid", beta=0.1))
    with pytest.raises(FinetuneError, match=r"^--loss_type dapo is a GRPO aggregation \(--recipe grpo\)"):
        run_task(load_recipe("bbc-headlines-dpo"), parse_config(["--recipe", "bbc-headlines-dpo", "--loss_type",
                                                                 "dapo"]))


# ------------------------------------------------------------------------------------------ the reference, masking
@pytest.mark.parametrize("reference", ["frozen copy", "disabled adapter"])
def test_the_kl_to_the_reference_is_0_at_the_first_step_and_exact_over_splits(tmp_path, chat_llama, data, reference):
    """--beta 0.04: at step 1 the policy is the reference, so TRL's k3 KL is exactly 0; after it, positive; and the
    KL term accumulates exactly (B x 1 against 1 x B)."""
    extra = {"beta": 0.04, "max_steps": 2, **({"use_peft": True, "lora_dropout": 0.0}
                                             if reference == "disabled adapter" else {})}
    (params, steps), (split_params, split_steps) = (train_split(tmp_path, chat_llama, data, "kl", s, **extra)
                                                    for s in ("Bx1", "1xB"))
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] > 1e-6
    assert split_steps[1]["kl"] == pytest.approx(steps[1]["kl"], rel=1e-4)
    assert relative_difference(params, split_params) < 1e-5


def test_masked_truncated_completions_train_nothing_but_count_as_trl_counts_them(tmp_path, chat_llama, data):
    """--mask_truncated_completions: a truncated completion adds no loss and no token (dapo's trained tokens are
    those of the completions that end in EOS), yet it still takes part in its group's advantages."""
    records = [json.loads(line) for line in open(data["replay"]).read().splitlines()]
    _, out = run_in_process(tmp_path, "masked", **flags(chat_llama, data, mask_truncated_completions=True,
                                                         max_steps=1))
    _, plain = run_in_process(tmp_path, "plain", **flags(chat_llama, data, max_steps=1))
    step1 = {(r["prompt"], r["generation"]): r["completion_ids"] for r in records if r["step"] == 1}
    prompts = {json.loads(line)["prompt"] for line in (out / "completions.jsonl").read_text().splitlines()}
    ended = sum(len(step1[p, g]) for p in prompts for g in range(G) if step1[p, g][-1] == EOS)
    everything = sum(len(step1[p, g]) for p in prompts for g in range(G))
    assert train_steps(out)[0]["trained_tokens"] == ended < everything == train_steps(plain)[0]["trained_tokens"]
    assert train_steps(out)[0]["completions/clipped_ratio"] == train_steps(plain)[0]["completions/clipped_ratio"] > 0


# ------------------------------------------------------------------------------------------ completions in the log
def rendered_table(markdown: str) -> list[list[str]]:
    """The rows of the table TensorBoard shows for a text summary (its own markdown rendering,
    ``plugin_util.markdown_to_safe_html``), header first, each cell's text as shown (``<br>`` a line break)."""
    import html
    import re

    from tensorboard.plugin_util import markdown_to_safe_html

    rendered = markdown_to_safe_html(markdown)
    assert rendered.startswith("<table>"), rendered[:200]
    return [[html.unescape(cell.replace("<br>", "\n")) for cell in re.findall(r"<t[hd]>(.*?)</t[hd]>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", rendered, re.S)]


def test_the_completions_table_shows_any_text_as_it_is():
    """Markdown's and HTML's special characters, pipes, tabs and line breaks in a prompt or completion render in
    TensorBoard as the text itself, in its own cell; a reward function that gave none shows "-"."""
    from finetune.outputs.reporting import completions_table

    text = "a*b*_c_ `x` [l](u) !i <b>b</b> & | \\ # h\n- item\n1. one ~~s~~ <|im_end|> &amp; \\* {b}\t tab  end"
    samples = [{"prompt": [{"role": "system", "content": "S | *"}, {"role": "user", "content": text}],
                "completion": text, "reward": 0.123456789, "rewards": {"f_1": None, "g": 1.0}},
               {"prompt": "plain", "completion": "", "reward": None, "rewards": {"f_1": None, "g": None}}]
    assert rendered_table(completions_table(samples)) == [
        ["prompt", "completion", "reward", "f_1", "g"],
        [f"system: S | *\nuser: {text}", text, "0.123457", "-", "1"], ["plain", "", "-", "-", "-"]]


def test_each_evaluation_s_completions_are_in_the_log_and_a_table_in_tensorboard(tmp_path, chat_llama, data):
    """--report_to tensorboard, evaluations at steps 0 (--eval_on_start), 1 and 2: each one's held-out prompts,
    greedy completions and rewards are in its log.jsonl record (``completions``) and, row for row, the table
    TensorBoard renders from ``eval/completions`` at that step; the text reward scored again on each shown
    completion is the one shown, the weighted reward their sum, and eval_reward the mean. (The tiny model's greedy
    completions are alike over prompts, which end alike; training moves them between evaluations.)"""
    from grpo_rewards import letters
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    _, out = run_in_process(tmp_path, "tb", **flags(chat_llama, data, report_to="tensorboard", max_steps=2,
                                                     learning_rate=0.05,  # moves the greedy completions
                                                     reward_funcs="grpo_rewards:letters,grpo_rewards:topic_named",
                                                     eval_strategy="steps", eval_steps=1, eval_on_start=True))
    tables = {}
    for path in out.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(path.parent), size_guidance={"tensors": 0})
        accumulator.Reload()
        if "eval/completions/text_summary" in accumulator.Tags()["tensors"]:
            for event in accumulator.Tensors("eval/completions/text_summary"):
                tables[event.step] = rendered_table(tensor_util.make_ndarray(event.tensor_proto)[0].decode())
    evaluations = [r for r in read_log(out) if "eval_reward" in r]
    assert [r["step"] for r in evaluations] == sorted(tables) == [0, 1, 2]
    valid = [json.loads(line) for line in Path(data["valid"]).read_text().splitlines()]
    for record in evaluations:
        shown = record["completions"]
        assert [s["prompt"] for s in shown] == [row["prompt"] for row in valid]
        texts = [s["completion"] for s in shown]
        assert [s["rewards"]["letters"] for s in shown] == letters(None, [[{"role": "assistant", "content": t}]
                                                                          for t in texts])
        for s in shown:
            parts = [v for v in s["rewards"].values() if v is not None]
            assert s["reward"] == (pytest.approx(sum(parts), rel=1e-6) if parts else None)
        assert record["eval_reward"] == pytest.approx(sum(s["reward"] for s in shown) / len(shown), rel=1e-6)
        header, *rows = tables[record["step"]]
        assert header == ["prompt", "completion", "reward", "letters", "topic_named"]
        assert [row[:2] for row in rows] == [[f"user: {v['prompt'][0]['content']}", t] for v, t in zip(valid, texts)]
        assert [row[2:] for row in rows] == [["-" if v is None else f"{v:.6g}" for v in
                                              (s["reward"], s["rewards"]["letters"], s["rewards"]["topic_named"])]
                                             for s in shown]
    assert len({tuple(s["completion"] for s in r["completions"]) for r in evaluations}) > 1  # training moved them


# ------------------------------------------------------------------------------------------ two processes
REWARD_FILE = Path(__file__).parent / "grpo_rewards.py"


@pytest.mark.parametrize("loss_type,mu,mutant", [("dapo", 1, None), ("grpo", 1, None), ("dr_grpo", 1, None),
                                                  ("dapo", 2, None), ("dapo", 1, "drop-processes")])
def test_two_processes_train_what_one_does(tmp_path, chat_llama, data, loss_type, mu, mutant):
    """2 gloo processes x 1 prompt x 2 micro-batches against one process's 4 x 1 (B = 4) on 9 prompts, replayed
    completions of 1-6 tokens, fp32: windows of 4, 4 and 1 (the last on one process, the other's row an epoch
    repeat, masked: dr_grpo counts 1 x --max_completion_length there, not 2), advantages over both processes'
    completions: the same weights (relative 1e-5), per-step losses, rewards and clip ratios, and the same record;
    with --num_iterations 2 too (each process keeps its own generation's old log-probabilities; epsilon 0.001 clips
    at each generation's second step, and the window's clip_ratio/high_max is gathered over both processes); the
    evaluation's completions shown once each, as one process shows them. The gradient norm too: it is what sees an
    engine that scales every way alike (``drop-processes``, ``tests/faults/mutants.py``: each process's own items as
    the denominator, every gradient halved on 2 processes), which verify's ways, all on the accelerate backend,
    cannot (docs/verify-mutants.md); the mutant's run logs half the norm."""
    common = flags(chat_llama, data, loss_type=loss_type, max_train_samples=9, num_iterations=mu, epsilon=0.001,
                   reward_funcs=f"{REWARD_FILE}:token_parity,{REWARD_FILE}:topic_named", eval_strategy="epoch")
    _, one = run_in_process(tmp_path, "one", **{**common, "per_device_train_batch_size": 4,
                                                "gradient_accumulation_steps": 1})
    args = []
    for key, value in {**common, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2,
                       "output_dir": str(tmp_path / "two")}.items():
        args += [f"--{key}", str(value)]
    result = launch(args, num_processes=2, env={**fault_env(), MUTANT_ENV: mutant} if mutant else None)
    assert result.returncode == 0, result.stderr[-3000:]
    two = tmp_path / "two"
    if mutant:  # the first step's gradients halved (the later ones' too, from other weights: not compared)
        assert train_steps(two)[0]["grad_norm"] == pytest.approx(train_steps(one)[0]["grad_norm"] / 2, rel=1e-5)
        return
    assert relative_difference(load_params(one), load_params(two)) < 1e-5
    for a, b in zip(train_steps(one), train_steps(two), strict=True):
        assert b["samples"] == a["samples"]
        for key in ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "entropy",
                    "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert [r["samples"] for r in train_steps(two)] == [n for n in (4, 4, 1) for _ in range(mu)]
    assert (max(r["clip_ratio/high_max"] for r in train_steps(two)) > 0) == (mu > 1)
    records = [sorted(map(json.dumps, (json.loads(line) for line in (out / "completions.jsonl").read_text()
                                       .splitlines()))) for out in (one, two)]
    assert records[0] == records[1] and len(records[0]) == 9 * G
    # the evaluation's 3 held-out prompts, with the rows Accelerate repeats to even out the processes: shown once each
    shown = [[r["completions"] for r in read_log(out) if "eval_reward" in r] for out in (one, two)]
    assert shown[0] == shown[1] and [len(c) for c in shown[1]] == [3]


# ------------------------------------------------------------------------------------------ resume
def test_a_resume_mid_epoch_regenerates_the_same_completions_bit_for_bit(tmp_path, chat_llama, data, monkeypatch):
    """Generated completions, 2 epochs of 3 steps; SIGTERM as window 4 starts (epoch 1, mid-epoch): resumed from
    'latest', every step's loss, the final weights and completions.jsonl equal the uninterrupted run's, bit for bit
    (each group's seed is (seed, step, prompt), never the generators' state)."""
    import signal

    from helpers import stop_during_window

    import finetune.backends.accelerate as engine
    from finetune.errors import TrainingStopped

    common = dict(flags(chat_llama, data, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        num_train_epochs=2, num_generations=2, max_completion_length=3))
    del common["replay_completions"]
    run_in_process(tmp_path, "full", **common)
    original = stop_during_window(monkeypatch, index=4)
    with pytest.raises(TrainingStopped) as stopped:
        run_in_process(tmp_path, "stopped", **common)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    monkeypatch.setattr(engine, "iter_windows", original)
    run_in_process(tmp_path, "stopped", **common, resume_from_checkpoint="latest")
    full, resumed = train_steps(tmp_path / "full"), train_steps(tmp_path / "stopped")
    assert len(full) == 6 and [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [r["reward"] for r in resumed] == [r["reward"] for r in full]
    a, b = load_params(tmp_path / "full"), load_params(tmp_path / "stopped")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "stopped" / "completions.jsonl").read_text() == (tmp_path / "full" / "completions.jsonl"
                                                                         ).read_text()


# ------------------------------------------------------------------------------------------ the shipped recipe
def test_the_bbc_topic_rewards_score_hand_made_completions():
    recipe = load_recipe("bbc-topic-grpo")
    completions = [[{"role": "assistant", "content": c}] for c in ("Sport.", "It is about tech, not sport", "Tech",
                                                                  "politics!", "none", "This is about technology")]
    topics = ["sports", "sports", "business", "politics", "tech", "tech"]  # as the data spells them (its folders)
    assert recipe.topic_reward(None, completions, topics) == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    # one word, and the right one: "Tech" to a business article earns nothing
    assert recipe.exact_answer_reward(None, completions, topics) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_every_topic_of_the_bbc_data_can_be_rewarded():
    """Each topic the recipe's data holds is one its question names and its rewards pay for: the corpus's folder is
    ``sports``, and a reward that knew only "sport" paid nothing on a fifth of the articles (which the first shipped
    recipe did)."""
    recipe = load_recipe("bbc-topic-grpo")
    data = recipe.load_raw_datasets(None)
    topics = set(data["train"]["topic"]) | set(data["validation"]["topic"])
    assert topics == set(recipe.TOPICS)
    for topic in topics:
        answer = [[{"role": "assistant", "content": topic.capitalize() + "."}]]
        assert recipe.topic_reward(None, answer, [topic]) == recipe.exact_answer_reward(None, answer, [topic]) == [1.0]
        assert topic in recipe.QUESTION


def test_the_bbc_topic_recipe_trains_two_steps_on_a_tiny_model(tmp_path, chat_llama):
    """The shipped recipe's data, rewards and evaluation on the tiny chat Llama: 2 steps of 2 prompts x 2
    completions; every step logs its rewards (the recipe's two functions, weighted 1 and 0.5) and the evaluation
    its held-out mean reward."""
    _, out = run_in_process(tmp_path, "topic", recipe="bbc-topic-grpo", model_name_or_path=chat_llama, max_steps=2,
                            num_generations=2, max_completion_length=4, max_train_samples=8, max_eval_samples=4,
                            learning_rate=1e-3, mixed_precision="no", eval_strategy="no")
    steps = train_steps(out)
    assert [r["samples"] for r in steps] == [2, 2]
    for r in steps:
        assert r["reward"] == pytest.approx(r["rewards/topic_reward/mean"] + 0.5 * r["rewards/exact_answer_reward/mean"],
                                            abs=1e-6)
        assert 0 < r["completions/mean_length"] <= 4
    start = next(r for r in read_log(out) if "eval_reward" in r)
    assert start["step"] == 0 and start["eval_samples"] == 4 and 0 <= start["eval_reward"] <= 1.5
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 2 and {tuple(r["rewards"]) for r in records} == {("topic_reward", "exact_answer_reward")}


def test_check_data_reads_prompts_as_generation_s_and_finds_them_clean(tmp_path, data, chat_llama, capsys):
    """``finetune check-data`` on prompt-only rows: no "nothing trained" or "end-of-turn" failure (the trained tokens
    are generated), the generated share said instead, exit 0 (a held-out file of its own prompts: no leakage)."""
    from finetune.commands.check_data import main

    valid = tmp_path / "valid.jsonl"
    valid.write_text("".join(json.dumps({"prompt": f"held out {w}", "topic": 1}) + "\n" for w in WORDS[:3]))
    code = main(["--train_file", data["train"], "--validation_file", str(valid), "--model_name_or_path", chat_llama,
                 "--reward_funcs", REWARDS, "--max_completion_length", str(L), "--num_generations", str(G)])
    out = capsys.readouterr().out
    assert code == 0 and "none: the data is clean" in out and "nothing trained" not in out
    assert f"Trained tokens: generated at each step (at most --max_completion_length {L} per completion, {G} per " \
           "prompt)" in out and "(a longer prompt is refused; completions are generated)" in out


# ------------------------------------------------------------------------------------------ --num_iterations
def test_num_iterations_trains_each_generation_mu_steps_exactly_over_splits(tmp_path, chat_llama, data):
    """--num_iterations 2: each window's completions train 2 optimizer steps against the old log-probabilities kept
    from generation (ratios move off 1 at the second: clipped at --epsilon 0.001), 6 steps for 3 windows, the
    record written once per generation; B x 1 and 1 x B train the same weights."""
    extra = dict(num_iterations=2, epsilon=0.001)
    (params, steps), (split_params, split_steps) = (train_split(tmp_path, chat_llama, data, "mu", s, **extra)
                                                    for s in ("Bx1", "1xB"))
    assert len(steps) == 6 and [r["samples"] for r in steps] == [4, 4, 4, 4, 2, 2]
    assert [r["micro_batches"] for r in steps] == [0, 1, 0, 1, 0, 1]  # the data moves on at a generation's last step
    assert all(r["clip_ratio/region_mean"] == 0 for r in steps[::2]) and all(
        r["clip_ratio/region_mean"] > 0 for r in steps[1::2])
    assert [r["reward"] for r in steps[::2]] == [r["reward"] for r in steps[1::2]]  # one generation, two steps
    assert relative_difference(params, split_params) < 1e-5
    for a, b in zip(steps, split_steps):
        assert a["clip_ratio/region_mean"] == pytest.approx(b["clip_ratio/region_mean"], rel=1e-5)
        # the window's least and largest per-completion shares, whatever the split (TRL's: per micro-batch)
        assert (a["clip_ratio/low_min"], a["clip_ratio/high_max"]) == (b["clip_ratio/low_min"],
                                                                        b["clip_ratio/high_max"])
    assert max(r["clip_ratio/high_max"] for r in steps) > 0
    records = (tmp_path / "mu-Bx1" / "completions.jsonl").read_text().splitlines()
    assert sorted({json.loads(line)["step"] for line in records}) == [1, 3, 5] and len(records) == PROMPTS * G


def test_a_resume_inside_a_generation_continues_it_bit_for_bit(tmp_path, chat_llama, data, monkeypatch):
    """--num_iterations 2, generated completions: SIGTERM as window 1 starts stops after step 3, the first of its
    generation's two steps; the resume takes that generation (and its old log-probabilities) back from
    <output_dir>/grpo_generation and ends equal to the uninterrupted run, bit for bit."""
    import signal

    from helpers import stop_during_window

    import finetune.backends.accelerate as engine
    from finetune.errors import TrainingStopped

    common = dict(flags(chat_llama, data, num_iterations=2, num_generations=2, max_completion_length=3,
                        epsilon=0.001))
    del common["replay_completions"]
    run_in_process(tmp_path, "full", **common)
    original = stop_during_window(monkeypatch, index=1)
    with pytest.raises(TrainingStopped) as stopped:
        run_in_process(tmp_path, "stopped", **common)
    assert stopped.value.exit_code == 128 + signal.SIGTERM and len(train_steps(tmp_path / "stopped")) == 3
    monkeypatch.setattr(engine, "iter_windows", original)
    run_in_process(tmp_path, "stopped", **common, resume_from_checkpoint="latest")
    full, resumed = train_steps(tmp_path / "full"), train_steps(tmp_path / "stopped")
    assert len(full) == 6 and [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [r["clip_ratio/region_mean"] for r in resumed] == [r["clip_ratio/region_mean"] for r in full]
    a, b = load_params(tmp_path / "full"), load_params(tmp_path / "stopped")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "stopped" / "completions.jsonl").read_text() == (tmp_path / "full" / "completions.jsonl"
                                                                         ).read_text()


def test_num_iterations_is_refused_by_a_task_that_generates_nothing(tmp_path):
    with pytest.raises(FinetuneError, match=r"^--num_iterations 2 is GRPO's .* the sequence-classification task"):
        run_task(load_recipe("bbc-news"), parse_config(["--recipe", "bbc-news", "--num_iterations", "2"]))
