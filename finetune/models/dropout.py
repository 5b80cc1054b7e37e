"""``--disable_dropout``: every dropout of a built model off, whatever its family calls it, and checked.

Families name their dropout probabilities differently (``hidden_dropout_prob`` in BERT, ``attention_dropout`` in
Llama, ``resid_pdrop``/``embd_pdrop``/``attn_pdrop`` in GPT-2, GPT-J, Phi and CodeGen, ``hidden_dropout`` in
Bloom, ``layerdrop``, ``drop_path_rate``), and use them in three ways: ``torch.nn.Dropout*`` modules built from
the config at init, float attributes of modules copied from the config at init (Llama's attention
``attention_dropout``, BERT's ``dropout_prob``, Bloom's ``hidden_dropout``: passed to SDPA or
``F.dropout`` at call time), and the config read at call time (``F.dropout(..., p=self.config.dropout)``).
Zeroing config keys that contain "dropout" before loading missed the ``*_pdrop`` families. So, after the model is
built (LoRA included), all three:
``p = 0`` on every ``torch.nn.modules.dropout._DropoutNd`` (TRL's ``disable_dropout_in_model``, trl/trainer/
utils.py, sets ``p = 0`` on ``torch.nn.Dropout``; ``_DropoutNd`` also covers Dropout1d/2d/3d and AlphaDropout), and
every float in (0, 1] whose name contains "drop" on the modules and on the configs they reach. Then
``dropout_left`` checks, more broadly (any module whose class name says Dropout), that nothing is left.
Why: docs/design-notes.md#dropout-off-on-the-built-model; detail: docs/verify.md#dropout-off-checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedConfig

from finetune.errors import FinetuneError


def is_dropout_probability(name: str, value) -> bool:
    """Whether a config field or module attribute ``name`` = ``value`` is a dropout probability to zero: its name
    contains "drop" (``*dropout*``, ``*_pdrop``, ``layerdrop``, ``drop_path_rate``; every such float field of
    transformers 5.24's configs is a probability) and its value is a float in (0, 1]. Booleans
    (``token_dropout``), ints, tuples and None are left alone, and so is a float above 1: not a probability."""
    return ("drop" in name.lower() and isinstance(value, float) and not isinstance(value, bool)
            and 0.0 < value <= 1.0)


@dataclass
class DropoutOff:
    """What ``disable_dropout`` set to 0: ``modules`` (names of ``_DropoutNd`` modules whose ``p`` was > 0),
    ``attributes`` ("module.name" of float attributes), ``config_fields`` ("config.name", "config.sub.name")."""

    modules: list = field(default_factory=list)
    attributes: list = field(default_factory=list)
    config_fields: list = field(default_factory=list)

    def summary(self) -> str:
        """E.g. "9 dropout modules, 4 module attributes and 3 config fields set to 0"."""
        return (f"{len(self.modules)} dropout modules, {len(self.attributes)} module attributes and "
                f"{len(self.config_fields)} config fields set to 0")


def _configs(model) -> list[tuple[str, PreTrainedConfig]]:
    """Every ``PreTrainedConfig`` the model reaches: ``model.config``, the ``config`` attribute of any module (a
    copy some modules keep), and their sub-configs (``text_config``, ...), each once, with a dotted name."""
    roots = [("config", getattr(model, "config", None))]
    roots += [(f"{name}.config" if name else "config", vars(module).get("config"))
              for name, module in model.named_modules()]
    return _walk_configs(roots)


def _walk_configs(roots) -> list[tuple[str, PreTrainedConfig]]:
    """The ``PreTrainedConfig``s among ``roots`` ((name, object) pairs) and their sub-configs, each once."""
    found, seen = [], set()

    def walk(prefix: str, config) -> None:
        if not isinstance(config, PreTrainedConfig) or id(config) in seen:
            return
        seen.add(id(config))
        found.append((prefix, config))
        for key, value in list(vars(config).items()):
            walk(f"{prefix}.{key}", value)

    for prefix, config in roots:
        walk(prefix, config)
    return found


def _module_attributes(model):
    """(module name, module, attribute, value) for every plain attribute of every module (``vars``: not its
    parameters, buffers or submodules, which torch keeps in ``_parameters``/``_buffers``/``_modules``)."""
    for name, module in model.named_modules():
        for key, value in list(vars(module).items()):
            if not key.startswith("_"):
                yield name, module, key, value


def zero_config_dropout(config) -> list[str]:
    """Set every dropout probability (``is_dropout_probability``) of ``config`` and its sub-configs to 0.0, before
    a model is built from it; returns the fields set ("config.attn_pdrop", ...)."""
    zeroed = []
    for prefix, cfg in _walk_configs([("config", config)]):
        for key, value in list(vars(cfg).items()):
            if is_dropout_probability(key, value):
                setattr(cfg, key, 0.0)
                zeroed.append(f"{prefix}.{key}")
    return zeroed


def disable_dropout(model: torch.nn.Module) -> DropoutOff:
    """Turn every dropout of the built ``model`` off: ``p = 0`` on every ``torch.nn.modules.dropout._DropoutNd``
    (LoRA's ``lora_dropout`` modules too: ``--disable_dropout`` means all of them), every float dropout
    probability attribute of a module (``attention_dropout``, ``dropout_prob``, ``hidden_dropout``, ...) and every
    dropout probability field of the configs the model reaches (read at call time by some families), then check
    with ``dropout_left``. Returns what was set to 0 (``DropoutOff``). Raises ``FinetuneError`` naming what is
    still above 0 (a dropout this rule does not know), rather than train with dropout on while saying it is off."""
    off = DropoutOff()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            off.modules.append(name)
    for name, module, key, value in _module_attributes(model):
        if is_dropout_probability(key, value):
            setattr(module, key, 0.0)
            off.attributes.append(f"{name}.{key}" if name else key)
    for prefix, config in _configs(model):
        for key, value in list(vars(config).items()):
            if is_dropout_probability(key, value):
                setattr(config, key, 0.0)
                off.config_fields.append(f"{prefix}.{key}")
    left = dropout_left(model)
    if left:
        raise FinetuneError(f"--disable_dropout: this model keeps dropout this run cannot turn off: {', '.join(left[:5])}"
                            f"{f' (and {len(left) - 5} more)' if len(left) > 5 else ''}. Train without "
                            "--disable_dropout, or set it to 0 in the model's config.")
    return off


def dropout_left(model: torch.nn.Module) -> list[str]:
    """What still drops out in ``model``, as "where=value": ``_DropoutNd`` modules with ``p`` > 0, any other module
    whose class name contains "Dropout" with a float attribute > 0 (e.g. a family's own ``StableDropout``), module
    attributes and config fields that are dropout probabilities (``is_dropout_probability``). [] when dropout is
    off everywhere this can see."""
    left = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            if module.p > 0:
                left.append(f"{name}.p={module.p}")
        elif "dropout" in type(module).__name__.lower():
            left += [f"{name}.{k}={v}" for k, v in vars(module).items()
                     if isinstance(v, float) and not isinstance(v, bool) and v > 0]
    left += [f"{name}.{key}={value}" for name, _, key, value in _module_attributes(model)
             if is_dropout_probability(key, value)]
    left += [f"{prefix}.{key}={value}" for prefix, config in _configs(model) for key, value in vars(config).items()
             if is_dropout_probability(key, value)]
    return left
