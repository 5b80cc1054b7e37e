"""The one run configuration: ``TrainConfig``, a dataclass whose field names match ``TrainingArguments`` where the
concept is the same, parsed from the command line by ``transformers.HfArgumentParser``.

Flags live in sections, as TRL splits its configs (``ModelConfig``, ``ScriptArguments``, one config per training
style): one dataclass per section, each in its own module with the checks of its own flags, composed into
``TrainConfig`` by inheritance, so every flag stays an attribute of its own name (``config.learning_rate``) and
``--help`` lists the flags under one heading per section (``SECTIONS``):

- ``run`` (``RunArguments``): recipe, output directory, backend, resuming, the processes' timeouts;
- ``model`` (``ModelArguments``); ``data`` (``DataArguments``); ``batch`` (``BatchArguments``);
  ``optimization`` (``OptimizationArguments``); ``cadence.py`` (``CadenceArguments``): evaluation, checkpoints
  and logging; ``hub`` (``HubArguments``); ``speed`` (``SpeedArguments``): precision, compilation, activation
  checkpointing; ``causal_lm`` (``CausalLMArguments``): the flags of the causal LM and SFT styles only;
  ``lora`` (``LoraArguments``); ``reproducibility`` (``ReproducibilityArguments``).

The other modules: ``flags`` (how a flag is declared: ``flag(...)``, ``derived(...)``, ``Roles``), ``train_config``
(``TrainConfig``, its cross-section checks, the queries over the roles), ``parsing`` (``parse_config``, ``--config``
files), ``replay`` (``config_argv``, ``reproduce_command``).

Precedence: dataclass default < recipe ``DEFAULTS`` < ``--config`` file < command-line flag.

Read-only once validated: ``validate()`` ends by freezing the config (assigning a field raises
``dataclasses.FrozenInstanceError``); a changed run is a new config (``dataclasses.replace``), validated
again. Values derived while resolving a run (``derived(...)`` fields: where the precision came from, the batch
plan) are fields too, so ``run_config.json`` holds them, but no flag sets them.
"""

from finetune.config.batch import BatchArguments
from finetune.config.cadence import CadenceArguments, or_trainer_save_steps
from finetune.config.causal_lm import CausalLMArguments
from finetune.config.data import DataArguments
from finetune.config.flags import KEPT, ROLES, Roles, derived, flag
from finetune.config.hub import HubArguments
from finetune.config.lora import LoraArguments
from finetune.config.model import ModelArguments
from finetune.config.optimization import LR_SCHEDULER_CHOICES, OptimizationArguments
from finetune.config.parsing import ACCELERATE_CONFIG_KEYS, parse_config, read_config_file
from finetune.config.replay import config_argv, reproduce_command
from finetune.config.reproducibility import ReproducibilityArguments
from finetune.config.run import RunArguments, check_grace_seconds
from finetune.config.speed import DEFAULT_MIXED_PRECISION, MIXED_PRECISION_CHOICES, SpeedArguments, is_bf16
from finetune.config.train_config import (
    DERIVED_FIELDS,
    SECTIONS,
    TrainConfig,
    check_settings,
    fields_with,
    roles,
    trainer_arguments,
)

__all__ = [
    "ACCELERATE_CONFIG_KEYS", "DEFAULT_MIXED_PRECISION", "DERIVED_FIELDS", "KEPT", "LR_SCHEDULER_CHOICES",
    "MIXED_PRECISION_CHOICES", "ROLES", "SECTIONS", "BatchArguments", "CadenceArguments", "CausalLMArguments",
    "DataArguments", "HubArguments", "LoraArguments", "ModelArguments", "OptimizationArguments",
    "ReproducibilityArguments", "Roles", "RunArguments", "SpeedArguments", "TrainConfig", "check_grace_seconds",
    "check_settings", "config_argv", "derived", "fields_with", "flag", "is_bf16", "or_trainer_save_steps",
    "parse_config", "read_config_file", "reproduce_command", "roles", "trainer_arguments",
]
