"""Training styles, one module each, behind one protocol (``base.Task``): classification, causal LM, instruction
tuning (SFT). ``get_task(recipe.TASK)`` gives a recipe's task. Adding a style: docs/contributing.md#add-a-task."""

from __future__ import annotations

from finetune.tasks.base import IGNORE_INDEX, Task, auxiliary_loss_sum, split_labels, with_auxiliary
from finetune.tasks.causal_lm import CausalLM, CausalLMCollator
from finetune.tasks.classification import SequenceClassification
from finetune.tasks.sft import SFT_TASK, InstructionCausalLM, SFTCollator

# A recipe's TASK -> the task object
TASKS: dict[str, Task] = {task.name: task for task in (SequenceClassification(), CausalLM(), SFT_TASK)}

__all__ = ["IGNORE_INDEX", "TASKS", "CausalLM", "CausalLMCollator", "InstructionCausalLM", "SFTCollator", "SFT_TASK",
           "SequenceClassification", "Task", "auxiliary_loss_sum", "get_task", "split_labels", "with_auxiliary"]


def get_task(name: str) -> Task:
    """The task object for a recipe's ``TASK``. Raises ``KeyError`` naming the known tasks."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]
