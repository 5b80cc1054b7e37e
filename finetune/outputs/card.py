"""The model card: ``README.md`` in a run's output directory, built with ``huggingface_hub.ModelCard``:
metadata (``ModelCardData``, every eval metric an ``EvalResult``) over a Markdown body that says what was
trained, on what, how (as it ran), how well, and the command that reproduces it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shlex
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from finetune import __version__
from finetune.engine import TRACKER_MODULES
from finetune.engine.precision import PRECISION_NAMES

# eval_* keys that describe the evaluation run, not the model's quality: in the body's table, not in eval_results
_EVAL_BOOKKEEPING = {"eval_samples", "eval_tokens", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second",
                     "eval_benchmarks_runtime"}
# (name in the card, distribution): the versions a run's card records, as TRL's lm_model_card.md does
FRAMEWORKS = (("PyTorch", "torch"), ("Transformers", "transformers"), ("Accelerate", "accelerate"),
              ("Datasets", "datasets"), ("Tokenizers", "tokenizers"), ("huggingface_hub", "huggingface_hub"),
              ("PEFT", "peft"), ("DeepSpeed", "deepspeed"))
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


# ------------------------------------------------------------------------------------------ helpers
def _is_hub_id(name_or_path: str | None) -> bool:
    """Whether ``name_or_path`` names a hub model (``org/name`` or ``name``), not a local directory or GGUF file."""
    if not name_or_path or name_or_path.lower().endswith(".gguf") or Path(name_or_path).expanduser().exists():
        return False
    return bool(_HUB_ID.match(name_or_path)) and not name_or_path.startswith(".")


def _fmt(value) -> str:
    """A metric value for a table: floats to 4 decimals, everything else as is."""
    return f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else str(value)


def _table(rows, header=("setting", "value")) -> str:
    """A two-column Markdown table of the rows whose value is not None, False or ""; ``|`` in values is escaped."""
    rows = [(k, v) for k, v in rows if v is not None and v is not False and v != ""]  # 0 is a value, False is not
    rows = [f"| {k} | {str(v).replace('|', '&#124;')} |" for k, v in rows]
    return "\n".join([f"| {header[0]} | {header[1]} |", "| --- | --- |", *rows])


def _labels(output_dir: Path) -> list[str]:
    """Label names from the saved ``config.json`` (``id2label`` in id order), or [] if unavailable."""
    try:
        id2label = json.loads((output_dir / "config.json").read_text()).get("id2label") or {}
        return [str(id2label[k]) for k in sorted(id2label, key=int)]
    except (OSError, ValueError, AttributeError, TypeError):
        return []


def _eval_results(config, metrics: dict, recipe, hub, task: str) -> list[EvalResult]:
    """One ``EvalResult`` per finite numeric eval_* quality metric, on the validation split of the run's data:
    the hub dataset ``hub`` (id, config) if given, else the recipe's dataset (or the user's files)."""
    name = str(getattr(recipe, "NAME", "custom"))
    own = config.train_file and f"own data ({Path(config.validation_file or config.train_file).name})"
    dataset = {"dataset_type": hub[0] if hub else "custom" if own else name, "dataset_split": "validation",
               "dataset_name": own or str(getattr(recipe, "DATASET", hub[0] if hub else name)),
               "dataset_config": hub[1] if hub and len(hub) > 1 and hub[1] else None}
    specs, results = getattr(recipe, "METRICS", None) or {}, []
    for key, value in metrics.items():
        if (key.startswith("eval_") and key not in _EVAL_BOOKKEEPING and not key.endswith("_stderr")
                and not isinstance(value, bool)
                and isinstance(value, (int, float)) and math.isfinite(value)):  # model-index values: finite numbers
            kind = key.removeprefix("eval_")
            args = dict(specs.get(kind) or {}) or None
            results.append(EvalResult(
                task_type=task, task_name=task.replace("-", " ").title(), metric_type=kind,
                metric_value=float(value) if isinstance(value, float) else int(value),  # numpy scalars: plain YAML
                metric_name=f"eval {kind}" + (f" ({', '.join(f'{k}={v}' for k, v in args.items())})" if args else ""),
                metric_args=args, **dataset))
    return results


def _precision(config, metrics: dict) -> str:
    """The precision the run trained in, as measured, and why it differs from the requested one if it does."""
    ran = metrics.get("mixed_precision", config.mixed_precision)
    requested = metrics.get("mixed_precision_requested", config.mixed_precision)
    device, name = metrics.get("device"), PRECISION_NAMES.get(ran, ran)
    text = f"This run trained in **{name}** (`mixed_precision: {ran}`, as measured inside autocast" \
           f"{f' on {device}' if device else ''})."
    if requested == ran:
        return text
    if requested == "fp16" and ran == "bf16" and metrics.get("precision_choice"):
        return (f"{text}\n\n`--mixed_precision fp16` was requested, which a CPU does not run; "
                f"{metrics['precision_choice']}.")
    why = ("fp16 does not run on CPU: Accelerate accepts the flag, but CPU autocast stays fp32, so"
           if requested == "fp16" and device in (None, "cpu") else
           f"autocast on {device or 'this device'} does not run {requested} (fp16 does not run on CPU at all), so")
    return f"{text}\n\n`--mixed_precision {requested}` was requested, but {why} the weights were trained in {name}."


def lora_summary(config) -> str:
    """The LoRA family settings in a few words: "LoRA r=16, alpha=32" plus DoRA, rsLoRA, the initialisation and
    the modules trained in full where set (the banner's and the card's)."""
    kind = "DoRA" if config.use_dora else "LoRA"
    extras = [name for name, on in (("rsLoRA scaling alpha/sqrt(r)", config.use_rslora),
                                    (f"init {config.init_lora_weights}", config.init_lora_weights != "true"),
                                    (f"targets {config.lora_target_modules}", config.lora_target_modules),
                                    (f"trained in full: {config.lora_modules_to_save}", config.lora_modules_to_save))
              if on]
    return f"{kind} r={config.lora_r}, alpha={config.lora_alpha}" + "".join(f"; {e}" for e in extras)


def quantized_base_summary(config, precision: str | None = None) -> str | None:
    """The quantized base the flags asked for, in words ("NF4 4-bit (bitsandbytes), nested constants, compute
    float32"; "int8 8-bit (bitsandbytes LLM.int8())"), or None for a full-precision base; ``precision``: the one
    that ran ("no", "bf16", "fp16"), where known, which the 4-bit layers computed in unless the flag said."""
    if config.load_in_8bit:
        return "int8 8-bit (bitsandbytes LLM.int8()), frozen"
    if not config.load_in_4bit:
        return None
    from finetune.models.quantization import compute_dtype  # the default is the run's precision's

    nested = ", nested constants" if config.use_bnb_nested_quant else ""
    return f"{config.bnb_4bit_quant_type.upper()} 4-bit (bitsandbytes){nested}, compute {compute_dtype(config, precision)}, frozen"


def _hyperparameters(config, metrics: dict) -> list[tuple[str, object]]:
    """The training settings as the run used them (``metrics`` first, ``config`` as the fallback)."""
    processes = metrics.get("num_processes", 1)
    micro = metrics.get("per_device_train_batch_size", config.per_device_train_batch_size)
    accum = metrics.get("gradient_accumulation_steps", config.gradient_accumulation_steps)
    effective = metrics.get("effective_batch_size", micro * accum * processes)
    limit = (f"--max_steps {config.max_steps}" if config.max_steps > 0
             else f"--num_train_epochs {config.num_train_epochs}")
    return [
        ("per_device_train_batch_size (micro-batch, samples)", micro), ("gradient_accumulation_steps", accum),
        ("number of processes", processes),
        ("**effective batch size** (samples per optimizer step)", f"**{effective}** = {micro} x {accum} x {processes}"),
        ("learning_rate (peak)", config.learning_rate), ("lr_scheduler_type", config.lr_scheduler_type),
        ("warmup_steps (optimizer steps)", config.warmup_steps),
        ("epochs", f"{metrics['epochs']} (as run; set by {limit})" if "epochs" in metrics else limit),
        ("optimizer steps", metrics.get("optimizer_steps", "?")),
        ("max_grad_norm", config.max_grad_norm if config.max_grad_norm > 0 else "0 (no clipping)"),
        ("weight_decay", config.weight_decay),
        ("optimizer", f"AdamW, `{config.optim}` (betas {config.adam_beta1}, {config.adam_beta2}; eps {config.adam_epsilon})"),
        ("adapters", config.use_peft and lora_summary(config)),
        ("base model weights", quantized_base_summary(config, metrics.get("mixed_precision"))),
        ("max_length (tokens, truncation)", config.max_length), ("seed", config.seed),
        ("training engine", metrics.get("backend")),
        # a run with --disable_dropout trains only once every dropout is checked off (dropout.disable_dropout raises)
        ("dropout", config.disable_dropout and "off (--disable_dropout: every dropout module and probability set "
                                               "to 0, checked)"),
        ("skipped optimizer steps (fp16 overflow)", metrics.get("skipped_optimizer_steps") or None)]


def _data(config, metrics: dict, recipe, labels: list[str]) -> str:
    """Where the training and evaluation data came from, and how much of it was used."""
    if config.train_file:
        text = f"Own data: trained on `{config.train_file}`, evaluated on " + (
            f"`{config.validation_file}`." if config.validation_file else "a 20% stratified hold-out of it (seed 42).")
    else:
        text = f"{getattr(recipe, 'DATASET', config.recipe)}, the recipe's train/validation splits."
    subset = "first {} samples (--max_{}_samples)".format
    return text + "\n\n" + _table([
        ("text column(s)", ", ".join(f"`{c}`" for c in getattr(recipe, "TEXT_COLUMNS", None) or ())),
        ("labels (id order)", ", ".join(f"`{name}`" for name in labels)),
        ("training subset", config.max_train_samples is not None and subset(config.max_train_samples, "train")),
        ("evaluation subset", config.max_eval_samples is not None and subset(config.max_eval_samples, "eval")),
        ("samples seen in training (all epochs)", metrics.get("train_samples")),
        ("evaluation samples", metrics.get("eval_samples"))], ("what", "value"))


def _results_and_speed(metrics: dict, loss_name: str) -> tuple[str, str]:
    """The evaluation section (every eval_* value, the training loss: the mean of ``loss_name``, the task's) and the
    speed section (seconds, MiB)."""
    evals = [(f"`{k}`", _fmt(v)) for k, v in metrics.items() if k.startswith("eval_")]
    results = ("On the validation split, after the last epoch:\n\n" + _table(evals, ("metric", "value"))
               if evals else "No evaluation was recorded.")
    if "train_loss" in metrics:
        results += f"\n\nTraining loss (mean {loss_name} over all optimizer steps): {_fmt(metrics['train_loss'])}."
    units = {"train_samples_per_second": "samples/s", "train_runtime": "s", "eval_runtime": "s", "wall_time": "s"}
    speed = [(f"`{k}` ({unit})", metrics[k]) for k, unit in units.items() if k in metrics]
    if isinstance(metrics.get("peak_memory_bytes"), (int, float)):
        kind = metrics.get("peak_memory_kind")
        speed.append((f"peak memory{f' ({kind})' if kind else ''}", f"{metrics['peak_memory_bytes'] / 2**20:.0f} MiB"))
    device = metrics.get("device")
    where = f"\n\nMeasured on {device} with {metrics.get('num_processes', 1)} process(es)." if device else ""
    return results, (_table(speed, ("metric", "value")) + where) if speed else "Not recorded."


def _usage(path: str, task: str, example: str, hub_repo_id: str | None = None) -> str:
    """Python and command-line snippets that load the saved model from ``path`` (or from the Hub repository
    ``hub_repo_id``, downloaded for ``finetune predict``, which takes a local directory) and run it on ``example``."""
    auto = "AutoModelForCausalLM" if task == "text-generation" else "AutoModelForSequenceClassification"
    call = f"{json.dumps(example)}, max_new_tokens=40, do_sample=False" if task == "text-generation" \
        else json.dumps(example)
    p = json.dumps(hub_repo_id or path)
    local = hub_repo_id.split("/")[-1] if hub_repo_id else path
    fetch = f"hf download {hub_repo_id} --local-dir {shlex.quote(local)}\n" if hub_repo_id else ""
    return (f"```python\nfrom transformers import {auto}, AutoTokenizer, pipeline\n\n"
            f'pipe = pipeline("{task}", model={p})\nprint(pipe({call}))\n\n'
            f"tokenizer = AutoTokenizer.from_pretrained({p})\nmodel = {auto}.from_pretrained({p})\n```\n\n"
            f"Or from the command line:\n\n```bash\n{fetch}finetune predict --model {shlex.quote(local)} "
            f'"some text"\n```')


def _generations(output_dir: Path, count: int = 5) -> str:
    """A table of the first ``count`` generated completions beside the references, from the final
    evaluation's ``generations.jsonl`` (instruction recipes); "" when there is none."""
    path = output_dir / "generations.jsonl"
    if not path.is_file():
        return ""
    rows = [json.loads(line) for line in path.read_text().splitlines()[:count]]
    cell = lambda text: str(text).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return "\n".join(["| generated | reference |", "| --- | --- |",
                      *(f"| {cell(r['generated'])} | {cell(r['reference'])} |" for r in rows)])


def framework_versions() -> list[tuple[str, str]]:
    """(name, version) of Python, finetune and each of ``FRAMEWORKS`` that is installed (``importlib.metadata``;
    one that is not, DeepSpeed on a CPU machine say, is left out)."""
    versions = [("Python", platform.python_version()), ("finetune", __version__)]
    for name, distribution in FRAMEWORKS:
        try:
            versions.append((name, importlib.metadata.version(distribution)))
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def _evaluations(output_dir: Path) -> str:
    """The run's evaluations, one row each (step, epoch, every quality metric in the order first logged), from the
    evaluation records of ``log.jsonl`` (records without a training ``loss``); "" when there is none."""
    try:
        lines = (output_dir / "log.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    records = [r for r in map(json.loads, filter(None, lines))
               if "loss" not in r and any(k.startswith("eval_") for k in r)]
    if not records:
        return ""
    keys = list(dict.fromkeys(k for r in records for k in r if k.startswith("eval_") and k not in _EVAL_BOOKKEEPING))
    rows = [f"| {r['step']} | {_fmt(r.get('epoch', ''))} | " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |"
            for r in records]
    return "\n".join(["| step | epoch | " + " | ".join(f"`{k}`" for k in keys) + " |",
                      "| ---: | ---: | " + " | ".join("---:" for _ in keys) + " |", *rows])


BENCHMARKS = "Benchmarks (lm-evaluation-harness)"  # the section's title; finetune eval rewrites it in place
_BENCHMARKS_END = "<!-- end of benchmarks -->"


def _read_json(path: Path) -> dict:
    """``path``'s JSON object, or {} where it is missing or unreadable."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def benchmark_table(tuned: dict, base: dict | None, names: tuple[str, str] = ("base", "tuned"),
                    documents: tuple[Path, Path] | None = None) -> str:
    """A Markdown table of ``benchmarks.comparison_rows``: metric, base, tuned and the difference, each with its
    standard error (the difference's paired over the per-document records in ``documents``: the folders of tuned's
    and base's ``samples_<task>.jsonl``); metric and the tuned value only without ``base``."""
    from finetune.outputs.lm_eval import comparison_rows, document_values, read_samples

    rows = comparison_rows(tuned, base, tuple(document_values(read_samples(f)) for f in documents)
                           if base and documents else None)
    if base:
        return "\n".join([f"| metric | {names[0]} | {names[1]} | difference |", "| --- | ---: | ---: | ---: |",
                          *(f"| `{k}` | {b} | {t} | {d} |" for k, b, t, d in rows)])
    return "\n".join(["| metric | value |", "| --- | ---: |", *(f"| `{k}` | {t} |" for k, _, t, _ in rows)])


def benchmarks_section(output_dir: Path) -> str:
    """The benchmarks section's text from what the run directory holds ("" where it holds none): the
    ``--eval_tasks`` evaluations of ``log.jsonl`` (base: the one at step 0, ``--eval_on_start``; tuned: the best
    step's under ``--load_best_model_at_end``, else the last), and ``finetune eval``'s ``eval/eval_results.json``
    (beside ``eval/baseline/eval_results.json`` where it ran with ``--baseline``)."""
    from finetune.config.cadence import task_names
    from finetune.outputs.lm_eval import flat_metrics

    output_dir, parts = Path(output_dir), []
    run_config = _read_json(output_dir / "run_config.json")
    tasks = task_names(run_config.get("eval_tasks"))
    try:
        lines = (output_dir / "log.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    ours = lambda r: {k: v for k, v in r.items() if any(k.startswith(f"eval_{t}_") for t in tasks)}  # noqa: E731
    records = [r for r in map(json.loads, filter(None, lines)) if "loss" not in r and ours(r)] if tasks else []
    if records:
        best = _read_json(output_dir / "metrics.json").get("best_step") if run_config.get(
            "load_best_model_at_end") else None
        tuned = next((r for r in records if r["step"] == best), records[-1])
        base = records[0] if records[0]["step"] == 0 and tuned is not records[0] else None
        limit, shots = run_config.get("eval_limit"), run_config.get("eval_num_fewshot")
        limit = int(limit) if isinstance(limit, float) and limit >= 1 else limit  # a count, stored as a float
        what = (f"During training, `--eval_tasks {','.join(tasks)}`" + (f" on {_fmt(limit)} documents per task"
                if limit is not None else "") + (f", {shots}-shot" if shots is not None else "") +
                f", the model in eval mode: tuned is step {tuned['step']}"
                + (" (the best model, kept)" if best is not None and tuned["step"] == best else " (the last evaluation)")
                + (", base is step 0 (before the first optimizer step)." if base else
                   "; no evaluation at step 0 to compare with (`--eval_on_start`)."))
        steps = output_dir / "benchmarks"
        parts.append(what + "\n\n" + benchmark_table(ours(tuned), ours(base) if base else None,
                                                      ("base (step 0)", f"tuned (step {tuned['step']})"),
                                                      (steps / f"step_{tuned['step']:08d}", steps / "step_00000000")))
    after = _read_json(output_dir / "eval" / "eval_results.json")
    if after.get("results"):
        baseline = _read_json(output_dir / "eval" / "baseline" / "eval_results.json")
        counts = ", ".join(f"{t}: {n.get('effective')}" for t, n in (after.get("n-samples") or {}).items())
        against = (baseline.get("finetune") or {}).get("model") if baseline.get("results") else None
        parts.append(f"`finetune eval` on the final model (documents per task: {counts or '?'})"
                     + (f", base `{against}`" if against else "") + ":\n\n"
                     + benchmark_table(flat_metrics(after), flat_metrics(baseline) if against else None,
                                       documents=(output_dir / "eval", output_dir / "eval" / "baseline")))
    if not parts:
        return ""
    return "\n\n".join(parts) + ("\n\nStandard errors are lm-eval's (the sample standard deviation over documents "
                                  "/ sqrt(n)); a difference's is paired: that of the per-document differences, "
                                  "from lm-eval's per-document records (marked unpaired where the two were not "
                                  "scored on the same documents: sqrt(se_base^2 + se_tuned^2)).\n" + _BENCHMARKS_END)


def update_benchmarks_section(card_path: Path, section: str) -> bool:
    """Replace the benchmarks section of the card at ``card_path`` (``## <BENCHMARKS>`` up to its end marker) by
    ``section``, or insert it before "## Training speed" (at the end where there is none); False where there is
    no card. ``finetune eval`` calls it after writing its results to a run directory."""
    try:
        text = card_path.read_text(encoding="utf-8")
    except OSError:
        return False
    block = f"## {BENCHMARKS}\n\n{section}\n\n"
    start = text.find(f"## {BENCHMARKS}\n")
    if start >= 0:
        end = text.find(_BENCHMARKS_END, start)
        end = len(text) if end < 0 else end + len(_BENCHMARKS_END)
        text = text[:start] + block.rstrip("\n") + text[end:]
    else:
        where = text.find("## Training speed")
        text = text[:where] + block + text[where:] if where >= 0 else text.rstrip("\n") + "\n\n" + block
    card_path.write_text(text, encoding="utf-8")
    return True


def _tracking(config, output_dir: Path) -> str:
    """Where the run's tracker wrote: TensorBoard's log directory (the folders of its event files under
    ``output_dir``, relative to it: ``runs/`` for the accelerate backend, ``checkpoints/runs/<time_host>`` for
    Trainer's), or the tracker's name; "" without a tracker."""
    if config.report_to == "none":
        return ""
    lines = []
    events = sorted({p.parent.relative_to(output_dir).as_posix()
                     for p in output_dir.rglob("events.out.tfevents.*")}) if output_dir.is_dir() else []
    if events:
        root = os.path.commonpath(events)  # TensorBoard reads the folders under it (hparams write a subfolder)
        lines.append(f"TensorBoard: logs in `{root}/` of the model directory (on the Hub: the *Training metrics* "
                     f"tab); locally `tensorboard --logdir {shlex.quote(str(output_dir / root))}`.")
    named = ([t for t, module in TRACKER_MODULES.items() if importlib.util.find_spec(module)]
             if config.report_to == "all" else [config.report_to])
    for tracker in (t for t in named if t != "tensorboard"):
        where = os.environ.get("MLFLOW_TRACKING_URI") if tracker == "mlflow" else None
        lines.append(f"`--report_to {tracker}`: the run's metrics went to {tracker}"
                     + (f" (tracking URI `{where}`)." if where else " (its run is not linked here)."))
    return "\n\n".join(lines)


def _run_config(config, output_dir: Path) -> str:
    """``run_config.json`` (the resolved flags the run trained with) in a collapsed ``<details>`` block: the
    run's own file when there is one, else ``config``'s JSON."""
    try:
        text = (output_dir / "run_config.json").read_text(encoding="utf-8").strip()
    except OSError:
        text = config.to_json()
    return (f"<details>\n<summary><code>run_config.json</code>: every setting, as resolved (replay it with "
            f"<code>finetune train --config run_config.json</code>)</summary>\n\n```json\n{text}\n```\n\n</details>")


# ------------------------------------------------------------------------------------------ the card
def render_model_card(config, metrics: dict, recipe, command: str, output_dir=None,
                      hub_repo_id: str | None = None) -> str:
    """The model card's text (``str`` of a ``huggingface_hub.ModelCard``): YAML metadata, then Markdown; writes
    nothing. ``output_dir`` (default ``config.output_dir``): the model's name, snippets' path, label names, and
    what the run left there: the evaluations of ``log.jsonl``, TensorBoard's event files, ``run_config.json``.
    ``hub_repo_id``: the Hub repository the model is pushed to (``--push_to_hub``): named under the title, and the
    usage snippets load from it. The run's task (``tasks.run_task``) gives the pipeline, the training loss's name
    (``loss_name``) and its own hyperparameter rows (``card_settings``).
    Raises ``ValueError`` (``huggingface_hub``) for invalid metadata, ``AttributeError`` if ``config`` lacks a
    ``TrainConfig`` field, and ``run_task``'s errors (``KeyError`` for a recipe's unknown ``TASK``)."""
    output_dir = Path(output_dir if output_dir is not None else config.output_dir)
    model_name = output_dir.resolve().name or "model"
    recipe_name = str(getattr(recipe, "NAME", config.recipe))
    from finetune.tasks import run_task  # torch and transformers: `finetune env` imports this module for its versions

    trained = run_task(recipe, config)
    task = trained.pipeline_tag
    base = config.model_name_or_path or "?"
    hub = None if config.train_file else getattr(recipe, "HUB_DATASET", None)
    data = ModelCardData(
        base_model=base if _is_hub_id(base) else None, datasets=[hub[0]] if hub else None,
        library_name="transformers", pipeline_tag=task, tags=["finetune", "generated_from_finetune", recipe_name],
        model_name=model_name, eval_results=_eval_results(config, metrics, recipe, hub, task) or None)

    where = "" if _is_hub_id(base) else (" (a local GGUF file, not a hub model)" if base.lower().endswith(".gguf")
                                         else " (a local directory, not a hub model)")
    labels = _labels(output_dir) if task == "text-classification" else []
    results, speed = _results_and_speed(metrics, trained.loss_name)
    example = {"bbc-news": "Shares rose after the company reported record profits."}.get(
        recipe_name, "Once upon a time" if task == "text-generation" else "An example text.")
    sections = {
        "Recipe": f"- **name**: `{recipe_name}`\n- **description**: {getattr(recipe, 'DESCRIPTION', '')}\n"
                  f"- **task**: {trained.name}\n- **dataset**: {getattr(recipe, 'DATASET', '')}\n"
                  f"- **base model**: `{base}`{where}",
        "Data": _data(config, metrics, recipe, labels),
        "Training hyperparameters": _table(_hyperparameters(config, metrics) + trained.card_settings(config)),
        "Precision": _precision(config, metrics), "Evaluation results": results, "Training speed": speed,
        "Reproduce": f"```bash\n{command}\n```", "Usage": _usage(str(output_dir), task, example, hub_repo_id)}
    samples = _generations(output_dir)
    if samples:
        sections["Sample generations"] = samples
    evaluations, tracking = _evaluations(output_dir), _tracking(config, output_dir)
    if evaluations:  # right after the final results, as Trainer's "Training results" table
        keys = list(sections)
        keys.insert(keys.index("Evaluation results") + 1, "Evaluations during training")
        sections = {k: evaluations if k == "Evaluations during training" else sections[k] for k in keys}
    benchmarks = benchmarks_section(output_dir)
    if benchmarks:  # before the speed, as finetune eval inserts it (update_benchmarks_section)
        keys = list(sections)
        keys.insert(keys.index("Training speed"), BENCHMARKS)
        sections = {k: benchmarks if k == BENCHMARKS else sections[k] for k in keys}
    if tracking:
        sections["Experiment tracking"] = tracking
    sections["Framework versions"] = "\n".join(f"- {name}: {version}" for name, version in framework_versions())
    sections["Run configuration"] = _run_config(config, output_dir)
    body = (f"\n# {model_name}\n\n`{base}`{where} fine-tuned for {task} with finetune (Hugging Face Accelerate, exact "
            f"gradient accumulation) on the `{recipe_name}` recipe.\n\n"
            + (f"On the Hugging Face Hub: [{hub_repo_id}](https://huggingface.co/{hub_repo_id}).\n\n"
               if hub_repo_id else "")
            + "\n\n".join(f"## {title}\n\n{text}" for title, text in sections.items()) + "\n")
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))


def write_model_card(output_dir, config, metrics: dict, recipe, command: str, hub_repo_id: str | None = None) -> Path:
    """Write the model card to ``output_dir/README.md`` (overwriting it) and return that path.
    ``metrics``: what ``train()`` returns (batch sizes in samples, runtimes in s, ``peak_memory_bytes``; a missing
    key falls back to ``config`` or is left out). ``recipe``: the recipe module; ``command``: the reproduce line,
    verbatim. Metadata: ``base_model`` only for a hub id, ``datasets`` only for a hub dataset, one ``EvalResult``
    per finite quality metric (see docs/outputs.md#the-model-card); ``hub_repo_id`` as ``render_model_card``.
    Raises ``OSError`` if the directory cannot be written, and what ``render_model_card`` raises."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "README.md"
    path.write_text(render_model_card(config, metrics, recipe, command, output_dir=output_dir,
                                      hub_repo_id=hub_repo_id), encoding="utf-8")
    return path
