"""The task seam's shape (issue 52): the ``Task`` protocol composed of its groups, a plain task's own methods few,
``loss_from_logits`` declared where it is required, each task's loss named, generation's rows read by the task."""

from __future__ import annotations

import inspect
from typing import Protocol

import pytest

from finetune.config import parse_config
from finetune.errors import FinetuneError
from finetune.recipes import load_recipe
from finetune.tasks import TASKS, SequenceClassification, StatelessTask, Task, get_task, run_task, task_of
from finetune.tasks.base import GROUPS


def members(protocol) -> set[str]:
    """The names a protocol class itself declares: its annotated facts and its methods."""
    own = vars(protocol)
    names = set(own.get("__annotations__", {})) | {n for n, v in own.items() if inspect.isfunction(v)}
    return {n for n in names if not n.startswith("_")}


def test_the_protocol_is_its_groups_and_each_member_is_in_one():
    assert Task.__bases__[:len(GROUPS)] == GROUPS and all(issubclass(g, Protocol) for g in GROUPS)
    assert [g.__name__ for g in GROUPS] == ["TaskFacts", "TaskData", "TaskRun", "TaskStep", "TaskEvaluation",
                                            "TaskTools"]
    assert members(Task) == set()  # Task adds nothing of its own: every member is in a group
    groups = [members(g) for g in GROUPS]
    everything = set().union(*groups)
    assert sum(len(g) for g in groups) == len(everything) == 41  # no member in two groups
    # GRPO: TaskFacts.generates, split_dependence and mean_of_means (finetune verify), TaskStep.rollout,
    # TaskRun.note (its vLLM line on the banner), TaskEvaluation.eval_samples
    assert [len(g) for g in groups] == [15, 6, 4, 6, 4, 6]
    assert {"loss_name", "step_metrics"} <= groups[0] and "prompt_and_reference" in groups[4]
    for name, task in TASKS.items():  # every shipped task answers every member
        assert not [m for m in everything if not hasattr(task, m)], name


def test_a_plain_task_writes_at_most_eight_methods():
    own = sorted(n for n, v in vars(SequenceClassification).items() if inspect.isfunction(v))
    assert own == ["collator", "eval_metrics", "eval_outputs", "load_model", "loss_from_logits", "probe_batch",
                   "sequences", "tokenize"]
    assert set(own) == StatelessTask.__abstractmethods__  # exactly what the base requires; the rest are defaults


def test_loss_from_logits_is_declared_where_it_is_required():
    """A stateless task that writes every method but ``loss_from_logits`` (which the default ``loss_sum`` and
    ``plain_loss_sum`` call) cannot be built: the error names the method, before any step runs."""
    written = {name: (lambda self, *args: None) for name in StatelessTask.__abstractmethods__ - {"loss_from_logits"}}
    unfinished = type("Unfinished", (StatelessTask,), written)
    assert unfinished.__abstractmethods__ == {"loss_from_logits"}
    with pytest.raises(TypeError, match="loss_from_logits"):
        unfinished()


def test_each_task_names_its_own_loss():
    assert get_task("sequence-classification").loss_name == "cross-entropy per sample"
    assert get_task("causal-lm").loss_name == "cross-entropy per label token"
    assert get_task("sft").loss_name == "cross-entropy per label token"
    assert get_task("preference").loss_name == "sigmoid DPO loss per pair"
    config = parse_config(["--recipe", "bbc-headlines-dpo", "--loss_type", "ipo"])
    assert run_task(load_recipe("bbc-headlines-dpo"), config).loss_name == "ipo DPO loss per pair"


def test_task_of_a_recipe_and_the_task_flag_that_disagrees():
    assert task_of(load_recipe("bbc-headlines-dpo")) is TASKS["preference"]
    assert task_of(load_recipe("bbc-news")) is TASKS["sequence-classification"]
    with pytest.raises(FinetuneError, match=r"^--task sft and --recipe bbc-news \(task sequence-classification\) "
                                            r"disagree: pass one of them\.$"):
        parse_config(["--recipe", "bbc-news", "--task", "sft"])


def test_generation_rows_are_read_by_the_task():
    pair = {"prompt": [{"role": "user", "content": "Q?"}], "chosen": [{"role": "assistant", "content": "yes"}],
            "rejected": [{"role": "assistant", "content": "no"}]}
    assert get_task("preference").prompt_and_reference(pair, "row 0") == ([{"role": "user", "content": "Q?"}], "yes")
    completion = {"prompt": [{"role": "user", "content": "Q?"}], "completion": [{"role": "assistant", "content": "A"}]}
    assert get_task("sft").prompt_and_reference(completion) == ([{"role": "user", "content": "Q?"}], "A")
    with pytest.raises(FinetuneError, match="row 3"):  # a pair is no conversation: the SFT task refuses it
        get_task("sft").prompt_and_reference(pair, "row 3")
