"""Our GRPO task against its peer, TRL 1.16's ``GRPOTrainer`` (issue 54, "Peer"), on replayed completions: on the
tiny chat Llama, fp32, dropout off, the same initial weights (a LoRA adapter too), the same prompts in the same order
and the same completions (ours recorded, handed to TRL by a stand-in generation), every optimizer step's loss,
gradient norm, rewards, KL, entropy and clip ratios equal within 2e-6 for dapo, dr_grpo and grpo, with
num_iterations 1 and 2, LoRA and full fine-tuning; bnpo, and TRL's logged token metrics, measured where they depend
on the split. How TRL is given the completions, with the lines of TRL's code relied on: ``tests/trl_grpo_replay.py``.
Figures: docs/dpo.md#equal-to-trls-grpotrainer (``pytest tests/test_grpo_peer.py -s`` prints them).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from tiny_models import build_tiny_chat_llama

trl = pytest.importorskip("trl", reason="trl is not installed: the peer comparison needs TRL 1.16's GRPOTrainer "
                                        "(pip install -e '.[test]' installs trl==1.16.0)")
from trl_grpo_replay import (  # noqa: E402
    even_ids,
    generation_batches,
    length_and_parity,
    replay_config,
    run_ours,
    run_trl_replay,
)
from trl_peer import reset_accelerate_state  # noqa: E402

WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()
TOLERANCE = 2e-6
EOS = 2  # the tiny chat tokenizer's <|im_end|>
# every metric both log per step (TRL's names), compared absolute up to 1 and relative above: the losses and the KL
# are O(0.001-1), the gradient norm O(1), the entropy ~6 nats, the rewards O(1)
METRICS = ("loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "rewards/length_and_parity/mean",
           "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
           "clip_ratio/low_min", "clip_ratio/high_max", "completions/mean_length", "completions/clipped_ratio")
G, LENGTH, PROMPTS = 3, 8, 4  # generations per prompt, max_completion_length, training prompts (2 a step)
# epsilon 0.05: the second pass of num_iterations 2 clips some tokens at this learning rate
COMMON = dict(learning_rate=1e-3, warmup_steps=0, lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=1.0,
              seed=5, beta=0.1, epsilon=0.05, num_generations=G, max_completion_length=LENGTH, temperature=1.0)
LORA = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0)


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def fresh_accelerate_state():
    """Accelerate's state is process-wide and TRL's Trainer builds its own Accelerator: the tests after these
    start from a clean one."""
    yield
    reset_accelerate_state()


def prompt_rows(n: int, seed: int) -> list[dict]:
    """``n`` conversational prompt rows (TRL's prompt-only format) of 2-9 words, all different."""
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        row = {"prompt": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 5, 9])))}]}
        if row not in rows:
            rows.append(row)
    return rows


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> dict:
    """The training prompts (PROMPTS conversational rows of unequal lengths) and 2 held-out ones, as JSON lines, and
    the training rows themselves (TRL's dataset)."""
    root = tmp_path_factory.mktemp("prompts")
    rows = prompt_rows(PROMPTS + 2, seed=1)
    for name, part in (("train", rows[:PROMPTS]), ("valid", rows[PROMPTS:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return {"train": str(root / "train.jsonl"), "valid": str(root / "valid.jsonl"), "rows": rows[:PROMPTS]}


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory, prompts) -> str:
    """The tiny chat Llama with its (tied) EOS row moved towards the mean final hidden state of the training
    prompts, so that it ends some completions within LENGTH tokens (unmoved it ends almost none: every completion
    would be truncated, all of one length)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama"))
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        states = [model.model(torch.tensor([tokenizer(tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=False))["input_ids"]])).last_hidden_state[0]
            for row in prompts["rows"]]
        mean = torch.cat(states).mean(0)
        model.get_output_embeddings().weight[EOS] += 3.0 * mean / mean.norm() ** 2
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def unequal(tmp_path_factory) -> str:
    """A completions.jsonl for --replay_completions holding, for every step of the runs here and every prompt, G
    completions of 1-8 tokens (seeded random ids), most ending in EOS, those of 8 without it (truncated): ours
    replays the ones its own order draws and records them again."""
    rng = random.Random(7)
    records = []
    for step in range(1, 2 * PROMPTS + 1):
        for prompt in range(PROMPTS):
            for g in range(G):
                n = rng.choice([1, 2, 3, 5, LENGTH])
                ids = [rng.randrange(3, 300) for _ in range(n if n == LENGTH else n - 1)]
                records.append(dict(step=step, prompt=prompt, generation=g, rewards={},
                                    completion_ids=ids + ([] if n == LENGTH else [EOS])))
    path = tmp_path_factory.mktemp("replay") / "completions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, chat_llama, prompts, unequal):
    """The runs, each trained once for the whole module (the tests share them): ``runs.ours(...)`` and
    ``runs.trl(...)`` by their settings."""
    return Runs(tmp_path_factory.mktemp("runs"), chat_llama, prompts, unequal)


# ------------------------------------------------------------------------------------------ the two runs
class Runs:
    """Our runs and TRL's on the module's model, prompts and replayed completions, kept by their settings."""

    def __init__(self, root, model_dir: str, prompts: dict, unequal: str):
        self.root, self.model_dir, self.prompts, self.unequal, self.kept = root, model_dir, prompts, unequal, {}

    def ours(self, loss_type: str, peft: bool = False, num_iterations: int = 1, micro_batch: int = 1,
             accumulation: int = 2, generate: bool = False, scale_rewards: str = "group", two_rewards: bool = False,
             replay: str | None = None, **same):
        """(our run, the completions.jsonl it recorded): micro-batches of ``micro_batch`` prompts x G completions,
        the completions generated by the policy or replayed from ``replay`` (default ``unequal``); rewards
        ``length_and_parity`` (and ``even_ids`` weighted 0.5 with ``two_rewards``); ``same``: more settings, named
        as both spell them (``mask_truncated_completions``, ``epsilon_high``)."""
        key = ("ours", loss_type, peft, num_iterations, micro_batch, accumulation, generate, scale_rewards, two_rewards,
               replay, tuple(sorted(same.items())))
        if key not in self.kept:
            out = self.root / f"ours-{len(self.kept)}"
            flags = dict(recipe="grpo", output_dir=out, model_name_or_path=self.model_dir,
                         train_file=self.prompts["train"], validation_file=self.prompts["valid"], num_train_epochs=1,
                         eval_strategy="no", save_strategy="no", mixed_precision="no", loss_type=loss_type,
                         num_iterations=num_iterations, per_device_train_batch_size=micro_batch,
                         gradient_accumulation_steps=accumulation, use_peft=peft, scale_rewards=scale_rewards,
                         reward_funcs="trl_grpo_replay:length_and_parity", **COMMON, **same,
                         **(LORA if peft else {}))
            if two_rewards:
                flags.update(reward_funcs="trl_grpo_replay:length_and_parity,trl_grpo_replay:even_ids",
                             reward_weights="1.0,0.5")
            if not generate:
                flags["replay_completions"] = replay or self.unequal
            run = run_ours([arg for flag, value in flags.items() for arg in (f"--{flag}", str(value))])
            self.kept[key] = run, out / "completions.jsonl"
        return self.kept[key]

    def trl(self, record, loss_type: str, peft: bool = False, num_iterations: int = 1,
            completions_per_micro_batch: int = 2 * G, accumulation: int = 1, scale_rewards: str = "group",
            two_rewards: bool = False, **same):
        """TRL's GRPOTrainer on the same prompts, in the order of ``record`` (a run of ours), on its completions
        (``ReplayGRPOTrainer``), with our runs' settings (``same``: as ``ours``)."""
        from peft import LoraConfig

        key = ("trl", str(record), loss_type, peft, num_iterations, completions_per_micro_batch, accumulation,
               scale_rewards, two_rewards, tuple(sorted(same.items())))
        if key not in self.kept:
            generations = generation_batches(record, num_iterations)
            order = [batch[i]["prompt"] for batch in generations for i in range(0, len(batch), G)]
            args = replay_config(self.root / f"trl-{len(self.kept)}", gradient_accumulation_steps=accumulation,
                                 per_device_train_batch_size=completions_per_micro_batch, loss_type=loss_type,
                                 num_iterations=num_iterations, scale_rewards=scale_rewards,
                                 reward_weights=[1.0, 0.5] if two_rewards else None,
                                 **COMMON, **same)
            lora = LoraConfig(task_type="CAUSAL_LM", r=LORA["lora_r"], lora_alpha=LORA["lora_alpha"],
                              lora_dropout=LORA["lora_dropout"])  # peft's default target modules, as ours
            functions = [length_and_parity, even_ids] if two_rewards else [length_and_parity]
            run, trainer = run_trl_replay(self.model_dir, self.prompts["rows"], generations, args, functions,
                                          order=order, peft_config=lora if peft else None)
            assert len(trainer.replayed) == len(generations)  # every recorded batch, each once
            self.kept[key] = run
        return self.kept[key]


# ------------------------------------------------------------------------------------------ measures
def differences(a: list[dict], b: list[dict], metrics=METRICS) -> dict[str, float]:
    """Per metric: the largest difference over the steps where both log it, absolute where |value| <= 1 and
    relative above (the issue's "relative where values are large")."""
    assert len(a) == len(b), (len(a), len(b))
    found = {}
    for k in metrics:
        pairs = [(x[k], y[k]) for x, y in zip(a, b) if k in x and k in y]
        assert pairs, f"no step logs {k} on both sides"
        found[k] = max(abs(x - y) / max(1.0, abs(x)) for x, y in pairs)
    return found


def weights_difference(a: dict, b: dict) -> float:
    """The norm of the whole difference of two sets of weights over the norm of ``a``."""
    assert a.keys() == b.keys()
    return float(torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)) / torch.sqrt(sum((a[k] ** 2).sum() for k in a)))


def report(what: str, found: dict) -> None:
    print(f"\n{what}: " + ", ".join(f"{k} {v:.1e}" for k, v in found.items()))


def assert_same_run(run, peer, what, steps: int, metrics=METRICS) -> dict:
    """The same initial weights (LoRA's adapter too), ``steps`` steps on both sides, every step's ``metrics``
    within TOLERANCE and the trained weights within 1e-5 (relative, whole model). Returns the differences."""
    assert peer.initial.keys() == run.initial.keys()
    assert all(torch.equal(peer.initial[k], run.initial[k]) for k in run.initial)
    assert [r["step"] for r in run.steps] == list(range(1, steps + 1)) and len(peer.steps) == steps
    found = differences(run.steps, peer.steps, metrics)
    found["weights"] = weights_difference(run.final, peer.final)
    report(what, found)
    assert all(v <= TOLERANCE for k, v in found.items() if k != "weights"), (what, found)
    assert found["weights"] < 1e-5, (what, found)
    return found


# ------------------------------------------------------------------------------------------ the stand-in alone
def test_the_peer_is_trl_1_16():
    """The lines of TRL's code cited in trl_grpo_replay.py are TRL 1.16.0's (the test extra pins it)."""
    assert trl.__version__ == "1.16.0", f"the peer is TRL 1.16.0 (pyproject's test extra), found {trl.__version__}"


def test_the_stand_in_hands_trl_the_recorded_completions(tmp_path, chat_llama):
    """A hand-written completions.jsonl (2 generation batches of 2 prompts x 2 completions, unequal lengths, one
    without EOS): TRL's reward function receives exactly the recorded ids, batch by batch, TRL trains on them (the
    second step's loss, gradient and KL are not zero), and two runs log the same numbers, bit for bit. Records whose
    prompts are not the ones TRL asks for are refused."""
    rng = random.Random(0)
    rows = prompt_rows(4, seed=0)
    records = [dict(step=step, prompt=p, generation=g, rewards={},
                    completion_ids=[rng.randrange(3, 300) for _ in range(n)] + ([2] if eos else []))
               for step, prompts in ((1, (0, 1)), (2, (2, 3))) for p in prompts for g in range(2)
               for n, eos in [(rng.choice([1, 3, 6]), (step, p, g) != (2, 3, 1))]]
    path = tmp_path / "completions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    seen = []

    def length(prompts, completions, completion_ids, **columns):
        seen.append([list(ids) for ids in completion_ids])
        return [float(len(ids)) for ids in completion_ids]

    runs = []
    for name in ("a", "b"):
        args = replay_config(tmp_path / name, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             num_generations=2, max_completion_length=8, beta=0.1, learning_rate=1e-2, seed=3)
        run, trainer = run_trl_replay(chat_llama, rows, generation_batches(path), args, [length],
                                      order=[0, 1, 2, 3])
        runs.append(run)
        assert trainer.replayed == [[(r["prompt"], r["completion_ids"]) for r in records[:4]],
                                    [(r["prompt"], r["completion_ids"]) for r in records[4:]]]
    assert seen == 2 * [[r["completion_ids"] for r in records[:4]], [r["completion_ids"] for r in records[4:]]]
    untimed = [[{k: v for k, v in step.items() if k != "step_time"} for step in run.steps] for run in runs]
    assert untimed[0] == untimed[1] and len(untimed[0]) == 2
    second = runs[0].steps[1]
    assert second["loss"] != 0 and second["grad_norm"] > 0 and second["kl"] > 0
    assert second["completions/clipped_ratio"] == 0.25  # the one record without EOS
    assert second["completions/mean_length"] == sum(len(r["completion_ids"]) for r in records[4:]) / 4

    args = replay_config(tmp_path / "wrong", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         num_generations=2, max_completion_length=8, seed=3)
    with pytest.raises(AssertionError, match="not the recorded prompt"):
        run_trl_replay(chat_llama, rows, generation_batches(path), args, [length], order=[1, 0, 2, 3])


# ------------------------------------------------------------------------------------------ ours against TRL
# each loss type with num_iterations 1 and 2, and with LoRA and full fine-tuning (six runs, not twelve); TRL's three
# scale_rewards among them, and two reward functions (one giving None for some completions) with weights
GENERATED = ("grpo", False, 1)  # the case that trains on our policy's own samples
CASES = [("dapo", False, 1, "group", False), ("dapo", True, 2, "batch", False), ("dr_grpo", True, 1, "none", True),
         ("dr_grpo", False, 2, "group", True), ("grpo", False, 1, "batch", False), ("grpo", True, 2, "group", False)]


@pytest.mark.parametrize("loss_type,peft,num_iterations,scale_rewards,two_rewards", CASES,
                         ids=[f"{t}-{'lora' if p else 'full'}-mu{m}-{s}{'-2rewards' if r else ''}"
                              for t, p, m, s, r in CASES])
def test_every_step_equals_trls(runs, loss_type, peft, num_iterations, scale_rewards, two_rewards):
    """Completions of unequal lengths, some truncated: sampled by our policy (grpo, full, num_iterations 1: the
    stand-in checks each prompt TRL tokenises against the recorded one) or replayed (1-8 tokens, some EOS alone);
    2 prompts x G per step, beta 0.1 (the reference: a frozen copy, or the disabled adapter): ours as 1 x 2, TRL as
    one micro-batch of 2 x G (its logged kl, entropy and clip ratios are then the window's, not means of micro-batch
    means). Every step's loss, gradient norm, rewards, KL, entropy, clip ratios and completion lengths within
    2e-6; with num_iterations 2 the second pass over each batch against the old policy's log-probabilities."""
    settings = dict(scale_rewards=scale_rewards, two_rewards=two_rewards)
    run, record = runs.ours(loss_type, peft, num_iterations, generate=GENERATED == (loss_type, peft, num_iterations),
                            **settings)
    lengths = {len(json.loads(line)["completion_ids"]) for line in record.read_text().splitlines()}
    assert len(lengths) > 2 and LENGTH in lengths  # unequal, and some cut at --max_completion_length
    peer = runs.trl(record, loss_type, peft, num_iterations, **settings)
    metrics = METRICS + (("rewards/even_ids/mean",) if two_rewards else ())
    found = assert_same_run(run, peer, f"{loss_type}, {'LoRA' if peft else 'full'}, num_iterations {num_iterations}, "
                            f"scale_rewards {scale_rewards}{', two rewards' if two_rewards else ''}",
                            PROMPTS // 2 * num_iterations, metrics)
    if num_iterations > 1:  # the second pass moved off the old policy far enough to clip
        assert max(step["clip_ratio/region_mean"] for step in peer.steps) > 0, found


@pytest.fixture(scope="module")
def truncated_on_top(tmp_path_factory) -> str:
    """A completions.jsonl whose every group is one truncated completion (LENGTH tokens, no EOS: reward >= 2) and
    two that end in EOS (1-4 tokens of even ids: reward <= 1), so that both of these are below their group's mean
    (2a < T + b): under --mask_truncated_completions every trained completion has a negative advantage."""
    rng = random.Random(11)
    records = []
    for step in range(1, 2 * PROMPTS + 1):
        for prompt in range(PROMPTS):
            records.append(dict(step=step, prompt=prompt, generation=0, rewards={},
                                completion_ids=[rng.randrange(3, 300) for _ in range(LENGTH)]))
            for g in (1, 2):
                ids = [2 * rng.randrange(2, 150) for _ in range(rng.randrange(0, 4))] + [EOS]
                records.append(dict(step=step, prompt=prompt, generation=g, rewards={}, completion_ids=ids))
    path = tmp_path_factory.mktemp("replay") / "truncated-on-top.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_clip_extremes_equal_trls_where_they_are_not_0(runs, truncated_on_top):
    """clip_ratio/low_min is the least share of a trained completion's tokens clipped low: 0 wherever a trained
    completion has a non-negative advantage (one always has, in a group-normalised batch) unless the completions
    above their group's mean are masked. Here they are (``truncated_on_top``, --mask_truncated_completions), and
    the second pass of num_iterations 2 clips every trained completion low somewhere: low_min is above 0 there,
    high_max 0 (no trained completion has a positive advantage). clip_ratio/high_max, the largest share clipped
    high: at epsilon 0.05 the runs above clip low only, so epsilon_high 0.001 (TRL's name, ours too) makes the
    second pass clip high. Every step's metrics equal TRL's within 2e-6 in both."""
    low = dict(replay=truncated_on_top, mask_truncated_completions=True)
    run, record = runs.ours("dapo", num_iterations=2, **low)
    peer = runs.trl(record, "dapo", num_iterations=2, mask_truncated_completions=True)
    assert_same_run(run, peer, "dapo, full, num_iterations 2, truncated completions on top, masked", PROMPTS)
    assert [step["clip_ratio/low_min"] > 0 for step in peer.steps] == [False, True] * (PROMPTS // 2)
    assert all(step["clip_ratio/high_max"] == 0 for step in peer.steps)
    run, record = runs.ours("dapo", num_iterations=2, epsilon_high=0.001)
    peer = runs.trl(record, "dapo", num_iterations=2, epsilon_high=0.001)
    assert_same_run(run, peer, "dapo, full, num_iterations 2, epsilon_high 0.001", PROMPTS)
    assert [step["clip_ratio/high_max"] > 0 for step in peer.steps] == [False, True] * (PROMPTS // 2)
    print("low_min, high_max per step:", [(s["clip_ratio/low_min"], s["clip_ratio/high_max"]) for s in peer.steps])
