"""Each flag declares its roles where it is defined (``flag(...)`` in finetune/config.py): every field declares
them, the lists the code used to keep by hand come out of them unchanged, and ``training_arguments`` gives the
same ``TrainingArguments`` as the hand-written mapping it replaced."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from transformers import TrainingArguments

from finetune.backends.trainer import training_arguments
from finetune.commands import compare
from finetune.config import (
    DERIVED_FIELDS,
    KEPT,
    ROLES,
    Roles,
    TrainConfig,
    check_settings,
    config_argv,
    derived,
    fields_with,
    flag,
    parse_config,
    roles,
)
from finetune.lifecycle import checkpoint as ckpt
from finetune.lifecycle import output
from finetune.planner.plans import Lever
from finetune.recipes import load_recipe

# ---- the lists as main kept them by hand (5c2b795), the expected values of the queries that replace them, over
# main's fields (a flag added since is declared in one place, its roles its own; a change of an old flag's role is
# a change of behaviour, and shows here)
MAIN_FIELDS = set("""
recipe list_recipes output_dir overwrite_output_dir model_name_or_path train_file validation_file dataset_name
dataset_config dataset_train_split dataset_test_split per_device_train_batch_size per_device_eval_batch_size
total_batch_size auto_find_batch_size max_memory_mb gradient_accumulation_steps mixed_precision learning_rate
weight_decay optim adam_beta1 adam_beta2 adam_epsilon num_train_epochs max_steps lr_scheduler_type warmup_steps
max_grad_norm max_length block_size max_train_samples max_eval_samples eval_strategy eval_steps logging_steps backend
compare eval_on_start save_strategy save_steps checkpointing_steps load_best_model_at_end metric_for_best_model
greater_is_better early_stopping_patience save_total_limit resume_from_checkpoint ignore_checkpoint_mismatch
max_skipped_steps ddp_timeout preemption_grace_seconds report_to push_to_hub hub_model_id hub_strategy
hub_private_repo train_sampling_strategy torch_compile torch_compile_mode dataloader_num_workers dataloader_pin_memory
activation_checkpointing gradient_checkpointing activation_checkpointing_kwargs loss_chunk_size use_peft lora_r
lora_alpha lora_dropout lora_target_modules merge_adapter seed disable_dropout cache_dir precision_source batch_plan
""".split())
OLD_DERIVED_FIELDS = ("precision_source", "batch_plan")  # config.py
OLD_REPLAY_IGNORED = {"output_dir", "overwrite_output_dir", "resume_from_checkpoint", "list_recipes",
                      "precision_source"}  # config.py
OLD_OUTPUT_IGNORED = {"output_dir", "overwrite_output_dir", "list_recipes", "resume_from_checkpoint",
                      "ignore_checkpoint_mismatch", "checkpointing_steps", "save_strategy", "save_steps",
                      "save_total_limit", "logging_steps", "preemption_grace_seconds", "push_to_hub", "hub_model_id",
                      "hub_strategy", "hub_private_repo", *OLD_DERIVED_FIELDS}  # output.py _IGNORED
OLD_STEP_MEANING = ("recipe", "train_file", "dataset_name", "dataset_config", "dataset_train_split",
                    "max_train_samples", "max_length", "block_size", "model_name_or_path",
                    "per_device_train_batch_size", "gradient_accumulation_steps", "seed", "train_sampling_strategy",
                    "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")  # checkpoint.py
OLD_NOT_PASSED = {"compare", "backend", "output_dir", "list_recipes", "overwrite_output_dir", "total_batch_size",
                  "auto_find_batch_size", "max_memory_mb"}  # compare.py _NOT_PASSED
OLD_CHECK_SETTINGS = dict(disable_dropout=True, lora_dropout=0.0, eval_strategy="no", eval_on_start=False,
                          save_strategy="no", checkpointing_steps=None, save_total_limit=None,
                          load_best_model_at_end=False, early_stopping_patience=None, logging_steps=1,
                          report_to="none", resume_from_checkpoint=None, overwrite_output_dir=True,
                          total_batch_size=None, auto_find_batch_size=False, compare=False,
                          backend="accelerate")  # verify.py


def old_training_arguments(config, output_dir: str | None = None) -> TrainingArguments:
    """main's ``trainer_backend.training_arguments`` (5c2b795), copied unchanged as the oracle."""
    fp16 = config.mixed_precision == "fp16" and torch.cuda.is_available()
    return TrainingArguments(
        output_dir=str(ckpt.checkpoints_dir(output_dir or config.output_dir)),
        per_device_train_batch_size=config.per_device_train_batch_size,
        per_device_eval_batch_size=config.per_device_eval_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        fp16=fp16,
        bf16=config.mixed_precision == "bf16",
        use_cpu=not torch.cuda.is_available(),
        learning_rate=config.learning_rate,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_epsilon=config.adam_epsilon,
        optim=config.optim,
        num_train_epochs=config.num_train_epochs,
        max_steps=config.max_steps,
        lr_scheduler_type=config.lr_scheduler_type,
        warmup_steps=config.warmup_steps,
        max_grad_norm=config.max_grad_norm,
        seed=config.seed,
        data_seed=config.seed,
        eval_strategy="no",
        save_strategy=config.save_strategy,
        save_steps=config.save_steps if config.save_steps is not None else 500,
        save_total_limit=config.save_total_limit,
        logging_strategy="steps",
        logging_steps=1,
        logging_nan_inf_filter=False,
        report_to=config.report_to,
        dataloader_drop_last=False,
        train_sampling_strategy=config.train_sampling_strategy,
        torch_compile=config.torch_compile,
        torch_compile_mode=config.torch_compile_mode,
        dataloader_num_workers=config.dataloader_num_workers,
        dataloader_pin_memory=config.dataloader_pin_memory,
        include_num_input_tokens_seen="non_padding",
        average_tokens_across_devices=True,
        ddp_timeout=config.ddp_timeout,
        remove_unused_columns=False,  # added with the preference task: its rejected_* columns are no forward argument
    )


def undeclared_roles(cls) -> list[str]:
    """Why each field of the dataclass ``cls`` fails to declare its roles: no ``Roles`` in its metadata (a plain
    ``field()``), a flag without help or a derived value with one, a role of the wrong type, a ``trainer``
    name that is not a ``TrainingArguments`` argument."""
    trainer_names = {f.name for f in dataclasses.fields(TrainingArguments)}
    problems = []
    for f in dataclasses.fields(cls):
        role = f.metadata.get(ROLES)
        if not isinstance(role, Roles):
            problems.append(f"{f.name}: no roles (write it with flag(...) or derived(...))")
            continue
        if role.derived == ("help" in f.metadata):
            problems.append(f"{f.name}: a flag needs its help, a derived value has none")
        for name in ("step", "replay", "same_run", "compare_passes", "derived"):
            if not isinstance(getattr(role, name), bool):
                problems.append(f"{f.name}: {name} is {getattr(role, name)!r}, not True or False")
        unknown = set(role.trainer_arguments) - trainer_names
        if unknown or (role.to_trainer is not None and not role.trainer_arguments):
            problems.append(f"{f.name}: trainer {role.trainer!r} is not a TrainingArguments argument")
    return problems


def test_every_field_declares_its_roles():
    assert undeclared_roles(TrainConfig) == []
    # the roles that matter most have no default: a flag that leaves one out does not import
    parameters = inspect.signature(flag).parameters
    for role in ("step", "trainer"):
        assert parameters[role].default is inspect.Parameter.empty, role
    with pytest.raises(TypeError, match="step"):
        flag(1, "a flag that forgot whether it is part of a step", trainer=None)
    with pytest.raises(TypeError, match="trainer"):
        flag(1, "a flag that forgot its Trainer argument", step=False)
    with pytest.raises(TypeError, match="unknown role"):
        fields_with(stepp=True)


def test_the_walk_catches_a_field_without_roles():
    """The mutants: a plain ``field()``, a misspelt Trainer argument, a derived value with help."""

    @dataclasses.dataclass
    class Mutant:
        fine: int = flag(1, "declared", step=True, trainer="seed")
        plain: int = dataclasses.field(default=1, metadata={"help": "no roles"})
        misspelt: float = flag(1.0, "Trainer has no such argument", step=False, trainer="learning_rat")
        value: int | None = dataclasses.field(default=None, metadata={"help": "derived, yet a flag",
                                                                      ROLES: roles("batch_plan")})
        ok: dict | None = derived(None, replay=True)

    problems = undeclared_roles(Mutant)
    assert [p.split(":")[0] for p in problems] == ["plain", "misspelt", "value"]


def of_main(names) -> set:
    return set(names) & MAIN_FIELDS


def test_the_lists_are_the_ones_main_kept_by_hand():
    assert MAIN_FIELDS <= set(TrainConfig.__dataclass_fields__)
    # since then: the CPU bf16 choice's two (issue 41), defined after precision_source; the recipe chosen from your
    # data's columns (issue 51)
    assert DERIVED_FIELDS == (OLD_DERIVED_FIELDS[0], "precision_choice", "mixed_precision_requested", "recipe_source",
                              *OLD_DERIVED_FIELDS[1:])
    assert of_main(fields_with(replay=False)) == OLD_REPLAY_IGNORED
    assert of_main(output._IGNORED) == OLD_OUTPUT_IGNORED
    # the same fields, in the order they are defined in (the order a resume refusal lists several differences in)
    # issue 28 took the split of B out of a step's meaning on purpose (B is in it: elastic.batch_meaning)
    split = {"per_device_train_batch_size", "gradient_accumulation_steps"}
    assert of_main(ckpt.STEP_MEANING) == set(OLD_STEP_MEANING) - split
    config = TrainConfig(seed=3, lora_r=4)
    meaning = ckpt.step_meaning(config, 2)
    assert {k: v for k, v in meaning.items() if k in MAIN_FIELDS | {"num_processes"}} == {
        **{name: getattr(config, name) for name in OLD_STEP_MEANING}, "num_processes": 2,
        "total_batch_size": 16}  # the split is recorded, and B (elastic.batch_meaning)
    # compare leaves out the derived values too: config_argv never emits them anyway
    assert of_main(compare._NOT_PASSED) == OLD_NOT_PASSED | set(OLD_DERIVED_FIELDS)
    assert {k: v for k, v in check_settings().items() if k in MAIN_FIELDS} == OLD_CHECK_SETTINGS
    assert all(roles(name).verify is KEPT for name in MAIN_FIELDS - set(OLD_CHECK_SETTINGS))


def test_verify_fixes_the_same_settings():
    from finetune.commands import verify

    assert {k: v for k, v in verify.CHECK_SETTINGS.items() if k in MAIN_FIELDS} == OLD_CHECK_SETTINGS


def test_compare_passes_the_same_flags(tmp_path):
    recipe = load_recipe("bbc-news")
    config = parse_config(["--recipe", "bbc-news", "--output_dir", str(tmp_path), "--total_batch_size", "16",
                           "--auto_find_batch_size", "--max_memory_mb", "900", "--backend", "trainer", "--compare",
                           "--learning_rate", "3e-5", "--seed", "7", "--save_steps", "2", "--overwrite_output_dir"])
    old = config_argv(config, recipe, exclude=OLD_NOT_PASSED)
    assert compare.child_argv(config, recipe, "accelerate", tmp_path / "a")[:len(old)] == old
    assert "--learning_rate" in old and "--total_batch_size" not in old and "--compare" not in old


def test_lever_sets_the_same_config_fields():
    assert Lever(True, None).config_fields() == {"activation_checkpointing": True}
    assert Lever(False, 0).config_fields() == {"activation_checkpointing": False, "loss_chunk_size": 0}
    assert Lever(True, 512).config_fields() == {"activation_checkpointing": True, "loss_chunk_size": 512}
    assert {f.name for f in dataclasses.fields(Lever)} <= set(TrainConfig.__dataclass_fields__)


@pytest.mark.parametrize("argv", [
    [],
    ["--mixed_precision", "bf16", "--seed", "9", "--save_steps", "3", "--save_total_limit", "2",
     "--report_to", "tensorboard", "--torch_compile_mode", "max-autotune", "--dataloader_num_workers", "2"],
    ["--mixed_precision", "no", "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "5",
     "--learning_rate", "3e-5", "--weight_decay", "0.05", "--adam_beta1", "0.8", "--adam_beta2", "0.95",
     "--adam_epsilon", "1e-7", "--optim", "adamw_torch_fused", "--num_train_epochs", "2.5", "--max_steps", "11",
     "--lr_scheduler_type", "cosine", "--warmup_steps", "0.1", "--max_grad_norm", "0.5", "--save_strategy", "epoch",
     "--train_sampling_strategy", "group_by_length", "--dataloader_pin_memory", "False", "--ddp_timeout", "77",
     "--per_device_eval_batch_size", "5"],
    ["--mixed_precision", "fp16", "--checkpointing_steps", "4", "--eval_strategy", "steps", "--eval_steps", "2",
     "--load_best_model_at_end", "--max_train_samples", "10", "--use_peft", "--activation_checkpointing"],
])
def test_training_arguments_are_the_hand_written_mappings(tmp_path, argv):
    config = parse_config(["--recipe", "bbc-news", "--output_dir", str(tmp_path), *argv])
    config.validate()
    assert training_arguments(config).to_dict() == old_training_arguments(config).to_dict()
    other = str(tmp_path / "elsewhere")
    assert training_arguments(config, other).to_dict() == old_training_arguments(config, other).to_dict()
