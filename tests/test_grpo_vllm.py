"""GRPO's ``--use_vllm`` (colocate) through a stand-in for vLLM (``tests/fakes/vllm``: vLLM needs a GPU and is not
installed here): the engine is built as TRL builds it; before each generation it holds the policy's current weights
(LoRA merged), so that its completions are the policy's, and a stale push is caught; each prompt's group is one
request under the (seed, step, prompt) seed; ``completions.jsonl`` holds the engine's completions and the run trains
exactly what a replay of them trains; without vllm, one ``error:`` line and nothing written."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import test_grpo
import torch
from helpers import run_in_process, train_steps
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from finetune.config import parse_config
from finetune.errors import FinetuneError
from finetune.recipes import load_recipe
from finetune.tasks import rollout, run_task
from finetune.tasks.base import unwrapped
from finetune.tasks.grpo import GRPOTask
from finetune.tasks.vllm_generation import ColocatedVLLM, request_seed

chat_llama, data, flags = test_grpo.chat_llama, test_grpo.data, test_grpo.flags  # its fixtures and flags
FAKES = Path(__file__).parent / "fakes"
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
PROBE = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 2, 1, 50, 51, 52]])  # a fixed input both models are read on


@pytest.fixture
def fake_vllm(monkeypatch):
    """The stand-in importable as ``vllm`` for this test only; the launch variables the engine sets restored."""
    saved = {k: os.environ.get(k) for k in LAUNCH_ENV}
    monkeypatch.syspath_prepend(str(FAKES))
    sys.modules.pop("vllm", None)
    import vllm

    vllm.ENGINES.clear()
    vllm.GENERATIONS.clear()
    yield vllm
    sys.modules.pop("vllm", None)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def vllm_flags(chat_llama, data, **extra) -> dict:
    generated = flags(chat_llama, data, use_vllm=True, max_steps=2, temperature=0.9, top_p=0.95, **extra)
    del generated["replay_completions"]
    return generated


def watch_policy(monkeypatch, params: list | None = None) -> list[torch.Tensor]:
    """The policy's logits on ``PROBE`` (eval mode, no gradients) as each rollout starts, one per step; its
    parameters too, into ``params``."""
    seen, original = [], GRPOTask.rollout

    def rollout_(self, model, window, step):
        policy = unwrapped(model)
        was = policy.training
        policy.eval()
        with torch.no_grad():
            seen.append(policy(input_ids=PROBE).logits.double())
        if params is not None:
            params.append({n: p.detach().clone() for n, p in policy.named_parameters()})
        policy.train(was)
        return original(self, model, window, step)

    monkeypatch.setattr(GRPOTask, "rollout", rollout_)
    return seen


def engine_logits(chat_llama, weights: dict) -> torch.Tensor:
    """The logits on ``PROBE`` of the model with the weights the engine held at a generation."""
    model = AutoModelForCausalLM.from_pretrained(chat_llama, dtype=torch.float32).eval()
    model.load_state_dict(weights)
    with torch.no_grad():
        return model(input_ids=PROBE).logits.double()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_engine_holds_the_policy_s_weights_at_each_generation_and_the_run_trains_its_completions(
        tmp_path, chat_llama, data, fake_vllm, monkeypatch, capsys, lora):
    extra = {"use_peft": True, "lora_dropout": 0.0, "lora_r": 4, "learning_rate": 2e-2} if lora else {}
    params = []
    seen = watch_policy(monkeypatch, params)
    _, out = run_in_process(tmp_path, "vllm", **vllm_flags(chat_llama, data, **extra))
    assert "Generation: vLLM 0.0.0+fake colocated (tensor parallel 1)" in capsys.readouterr().out
    engine, generations = fake_vllm.ENGINES, fake_vllm.GENERATIONS
    assert len(engine) == 1 and engine[0] == dict(model=chat_llama, tensor_parallel_size=1, gpu_memory_utilization=0.3,
                                                  max_model_len=None, distributed_executor_backend="external_launcher",
                                                  seed=5)
    # (a) at each generation the engine computes what the policy computes (LoRA merged: x(W + BAs) = xW + xABs)
    assert len(generations) == len(seen) == 2
    differences = [relative(engine_logits(chat_llama, g["weights"]), s) for g, s in zip(generations, seen)]
    assert max(differences) < 1e-6, differences
    print(f"{'lora' if lora else 'full'}: engine against policy logits at each generation {differences}, the "
          f"policy's move between them {relative(seen[1], seen[0]):.2e}")
    assert relative(seen[1], seen[0]) > 1e-4  # the policy moved between the generations: the check has teeth
    if not lora:  # whole weights: the very tensors, name by name
        for generation, policy in zip(generations, params):
            assert all(torch.equal(generation["weights"][name], tensor) for name, tensor in policy.items())
    # each prompt's group is one request of n = G under the (seed, step, prompt) seed
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    for step, generation in enumerate(generations, 1):
        prompts = sorted({r["prompt"] for r in records if r["step"] == step})
        seeds = {request_seed(rollout.group_seed(5, step, p)): p for p in prompts}
        assert sorted(r["seed"] for r in generation["requests"]) == sorted(seeds)
        assert all(r["n"] == 4 for r in generation["requests"])
        # (b) completions.jsonl holds the engine's completions, each under its prompt and generation
        by_prompt = {seeds[r["seed"]]: r["completions"] for r in generation["requests"]}
        for record in (r for r in records if r["step"] == step):
            assert record["completion_ids"] == by_prompt[record["prompt"]][record["generation"]]
    assert len(records) == 2 * 4 * 4 and len({len(r["completion_ids"]) for r in records}) > 1
    # (b) the run trains exactly what its completions train: a replay of them (no vLLM) ends bit for bit alike
    _, again = run_in_process(tmp_path, "replayed", **flags(chat_llama, data, replay_completions=str(
        out / "completions.jsonl"), max_steps=2, temperature=0.9, top_p=0.95, **extra))
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    mine, replayed = load_file(str(out / name)), load_file(str(again / name))
    assert all(torch.equal(mine[k], replayed[k]) for k in mine)
    assert [s["loss"] for s in train_steps(out)] == [s["loss"] for s in train_steps(again)]


def test_a_stale_push_is_caught(tmp_path, chat_llama, data, fake_vllm, monkeypatch):
    """The mutant: the engine keeps the weights of its first push. At the second generation its logits are far
    from the policy's (more than 100 x the 1e-6 the test above allows)."""
    original = ColocatedVLLM.push
    monkeypatch.setattr(ColocatedVLLM, "push", lambda self, policy: None if self.pushes else original(self, policy))
    seen = watch_policy(monkeypatch)
    run_in_process(tmp_path, "stale", **vllm_flags(chat_llama, data, use_peft=True, lora_dropout=0.0, lora_r=4,
                                                    learning_rate=2e-2))
    stale = relative(engine_logits(chat_llama, fake_vllm.GENERATIONS[1]["weights"]), seen[1])
    print(f"stale push: relative logit difference {stale:.2e}")
    assert stale > 100 * 1e-6


def test_without_vllm_use_vllm_is_one_error_line_and_writes_nothing(tmp_path, chat_llama, data,
                                                                   monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable, whatever this machine has
    with pytest.raises(FinetuneError, match=r"^--use_vllm needs the vllm package, which is not installed here: "
                                            r"pip install vllm \(it generates on a GPU\)"):
        run_in_process(tmp_path, "missing", **vllm_flags(chat_llama, data))
    assert not (tmp_path / "missing").exists()


def test_server_mode_and_a_task_that_generates_nothing_are_refused(data):
    base = ["--train_file", data["train"], "--model_name_or_path", "m", "--reward_funcs",
            "grpo_rewards:token_parity", "--use_vllm"]
    with pytest.raises(FinetuneError, match=r"^--vllm_mode server is not built: only colocate"):
        parse_config(base + ["--vllm_mode", "server"]).validate()
    with pytest.raises(FinetuneError, match=r"^--vllm_gpu_memory_utilization must lie in \(0, 1\]"):
        parse_config(base + ["--vllm_gpu_memory_utilization", "1.5"]).validate()
    with pytest.raises(FinetuneError, match=r"^--use_vllm generates GRPO's completions; the sequence-classification"):
        run_task(load_recipe("bbc-news"), parse_config(["--recipe", "bbc-news", "--use_vllm"]))
