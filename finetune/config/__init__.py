"""The one run configuration: a dataclass whose field names match `TrainingArguments` where the
concept is the same, parsed from the command line by `transformers.HfArgumentParser`.

Precedence: dataclass default < recipe ``DEFAULTS`` < command-line flag.

Read-only once validated: ``validate()`` ends by freezing the config (assigning a field raises
``dataclasses.FrozenInstanceError``); a changed run is a new config (``dataclasses.replace``), validated
again. Values derived while resolving a run (``derived(...)`` fields: where the precision came from, the batch
plan) are fields too, so ``run_config.json`` holds them, but no flag sets them.

Each flag says what it is for where it is defined: ``flag(default, help, *, step, trainer, ...)`` keeps its roles
in the field's metadata (a ``Roles``), and every list of flags the code needs is a query over them
(``fields_with``). The roles:

- ``step`` (required): part of what one optimizer step means (which samples, in which batch, through which
  model). A checkpoint resumes only under the same values (``checkpoint.step_meaning``, ``check_compatible``).
- ``trainer`` (required): the ``TrainingArguments`` argument the Trainer backend passes it as (the installed
  transformers' name), a tuple of names that all get its value, or None (not one of Trainer's arguments: the
  Trainer backend reads it from the config, or it has no counterpart). ``to_trainer``: the conversion, where
  Trainer's value differs from ours (``trainer_backend.training_arguments``).
- ``replay`` (default True): a replayed ``run_config.json`` (``--config``) sets it. False for where this run
  writes and whether it resumes: the new command line decides those (``read_config_file``).
- ``same_run`` (default True): compared when a new run finds a previous run's config in its ``--output_dir``
  (``output.check_output_dir``). False where a change leaves it the same run: where it goes, checkpoints,
  logging, the Hub.
- ``compare_passes`` (default True): ``finetune compare`` passes it to both backends' runs
  (``compare.child_argv``). False where compare decides itself: the backend, the output directories, the batch
  plan it resolved once.
- ``verify`` (default ``KEPT``): the value ``finetune verify`` fixes for its check (``verify.CHECK_SETTINGS``);
  ``KEPT``: the run's own value.
- ``derived``: set while the run is resolved, never by a flag (``derived(default, replay=...)``): the parser has
  no flag for it, ``config_argv`` never emits it, a rerun does not compare it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import shlex
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import yaml
from transformers import HfArgumentParser

from finetune.argv import given
from finetune.errors import FinetuneError
from finetune.recipes import load_recipe

MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16")
# The precision this project is defined by: Accelerator(mixed_precision="fp16"), loss scaling included.
DEFAULT_MIXED_PRECISION = "fp16"
LR_SCHEDULER_CHOICES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)

ROLES = "roles"  # the metadata key of a field's Roles (HfArgumentParser gets the other keys: "help")


class _Kept:
    """``KEPT``: ``verify`` leaves the field at the run's own value (None is a value verify may fix)."""

    def __repr__(self) -> str:
        return "KEPT"


KEPT = _Kept()


@dataclass(frozen=True)
class Roles:
    """What a ``TrainConfig`` field is for; the module docstring defines each role."""

    step: bool
    trainer: str | tuple[str, ...] | None
    to_trainer: Callable | None = None
    replay: bool = True
    same_run: bool = True
    compare_passes: bool = True
    verify: object = KEPT
    derived: bool = False

    @property
    def trainer_arguments(self) -> tuple[str, ...]:
        """The ``TrainingArguments`` names the field is passed as (none, one or several)."""
        if self.trainer is None:
            return ()
        return (self.trainer,) if isinstance(self.trainer, str) else tuple(self.trainer)


def flag(default, help: str, *, step: bool, trainer: str | tuple[str, ...] | None, to_trainer: Callable | None = None,
         replay: bool = True, same_run: bool = True, compare_passes: bool = True, verify=KEPT):
    """A ``TrainConfig`` flag: ``dataclasses.field`` with its ``help`` for the parser and its ``Roles``.
    ``step`` and ``trainer`` have no default: every flag says whether it is part of what a step means and
    what Trainer calls it. Raises ``TypeError`` (at import) when either is missing."""
    declared = Roles(step=step, trainer=trainer, to_trainer=to_trainer, replay=replay, same_run=same_run,
                     compare_passes=compare_passes, verify=verify)
    return field(default=default, metadata={"help": help, ROLES: declared})


def derived(default, *, replay: bool):
    """A value the run derives while it is resolved, never a flag: not part of a step's meaning, not a Trainer
    argument, not compared by a rerun, not passed by ``compare``, kept by ``verify``; ``replay``: whether a
    replayed ``run_config.json`` sets it. Left out of ``==`` (``compare=False``), so the config that
    ``config_argv``'s flags rebuild equals the one they came from."""
    declared = Roles(step=False, trainer=None, same_run=False, compare_passes=False, replay=replay, derived=True)
    return field(default=default, compare=False, metadata={ROLES: declared})


def roles(name: str) -> Roles:
    """The ``Roles`` of the ``TrainConfig`` field ``name``. Raises ``KeyError`` for a name that is no field."""
    return _FIELDS[name].metadata[ROLES]


def fields_with(**wanted) -> tuple[str, ...]:
    """Names of the ``TrainConfig`` fields whose roles have every given value, in definition order: e.g.
    ``fields_with(step=True)``, ``fields_with(replay=False)``. Raises ``TypeError`` for an unknown role."""
    unknown = set(wanted) - {f.name for f in dataclasses.fields(Roles)}
    if unknown:
        raise TypeError(f"unknown role(s): {', '.join(sorted(unknown))}")
    return tuple(name for name, f in _FIELDS.items()
                 if all(getattr(f.metadata[ROLES], role) == value for role, value in wanted.items()))


def check_settings() -> dict:
    """What ``finetune verify`` fixes for its check: {field: value} for every field whose ``verify`` role is not
    ``KEPT``."""
    return {name: roles(name).verify for name in _FIELDS if roles(name).verify is not KEPT}


def trainer_arguments(config) -> dict:
    """{``TrainingArguments`` argument: value} of every field of ``config`` with a ``trainer`` role, converted by
    its ``to_trainer`` where it has one (``trainer_backend.training_arguments`` adds the arguments no single
    field gives)."""
    arguments = {}
    for name in _FIELDS:
        role, value = roles(name), getattr(config, name)
        for argument in role.trainer_arguments:
            arguments[argument] = role.to_trainer(value) if role.to_trainer else value
    return arguments


def is_bf16(mixed_precision: str) -> bool:
    """``--mixed_precision`` as ``TrainingArguments(bf16=...)``."""
    return mixed_precision == "bf16"


def or_trainer_save_steps(save_steps: float | None) -> float:
    """``--save_steps`` as ``TrainingArguments(save_steps=...)``, which takes no None: its default, 500
    (transformers 5.24 training_args.py lines 1183-1184), where the flag is unset (Trainer ignores it unless
    ``save_strategy`` is ``steps``, which needs ``--save_steps``)."""
    return 500 if save_steps is None else save_steps


@dataclass
class TrainConfig:
    """Every setting of a run. Units: batch sizes in samples, steps in optimizer steps unless named
    ``micro``, lengths in tokens, learning rate per optimizer step.

    Raises ``FinetuneError`` from ``validate()`` for values that cannot run, naming the flag. After
    ``validate()`` assigning any attribute raises ``dataclasses.FrozenInstanceError``: build a changed copy
    with ``dataclasses.replace(config, name=value)`` and validate that.
    """

    recipe: str = flag(
        "bbc-news", "Recipe name (see --list_recipes) or path/to/recipe.py.",
        step=True, trainer=None,
    )
    list_recipes: bool = flag(
        False, "Print the known recipes and exit.",
        step=False, trainer=None, replay=False, same_run=False, compare_passes=False,
    )
    output_dir: str | None = flag(
        None, "Where the model, metrics.json and log.jsonl go. Default: outputs/<recipe>.",
        step=False, trainer=None, replay=False, same_run=False, compare_passes=False,
    )
    overwrite_output_dir: bool = flag(
        False, "Allow writing into an output_dir that already holds another run.",
        step=False, trainer=None, replay=False, same_run=False, compare_passes=False, verify=True,
    )
    model_name_or_path: str | None = flag(
        None, "Hub id or local model directory. Default: the recipe's model.",
        step=True, trainer=None,
    )
    attn_implementation: str | None = flag(
        None, "The model's attention implementation (TRL's ModelConfig name; transformers' attn_implementation): "
        "'sdpa', 'eager', 'flash_attention_2', 'flex_attention', ... Default: transformers' choice (sdpa where "
        "torch has it).",
        step=False, trainer=None,
    )
    train_file: str | None = flag(
        None, "Your own training data: CSV or JSON lines with the recipe's text column(s) and `label`.",
        step=True, trainer=None,
    )
    validation_file: str | None = flag(
        None, "Your own validation data (same format). Default: 20%% split of train_file.",
        step=False, trainer=None,
    )
    dataset_name: str | None = flag(
        None,
        "A dataset by name (TRL's flag): a folder written by save_to_disk, a folder of "
        "data files, or a Hub name (needs the Hub).",
        step=True, trainer=None,
    )
    dataset_config: str | None = flag(
        None, "The --dataset_name configuration (subset).",
        step=True, trainer=None,
    )
    dataset_train_split: str = flag(
        "train", "The --dataset_name split to train on.",
        step=True, trainer=None,
    )
    dataset_test_split: str = flag(
        "test",
        "The --dataset_name split to validate on; without it 20%% of the train "
        "split is held out.",
        step=False, trainer=None,
    )
    per_device_train_batch_size: int = flag(
        8, "Micro-batch size in samples, per process, per forward/backward.",
        # a split of the effective batch B: B is part of a step's meaning (elastic.batch_meaning), its split is not
        step=False, trainer="per_device_train_batch_size",
    )
    per_device_eval_batch_size: int = flag(
        32, "Evaluation batch size per process.",
        step=False, trainer="per_device_eval_batch_size",
    )
    total_batch_size: int | None = flag(
        None,
        "Global effective batch per optimizer step (samples). Sets the accumulation steps so "
        "micro-batch x accumulation x processes equals it exactly.",
        step=False, trainer=None, compare_passes=False, verify=None,
    )
    auto_find_batch_size: bool = flag(
        False, "With --total_batch_size: use the largest micro-batch that fits in memory (probe steps).",
        step=False, trainer=None, compare_passes=False, verify=False,
    )
    max_memory_mb: int | None = flag(
        None,
        "CPU memory budget for --auto_find_batch_size (MiB; default: available RAM). "
        "The estimate leaves out transient buffers (0.2-0.4 GiB under the real peak "
        "at bbc-news, 256 tokens): leave a margin.",
        step=False, trainer=None, compare_passes=False,
    )
    gradient_accumulation_steps: int = flag(
        1, "Micro-batches per optimizer step (N). Effective batch = micro x N x processes.",
        step=False, trainer="gradient_accumulation_steps",  # a split of B, as per_device_train_batch_size
    )
    # Trainer's fp16 is asked for on CUDA only, in trainer_backend.training_arguments (a CPU runs fp32)
    mixed_precision: Literal["no", "fp16", "bf16"] | None = flag(
        None,
        "Autocast precision; fp16 uses loss scaling (on a CPU it does not run: fp32). "
        "Default: the accelerate config's or launcher's fp16/bf16, else fp16.",
        step=False, trainer="bf16", to_trainer=is_bf16,
    )
    learning_rate: float = flag(
        5e-5, "Peak AdamW learning rate.",
        step=False, trainer="learning_rate",
    )
    weight_decay: float = flag(
        0.0, "AdamW weight decay (not on biases and LayerNorm).",
        step=False, trainer="weight_decay",
    )
    optim: Literal["adamw_torch", "adamw_torch_fused"] = flag(
        "adamw_torch", "AdamW implementation (TrainingArguments names); fused is one kernel per step.",
        step=False, trainer="optim",
    )
    adam_beta1: float = flag(
        0.9, "AdamW beta1.",
        step=False, trainer="adam_beta1",
    )
    adam_beta2: float = flag(
        0.999, "AdamW beta2.",
        step=False, trainer="adam_beta2",
    )
    adam_epsilon: float = flag(
        1e-8, "AdamW epsilon.",
        step=False, trainer="adam_epsilon",
    )
    num_train_epochs: float = flag(
        3.0, "Epochs (fractions allowed). Ignored if max_steps > 0.",
        step=False, trainer="num_train_epochs",
    )
    max_steps: int = flag(
        -1, "Total optimizer steps; overrides num_train_epochs if > 0.",
        step=False, trainer="max_steps",
    )
    lr_scheduler_type: Literal[LR_SCHEDULER_CHOICES] = flag(
        "linear", "LR schedule, sized in optimizer steps.",
        step=False, trainer="lr_scheduler_type",
    )
    warmup_steps: float = flag(
        0,
        "Linear warmup: a count of optimizer steps, or a float in [0, 1): that ratio of "
        "the total optimizer steps (as TrainingArguments; there is no warmup_ratio).",
        step=False, trainer="warmup_steps",
    )
    max_grad_norm: float = flag(
        1.0, "Clip the global grad norm to this (0 disables).",
        step=False, trainer="max_grad_norm",
    )
    max_length: int = flag(
        128, "Truncate inputs to this many tokens.",
        step=True, trainer=None,
    )
    block_size: int | None = flag(
        None, "Causal LM: concatenate texts and cut blocks of this many tokens (default: one text per sample).",
        step=True, trainer=None,
    )
    max_train_samples: int | None = flag(
        None, "Use only the first N training samples.",
        step=True, trainer=None,
    )
    max_eval_samples: int | None = flag(
        None, "Use only the first N evaluation samples.",
        step=False, trainer=None,
    )
    eval_strategy: Literal["no", "steps", "epoch"] = flag(
        "epoch",
        "When to evaluate: after every epoch, every --eval_steps optimizer steps "
        "(and after the last one), or never ('no').",
        step=False, trainer=None, verify="no",
    )
    eval_steps: float | None = flag(
        None,
        "With --eval_strategy steps: optimizer steps between evaluations, or a float in "
        "[0, 1): that ratio of the total steps.",
        step=False, trainer=None,
    )
    logging_steps: float = flag(
        1,
        "Optimizer steps between console/tracker updates (or a ratio in [0, 1) of the "
        "total). log.jsonl always has one record per optimizer step.",
        step=False, trainer=None, same_run=False, verify=1,
    )
    backend: Literal["accelerate", "trainer"] = flag(
        "accelerate", "Training engine: our accelerator.accumulate() loop, or transformers' Trainer.",
        step=False, trainer=None, compare_passes=False, verify="accelerate",
    )
    compare: bool = flag(
        False, "Run both backends with the same settings and write comparison.md/json/png.",
        step=False, trainer=None, compare_passes=False, verify=False,
    )
    eval_on_start: bool = flag(
        False, "Also evaluate before the first optimizer step.",
        step=False, trainer=None, verify=False,
    )
    save_strategy: Literal["no", "steps", "epoch"] = flag(
        "no",
        "When to write a resumable checkpoint: every --save_steps optimizer steps, after "
        "every epoch, or never. A signal (SIGTERM/SIGINT) always writes one.",
        step=False, trainer="save_strategy", same_run=False, verify="no",
    )
    save_steps: float | None = flag(
        None,
        "With --save_strategy steps (implied when only this is given): optimizer steps "
        "between checkpoints, or a float in [0, 1): that ratio of the total steps.",
        step=False, trainer="save_steps", to_trainer=or_trainer_save_steps, same_run=False,
    )
    checkpointing_steps: str | None = flag(
        None,
        "Older spelling: N means --save_strategy steps --save_steps N; 'epoch' means --save_strategy "
        "epoch.",
        step=False, trainer=None, same_run=False, verify=None,
    )
    load_best_model_at_end: bool = flag(
        False,
        "Keep the checkpoint with the best --metric_for_best_model and make it the final "
        "model. Needs --save_strategy equal to --eval_strategy (steps: --save_steps a "
        "multiple of --eval_steps).",
        step=False, trainer=None, verify=False,
    )
    metric_for_best_model: str | None = flag(
        None, "The eval metric that decides the best model (default 'loss', i.e. eval_loss).",
        step=False, trainer=None,
    )
    greater_is_better: bool | None = flag(
        None,
        "Whether a larger --metric_for_best_model is better (default: False for a "
        "loss, True otherwise).",
        step=False, trainer=None,
    )
    early_stopping_patience: int | None = flag(
        None,
        "Stop after this many evaluations in a row without improving "
        "--metric_for_best_model (needs --load_best_model_at_end).",
        step=False, trainer=None, verify=None,
    )
    save_total_limit: int | None = flag(
        None, "Keep only the newest K checkpoints.",
        step=False, trainer="save_total_limit", same_run=False, verify=None,
    )
    resume_from_checkpoint: str | None = flag(
        None,
        "'latest' (newest complete checkpoint in output_dir), 'auto' (latest if there "
        "is one, else a fresh start; a finished run exits 0: one command for a "
        "requeued job) or a checkpoint path.",
        step=False, trainer=None, replay=False, same_run=False, verify=None,
    )
    ignore_checkpoint_mismatch: bool = flag(
        False, "Resume even if the effective batch or the data differ (another split of the same batch needs no "
        "flag; samples are never replayed or skipped).",
        step=False, trainer=None, same_run=False,
    )
    max_skipped_steps: int = flag(
        10, "fp16: stop after this many optimizer steps in a row skipped by the GradScaler.",
        step=False, trainer=None,
    )
    ddp_timeout: int = flag(
        1800,
        "Seconds a collective waits for a peer process before the run fails (torch's "
        "process-group timeout; TrainingArguments' name and default).",
        step=False, trainer="ddp_timeout",
    )
    preemption_grace_seconds: float | None = flag(
        None,
        "Seconds the scheduler allows between its stop signal and SIGKILL (SLURM: the "
        "partition's GraceTime, or N of --signal=B:USR1@N). finetune train sets "
        "torchrun's shutdown timeout to it (default 30 s), and the run warns when an "
        "optimizer step plus a checkpoint will not fit in it.",
        step=False, trainer=None, same_run=False,
    )
    report_to: Literal["none", "tensorboard", "trackio", "wandb", "all"] = flag(
        "none", "Experiment tracking through Accelerate's trackers (TensorBoard works offline).",
        step=False, trainer="report_to", verify="none",
    )
    push_to_hub: bool = flag(
        False,
        "Upload the model directory to the Hugging Face Hub (huggingface_hub's HfApi, "
        "main process only): at the end, and per --hub_strategy after checkpoints. "
        "Needs a token (`hf auth login` or HF_TOKEN); checked before training.",
        step=False, trainer=None, same_run=False,
    )
    hub_model_id: str | None = flag(
        None,
        "The Hub repository (TrainingArguments' name): 'name' (your namespace) or "
        "'org/name'. Default: <your user>/<the --output_dir folder's name>.",
        step=False, trainer=None, same_run=False,
    )
    hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = flag(
        "every_save",
        "What to push and when, as TrainingArguments: 'end' (the final model "
        "only), 'every_save' (also the model of every checkpoint, in the "
        "background), 'checkpoint' (and the newest checkpoint in "
        "last-checkpoint/, to resume from), 'all_checkpoints' (each one in "
        "its own folder).",
        step=False, trainer=None, same_run=False,
    )
    hub_private_repo: bool | None = flag(
        None,
        "Create the repository private (default: public unless the organisation's "
        "default is private; ignored if the repository exists).",
        step=False, trainer=None, same_run=False,
    )
    train_sampling_strategy: Literal["random", "group_by_length"] = flag(
        "random",
        "Training order (TrainingArguments name): 'random', or 'group_by_length' (shuffled, then "
        "sorted by length within mega-batches of 50 optimizer steps, so micro-batches need less padding).",
        step=True, trainer="train_sampling_strategy",
    )
    padding_free: bool = flag(
        False,
        "Causal LM/SFT (TRL's name): each micro-batch's samples concatenated into one row, position_ids restarting "
        "per sample, no padding computed; the same samples and label tokens per step as padded micro-batches "
        "(docs/packing.md).",
        step=False, trainer=None,  # how a step is computed, not which samples form it
    )
    packing: bool = flag(
        False,
        "Causal LM/SFT (TRL's name): repack each optimizer step's own samples into padding-free micro-batches of at "
        "most --max_tokens_per_micro_batch tokens (--packing_strategy); which samples form a step never changes "
        "(docs/packing.md).",
        step=False, trainer=None,
    )
    packing_strategy: Literal["window_bfd"] = flag(
        "window_bfd",
        "With --packing: 'window_bfd', best-fit decreasing within each accumulation window. TRL's dataset-wide "
        "'bfd'/'wrapped' are not offered: they change which samples form a step.",
        step=False, trainer=None,
    )
    max_tokens_per_micro_batch: int | None = flag(
        None,
        "With --packing: positions per packed micro-batch, per process (its rows x its longest row's tokens; rows "
        "hold at most --max_length tokens). Default: micro-batch x max_length, the most a padded micro-batch "
        "computes (docs/packing.md).",
        step=False, trainer=None,
    )
    torch_compile: bool = flag(
        False, "Compile the model with torch.compile (inductor) through Accelerate's dynamo plugin.",
        step=False, trainer="torch_compile",
    )
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune"] | None = flag(
        None, "torch.compile mode (implies --torch_compile).",
        step=False, trainer="torch_compile_mode",
    )
    dataloader_num_workers: int = flag(
        0, "DataLoader worker processes (0: collate in the training process).",
        step=False, trainer="dataloader_num_workers",
    )
    dataloader_pin_memory: bool = flag(
        True, "Pin host memory for faster copies to a GPU (ignored on a CPU).",
        step=False, trainer="dataloader_pin_memory",
    )
    activation_checkpointing: bool = flag(
        False,
        "Recompute each layer's activations in the backward pass instead of keeping "
        "them (less memory, about one more forward of time); non-reentrant.",
        step=False, trainer=None,
    )
    gradient_checkpointing: bool | None = flag(
        None, "Deprecated alias of --activation_checkpointing (as in TrainingArguments).",
        step=False, trainer=None,
    )
    activation_checkpointing_kwargs: str | None = flag(
        None,
        "JSON object, as TrainingArguments takes it: \"every_n_layers\" (checkpoint "
        "only every n-th layer: less recompute, more memory) and \"offload\" (saved "
        "activations in host memory) for activation_checkpointing_enable, the other "
        "keys for torch.utils.checkpoint (default {\"use_reentrant\": false}).",
        step=False, trainer=None,
    )
    loss_chunk_size: int | None = flag(
        None,
        "Causal LM: compute the loss from the final hidden states, this many label "
        "tokens at a time, never materialising the (batch, seq, vocab) logits (0: the "
        "plain full logits). Default: 1024 on a CPU, where it was measured faster and "
        "7x lighter; 0 on a GPU until measured there.",
        step=False, trainer=None,
    )
    use_peft: bool = flag(
        False,
        "Train LoRA adapters (peft) instead of every weight: the base model stays "
        "frozen (no gradients, no optimizer state); a classifier head stays trainable.",
        step=True, trainer=None,
    )
    lora_r: int = flag(
        16, "LoRA rank (TRL's default).",
        step=True, trainer=None,
    )
    lora_alpha: int = flag(
        32, "LoRA alpha: the update is scaled by alpha / r.",
        step=True, trainer=None,
    )
    lora_dropout: float = flag(
        0.05, "Dropout on the LoRA branch.",
        step=True, trainer=None, verify=0.0,
    )
    lora_target_modules: str | None = flag(
        None,
        "Comma-separated module names to adapt, or 'all-linear' (default: peft's "
        "choice for the architecture, e.g. the attention projections).",
        step=True, trainer=None,
    )
    merge_adapter: bool = flag(
        False,
        "With --use_peft: also write the base model with the adapter merged in, to "
        "<output_dir>/merged (a plain model directory).",
        step=False, trainer=None,
    )
    seed: int = flag(
        42, "Seed for initialisation, data order and dropout.",
        step=True, trainer=("seed", "data_seed"),
    )
    disable_dropout: bool = flag(
        False, "Set every dropout probability to 0 (deterministic, comparable runs).",
        step=False, trainer=None, verify=True,
    )
    cache_dir: str | None = flag(
        None, "Where tokenized datasets are cached. Default: the datasets library cache.",
        step=False, trainer=None,
    )
    # ---- derived: set while the run is resolved, never by a flag
    # where mixed_precision came from: "--mixed_precision", "the accelerate config/launcher" or "the default";
    # a replay resolves it again
    precision_source: str | None = derived(None, replay=False)
    # the batch planner's plan under --total_batch_size (planner.BatchPlan.to_dict: micro-batch, accumulation,
    # processes, total, the lever setting chosen under --auto_find_batch_size), set by finetune.run.apply_plan;
    # a replay takes it as recorded (read_config_file)
    batch_plan: dict | None = derived(None, replay=True)

    def __post_init__(self) -> None:
        # Precedence: --mixed_precision, then the accelerate config or `accelerate launch --mixed_precision`
        # (the launcher exports it as ACCELERATE_MIXED_PRECISION), then our default. The launcher's "no" is
        # also its value when nothing was configured, so only its fp16/bf16 count as a choice. A copy
        # (dataclasses.replace, or run_config.json read back) keeps the source it was resolved from.
        if self.mixed_precision is None:
            launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
            if launcher in ("fp16", "bf16"):
                self.mixed_precision, self.precision_source = launcher, "the accelerate config/launcher"
            else:
                self.mixed_precision, self.precision_source = DEFAULT_MIXED_PRECISION, "the default"
        elif self.precision_source is None:
            self.precision_source = "--mixed_precision"
        if self.gradient_checkpointing is not None:  # the deprecated alias, folded into the new name once
            self.activation_checkpointing = self.activation_checkpointing or self.gradient_checkpointing
            self.gradient_checkpointing = None
        if self.torch_compile_mode is not None:
            self.torch_compile = True  # as TrainingArguments: a mode implies compilation
        if self.checkpointing_steps is not None:  # the older flag, parsed once into the TrainingArguments pair
            value, self.checkpointing_steps = str(self.checkpointing_steps), None
            if value == "epoch":
                self.save_strategy = "epoch"
            elif value.isdigit() and int(value) >= 1:
                self.save_strategy, self.save_steps = "steps", int(value)
            else:
                raise FinetuneError(f"--checkpointing_steps must be a positive integer (optimizer steps) or 'epoch', "
                                    f"got {value!r}.")
        if self.save_steps is not None and self.save_strategy == "no":
            self.save_strategy = "steps"
        if self.metric_for_best_model is None and self.load_best_model_at_end:
            self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            # TrainingArguments' rule: a metric named like a loss is minimised
            self.greater_is_better = not self.metric_for_best_model.removeprefix("eval_").endswith("loss")

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_read_only"):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to {name!r}: a TrainConfig is read-only after validate(). Build a changed copy "
                f"with dataclasses.replace(config, {name}=...) and validate that.")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_read_only"):
            raise dataclasses.FrozenInstanceError(f"cannot delete {name!r}: a TrainConfig is read-only after "
                                                  "validate().")
        super().__delattr__(name)

    @property
    def best_metric_key(self) -> str:
        """The ``metrics`` key of ``metric_for_best_model`` (``eval_`` prefixed, as Trainer does)."""
        name = self.metric_for_best_model or "loss"
        return name if name.startswith("eval_") else f"eval_{name}"

    def validate(self) -> None:
        """Check values that argparse cannot; raise ``FinetuneError`` naming the flag and the fix. A config
        that passes is read-only from then on (``dataclasses.FrozenInstanceError`` on assignment)."""
        self._check_batch()
        self._check_optimization()
        self._check_step_counts()
        self._check_evaluation_and_saving()
        self._check_data()
        self._check_processes()
        self._check_peft()
        self._check_memory_levers()
        self._check_packing()
        self._check_hub()
        object.__setattr__(self, "_read_only", True)  # not a field: copies (dataclasses.replace) start writable

    def _check_batch(self) -> None:
        """Batch sizes and accumulation (samples, micro-batches), and the planner's flags."""
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            _check_positive_int(name, getattr(self, name))
        if self.auto_find_batch_size and not self.total_batch_size:
            raise FinetuneError("--auto_find_batch_size needs --total_batch_size (the effective batch it must keep).")
        if self.total_batch_size is not None and self.total_batch_size < 1:
            raise FinetuneError(f"--total_batch_size must be a positive integer, got {self.total_batch_size}.")

    def _check_optimization(self) -> None:
        """Precision, learning rate, length of training, clipping, fp16's skipped steps."""
        if self.mixed_precision not in MIXED_PRECISION_CHOICES:
            raise FinetuneError(
                f"--mixed_precision must be one of {', '.join(MIXED_PRECISION_CHOICES)}, got {self.mixed_precision!r}."
            )
        if self.learning_rate <= 0:
            raise FinetuneError(f"--learning_rate must be > 0, got {self.learning_rate}.")
        if self.num_train_epochs <= 0 and self.max_steps <= 0:
            raise FinetuneError("--num_train_epochs must be > 0 (or set --max_steps to a positive number).")
        if self.max_grad_norm < 0:
            raise FinetuneError(f"--max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}.")
        if self.max_skipped_steps < 1:
            raise FinetuneError(f"--max_skipped_steps must be >= 1, got {self.max_skipped_steps}.")

    def _check_step_counts(self) -> None:
        """The flags that take a count of optimizer steps or a ratio of the total."""
        for name in ("warmup_steps", "logging_steps", "eval_steps", "save_steps"):
            value = getattr(self, name)
            if value is not None and (value < 0 or (value >= 1 and value != int(value))):
                raise FinetuneError(f"--{name} must be a whole number of optimizer steps or a ratio in [0, 1) of the "
                                    f"total steps, got {value}.")
        for name in ("logging_steps", "eval_steps", "save_steps"):
            if getattr(self, name) == 0:
                raise FinetuneError(f"--{name} must be > 0 (a count of optimizer steps, or a ratio in (0, 1)).")

    def _check_evaluation_and_saving(self) -> None:
        """When to evaluate and to save, and what the two decide together (the best model, early stopping)."""
        if self.eval_strategy == "steps" and self.eval_steps is None:
            raise FinetuneError("--eval_strategy steps needs --eval_steps N (optimizer steps between evaluations).")
        if self.eval_steps is not None and self.eval_strategy != "steps":
            raise FinetuneError(f"--eval_steps is used only with --eval_strategy steps (it is {self.eval_strategy!r}); "
                                "add --eval_strategy steps or drop --eval_steps.")
        if self.save_strategy == "steps" and self.save_steps is None:
            raise FinetuneError("--save_strategy steps needs --save_steps N (optimizer steps between checkpoints).")
        if self.load_best_model_at_end:
            self._check_best_model()
        if self.early_stopping_patience is not None:
            if self.early_stopping_patience < 1:
                raise FinetuneError(f"--early_stopping_patience must be >= 1, got {self.early_stopping_patience}.")
            if not self.load_best_model_at_end:
                raise FinetuneError("--early_stopping_patience needs --load_best_model_at_end (as Trainer's "
                                    "EarlyStoppingCallback): otherwise the run would end on a worse model.")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise FinetuneError(f"--save_total_limit must be >= 1, got {self.save_total_limit}.")

    def _check_best_model(self) -> None:
        """``--load_best_model_at_end``: a checkpoint at every evaluation."""
        if self.eval_strategy == "no":
            raise FinetuneError("--load_best_model_at_end needs evaluations: set --eval_strategy epoch or steps.")
        if self.save_strategy != self.eval_strategy:
            raise FinetuneError(f"--load_best_model_at_end needs --save_strategy equal to --eval_strategy "
                                f"({self.eval_strategy!r}), got {self.save_strategy!r}: the best model is one of the "
                                "checkpoints, so one must be written at every evaluation.")
        if self.eval_strategy == "steps" and ((self.save_steps < 1) != (self.eval_steps < 1) or
                                             (self.save_steps / self.eval_steps) != int(self.save_steps / self.eval_steps)):
            raise FinetuneError(f"--load_best_model_at_end needs --save_steps ({self.save_steps}) to be a round "
                                f"multiple of --eval_steps ({self.eval_steps}).")

    def _check_data(self) -> None:
        """Which data, how much of it, how it is cut and loaded."""
        _check_positive_int("max_length", self.max_length)
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise FinetuneError(f"--{name} must be a positive integer, got {value}.")
        if self.block_size is not None and self.block_size < 2:
            raise FinetuneError(f"--block_size must be an integer >= 2 (tokens), got {self.block_size}.")
        if self.dataloader_num_workers < 0:
            raise FinetuneError(f"--dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}.")
        if self.validation_file and not self.train_file:
            raise FinetuneError("--validation_file needs --train_file as well (or drop it to use the recipe's data).")
        if self.dataset_name and self.train_file:
            raise FinetuneError("--dataset_name and --train_file both name the training data: pass one of them.")

    def _check_processes(self) -> None:
        """What the processes wait for: each other (collectives), the scheduler's grace."""
        if self.ddp_timeout < 1:
            raise FinetuneError(f"--ddp_timeout must be a positive number of seconds, got {self.ddp_timeout}.")
        check_grace_seconds(self.preemption_grace_seconds)

    def _check_peft(self) -> None:
        """LoRA's settings and the merged copy."""
        if self.use_peft and (self.lora_r < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1):
            raise FinetuneError(f"LoRA needs --lora_r >= 1, --lora_alpha > 0 and --lora_dropout in [0, 1), got r="
                                f"{self.lora_r}, alpha={self.lora_alpha}, dropout={self.lora_dropout}.")
        if self.merge_adapter and not self.use_peft:
            raise FinetuneError("--merge_adapter needs --use_peft (there is no adapter to merge otherwise).")

    def _check_memory_levers(self) -> None:
        """Activation checkpointing's options and the chunked loss."""
        if self.activation_checkpointing_kwargs is not None:
            try:
                kwargs = json.loads(self.activation_checkpointing_kwargs)
                if not isinstance(kwargs, dict):
                    raise ValueError("not an object")
            except ValueError as err:
                raise FinetuneError(f"--activation_checkpointing_kwargs must be a JSON object such as "
                                    f"'{{\"use_reentrant\": false}}', got {self.activation_checkpointing_kwargs!r} "
                                    f"({err}).") from None
            every = kwargs.get("every_n_layers", 1)
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise FinetuneError(f"--activation_checkpointing_kwargs: \"every_n_layers\" must be a positive "
                                    f"integer (1 checkpoints every layer), got {every!r}.")
            if not isinstance(kwargs.get("offload", False), bool):
                raise FinetuneError(f"--activation_checkpointing_kwargs: \"offload\" must be true or false, got "
                                    f"{kwargs['offload']!r}.")
        if self.loss_chunk_size is not None and self.loss_chunk_size < 0:
            raise FinetuneError(f"--loss_chunk_size must be >= 0 (label tokens per chunk; 0 for the plain loss), "
                                f"got {self.loss_chunk_size}.")

    def _check_packing(self) -> None:
        """The --packing token budget, and the backend that can run packed windows."""
        if self.max_tokens_per_micro_batch is not None and (not self.packing or self.max_tokens_per_micro_batch < 2):
            raise FinetuneError(f"--max_tokens_per_micro_batch is the --packing token budget: add --packing, and give "
                                f"at least 2 tokens (got {self.max_tokens_per_micro_batch}).")
        if self.max_tokens_per_micro_batch is not None and self.backend == "trainer":  # trainer.py 1895-1899
            raise FinetuneError("--max_tokens_per_micro_batch is for --backend accelerate: Trainer finds the optimizer "
                                "step by counting micro-batches, so under --backend trainer a packed window keeps its "
                                "N micro-batches of at most m rows of --max_length tokens. Drop the flag, or use "
                                "--backend accelerate.")

    def _check_hub(self) -> None:
        """The Hub repository and when a push is possible."""
        if self.hub_model_id is not None and not self.push_to_hub:
            raise FinetuneError("--hub_model_id is used only with --push_to_hub: add --push_to_hub, or drop "
                                "--hub_model_id.")
        if self.push_to_hub and self.compare:
            raise FinetuneError("--push_to_hub with --compare: a comparison writes two runs, not one model. Drop "
                                "--push_to_hub, and push the run you keep with --push_to_hub on its own.")
        if self.hub_model_id is not None:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(self.hub_model_id)
            except HFValidationError as err:
                raise FinetuneError(f"--hub_model_id {self.hub_model_id!r} is not a Hub repository id ({err}). "
                                    "Use 'name' or 'org/name'.") from None

    def to_dict(self) -> dict:
        """All fields as a JSON-serialisable dict."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The resolved configuration as indented JSON (what ``run_config.json`` holds)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# Fields the run derives, not flags: the parser leaves them out, ``config_argv`` never emits them
DERIVED_FIELDS = fields_with(derived=True)


def _check_positive_int(name: str, value) -> None:
    """Raise ``FinetuneError`` unless ``value`` (of flag ``--name``) is an int >= 1 (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise FinetuneError(f"--{name} must be a positive integer, got {value!r}.")


def check_grace_seconds(value) -> float | None:
    """``--preemption_grace_seconds``: None, or a positive, finite number of seconds (returned as a float). Raises
    ``FinetuneError`` otherwise."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not 0 < seconds < float("inf"):
        raise FinetuneError(f"--preemption_grace_seconds must be a positive number of seconds (the scheduler's grace "
                            f"between its stop signal and SIGKILL, e.g. 120), got {value!r}.")
    return seconds


class _FlagParser(HfArgumentParser):
    """``HfArgumentParser`` without the ``DERIVED_FIELDS``: no flag for them (their defaults still reach the
    dataclass, which ``parse_args_into_dataclasses`` builds from every init field)."""

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field) -> None:
        if field.name in DERIVED_FIELDS:
            parser.set_defaults(**{field.name: field.default})
            return
        # the parser passes a field's metadata on to add_argument: only "help" (and "aliases") belong there
        flag_only = copy.copy(field)
        flag_only.metadata = types.MappingProxyType({k: v for k, v in field.metadata.items() if k != ROLES})
        HfArgumentParser._parse_dataclass_field(parser, flag_only)


def _refuse_unknown_flags(parser: HfArgumentParser, argv: list[str] | None) -> None:
    """Raise ``FinetuneError`` naming the first flag the parser does not know, and the nearest known one
    (``difflib``), instead of ``HfArgumentParser``'s ``ValueError`` traceback."""
    _, remaining = parser.parse_known_args(args=argv)
    if not remaining:
        return
    flag = next((a for a in remaining if a.startswith("-")), remaining[0])
    name = flag.split("=", 1)[0]
    known = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]}?" if close else " See --help for the flags."
    if not flag.startswith("-"):
        raise FinetuneError(f"unexpected argument {flag!r} (every setting is a --flag VALUE pair).{hint}")
    raise FinetuneError(f"unknown flag {name}.{hint}")


# Keys of an Accelerate config file (``accelerate config``'s YAML) that are no training flag
ACCELERATE_CONFIG_KEYS = {"compute_environment", "distributed_type", "num_machines", "machine_rank", "main_process_ip",
                          "main_process_port", "main_training_function", "use_cpu", "downcast_bf16", "rdzv_backend",
                          "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "deepspeed_config",
                          "fsdp_config", "gpu_ids", "dynamo_config", "enable_cpu_affinity"}


def _split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the ``--config FILE`` value or None, argv without it)."""
    rest, path, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def read_config_file(path: str, world_size: int = 1) -> dict:
    """The training flags a ``--config`` file sets (YAML or JSON; keys are the flags' names): a dict for the
    parser's defaults, so flags on the command line override it. A run's own ``run_config.json`` replays that
    run: its output and resume settings are left to the command line, and its recorded batch plan is taken
    as it is (``auto_find_batch_size`` off: never probed again), refusing another process count. Raises
    ``FinetuneError`` for an unreadable file, an Accelerate config file (naming ``--config_file``), an unknown
    key (naming the nearest flag) or a process count other than the recorded plan's."""
    try:
        values = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise FinetuneError(f"--config {path}: cannot read it as YAML or JSON ({err}).") from None
    if not isinstance(values, dict):
        raise FinetuneError(f"--config {path}: expected a mapping of training flags to values (flag: value).")
    accelerate = sorted(set(values) & ACCELERATE_CONFIG_KEYS)
    if accelerate:
        raise FinetuneError(f"--config {path} is an Accelerate config file ({', '.join(accelerate[:3])}): pass it "
                            f"as --config_file {path} (Accelerate's launcher flag); --config takes training flags.")
    replay = "precision_source" in values or Path(path).name == "run_config.json"
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields - set(DERIVED_FIELDS)), n=1, cutoff=0.6)
            raise FinetuneError(f"--config {path}: unknown key {key!r}."
                                + (f" Did you mean {close[0]}?" if close else " Keys are the training flags' names."))
    if replay:
        values = {k: v for k, v in values.items() if roles(k).replay}  # where it writes, whether it resumes: ours
        plan = values.get("batch_plan")
        if plan:
            if plan.get("num_processes") != world_size:
                raise FinetuneError(f"--config {path} replays a run planned for {plan.get('num_processes')} "
                                    f"process(es), and this launch has {world_size}: a step would mean another "
                                    "batch. Launch as many processes, or start a new run without its batch_plan.")
            values["auto_find_batch_size"] = False  # the plan's micro-batch and levers are in the file already
    return values


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse command-line flags into a ``TrainConfig``: the recipe's defaults, under a ``--config`` file's
    values (``read_config_file``), under the flags.

    Two passes: the first finds ``--recipe`` (from the flags, else the file); its ``DEFAULTS`` and then the
    file become the parser's defaults; the second parses everything. Raises ``FinetuneError`` for an unknown
    or misspelt flag or file key (naming the nearest known one), an unknown recipe (listing the known ones)
    and a recipe default that is not a flag's field; argparse exits 2 on a malformed value.
    """
    path, argv = _split_config_flag(list(sys.argv[1:] if argv is None else argv))
    file_values = {}
    if path:  # here, not at the top: distributed imports torch and accelerate, which parsing flags does not need
        from finetune.distributed import world_size

        file_values = read_config_file(path, world_size())
    derived = {k: file_values.pop(k) for k in DERIVED_FIELDS if k in file_values}
    if "recipe" in file_values and not given(argv, "--recipe"):
        argv = ["--recipe", str(file_values["recipe"]), *argv]
    parser = _FlagParser(TrainConfig)
    _refuse_unknown_flags(parser, argv)
    (first,) = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    if not first.list_recipes:
        recipe = load_recipe(first.recipe)
        names = {f.name for f in dataclasses.fields(TrainConfig)} - set(DERIVED_FIELDS)
        unknown = set(recipe.DEFAULTS) - names
        if unknown:
            raise FinetuneError(f"recipe {first.recipe!r} sets unknown config fields: {', '.join(sorted(unknown))}")
        parser.set_defaults(**recipe.DEFAULTS)
    parser.set_defaults(**file_values)
    (config,) = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    if derived.get("batch_plan") and config.total_batch_size == derived["batch_plan"].get("total_batch_size"):
        config.batch_plan = derived["batch_plan"]  # the replayed run's plan, recorded again
    if config.output_dir is None:
        config.output_dir = f"outputs/{config.recipe.removesuffix('.py').replace('/', '_')}"
    return config


def config_argv(config: TrainConfig, recipe=None, exclude=frozenset()) -> list[str]:
    """Flags that rebuild ``config`` with ``parse_config``: ``--recipe`` plus every field whose value
    differs from its default (the recipe's ``DEFAULTS`` over the dataclass defaults), leaving out the
    fields named in ``exclude`` and the ``DERIVED_FIELDS`` (no flag sets them).

    Used when the original command line is not at hand (e.g. inside ``train()``). Fields set to ``None``
    against a non-``None`` default cannot be expressed as a flag and are left out.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    if recipe is not None:
        defaults.update(getattr(recipe, "DEFAULTS", {}))
    argv = ["--recipe", str(config.recipe)]
    for f in dataclasses.fields(config):
        if f.name in ("recipe", "list_recipes", *DERIVED_FIELDS) or f.name in exclude:
            continue
        value = getattr(config, f.name)
        if value is None or (f.name in defaults and value == defaults[f.name]):
            continue
        if isinstance(value, bool):
            argv += [f"--{f.name}"] if value else [f"--{f.name}", "False"]
        else:
            argv += [f"--{f.name}", repr(value) if isinstance(value, float) else str(value)]
    return argv


def reproduce_command(argv: list[str], num_processes: int = 1, device: str | None = None,
                      machine_flags: list[str] | None = None) -> str:
    """The command line that reruns a training run from any directory: ``finetune train ARGS``, every
    argument quoted with ``shlex.quote`` (copy-pasteable into a POSIX shell).

    ``argv``: the run's training flags (a leading ``.../run.py`` is dropped, so ``sys.argv`` works too).
    ``num_processes`` > 1 adds ``--multi_gpu --num_processes N`` (Accelerate's launcher flags, which
    ``finetune train`` takes), and on ``device="cpu"`` the ``ACCELERATE_USE_CPU=1`` prefix that gives N gloo
    processes on a CPU. ``machine_flags``: launcher flags of a run over several machines (``--num_machines M
    --machine_rank R --main_process_ip IP --main_process_port P``), added after those.
    """
    args = list(argv)
    if args and args[0].endswith("run.py"):
        args = args[1:]
    prefix, launch = [], ["finetune", "train"]
    if num_processes > 1:
        launch += ["--multi_gpu", "--num_processes", str(num_processes)]
        if device == "cpu":
            prefix = ["ACCELERATE_USE_CPU=1"]
    launch += machine_flags or []
    return " ".join([*prefix, *(shlex.quote(a) for a in [*launch, *args])])
