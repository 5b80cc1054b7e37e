"""The model card: ``README.md`` in a run's output directory, a Hugging Face model card (YAML front
matter with ``model-index``) that says what was trained, on what, how (as it ran), how well, and the
command that reproduces it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
from pathlib import Path

from finetune.precision import PRECISION_NAMES

# eval_* keys that describe the evaluation run, not the model's quality: in the card's results table,
# not in model-index
_EVAL_BOOKKEEPING = {"eval_samples", "eval_tokens", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


# ------------------------------------------------------------------------------------------ commands
def reproduce_command(argv: list[str], num_processes: int = 1, device: str | None = None) -> str:
    """The command line that reruns a training run: ``accelerate launch finetune/run.py ARGS``, every
    argument quoted with ``shlex.quote`` (copy-pasteable into a POSIX shell).

    ``argv``: the run's arguments (``sys.argv[1:]``; a leading ``.../run.py`` is dropped, so
    ``sys.argv`` works too). ``num_processes`` > 1 adds ``--multi_gpu --num_processes N``, and on
    ``device="cpu"`` the ``ACCELERATE_USE_CPU=1`` prefix that gives N gloo processes on a CPU.
    """
    args = list(argv)
    if args and args[0].endswith("run.py"):
        args = args[1:]
    prefix = []
    launch = ["accelerate", "launch"]
    if num_processes > 1:
        launch += ["--multi_gpu", "--num_processes", str(num_processes)]
        if device == "cpu":
            prefix = ["ACCELERATE_USE_CPU=1"]
    return " ".join([*prefix, *(shlex.quote(a) for a in [*launch, "finetune/run.py", *args])])


def config_argv(config, recipe=None, exclude=frozenset()) -> list[str]:
    """Flags that rebuild ``config`` with ``parse_config``: ``--recipe`` plus every field whose value
    differs from its default (the recipe's ``DEFAULTS`` over the dataclass defaults), leaving out the
    fields named in ``exclude``.

    Used when the original command line is not at hand (e.g. inside ``train()``). Fields set to ``None``
    against a non-``None`` default cannot be expressed as a flag and are left out.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    if recipe is not None:
        defaults.update(getattr(recipe, "DEFAULTS", {}))
    argv = ["--recipe", str(config.recipe)]
    for f in dataclasses.fields(config):
        if f.name in ("recipe", "list_recipes") or f.name in exclude:
            continue
        value = getattr(config, f.name)
        if value is None or (f.name in defaults and value == defaults[f.name]):
            continue
        if isinstance(value, bool):
            argv += [f"--{f.name}"] if value else [f"--{f.name}", "False"]
        else:
            argv += [f"--{f.name}", repr(value) if isinstance(value, float) else str(value)]
    return argv


# ------------------------------------------------------------------------------------------ helpers
def _is_hub_id(name_or_path: str | None) -> bool:
    """Whether ``name_or_path`` names a hub model (``org/name`` or ``name``) rather than a local path."""
    if not name_or_path or Path(name_or_path).expanduser().exists():
        return False
    return bool(_HUB_ID.match(name_or_path)) and not name_or_path.startswith(".")


def _fmt(value) -> str:
    """A metric value for a table: floats to 4 decimals, everything else as is."""
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def _yaml_scalar(value) -> str:
    """A YAML scalar: numbers and booleans as is, strings double-quoted (JSON escaping is valid YAML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)) and (not isinstance(value, float) or math.isfinite(value)):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=False)


def _pipeline_tag(recipe) -> str:
    task = str(getattr(recipe, "TASK", "sequence-classification")).lower()
    return "text-generation" if ("causal" in task or "generation" in task or task == "lm") else "text-classification"


def _labels(output_dir: Path) -> list[str]:
    """Label names from the saved ``config.json`` (``id2label`` in id order), or [] if unavailable."""
    try:
        id2label = json.loads((output_dir / "config.json").read_text()).get("id2label") or {}
        return [str(id2label[k]) for k in sorted(id2label, key=lambda k: int(k))]
    except (OSError, ValueError, AttributeError, TypeError):
        return []


def _dataset_entry(config, recipe) -> dict:
    """model-index ``dataset``: the hub dataset when the recipe's data came from the hub, else the
    recipe's dataset (or the user's files)."""
    if getattr(config, "train_file", None):
        name = Path(config.validation_file or config.train_file).name
        return {"name": f"own data ({name})", "type": "custom", "split": "validation"}
    hub = getattr(recipe, "HUB_DATASET", None)
    if hub:
        entry = {"name": str(getattr(recipe, "DATASET", hub[0])), "type": hub[0]}
        if len(hub) > 1 and hub[1]:
            entry["config"] = hub[1]
        entry["split"] = "validation"
        return entry
    return {"name": str(getattr(recipe, "DATASET", getattr(recipe, "NAME", "custom"))),
            "type": str(getattr(recipe, "NAME", "custom")), "split": "validation"}


def _metric_entries(metrics: dict, recipe) -> list[dict]:
    """model-index ``metrics``: every numeric eval_* quality metric (loss, accuracy, f1, ...)."""
    specs = getattr(recipe, "METRICS", {}) or {}
    entries = []
    for key, value in metrics.items():
        if not key.startswith("eval_") or key in _EVAL_BOOKKEEPING:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue  # model-index values are numbers
        kind = key.removeprefix("eval_")
        entry = {"type": kind, "value": value, "name": f"eval {kind}"}
        args = specs.get(kind)
        if args:
            entry["args"] = dict(args)
            entry["name"] += " (" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")"
        entries.append(entry)
    return entries


def _front_matter(config, metrics: dict, recipe, model_name: str) -> str:
    tag = _pipeline_tag(recipe)
    lines = ["---", "library_name: transformers", f"pipeline_tag: {tag}", "tags:", "- finetune",
             f"- {_yaml_scalar(str(getattr(recipe, 'NAME', 'custom')))}"]
    if _is_hub_id(getattr(config, "model_name_or_path", None)):
        lines.append(f"base_model: {_yaml_scalar(config.model_name_or_path)}")
    hub = getattr(recipe, "HUB_DATASET", None)
    if hub and not getattr(config, "train_file", None):
        lines += ["datasets:", f"- {_yaml_scalar(hub[0])}"]
    entries = _metric_entries(metrics, recipe)
    if entries:
        task_name = "Text Generation" if tag == "text-generation" else "Text Classification"
        lines += ["model-index:", f"- name: {_yaml_scalar(model_name)}", "  results:", "  - task:",
                  f"      type: {tag}", f"      name: {_yaml_scalar(task_name)}", "    dataset:"]
        lines += [f"      {k}: {_yaml_scalar(v)}" for k, v in _dataset_entry(config, recipe).items()]
        lines.append("    metrics:")
        for entry in entries:
            lines.append(f"    - type: {_yaml_scalar(entry['type'])}")
            lines.append(f"      value: {_yaml_scalar(entry['value'])}")
            lines.append(f"      name: {_yaml_scalar(entry['name'])}")
            if "args" in entry:
                lines.append("      args:")
                lines += [f"        {k}: {_yaml_scalar(v)}" for k, v in entry["args"].items()]
    lines.append("---")
    return "\n".join(lines)


def _table(rows: list[tuple[str, object]], header=("setting", "value")) -> list[str]:
    out = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    out += [f"| {k} | {str(v).replace('|', '&#124;')} |" for k, v in rows]
    return out


# ------------------------------------------------------------------------------------------ the card
def render_model_card(config, metrics: dict, recipe, command: str, output_dir=None) -> str:
    """The model card's text (Markdown with YAML front matter); see ``write_model_card``."""
    output_dir = Path(output_dir if output_dir is not None else config.output_dir)
    model_name = output_dir.resolve().name or "model"
    recipe_name = str(getattr(recipe, "NAME", config.recipe))
    pipeline_tag = _pipeline_tag(recipe)
    base = config.model_name_or_path or "?"
    labels = _labels(output_dir) if pipeline_tag == "text-classification" else []

    parts = [_front_matter(config, metrics, recipe, model_name), "", f"# {model_name}", ""]
    parts.append(f"`{base}` fine-tuned for {pipeline_tag} with finetune (Hugging Face Accelerate, exact gradient "
                 f"accumulation) on the `{recipe_name}` recipe.")
    parts += ["", "## Recipe", "", f"- **name**: `{recipe_name}`",
              f"- **description**: {getattr(recipe, 'DESCRIPTION', '')}",
              f"- **task**: {getattr(recipe, 'TASK', '')}",
              f"- **dataset**: {getattr(recipe, 'DATASET', '')}",
              f"- **base model**: `{base}`" + ("" if _is_hub_id(base) else " (a local directory)")]

    parts += ["", "## Data", ""]
    if config.train_file:
        parts.append(f"Own data: trained on `{config.train_file}`, evaluated on "
                     + (f"`{config.validation_file}`." if config.validation_file
                        else "a 20% stratified hold-out of it (seed 42)."))
    else:
        parts.append(f"{getattr(recipe, 'DATASET', recipe_name)}, the recipe's train/validation splits.")
    text_columns = getattr(recipe, "TEXT_COLUMNS", None)
    data_rows = []
    if text_columns:
        data_rows.append(("text column(s)", ", ".join(f"`{c}`" for c in text_columns)))
    if labels:
        data_rows.append(("labels (id order)", ", ".join(f"`{name}`" for name in labels)))
    if config.max_train_samples is not None:
        data_rows.append(("training subset", f"first {config.max_train_samples} samples (--max_train_samples)"))
    if config.max_eval_samples is not None:
        data_rows.append(("evaluation subset", f"first {config.max_eval_samples} samples (--max_eval_samples)"))
    if "train_samples" in metrics:
        data_rows.append(("samples seen in training (all epochs)", metrics["train_samples"]))
    if "eval_samples" in metrics:
        data_rows.append(("evaluation samples", metrics["eval_samples"]))
    data_rows.append(("max_length (tokens, truncation)", config.max_length))
    if data_rows:
        parts += [""] + _table(data_rows, ("what", "value"))

    processes = metrics.get("num_processes", 1)
    micro = metrics.get("per_device_train_batch_size", config.per_device_train_batch_size)
    accum = metrics.get("gradient_accumulation_steps", config.gradient_accumulation_steps)
    effective = metrics.get("effective_batch_size", micro * accum * processes)
    limit = f"--max_steps {config.max_steps}" if config.max_steps > 0 else f"--num_train_epochs {config.num_train_epochs}"
    epochs = f"{metrics['epochs']} (as run; set by {limit})" if "epochs" in metrics else limit
    hyper = [
        ("per_device_train_batch_size (micro-batch, samples)", micro),
        ("gradient_accumulation_steps", accum),
        ("number of processes", processes),
        ("**effective batch size** (samples per optimizer step)", f"**{effective}** = {micro} x {accum} x {processes}"),
        ("learning_rate (peak)", config.learning_rate),
        ("lr_scheduler_type", config.lr_scheduler_type),
        ("warmup_steps (optimizer steps)", config.warmup_steps),
        ("epochs", epochs.strip()),
        ("optimizer steps", metrics.get("optimizer_steps", "?")),
        ("max_grad_norm", config.max_grad_norm if config.max_grad_norm > 0 else "0 (no clipping)"),
        ("weight_decay", config.weight_decay),
        ("optimizer", f"AdamW (betas {config.adam_beta1}, {config.adam_beta2}; eps {config.adam_epsilon})"),
        ("max_length (tokens)", config.max_length),
        ("seed", config.seed),
    ]
    if metrics.get("backend"):
        hyper.append(("training engine", metrics["backend"]))
    if config.disable_dropout:
        hyper.append(("dropout", "disabled (--disable_dropout)"))
    if metrics.get("skipped_optimizer_steps"):
        hyper.append(("skipped optimizer steps (fp16 overflow)", metrics["skipped_optimizer_steps"]))
    parts += ["", "## Training hyperparameters", ""] + _table(hyper)

    ran = metrics.get("mixed_precision", config.mixed_precision)
    requested = metrics.get("mixed_precision_requested", config.mixed_precision)
    device = metrics.get("device")
    parts += ["", "## Precision", "",
              f"This run trained in **{PRECISION_NAMES.get(ran, ran)}** (`mixed_precision: {ran}`, as measured inside "
              f"autocast{f' on {device}' if device else ''})."]
    if requested != ran:
        sentence = f"`--mixed_precision {requested}` was requested, but "
        if requested == "fp16" and device in (None, "cpu"):
            sentence += ("fp16 does not run on CPU: Accelerate accepts the flag, but CPU autocast stays fp32, "
                         f"so the weights were trained in {PRECISION_NAMES.get(ran, ran)}.")
        else:
            sentence += (f"autocast on {device or 'this device'} does not run {requested}, so the weights were "
                         f"trained in {PRECISION_NAMES.get(ran, ran)}. (fp16 does not run on CPU at all.)")
        parts += ["", sentence]

    evals = [(k, v) for k, v in metrics.items() if k.startswith("eval_")]
    parts += ["", "## Evaluation results", ""]
    if evals:
        parts.append("On the validation split, after the last epoch:")
        parts += [""] + _table([(f"`{k}`", _fmt(v)) for k, v in evals], ("metric", "value"))
    else:
        parts.append("No evaluation was recorded.")
    if "train_loss" in metrics:
        per = "label token" if pipeline_tag == "text-generation" else "sample"
        parts += ["", f"Training loss (mean cross-entropy per {per} over all optimizer steps, nats): "
                      f"{_fmt(metrics['train_loss'])}."]

    units = {"train_samples_per_second": "samples/s", "train_runtime": "s", "eval_runtime": "s", "wall_time": "s"}
    speed = [(f"`{k}` ({unit})", metrics[k]) for k, unit in units.items() if k in metrics]
    if isinstance(metrics.get("peak_memory_bytes"), (int, float)):
        kind = metrics.get("peak_memory_kind")
        speed.append((f"peak memory{f' ({kind})' if kind else ''}", f"{metrics['peak_memory_bytes'] / 2**20:.0f} MiB"))
    parts += ["", "## Training speed", ""]
    if speed:
        parts += _table(speed, ("metric", "value"))
        if device:
            parts += ["", f"Measured on {device} with {processes} process(es)."]
    else:
        parts.append("Not recorded.")

    parts += ["", "## Reproduce", "", "```bash", command, "```"]

    path = str(output_dir)
    if pipeline_tag == "text-generation":
        usage = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline", "",
                 f"generator = pipeline(\"text-generation\", model={json.dumps(path)})",
                 "print(generator(\"Once upon a time\", max_new_tokens=40, do_sample=False))", "",
                 f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(path)})",
                 f"model = AutoModelForCausalLM.from_pretrained({json.dumps(path)})", "```"]
    else:
        example = "Shares rose after the company reported record profits." if recipe_name == "bbc-news" \
            else "An example text."
        usage = ["```python", "import torch", "from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline",
                 "", f"classifier = pipeline(\"text-classification\", model={json.dumps(path)})",
                 f"print(classifier({json.dumps(example)}))", "",
                 f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(path)})",
                 f"model = AutoModelForSequenceClassification.from_pretrained({json.dumps(path)})",
                 f"inputs = tokenizer([{json.dumps(example)}], truncation=True, max_length={config.max_length}, "
                 "return_tensors=\"pt\")",
                 "with torch.no_grad():", "    probs = model(**inputs).logits.softmax(-1)",
                 "print(model.config.id2label[int(probs.argmax(-1))], float(probs.max()))", "```"]
    parts += ["", "## Usage", ""] + usage
    parts += ["", "Or from the command line:", "", "```bash",
              f"python -m finetune.predict --model {shlex.quote(path)} \"some text\"", "```", ""]
    return "\n".join(parts)


def write_model_card(output_dir, config, metrics: dict, recipe, command: str) -> Path:
    """Write ``README.md`` into ``output_dir`` and return its path.

    ``config``: the run's ``finetune.config.TrainConfig``. ``metrics``: the dict ``train()`` returns (as in
    ``metrics.json``: ``effective_batch_size``, ``mixed_precision`` as it ran, ``eval_*``, ...; missing
    keys are shown from ``config`` or left out). ``recipe``: the recipe module (``NAME``, ``DESCRIPTION``,
    ``DATASET``, ``TASK``, optional ``HUB_DATASET``, ``METRICS``, ``TEXT_COLUMNS``). ``command``: the shell
    line that reproduces the run (see ``reproduce_command``), shown verbatim in a code block.

    The card opens with YAML front matter (``library_name``, ``pipeline_tag``, ``tags``, ``base_model``
    when the base model is a hub id, ``model-index`` with every eval metric). Label names come from
    ``output_dir/config.json`` when it exists. Overwrites an existing ``README.md``. Raises ``OSError``
    if the directory cannot be written.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "README.md"
    path.write_text(render_model_card(config, metrics, recipe, command, output_dir=output_dir), encoding="utf-8")
    return path
