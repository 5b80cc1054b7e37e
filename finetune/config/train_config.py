"""``TrainConfig``: the one run configuration, composed from the section dataclasses, and the queries over its
fields' roles (``roles``, ``fields_with``, ``check_settings``, ``trainer_arguments``).

A dataclass lists its bases' fields from the last base to the first, so ``TrainConfig`` names its sections in
reverse: its fields, and so ``dataclasses.fields``, ``fields_with``, ``config_argv`` and ``--help``, run in
``SECTIONS`` order (the order a resume refusal lists several differences in), the derived values last.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from finetune.config.batch import BatchArguments
from finetune.config.cadence import CadenceArguments
from finetune.config.causal_lm import CausalLMArguments
from finetune.config.data import DataArguments
from finetune.config.flags import KEPT, ROLES, Roles, derived
from finetune.config.grpo import GRPOArguments
from finetune.config.hub import HubArguments
from finetune.config.lora import LoraArguments
from finetune.config.model import ModelArguments
from finetune.config.optimization import OptimizationArguments
from finetune.config.preference import PreferenceArguments
from finetune.config.reproducibility import ReproducibilityArguments
from finetune.config.run import RunArguments
from finetune.config.speed import DEFAULT_MIXED_PRECISION, SpeedArguments
from finetune.errors import FinetuneError

# The sections by their --help heading, in --help order and field order
SECTIONS = {
    "run": RunArguments,
    "model": ModelArguments,
    "data": DataArguments,
    "batch": BatchArguments,
    "optimization": OptimizationArguments,
    "evaluation, checkpoints and logging": CadenceArguments,
    "Hugging Face Hub": HubArguments,
    "speed and memory": SpeedArguments,
    "causal LM and SFT": CausalLMArguments,
    "LoRA adapters (peft)": LoraArguments,
    "preference tuning (DPO)": PreferenceArguments,
    "online RL (GRPO)": GRPOArguments,
    "reproducibility": ReproducibilityArguments,
}


@dataclass
class TrainConfig(ReproducibilityArguments, GRPOArguments, PreferenceArguments, LoraArguments, CausalLMArguments, SpeedArguments, HubArguments,
                  CadenceArguments, OptimizationArguments, BatchArguments, DataArguments, ModelArguments, RunArguments):
    """Every setting of a run. Units: batch sizes in samples, steps in optimizer steps unless named
    ``micro``, lengths in tokens, learning rate per optimizer step.

    The flags are the sections' fields (``SECTIONS``), each attribute under its own name (``config.learning_rate``);
    the values derived while the run is resolved are ``TrainConfig``'s own. Each section checks its own flags
    (``_check_*``); the checks across sections are here.

    Raises ``FinetuneError`` from ``validate()`` for values that cannot run, naming the flag. After
    ``validate()`` assigning any attribute raises ``dataclasses.FrozenInstanceError``: build a changed copy
    with ``dataclasses.replace(config, name=value)`` and validate that.
    """

    # ---- derived: set while the run is resolved, never by a flag
    # where mixed_precision came from: "--mixed_precision", "the accelerate config/launcher" or "the default";
    # a replay resolves it again
    precision_source: str | None = derived(None, replay=False)
    # on a CPU, what the bf16 measurements for the recipe said of a requested fp16 (engine.cpu_bf16.choose), for the
    # banner; and "fp16" where they turned it into bf16 (mixed_precision is then "bf16"); None where none applied
    precision_choice: str | None = derived(None, replay=False)
    mixed_precision_requested: str | None = derived(None, replay=False)
    # how the recipe was chosen where --recipe was not given: from your data's columns (config.your_data), for the banner
    recipe_source: str | None = derived(None, replay=False)
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
        self._resolve_speed()
        self._resolve_cadence()

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

    def validate(self) -> None:
        """Check values that argparse cannot; raise ``FinetuneError`` naming the flag and the fix. A config
        that passes is read-only from then on (``dataclasses.FrozenInstanceError`` on assignment). The checks run
        in one order (the first that fails is the one reported): each section's own, and those across sections."""
        self._check_batch()
        self._check_precision()
        self._check_optimization()
        self._check_step_counts()
        self._check_evaluation_and_saving()
        self._check_data()
        self._check_processes()
        self._check_peft()
        self._check_quantized_base()
        self._check_activation_checkpointing()
        self._check_causal_lm()
        self._check_preference()
        self._check_grpo()
        self._check_packing_backend()
        self._check_push_with_compare()
        self._check_hub()
        object.__setattr__(self, "_read_only", True)  # not a field: copies (dataclasses.replace) start writable

    def _check_step_counts(self) -> None:
        """The flags that take a count of optimizer steps or a ratio of the total (optimization and cadence)."""
        for name in ("warmup_steps", "logging_steps", "eval_steps", "save_steps"):
            value = getattr(self, name)
            if value is not None and (value < 0 or (value >= 1 and value != int(value))):
                raise FinetuneError(f"--{name} must be a whole number of optimizer steps or a ratio in [0, 1) of the "
                                    f"total steps, got {value}.")
        for name in ("logging_steps", "eval_steps", "save_steps"):
            if getattr(self, name) == 0:
                raise FinetuneError(f"--{name} must be > 0 (a count of optimizer steps, or a ratio in (0, 1)).")

    def _check_quantized_base(self) -> None:
        """A quantized base (LoRA and speed): not compiled (transformers 5.24 ``trainer_utils.py``
        ``validate_quantization_for_training`` refuses a compiled quantized model)."""
        if (self.load_in_4bit or self.load_in_8bit) and self.torch_compile:
            raise FinetuneError(f"--torch_compile with --{'load_in_4bit' if self.load_in_4bit else 'load_in_8bit'}: "
                                "bitsandbytes' layers are not compiled (transformers refuses a compiled quantized "
                                "model). Drop --torch_compile.")

    def _check_packing_backend(self) -> None:
        """The backend that can run packed windows (causal LM and run)."""
        if self.max_tokens_per_micro_batch is not None and self.backend == "trainer":  # trainer.py 1895-1899
            raise FinetuneError("--max_tokens_per_micro_batch is for --backend accelerate: Trainer finds the optimizer "
                                "step by counting micro-batches, so under --backend trainer a packed window keeps its "
                                "N micro-batches of at most m rows of --max_length tokens. Drop the flag, or use "
                                "--backend accelerate.")

    def _check_push_with_compare(self) -> None:
        """A push is of one run: not with ``--compare`` (Hub and run). Before the Hub section's own checks: the one
        it cannot fail together with (``--hub_model_id`` without ``--push_to_hub``) may come after it."""
        if self.push_to_hub and self.compare:
            raise FinetuneError("--push_to_hub with --compare: a comparison writes two runs, not one model. Drop "
                                "--push_to_hub, and push the run you keep with --push_to_hub on its own.")

    def to_dict(self) -> dict:
        """All fields as a JSON-serialisable dict."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The resolved configuration as indented JSON (what ``run_config.json`` holds)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


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
    its ``to_trainer`` where it has one (``backends.trainer.training_arguments`` adds the arguments no single
    field gives)."""
    arguments = {}
    for name in _FIELDS:
        role, value = roles(name), getattr(config, name)
        for argument in role.trainer_arguments:
            arguments[argument] = role.to_trainer(value) if role.to_trainer else value
    return arguments


# Fields the run derives, not flags: the parser leaves them out, ``config_argv`` never emits them
DERIVED_FIELDS = fields_with(derived=True)
