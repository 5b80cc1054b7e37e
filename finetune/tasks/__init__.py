"""Training styles, one module each, behind one protocol (``base.Task``): classification, causal LM, instruction
tuning (SFT), preference tuning (DPO), online RL (GRPO). ``task_of(recipe)`` gives a recipe's task, ``run_task(recipe, config)`` a
run's own; ``get_task(name)`` a task by its name. Adding a style: docs/contributing.md#add-a-task."""

from __future__ import annotations

from finetune.tasks.base import IGNORE_INDEX, StatelessTask, Task, auxiliary_loss_sum, split_labels, with_auxiliary
from finetune.tasks.causal_lm import CausalLM, CausalLMCollator
from finetune.tasks.classification import SequenceClassification
from finetune.tasks.grpo import GRPOTask
from finetune.tasks.preference import PreferenceTask
from finetune.tasks.sft import SFT_TASK, InstructionCausalLM, SFTCollator

# A recipe's TASK -> the task object
TASKS: dict[str, Task] = {task.name: task for task in (SequenceClassification(), CausalLM(), SFT_TASK,
                                                        PreferenceTask(), GRPOTask())}

__all__ = ["IGNORE_INDEX", "TASKS", "CausalLM", "CausalLMCollator", "GRPOTask", "InstructionCausalLM", "SFTCollator", "SFT_TASK",
           "PreferenceTask", "SequenceClassification", "StatelessTask", "Task", "auxiliary_loss_sum", "get_task",
           "run_task", "split_labels", "task_of", "with_auxiliary"]


def get_task(name: str) -> Task:
    """The task object named ``name`` (a recipe's ``TASK``). Raises ``KeyError`` naming the known tasks."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]


def task_of(recipe) -> Task:
    """The task ``recipe`` trains (its ``TASK``), as no run has configured it: for what does not depend on a run's
    settings (its facts, its data's checks, its rows' prompts). Raises ``KeyError`` as ``get_task``."""
    return get_task(recipe.TASK)


def run_task(recipe, config) -> Task:
    """The task of one run of ``recipe`` under ``config`` (``task.for_run``): built once per run and handed to
    everything that asks it (builders, the loop, evaluation, the card). Raises ``KeyError`` for an unknown ``TASK``
    and the task's ``FinetuneError`` for settings it refuses."""
    return task_of(recipe).for_run(config)
