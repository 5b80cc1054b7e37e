"""The one run configuration: a dataclass whose field names match `TrainingArguments` where the
concept is the same, parsed from the command line by `transformers.HfArgumentParser`.

Precedence: dataclass default < recipe ``DEFAULTS`` < command-line flag.

Read-only once validated: ``validate()`` ends by freezing the config (assigning a field raises
``dataclasses.FrozenInstanceError``); a changed run is a new config (``dataclasses.replace``), validated
again. Values derived while resolving a run (``DERIVED_FIELDS``: where the precision came from, the batch
plan) are fields too, so ``run_config.json`` holds them, but no flag sets them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from transformers import HfArgumentParser

from finetune.errors import FinetuneError
from finetune.recipes import load_recipe

MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16")
# The precision this project is defined by: Accelerator(mixed_precision="fp16"), loss scaling included.
DEFAULT_MIXED_PRECISION = "fp16"
# Fields the run derives, not flags: the parser leaves them out, ``config_argv`` never emits them, and a
# rerun's ``--output_dir`` check does not compare them.
DERIVED_FIELDS = ("precision_source", "batch_plan")
LR_SCHEDULER_CHOICES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)


@dataclass
class TrainConfig:
    """Every setting of a run. Units: batch sizes in samples, steps in optimizer steps unless named
    ``micro``, lengths in tokens, learning rate per optimizer step.

    Raises ``FinetuneError`` from ``validate()`` for values that cannot run, naming the flag. After
    ``validate()`` assigning any attribute raises ``dataclasses.FrozenInstanceError``: build a changed copy
    with ``dataclasses.replace(config, name=value)`` and validate that.
    """

    recipe: str = field(default="bbc-news", metadata={"help": "Recipe name (see --list_recipes) or path/to/recipe.py."})
    list_recipes: bool = field(default=False, metadata={"help": "Print the known recipes and exit."})
    output_dir: str | None = field(
        default=None, metadata={"help": "Where the model, metrics.json and log.jsonl go. Default: outputs/<recipe>."}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Allow writing into an output_dir that already holds another run."}
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub id or local model directory. Default: the recipe's model."}
    )
    train_file: str | None = field(
        default=None,
        metadata={"help": "Your own training data: CSV or JSON lines with the recipe's text column(s) and `label`."},
    )
    validation_file: str | None = field(
        default=None, metadata={"help": "Your own validation data (same format). Default: 20%% split of train_file."}
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "A dataset by name (TRL's flag): a folder written by save_to_disk, a folder of "
                                        "data files, or a Hub name (needs the Hub)."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "The --dataset_name configuration (subset)."})
    dataset_train_split: str = field(default="train", metadata={"help": "The --dataset_name split to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "The --dataset_name split to validate on; without it 20%% of the train "
                                          "split is held out."}
    )
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Micro-batch size in samples, per process, per forward/backward."}
    )
    per_device_eval_batch_size: int = field(default=32, metadata={"help": "Evaluation batch size per process."})
    total_batch_size: int | None = field(
        default=None,
        metadata={"help": "Global effective batch per optimizer step (samples). Sets the accumulation steps so "
                          "micro-batch x accumulation x processes equals it exactly."},
    )
    auto_find_batch_size: bool = field(
        default=False,
        metadata={"help": "With --total_batch_size: use the largest micro-batch that fits in memory (probe steps)."},
    )
    max_memory_mb: int | None = field(
        default=None, metadata={"help": "CPU memory budget for --auto_find_batch_size (MiB; default: available RAM). "
                                        "The estimate leaves out transient buffers (0.2-0.4 GiB under the real peak "
                                        "at bbc-news, 256 tokens): leave a margin."}
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-batches per optimizer step (N). Effective batch = micro x N x processes."}
    )
    mixed_precision: Literal["no", "fp16", "bf16"] | None = field(
        default=None, metadata={"help": "Autocast precision; fp16 uses loss scaling (on a CPU it does not run: fp32). "
                                        "Default: the accelerate config's or launcher's fp16/bf16, else fp16."}
    )
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak AdamW learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (not on biases and LayerNorm)."})
    optim: Literal["adamw_torch", "adamw_torch_fused"] = field(
        default="adamw_torch", metadata={"help": "AdamW implementation (TrainingArguments names); fused is one kernel per step."}
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Epochs (fractions allowed). Ignored if max_steps > 0."})
    max_steps: int = field(default=-1, metadata={"help": "Total optimizer steps; overrides num_train_epochs if > 0."})
    lr_scheduler_type: Literal[LR_SCHEDULER_CHOICES] = field(  # type: ignore[valid-type]
        default="linear", metadata={"help": "LR schedule, sized in optimizer steps."}
    )
    warmup_steps: float = field(
        default=0, metadata={"help": "Linear warmup: a count of optimizer steps, or a float in [0, 1): that ratio of "
                                     "the total optimizer steps (as TrainingArguments; there is no warmup_ratio)."}
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global grad norm to this (0 disables)."})
    max_length: int = field(default=128, metadata={"help": "Truncate inputs to this many tokens."})
    block_size: int | None = field(
        default=None,
        metadata={"help": "Causal LM: concatenate texts and cut blocks of this many tokens (default: one text per sample)."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training samples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N evaluation samples."})
    eval_strategy: Literal["no", "steps", "epoch"] = field(
        default="epoch", metadata={"help": "When to evaluate: after every epoch, every --eval_steps optimizer steps "
                                           "(and after the last one), or never ('no')."}
    )
    eval_steps: float | None = field(
        default=None, metadata={"help": "With --eval_strategy steps: optimizer steps between evaluations, or a float in "
                                        "[0, 1): that ratio of the total steps."}
    )
    logging_steps: float = field(
        default=1, metadata={"help": "Optimizer steps between console/tracker updates (or a ratio in [0, 1) of the "
                                     "total). log.jsonl always has one record per optimizer step."}
    )
    backend: Literal["accelerate", "trainer"] = field(
        default="accelerate",
        metadata={"help": "Training engine: our accelerator.accumulate() loop, or transformers' Trainer."},
    )
    compare: bool = field(
        default=False, metadata={"help": "Run both backends with the same settings and write comparison.md/json/png."}
    )
    eval_on_start: bool = field(default=False, metadata={"help": "Also evaluate before the first optimizer step."})
    save_strategy: Literal["no", "steps", "epoch"] = field(
        default="no", metadata={"help": "When to write a resumable checkpoint: every --save_steps optimizer steps, after "
                                        "every epoch, or never. A signal (SIGTERM/SIGINT) always writes one."}
    )
    save_steps: float | None = field(
        default=None, metadata={"help": "With --save_strategy steps (implied when only this is given): optimizer steps "
                                        "between checkpoints, or a float in [0, 1): that ratio of the total steps."}
    )
    checkpointing_steps: str | None = field(
        default=None,
        metadata={"help": "Older spelling: N means --save_strategy steps --save_steps N; 'epoch' means --save_strategy "
                          "epoch."},
    )
    load_best_model_at_end: bool = field(
        default=False, metadata={"help": "Keep the checkpoint with the best --metric_for_best_model and make it the final "
                                         "model. Needs --save_strategy equal to --eval_strategy (steps: --save_steps a "
                                         "multiple of --eval_steps)."}
    )
    metric_for_best_model: str | None = field(
        default=None, metadata={"help": "The eval metric that decides the best model (default 'loss', i.e. eval_loss)."}
    )
    greater_is_better: bool | None = field(
        default=None, metadata={"help": "Whether a larger --metric_for_best_model is better (default: False for a "
                                        "loss, True otherwise)."}
    )
    early_stopping_patience: int | None = field(
        default=None, metadata={"help": "Stop after this many evaluations in a row without improving "
                                        "--metric_for_best_model (needs --load_best_model_at_end)."}
    )
    save_total_limit: int | None = field(default=None, metadata={"help": "Keep only the newest K checkpoints."})
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "'latest' (newest complete checkpoint in output_dir), 'auto' (latest if there "
                                        "is one, else a fresh start; a finished run exits 0: one command for a "
                                        "requeued job) or a checkpoint path."}
    )
    ignore_checkpoint_mismatch: bool = field(
        default=False, metadata={"help": "Resume even if batch sizes, accumulation, processes or data differ."}
    )
    max_skipped_steps: int = field(
        default=10, metadata={"help": "fp16: stop after this many optimizer steps in a row skipped by the GradScaler."}
    )
    ddp_timeout: int = field(
        default=1800, metadata={"help": "Seconds a collective waits for a peer process before the run fails (torch's "
                                        "process-group timeout; TrainingArguments' name and default)."}
    )
    preemption_grace_seconds: float | None = field(
        default=None, metadata={"help": "Seconds the scheduler allows between its stop signal and SIGKILL (SLURM: the "
                                        "partition's GraceTime, or N of --signal=B:USR1@N). finetune train sets "
                                        "torchrun's shutdown timeout to it (default 30 s), and the run warns when an "
                                        "optimizer step plus a checkpoint will not fit in it."}
    )
    report_to: Literal["none", "tensorboard", "trackio", "wandb", "all"] = field(
        default="none", metadata={"help": "Experiment tracking through Accelerate's trackers (TensorBoard works offline)."}
    )
    push_to_hub: bool = field(
        default=False, metadata={"help": "Upload the model directory to the Hugging Face Hub (huggingface_hub's HfApi, "
                                         "main process only): at the end, and per --hub_strategy after checkpoints. "
                                         "Needs a token (`hf auth login` or HF_TOKEN); checked before training."}
    )
    hub_model_id: str | None = field(
        default=None, metadata={"help": "The Hub repository (TrainingArguments' name): 'name' (your namespace) or "
                                        "'org/name'. Default: <your user>/<the --output_dir folder's name>."}
    )
    hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = field(
        default="every_save", metadata={"help": "What to push and when, as TrainingArguments: 'end' (the final model "
                                                "only), 'every_save' (also the model of every checkpoint, in the "
                                                "background), 'checkpoint' (and the newest checkpoint in "
                                                "last-checkpoint/, to resume from), 'all_checkpoints' (each one in "
                                                "its own folder)."}
    )
    hub_private_repo: bool | None = field(
        default=None, metadata={"help": "Create the repository private (default: public unless the organisation's "
                                        "default is private; ignored if the repository exists)."}
    )
    train_sampling_strategy: Literal["random", "group_by_length"] = field(
        default="random",
        metadata={"help": "Training order (TrainingArguments name): 'random', or 'group_by_length' (shuffled, then "
                          "sorted by length within mega-batches of 50 optimizer steps, so micro-batches need less padding)."},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Causal LM/SFT (TRL's name): each micro-batch's samples concatenated into one row, "
                          "position_ids restarting per sample, no padding computed; the same samples and label "
                          "tokens per step as padded micro-batches (docs/packing.md)."},
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Causal LM/SFT (TRL's name): repack each optimizer step's own samples into padding-free "
                          "micro-batches of at most --max_tokens_per_micro_batch tokens (--packing_strategy); which "
                          "samples form a step never changes (docs/packing.md)."},
    )
    packing_strategy: Literal["window_bfd"] = field(
        default="window_bfd",
        metadata={"help": "With --packing: 'window_bfd', best-fit decreasing within each accumulation window. TRL's "
                          "dataset-wide 'bfd'/'wrapped' are not offered: they change which samples form a step."},
    )
    max_tokens_per_micro_batch: int | None = field(
        default=None,
        metadata={"help": "With --packing: tokens per packed micro-batch, per process (default: "
                          "per_device_train_batch_size x max_length, the padded micro-batch's most positions)."},
    )
    torch_compile: bool = field(
        default=False, metadata={"help": "Compile the model with torch.compile (inductor) through Accelerate's dynamo plugin."}
    )
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune"] | None = field(
        default=None, metadata={"help": "torch.compile mode (implies --torch_compile)."}
    )
    dataloader_num_workers: int = field(
        default=0, metadata={"help": "DataLoader worker processes (0: collate in the training process)."}
    )
    dataloader_pin_memory: bool = field(
        default=True, metadata={"help": "Pin host memory for faster copies to a GPU (ignored on a CPU)."}
    )
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute each layer's activations in the backward pass instead of keeping "
                                         "them (less memory, about one more forward of time); non-reentrant."}
    )
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated alias of --activation_checkpointing (as in TrainingArguments)."}
    )
    activation_checkpointing_kwargs: str | None = field(
        default=None, metadata={"help": "JSON object, as TrainingArguments takes it: \"every_n_layers\" (checkpoint "
                                        "only every n-th layer: less recompute, more memory) and \"offload\" (saved "
                                        "activations in host memory) for activation_checkpointing_enable, the other "
                                        "keys for torch.utils.checkpoint (default {\"use_reentrant\": false})."}
    )
    loss_chunk_size: int | None = field(
        default=None, metadata={"help": "Causal LM: compute the loss from the final hidden states, this many label "
                                        "tokens at a time, never materialising the (batch, seq, vocab) logits (0: the "
                                        "plain full logits). Default: 1024 on a CPU, where it was measured faster and "
                                        "7x lighter; 0 on a GPU until measured there."}
    )
    use_peft: bool = field(
        default=False, metadata={"help": "Train LoRA adapters (peft) instead of every weight: the base model stays "
                                         "frozen (no gradients, no optimizer state); a classifier head stays trainable."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (TRL's default)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha: the update is scaled by alpha / r."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: str | None = field(
        default=None, metadata={"help": "Comma-separated module names to adapt, or 'all-linear' (default: peft's "
                                        "choice for the architecture, e.g. the attention projections)."}
    )
    merge_adapter: bool = field(
        default=False, metadata={"help": "With --use_peft: also write the base model with the adapter merged in, to "
                                         "<output_dir>/merged (a plain model directory)."}
    )
    seed: int = field(default=42, metadata={"help": "Seed for initialisation, data order and dropout."})
    disable_dropout: bool = field(
        default=False, metadata={"help": "Set every dropout probability to 0 (deterministic, comparable runs)."}
    )
    cache_dir: str | None = field(
        default=None, metadata={"help": "Where tokenized datasets are cached. Default: the datasets library cache."}
    )
    # ---- derived (DERIVED_FIELDS): set while the run is resolved, never by a flag; left out of ==, so the
    # config that config_argv's flags rebuild equals the one they came from
    # where mixed_precision came from: "--mixed_precision", "the accelerate config/launcher" or "the default"
    precision_source: str | None = field(default=None, compare=False)
    # the batch planner's plan under --total_batch_size (planner.BatchPlan.to_dict: micro-batch, accumulation,
    # processes, total, the lever setting chosen under --auto_find_batch_size), set by finetune.run.apply_plan
    batch_plan: dict | None = field(default=None, compare=False)

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

    def validate(self) -> None:  # noqa: C901 - over the budget; to split
        """Check values that argparse cannot; raise ``FinetuneError`` naming the flag and the fix. A config
        that passes is read-only from then on (``dataclasses.FrozenInstanceError`` on assignment)."""
        positive = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "max_length")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise FinetuneError(f"--{name} must be a positive integer, got {value!r}.")
        if self.mixed_precision not in MIXED_PRECISION_CHOICES:
            raise FinetuneError(
                f"--mixed_precision must be one of {', '.join(MIXED_PRECISION_CHOICES)}, got {self.mixed_precision!r}."
            )
        if self.learning_rate <= 0:
            raise FinetuneError(f"--learning_rate must be > 0, got {self.learning_rate}.")
        if self.num_train_epochs <= 0 and self.max_steps <= 0:
            raise FinetuneError("--num_train_epochs must be > 0 (or set --max_steps to a positive number).")
        for name in ("warmup_steps", "logging_steps", "eval_steps", "save_steps"):
            value = getattr(self, name)
            if value is not None and (value < 0 or (value >= 1 and value != int(value))):
                raise FinetuneError(f"--{name} must be a whole number of optimizer steps or a ratio in [0, 1) of the "
                                    f"total steps, got {value}.")
        for name in ("logging_steps", "eval_steps", "save_steps"):
            if getattr(self, name) == 0:
                raise FinetuneError(f"--{name} must be > 0 (a count of optimizer steps, or a ratio in (0, 1)).")
        if self.eval_strategy == "steps" and self.eval_steps is None:
            raise FinetuneError("--eval_strategy steps needs --eval_steps N (optimizer steps between evaluations).")
        if self.eval_steps is not None and self.eval_strategy != "steps":
            raise FinetuneError(f"--eval_steps is used only with --eval_strategy steps (it is {self.eval_strategy!r}); "
                                "add --eval_strategy steps or drop --eval_steps.")
        if self.save_strategy == "steps" and self.save_steps is None:
            raise FinetuneError("--save_strategy steps needs --save_steps N (optimizer steps between checkpoints).")
        if self.load_best_model_at_end:
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
        if self.early_stopping_patience is not None:
            if self.early_stopping_patience < 1:
                raise FinetuneError(f"--early_stopping_patience must be >= 1, got {self.early_stopping_patience}.")
            if not self.load_best_model_at_end:
                raise FinetuneError("--early_stopping_patience needs --load_best_model_at_end (as Trainer's "
                                    "EarlyStoppingCallback): otherwise the run would end on a worse model.")
        if self.max_grad_norm < 0:
            raise FinetuneError(f"--max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}.")
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise FinetuneError(f"--{name} must be a positive integer, got {value}.")
        if self.block_size is not None and self.block_size < 2:
            raise FinetuneError(f"--block_size must be an integer >= 2 (tokens), got {self.block_size}.")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise FinetuneError(f"--save_total_limit must be >= 1, got {self.save_total_limit}.")
        if self.dataloader_num_workers < 0:
            raise FinetuneError(f"--dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}.")
        if self.ddp_timeout < 1:
            raise FinetuneError(f"--ddp_timeout must be a positive number of seconds, got {self.ddp_timeout}.")
        check_grace_seconds(self.preemption_grace_seconds)
        if self.max_skipped_steps < 1:
            raise FinetuneError(f"--max_skipped_steps must be >= 1, got {self.max_skipped_steps}.")
        if self.auto_find_batch_size and not self.total_batch_size:
            raise FinetuneError("--auto_find_batch_size needs --total_batch_size (the effective batch it must keep).")
        if self.total_batch_size is not None and self.total_batch_size < 1:
            raise FinetuneError(f"--total_batch_size must be a positive integer, got {self.total_batch_size}.")
        if self.use_peft and (self.lora_r < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1):
            raise FinetuneError(f"LoRA needs --lora_r >= 1, --lora_alpha > 0 and --lora_dropout in [0, 1), got r="
                                f"{self.lora_r}, alpha={self.lora_alpha}, dropout={self.lora_dropout}.")
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
        if self.merge_adapter and not self.use_peft:
            raise FinetuneError("--merge_adapter needs --use_peft (there is no adapter to merge otherwise).")
        if self.validation_file and not self.train_file:
            raise FinetuneError("--validation_file needs --train_file as well (or drop it to use the recipe's data).")
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
        if self.max_tokens_per_micro_batch is not None and (not self.packing or self.max_tokens_per_micro_batch < 2):
            raise FinetuneError(f"--max_tokens_per_micro_batch is the --packing token budget: add --packing, and give "
                                f"at least 2 tokens (got {self.max_tokens_per_micro_batch}).")
        if self.packing and self.backend == "trainer":  # Trainer syncs on its micro-batch counter (trainer.py 1895-1899)
            raise FinetuneError("--packing runs in --backend accelerate only: Trainer's inner loop decides the optimizer "
                                "step from a running micro-batch count, so a window cannot change its number of "
                                "micro-batches. Use --padding_free, or --backend accelerate.")
        if self.dataset_name and self.train_file:
            raise FinetuneError("--dataset_name and --train_file both name the training data: pass one of them.")
        object.__setattr__(self, "_read_only", True)  # not a field: copies (dataclasses.replace) start writable

    def to_dict(self) -> dict:
        """All fields as a JSON-serialisable dict."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The resolved configuration as indented JSON (what ``run_config.json`` holds)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


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
        HfArgumentParser._parse_dataclass_field(parser, field)


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
# What a replayed run_config.json does not decide: where this run writes and whether it resumes
REPLAY_IGNORED = {"output_dir", "overwrite_output_dir", "resume_from_checkpoint", "list_recipes", "precision_source"}


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
        values = {k: v for k, v in values.items() if k not in REPLAY_IGNORED}
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
    file_values = read_config_file(path, int(os.environ.get("WORLD_SIZE", "1"))) if path else {}
    derived = {k: file_values.pop(k) for k in DERIVED_FIELDS if k in file_values}
    if "recipe" in file_values and not any(a == "--recipe" or a.startswith("--recipe=") for a in argv):
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
