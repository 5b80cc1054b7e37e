"""Our GRPO task against its peer, TRL 1.16's ``GRPOTrainer`` (issue 54, "Peer"), on replayed completions: how TRL
is given our recorded completions, with the lines of TRL's code relied on, is ``tests/trl_grpo_replay.py``.
"""

from __future__ import annotations

import json
import random

import pytest
from tiny_models import build_tiny_chat_llama

trl = pytest.importorskip("trl", reason="trl is not installed: the peer comparison needs TRL 1.16's GRPOTrainer "
                                        "(pip install -e '.[test]' installs trl==1.16.0)")
from trl_grpo_replay import generation_batches, replay_config, run_trl_replay  # noqa: E402
from trl_peer import reset_accelerate_state  # noqa: E402

WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def fresh_accelerate_state():
    """Accelerate's state is process-wide and TRL's Trainer builds its own Accelerator: the tests after these
    start from a clean one."""
    yield
    reset_accelerate_state()


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


def prompt_rows(n: int, seed: int) -> list[dict]:
    """``n`` conversational prompt rows (TRL's prompt-only format) of 2-9 words, all different."""
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        row = {"prompt": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.choice([2, 5, 9])))}]}
        if row not in rows:
            rows.append(row)
    return rows


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
