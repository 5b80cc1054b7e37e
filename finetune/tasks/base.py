"""The task seam: a training style is one ``Task`` (docs/contributing.md#add-a-task-a-training-style). Everything that
differs between training styles is asked of the task, in six groups (``GROUPS``): its facts (``TaskFacts``:
``loss_name``, ``counts_tokens``, ``packs``, ``chunked_loss``, ``chat``, ``class_labels``, ``peft_task_type``, ...),
its data (``TaskData``: files, row checks, tokenization, collation, the model), a run's own task (``TaskRun``:
``for_run``, ``attach`` a reference, ``keep`` it), the step (``TaskStep``: the summed loss of a micro-batch,
``loss_sum``, and the items the loop divides by, ``count``), evaluation (``TaskEvaluation``), and the tools' hooks
(``TaskTools``: ``finetune check-data``, the planner, ``finetune verify``, the card). ``StatelessTask`` gives a task
that holds nothing of a run every hook but eight. No module outside ``finetune/tasks/`` branches on a task's name or
class."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

import torch

from finetune.data.chat import prompt_and_reference
from finetune.data.loading import IGNORE_INDEX, load_data_files  # IGNORE_INDEX: the label value every loss skips
from finetune.errors import FinetuneError


@dataclass
class Finding:
    """A problem ``finetune check-data`` looks for in a task's raw rows (``Task.data_findings``): ``name`` (its line
    in the report), the ``rows`` it was found in (file and line, else split and index; the side where it matters),
    ``fatal`` (it makes the run wrong: exit 1 unless ``--accept_problems``) and ``note`` (one line: what it does to
    training, and the fix)."""

    name: str
    rows: list[str] = field(default_factory=list)
    fatal: bool = False
    note: str = ""


class TaskFacts(Protocol):
    """What a task is: facts other modules ask instead of its name."""

    name: str  # a recipe's TASK
    loss_name: str  # what the loss is a mean of, for the model card ("cross-entropy per label token")
    counts_tokens: bool  # items are label tokens (the log counts trained tokens)
    packs: bool  # --packing/--padding_free may pack its samples (finetune.data.packing)
    no_packing_reason: str  # why not, where it does not (the refusal's words)
    chunked_loss: bool  # --loss_chunk_size may compute its loss in chunks (finetune.tasks.chunked_loss)
    chat: bool  # rows are conversations rendered with the chat template (TRL's formats)
    class_labels: bool  # one class label per sample (stratified hold-out, label names, label counts)
    peft_task_type: str  # peft's ``TaskType`` name for LoRA
    pipeline_tag: str  # the model card's pipeline (the Hub's name: text-classification, text-generation)
    probe_label_names: list[str] | None  # label names of the planner's probe model
    step_metrics: tuple[str, ...]  # names of the per-step metrics take_metric_sums gives, in its order
    generates: bool  # trains completions it generates at each step (GRPO): the data holds no trained token
    split_dependence: str | None  # why this run's loss depends on the accumulation split by its definition, else None
    mean_of_means: tuple[str, dict] | None  # verify's positive control, where the task has its own: (what it does,
    # the flags that make the loss the mean of micro-batch means); None: the generic one


class TaskData(Protocol):
    """The data: files, row checks, tokenization, collation, and the model that reads it."""

    def load_files(self, train_file: str, validation_file: str | None, text_columns, cache_dir):
        """``--train_file``/``--validation_file`` as a ``DatasetDict`` (train, validation)."""

    def check_rows(self, split) -> None:
        """Raise ``FinetuneError`` naming the first row of ``split`` that cannot be trained on."""

    def tokenize(self, raw, tokenizer, config, text_columns): ...

    def collator(self, tokenizer, pad_to_multiple_of): ...

    def item_lengths(self, dataset) -> list[int]:
        """Tokens per item of a tokenized split, in order (``--train_sampling_strategy group_by_length``)."""

    def load_model(self, config, label_names): ...


class TaskRun(Protocol):
    """One run's task: built from its config, given what it derives from the built model."""

    def for_run(self, config) -> "Task":
        """The task a run of ``config`` uses (its own instance where the config sets its loss, else ``self``)."""

    def attach(self, model, tokenized, collator, config, main_process_first, device, precision="no"):
        """What the task derives from the built model before training (a preference task's reference); returns the
        tokenized ``DatasetDict`` the run trains on (with precomputed columns, where the task adds any). ``device``:
        where to compute; ``precision``: as the run computes ("no", "fp16", "bf16")."""

    def keep(self, output_dir) -> None:
        """Write what ``attach`` derived for the run's directory (a preference task's precomputed reference
        log-probabilities) into ``output_dir``, once it is prepared (``lifecycle.RunState.open``: after
        ``--overwrite_output_dir`` cleared it), by the processes that write it."""

    def note(self) -> str | None:
        """One line for the run's banner on what the task does that its flags do not say (GRPO's vLLM sampler), or
        None."""


class TaskStep(Protocol):
    """The training step: a micro-batch's forward, its summed loss, its items, the task's own step metrics."""

    def count(self, batch: dict) -> torch.Tensor:
        """The micro-batch's items (a 0-d int tensor); rows masked as repeats count 0."""

    def samples(self, batch: dict) -> int:
        """The micro-batch's samples (rows of its ``labels``)."""

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        """Forward ``batch`` through ``model`` and return the loss summed over its items (0-d)."""

    def model_inputs(self, batch: dict) -> dict:
        """The model's forward arguments of a micro-batch (a preference pair's two sides stacked as rows)."""

    def take_metric_sums(self) -> torch.Tensor | None:
        """The task's own per-step metric sums over the micro-batches ``loss_sum`` computed since the last call (a 1-d
        float64 tensor the loop sums over processes and divides by the window's items), or None."""

    def rollout(self, model, window: list[dict], step: int) -> list[dict]:
        """The micro-batches a window of the data's micro-batches trains at optimizer ``step`` (1-based), as many as
        ``window`` holds, before the loop counts them: the window itself, or (online RL) its prompts' generated
        completions. Collective where a task gathers over the processes."""


class TaskEvaluation(Protocol):
    """Evaluation: per-sample outputs gathered over the processes, the ``eval_*`` figures, generation's rows."""

    def eval_outputs(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        """Per-sample tensors to gather (no gradients)."""

    def eval_metrics(self, gathered: list[torch.Tensor], metric_specs: dict) -> dict: ...

    def prompt_and_reference(self, row: dict, row_name: str = "row") -> tuple[list[dict], str]:
        """(prompt messages, reference text) of a raw row: what generation continues and what its completion is
        scored against. Raises ``FinetuneError`` naming ``row_name`` for a malformed row."""

    def eval_samples(self) -> list[dict]:
        """The completions the latest ``eval_outputs`` calls generated, to show beside the figures (GRPO's: each
        held-out prompt with its completion and rewards, ``{"prompt", "completion", "reward", "rewards"}``),
        gathered over the processes in row order, each row once; [] for a task that generates none. Collective
        where a task gathers: every process calls it after each evaluation."""


class TaskTools(Protocol):
    """What the tools around a run ask: ``finetune check-data`` (``data_findings``, ``sequences``), the planner
    (``probe_batch``, ``resident_bytes``), ``finetune verify`` (``plain_loss_sum``), the model card
    (``card_settings``)."""

    def data_findings(self, raw, tokenizer, config) -> tuple[dict, list[Finding]]:
        """``finetune check-data``'s look at the raw splits (a ``DatasetDict``: train, validation) before they are
        tokenized with ``tokenizer`` under ``config``: the splits without the rows training would stop on (each named
        in a fatal finding), and the task's own ``Finding``s, each listed even where no row has it. Raises
        ``FinetuneError`` for a malformed row (as ``check_rows``)."""

    def sequences(self, row: dict) -> dict[str, tuple[list[int], list[bool] | None]]:
        """The token sequences of a tokenized row, by name ("" for a task with one; a pair's "chosen" and
        "rejected"), each as (token ids, which of them the loss trains: None where a label, not a token, is)."""

    def probe_batch(self, micro_batch: int, length: int, vocab: int, device) -> dict:
        """A worst-case micro-batch of ``micro_batch`` rows of ``length`` tokens for the planner's probes."""

    def resident_bytes(self) -> int:
        """Bytes the task keeps beside the model while training (a preference task's frozen reference copy), for the
        planner's memory estimate."""

    def plain_loss_sum(self, model, forward, batch: dict) -> torch.Tensor:
        """``loss_sum`` without gradients' concerns: from ``forward`` (``model`` or its forward without accelerate's
        autocast wrapper), fp32 logits, no auxiliary loss (``finetune verify``'s loss after the last update)."""

    def card_settings(self, config) -> list[tuple[str, object]]:
        """Rows the model card's hyperparameter table adds for this task ((setting, value) pairs)."""


class Task(TaskFacts, TaskData, TaskRun, TaskStep, TaskEvaluation, TaskTools, Protocol):
    """What a training style provides, in groups: its facts, its data, a run's own task, the step, evaluation, and
    the tools' hooks. Units: a micro-batch is a dict of tensors ``(batch, ...)`` holding ``labels``; items are what
    the loss is a mean over (samples, label tokens, pairs); counts are 0-d tensors. ``StatelessTask`` gives every
    hook but a plain task's own eight a default."""


GROUPS = (TaskFacts, TaskData, TaskRun, TaskStep, TaskEvaluation, TaskTools)  # Task's members, group by group


class StatelessTask(ABC):
    """A task that holds nothing of a run, so one object serves every run (classification, causal LM, SFT): the
    defaults of ``Task``'s hooks for it. A subclass writes its own eight: ``load_model``, ``tokenize``,
    ``collator``, ``loss_from_logits``, ``eval_outputs``, ``eval_metrics``, ``sequences``, ``probe_batch``; the
    defaults: the same object for every run, nothing attached, no per-step metrics of its own, items = the labels
    that are not ``IGNORE_INDEX`` (``count_labels``), one ``input_ids`` sequence per item, the files of
    ``data.load_data_files`` (with a ``label`` column where the task has ``class_labels``), rows checked as they
    load, no findings of its own, no rows of its own in the card, conversations' prompts and references; its
    forward takes the batch less its labels, its loss is ``loss_from_logits`` plus a mixture-of-experts model's
    auxiliary loss."""

    step_metrics: tuple[str, ...] = ()
    generates: bool = False
    split_dependence: str | None = None
    mean_of_means: tuple[str, dict] | None = None

    # ---- what a subclass writes
    @abstractmethod
    def load_model(self, config, label_names):
        """The model ``config.model_name_or_path`` names, with the task's head (label names: a classifier's)."""

    @abstractmethod
    def tokenize(self, raw, tokenizer, config, text_columns):
        """The raw splits tokenized as the task trains on them."""

    @abstractmethod
    def collator(self, tokenizer, pad_to_multiple_of):
        """The callable that pads a list of tokenized rows into a micro-batch holding ``labels``."""

    @abstractmethod
    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss summed over the items of ``labels`` (0-d, fp32), from the forward's ``logits``."""

    @abstractmethod
    def eval_outputs(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        """Per-sample tensors to gather (no gradients)."""

    @abstractmethod
    def eval_metrics(self, gathered: list[torch.Tensor], metric_specs: dict) -> dict:
        """The ``eval_*`` figures of the gathered outputs."""

    @abstractmethod
    def sequences(self, row: dict) -> dict[str, tuple[list[int], list[bool] | None]]:
        """The token sequences of a tokenized row (``Task.sequences``)."""

    @abstractmethod
    def probe_batch(self, micro_batch: int, length: int, vocab: int, device) -> dict:
        """A worst-case micro-batch for the planner's probes (``Task.probe_batch``)."""

    # ---- the defaults
    def for_run(self, config):
        """The task for a run of ``config``: this one (nothing of it depends on the config). Raises
        ``FinetuneError`` for GRPO's generation flags (``refuse_generation_flags``)."""
        refuse_generation_flags(config, self.name)
        return self

    def attach(self, model, tokenized, collator, config, main_process_first, device, precision="no"):
        """Nothing to derive from the built model: ``tokenized`` unchanged."""
        return tokenized

    def keep(self, output_dir) -> None:
        """Nothing derived to write."""
        return

    def note(self) -> str | None:
        """Nothing for the banner."""
        return None

    def load_files(self, train_file: str, validation_file: str | None, text_columns, cache_dir=None):
        """CSV or JSON-lines files with the text column(s), and ``label`` where the task has ``class_labels``
        (``data.load_data_files``)."""
        return load_data_files(train_file, validation_file, text_columns, cache_dir, with_labels=self.class_labels)

    def check_rows(self, split) -> None:
        """Rows are checked as they are loaded (``data.check_rows``)."""
        return

    def item_lengths(self, dataset) -> list[int]:
        """Tokens per item of a tokenized split (``--train_sampling_strategy group_by_length``)."""
        return [len(ids) for ids in dataset["input_ids"]]

    def count_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Items among ``labels``: those that are not ``IGNORE_INDEX`` (a classifier's rows that repeat a sample at
        an epoch's end are so labelled: ``window.mask_repeats``). Returns a 0-d int tensor."""
        return (labels != IGNORE_INDEX).sum()

    def count(self, batch: dict) -> torch.Tensor:
        """Items in a micro-batch: ``count_labels`` of its ``labels``."""
        return self.count_labels(batch["labels"])

    def samples(self, batch: dict) -> int:
        """Rows of the micro-batch (a packed row holds several samples: ``packing`` counts them itself)."""
        return batch["labels"].shape[0]

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        """Forward, then ``loss_from_logits`` plus a mixture-of-experts model's auxiliary loss (0-d). The chunked
        loss (``loss.loss_function``) replaces this where ``--loss_chunk_size`` serves the model."""
        inputs, labels = split_labels(batch)
        outputs = model(**inputs)
        return with_auxiliary(self.loss_from_logits(outputs.logits, labels), outputs, model,
                              self.count_labels(labels))

    def model_inputs(self, batch: dict) -> dict:
        """The model's forward arguments of a micro-batch: all but its ``labels``."""
        return split_labels(batch)[0]

    def take_metric_sums(self):
        """No per-step metrics of its own: None."""
        return None

    def rollout(self, model, window: list[dict], step: int) -> list[dict]:
        """The window as it is: nothing is generated."""
        return window

    def prompt_and_reference(self, row: dict, row_name: str = "row") -> tuple[list[dict], str]:
        """(prompt messages, reference text) of a TRL conversation row (``chat.prompt_and_reference``). Raises
        ``FinetuneError`` for a row in neither TRL format."""
        return prompt_and_reference(row, row_name)

    def eval_samples(self) -> list[dict]:
        """No generated completions to show: []."""
        return []

    def data_findings(self, raw, tokenizer, config) -> tuple:
        """No findings of its own: every row is kept (its rows are checked when loaded)."""
        return raw, []

    def resident_bytes(self) -> int:
        """Bytes the task keeps beside the model while training: none."""
        return 0

    def plain_loss_sum(self, model, forward, batch: dict) -> torch.Tensor:
        """The loss summed over the batch's items from ``forward`` (``model``, or its forward without accelerate's
        autocast wrapper), in fp32, without an auxiliary loss (``finetune verify``'s loss after the last update)."""
        inputs, labels = split_labels(batch)
        return self.loss_from_logits(forward(**inputs).logits.float(), labels)

    def card_settings(self, config) -> list[tuple[str, object]]:
        """Rows the model card's hyperparameter table adds for this task: none."""
        return []


def refuse_generation_flags(config, task_name: str) -> None:
    """Raise ``FinetuneError`` for GRPO's generation flags given to a task that generates nothing:
    ``--num_iterations`` other than 1 (it would repeat each window's optimizer step) or ``--use_vllm``."""
    if getattr(config, "num_iterations", 1) != 1:
        raise FinetuneError(f"--num_iterations {config.num_iterations} is GRPO's (optimizer steps per generation); "
                            f"the {task_name} task generates nothing: drop the flag.")
    if getattr(config, "use_vllm", False):
        raise FinetuneError(f"--use_vllm generates GRPO's completions; the {task_name} task generates nothing: drop "
                            "the flag.")


def split_labels(batch: dict) -> tuple[dict, torch.Tensor]:
    """``batch`` without its ``labels`` (a new dict: the model's inputs), and the labels."""
    inputs = dict(batch)
    return inputs, inputs.pop("labels")


def unwrapped(model):
    """``model`` without its wrappers (DDP, accelerate's: each holds the wrapped model as ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def auxiliary_loss_sum(outputs, model, items: torch.Tensor):
    """A mixture-of-experts model's router load-balancing loss for this micro-batch, weighted by its ``items``:
    ``router_aux_loss_coef x aux_loss x items`` (a 0-d tensor), or None where the model returns no ``aux_loss``
    (transformers computes it when the config's ``output_router_logits`` is set) or its coefficient is 0. The
    loop divides by the window's items, so each micro-batch's term counts by its share of the window's items;
    with one micro-batch this is the model's own ``loss = CE + coef x aux_loss`` (transformers 5.23
    ``modeling_mixtral.py`` ``MixtralForCausalLM.forward``)."""
    aux = getattr(outputs, "aux_loss", None)
    if aux is None:
        return None
    coefficient = float(getattr(getattr(unwrapped(model), "config", None), "router_aux_loss_coef", 0.0) or 0.0)
    return coefficient * aux * items if coefficient else None


def with_auxiliary(loss_sum: torch.Tensor, outputs, model, items: torch.Tensor) -> torch.Tensor:
    """``loss_sum`` plus the model's ``auxiliary_loss_sum``, if any."""
    auxiliary = auxiliary_loss_sum(outputs, model, items)
    return loss_sum if auxiliary is None else loss_sum + auxiliary
