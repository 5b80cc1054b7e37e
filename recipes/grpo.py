"""grpo: online RL of your model on your prompts, as ``trl grpo`` does: TRL's prompt-only rows (``prompt`` as text
or messages; the other columns go to the reward functions), ``--reward_funcs module:function``, completions sampled by
the policy at each step, GRPOConfig's losses. Eval: the held-out prompts' mean reward of a greedy completion."""

from __future__ import annotations

from finetune.recipes.your_data import NEEDS_HUB, YOUR_DATA, load_raw_datasets  # noqa: F401 - the recipe contract

NAME = "grpo"
DESCRIPTION = "Your prompts and reward functions on your model, as trl grpo."
TASK = "grpo"
DATASET = "yours (--train_file)"
TEXT_COLUMNS = ("prompt",)
METRICS: dict = {}
# trl 1.16 GRPOConfig's defaults where ours differ (grpo_config.py: learning_rate 1e-6, beta 0.0, loss_type "dapo")
DEFAULTS = {"learning_rate": 1e-6, "beta": 0.0, "loss_type": "dapo", "eval_strategy": "no"}
