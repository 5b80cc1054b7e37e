"""Builders both engines share: the recipe's tokenizer, tokenized datasets, model and collator.

Recipes supply raw data (``load_raw_datasets``); tasks (``finetune.tasks``) say how to tokenize, build
the model and collate; this module puts them together in the order both engines need.
"""

from __future__ import annotations

import json
import sys

import transformers
from accelerate.utils import set_seed
from torch.nn.modules.batchnorm import _BatchNorm

from finetune.data.loading import LABEL_COLUMN, load_named_dataset
from finetune.data.mixture import load_mixture
from finetune.distributed import is_main_process
from finetune.errors import FinetuneError
from finetune.models.dropout import disable_dropout
from finetune.models.loading import check_max_length, load_tokenizer
from finetune.models.lora import apply_lora
from finetune.models.quantization import is_quantized, prepare_for_training, with_compute_dtype


def build_datasets(recipe, config, tokenizer, task):
    """Raw data (``raw_datasets``) tokenized. ``task``: the recipe's task. Returns ``(tokenized DatasetDict,
    label_names, raw validation split)``; the raw split is what generation evaluates (instruction tuning), the
    tokenized one what the loss sees."""
    raw = raw_datasets(recipe, config, task)
    label_feature = raw["train"].features.get(LABEL_COLUMN)
    label_names = label_feature.names if hasattr(label_feature, "names") else None
    return task.tokenize(raw, tokenizer, config, recipe.TEXT_COLUMNS), label_names, raw["validation"]


def raw_datasets(recipe, config, task, check: bool = True):
    """The run's raw ``train`` and ``validation`` splits (the recipe's, ``--dataset_name``, or ``--train_file``/
    ``--validation_file``), subsampled to ``max_train_samples``/``max_eval_samples`` (first N after the split),
    which is printed with the rows it keeps of how many.
    Instruction rows are checked where they came from (``check``; ``finetune check-data`` reports them instead).
    Raises the loaders' ``FinetuneError``s."""
    if config.dataset_mixture:
        loaded, kept = load_mixture(json.loads(config.dataset_mixture), config.cache_dir)
        if is_main_process():  # what each source gives, as a limit that changes what trains is said
            total = sum(n for _, n, _ in kept)
            print("Data: a mixture of " + "; ".join(f"{name} {n:,} of {rows:,} rows ({n / total:.1%})"
                                                    for name, n, rows in kept))
        raw = load_named_dataset("(the dataset mixture)", None, "train", "test", recipe.TEXT_COLUMNS, config.cache_dir,
                                 class_labels=task.class_labels, conversations=task.chat, loaded=loaded)
    elif config.dataset_name:
        raw = load_named_dataset(config.dataset_name, config.dataset_config, config.dataset_train_split,
                                 config.dataset_test_split, recipe.TEXT_COLUMNS, config.cache_dir,
                                 class_labels=task.class_labels, conversations=task.chat)
    elif config.train_file:
        raw = task.load_files(config.train_file, config.validation_file, recipe.TEXT_COLUMNS, config.cache_dir)
    else:
        raw = recipe.load_raw_datasets(config)
    if check:
        for split in raw.values():
            task.check_rows(split)
    for split, name, what in (("train", "max_train_samples", "training"), ("validation", "max_eval_samples",
                                                                              "validation")):
        limit, rows = getattr(config, name), len(raw[split])
        if limit is not None and limit < rows:
            raw[split] = raw[split].select(range(limit))
            if is_main_process():  # a limit that changes what trains is said, never silent
                source = "the recipe's default" if getattr(recipe, "DEFAULTS", {}).get(name) == limit else "yours"
                print(f"Data: the first {limit:,} of {rows:,} {what} rows (--{name} {limit}: {source}; "
                      f"--{name} N changes it)")
    return raw


def batchnorm_warning(model, gradient_accumulation_steps: int) -> str | None:
    """A warning when ``model`` holds BatchNorm layers (any ``torch.nn.modules.batchnorm._BatchNorm``) and
    gradients are accumulated: their statistics are per micro-batch, so accumulation is not equivalent to
    the large batch. None otherwise."""
    if gradient_accumulation_steps <= 1:
        return None
    layers = [name for name, module in model.named_modules() if isinstance(module, _BatchNorm)]
    if not layers:
        return None
    return (f"WARNING: the model has {len(layers)} BatchNorm layer(s) (e.g. {layers[0]!r}) and "
            f"gradient_accumulation_steps={gradient_accumulation_steps}: BatchNorm statistics are computed per "
            "micro-batch, so accumulated training is NOT equivalent to the large batch. Prefer a larger "
            "micro-batch, or replace BatchNorm (GroupNorm/LayerNorm, or SyncBatchNorm across processes).")


def enable_activation_checkpointing(model, config) -> None:
    """Turn on transformers' activation (gradient) checkpointing, non-reentrant unless
    ``--activation_checkpointing_kwargs`` says otherwise: reentrant checkpointing breaks DDP's
    ready-once bookkeeping (accelerate issue 389). The kwargs are split as ``Trainer`` (transformers 5.23)
    splits them: ``every_n_layers`` and ``offload`` go to ``activation_checkpointing_enable``, the rest to
    ``torch.utils.checkpoint.checkpoint``. Frozen input embeddings (LoRA) would give the checkpointed layers
    inputs that do not require grad, so no gradient would reach the adapters: the inputs are made to require
    grad (``enable_input_require_grads``), as peft's docs ask.

    Raises ``FinetuneError`` where the installed transformers predates ``activation_checkpointing_enable`` and
    ``every_n_layers``/``offload`` were asked for (its ``gradient_checkpointing_enable`` has neither)."""
    kwargs = {"use_reentrant": False, **json.loads(config.activation_checkpointing_kwargs or "{}")}
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers,
                                              offload=offload)
    elif every_n_layers != 1 or offload:
        raise FinetuneError(f"--activation_checkpointing_kwargs \"every_n_layers\"/\"offload\" need transformers' "
                            f"activation_checkpointing_enable, which transformers {transformers.__version__} lacks: "
                            "upgrade transformers (5.23 has it) or leave them out.")
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if config.use_peft:
        model.enable_input_require_grads()


def build_model(config, task, label_names=None, pad_token_id=None, recipe=None):
    """The model as training builds it, before an engine wraps it: ``task.load_model(config, label_names)``, or
    the recipe's own ``build_model(config, label_names)`` where it has one (``recipes/__init__.py``);
    its ``pad_token_id`` set from ``pad_token_id`` (the tokenizer's) where the model has none; ``--max_length``
    (``--block_size`` where set, tokens) checked against its position limit; activation checkpointing under
    ``config.activation_checkpointing`` (``enable_activation_checkpointing``), after a quantized base
    (``--load_in_4bit``/``--load_in_8bit``, loaded so by the task) is prepared for adapters
    (``quantization.prepare_for_training``); LoRA adapters under
    ``config.use_peft`` (``lora.apply_lora``); then, under ``config.disable_dropout``, every dropout of the built
    model off, LoRA's included (``dropout.disable_dropout``: modules, float attributes and config fields, whatever
    the family names them, checked). In eval mode, as loaded: the caller sets train mode.

    ``task``: a task object (``get_task``, ``run_task``); ``label_names``: the classifier's labels (None for causal LM).
    The one builder of the model: ``build_components`` (both engines), the planner's probes and
    ``bench/bench_memory.py``; a probe of another lever setting passes a config copy (``dataclasses.replace``).
    Raises ``FinetuneError`` (too long ``--max_length``, LoRA target modules the model lacks,
    ``--activation_checkpointing_kwargs`` this transformers cannot take, a dropout ``--disable_dropout`` cannot
    turn off) and the loaders' errors.
    """
    model = getattr(recipe, "build_model", task.load_model)(config, label_names)
    if model.config.pad_token_id is None and pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    check_max_length(config.block_size or config.max_length, model.config)
    if is_quantized(config):  # before checkpointing and adapters, as peft's docs order it
        model = prepare_for_training(model)
    if config.activation_checkpointing:
        enable_activation_checkpointing(model, config)
    if config.use_peft:
        try:
            model = apply_lora(model, config, task.peft_task_type)
        except ValueError as err:  # e.g. target modules the model does not have
            raise FinetuneError(f"--use_peft: {err} Check --lora_target_modules against the model's module "
                                "names (or leave it unset for peft's default).") from None
    if config.disable_dropout:  # last, so LoRA's dropout modules and anything a recipe built are off too
        disable_dropout(model)
    return model


def build_components(config, recipe, precision: str, main_process_first, task, device):
    """What both engines share: ``(tokenizer, tokenized datasets, label_names, model, collator, raw validation
    split)``, built by the run's task ``task`` (``tasks.run_task``); ``label_names`` is None for causal LM. The model
    is ``build_model``'s; then the task derives what it needs from it (``task.attach``: a preference task's
    reference, or its precomputed log-probabilities, computed on ``device``), before the seed is set again.

    ``main_process_first``: a context-manager factory (Accelerate's or TrainingArguments') so rank 0
    tokenizes and caches before the others read the cache. The seed is set before the model is built
    (the classifier head is random) and again after, as ``Trainer.__init__`` does, so both engines start
    training from the same RNG state (Accelerate's ``set_seed`` seeds what transformers' does on CPU and CUDA:
    ``random``, ``numpy``, ``torch``, every CUDA device; accelerate 1.15 ``utils/random.py`` ``set_seed``,
    transformers 5.24 ``trainer_utils.py`` ``set_seed``, whose module imports peft). ``precision`` is the one that
    really runs: under fp16/bf16 the collator pads to a multiple of 8 tokens (tensor cores), fp32 gains nothing
    from it; a 4-bit base computes in it (``quantization.with_compute_dtype``).
    """
    set_seed(config.seed)
    tokenizer = load_tokenizer(config.model_name_or_path)
    with main_process_first():
        datasets, label_names, raw_validation = build_datasets(recipe, config, tokenizer, task)
    # a 4-bit base computes in the precision that runs (an fp16 request runs fp32 on a CPU)
    model = build_model(with_compute_dtype(config, precision), task, label_names, tokenizer.pad_token_id, recipe)
    warning = batchnorm_warning(model, config.gradient_accumulation_steps)
    if warning and is_main_process():
        print(warning, file=sys.stderr)
    collator = task.collator(tokenizer, pad_to_multiple_of=8 if precision != "no" else None)
    datasets = task.attach(model, datasets, collator, config, main_process_first, device, precision)
    set_seed(config.seed)
    return tokenizer, datasets, label_names, model, collator, raw_validation
