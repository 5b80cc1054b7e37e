"""What a run tells: the banner at the start, ``log.jsonl`` while it trains, and at the end the model
directory, ``metrics.json``, the model card and the summary. One writer for both backends.

Units: seconds, bytes, samples; losses are mean per item (sample, or label token for causal LM), nats.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch

from finetune.config import config_argv, reproduce_command
from finetune.data import packing
from finetune.engine import parameter_counts
from finetune.engine.precision import PRECISION_NAMES
from finetune.machine import bf16_support, native_bf16
from finetune.models.dropout import dropout_left
from finetune.models.quantization import describe_base
from finetune.outputs.card import lora_summary, write_model_card
from finetune.outputs.flops import peak_flops, training_flops_per_token
from finetune.outputs.peak import bf16_ratio, matmul_peak

REMEASURE_AFTER = 60.0  # seconds of timed training after which a run measures the matmul peak again


def packing_banner(config) -> str:
    """The banner's packing line: padding-free micro-batches, or window-local packing and its token budget."""
    if not config.packing:
        return "padding-free micro-batches (--padding_free): one row per micro-batch, no padding computed"
    return (f"{config.packing_strategy}: each optimizer step's own samples packed into rows of at most "
            f"{packing.row_length(config)} tokens, micro-batches of at most {packing.budget(config)} positions per "
            "process" + (" (as many micro-batches as the padded run: Trainer counts them)"
                         if config.backend == "trainer" else ""))


def base_line(config, model) -> str:
    """", on an NF4 base (4-bit, ...)" for a quantized base of ``model`` (``quantization.describe_base``), naming a
    GGUF file's two steps (de-quantized, then quantized); "" for a full-precision base."""
    described = describe_base(model)
    if described is None:
        return ""
    gguf = "; the GGUF file de-quantized to fp32, then quantized" if str(config.model_name_or_path).endswith(".gguf") else ""
    return f", on a frozen {described} base{gguf}"


def run_banner(config, num_processes: int, plan, precision: str, device_type: str, model=None) -> str:
    """What the run will do, printed at start: the effective batch size (micro-batch x accumulation x
    processes, in samples), the optimizer steps (``plan``: a ``window.StepPlan``), and the precision
    that really runs, with a plain note when it is not the one requested (fp16 on a CPU: fp32, or bf16 where the
    measurements chose it, ``config.precision_choice``); on a CPU where bf16 or fp16 is requested or bf16 runs,
    how the CPU runs bf16 and its measured matmul ratio (``cpu_bf16_line``); the recipe where your data's columns
    chose it (``config.recipe_source``); under
    ``--disable_dropout``, whether ``model`` really has no dropout left (``dropout.dropout_left``)."""
    n = config.gradient_accumulation_steps
    effective = config.per_device_train_batch_size * n * num_processes
    requested = config.mixed_precision_requested or config.mixed_precision
    options = [name for name, on in (("torch.compile (inductor)", config.torch_compile),
                                     ("length-grouped batches", config.train_sampling_strategy == "group_by_length"))
               if on]
    text = ((f"Recipe: {config.recipe}, chosen {config.recipe_source} (--task or --recipe chooses another)\n"
             if config.recipe_source else "")
            + f"Effective batch size: {config.per_device_train_batch_size} (micro-batch) x {n} (accumulation) x "
            f"{num_processes} (processes) = {effective} samples per optimizer step\n"
            f"Optimizer steps: {plan.steps_per_epoch} per epoch ({plan.micro_batches_per_epoch} micro-batches per "
            f"process), {plan.max_steps} in total over {plan.num_epochs} epoch(s) [{config.backend} backend]\n"
            + (f"Speed options: {', '.join(options)}\n" if options else "")
            + (f"Packing: {packing_banner(config)}\n" if config.padding_free or config.packing else "")
            + (f"Parameters: {parameter_counts(model)[0]:,} trainable of {parameter_counts(model)[1]:,}"
               + (f" ({lora_summary(config)})" if config.use_peft else "") + base_line(config, model) + "\n"
               if model is not None else "")
            + (f"CPU bf16: {cpu_bf16_line(precision)}\n" if device_type == "cpu" and "no" != requested else "")
            + f"Precision: {PRECISION_NAMES[precision]} on {device_type} (requested: {requested}, "
              f"from {config.precision_source})")
    if config.mixed_precision_requested is not None and precision == config.mixed_precision:
        text += f" -- NOTE: {device_type} autocast does not run fp16; {config.precision_choice}"
    elif precision != config.mixed_precision:
        text += (f" -- NOTE: mixed_precision={requested!r} was requested, but {device_type} autocast "
                 f"does not run it, so this run is {PRECISION_NAMES[precision]}")
        if device_type == "cpu" and precision == "no":
            text += "; " + (config.precision_choice or cpu_bf16_note())
    if config.disable_dropout:  # said only when it is so: checked on the model as it will train
        left = dropout_left(model) if model is not None else None
        text += ("\nDropout: off (--disable_dropout; checked: no dropout module, attribute or config probability "
                 "above 0)" if left == [] else "\nDropout: --disable_dropout asked, but " +
                 ("the model was not checked" if left is None else f"still on: {', '.join(left[:5])}"))
    return text


def cpu_bf16_line(precision: str, features: list[str] | None = None, max_isa: str | None = None,
                  ratio: tuple[float, float, float] | None = None) -> str:
    """The banner's line on bf16 for a CPU run in ``precision`` (what runs: "no", "bf16"): native or emulated
    (``machine.bf16_support`` of ``features`` and ``max_isa``, default this machine's) and bf16's matmul peak over
    fp32's, ``ratio`` (default ``peak.bf16_ratio`` on the CPU: cached, else measured in a few seconds); where bf16
    runs emulated, that fp32 is the faster choice."""
    ratio = bf16_ratio(torch.device("cpu")) if ratio is None else ratio
    support = bf16_support(features, max_isa)
    text = (f"{support}; measured bf16 matmul peak {ratio[0]:.3g}x fp32's ({ratio[1] / 1e9:.3g} against "
            f"{ratio[2] / 1e9:.3g} GFLOP/s, outputs/peak.py)")
    if precision == "bf16" and not native_bf16(features, max_isa):
        text += "; --mixed_precision no trains faster on this CPU"
    return text


def cpu_bf16_note(features: list[str] | None = None, max_isa: str | None = None) -> str:
    """What ``--mixed_precision bf16`` would run on this CPU, from its flags (``machine.native_bf16`` of
    ``features`` and oneDNN's cap ``max_isa``, default this machine's): native bf16 matmuls (AVX512-BF16, AMX) or
    emulated ones, for the banner of a CPU run in fp32 where no measurement for its recipe decided
    (``engine.cpu_bf16``). The measured figures: docs/bf16-recipes.md."""
    native = native_bf16(features, max_isa)
    if native:
        return (f"this CPU has {' and '.join(sorted(native))}: --mixed_precision bf16 runs its matmuls in bf16, often "
                "faster; an fp16 request runs bf16 here once bench/bench_bf16_recipes.py has measured this recipe "
                "faster with its metric held on this CPU kind (docs/precision.md)")
    return (f"bf16 would not help here: bf16 matmuls are {bf16_support(features, max_isa)} on this CPU, so "
            "--mixed_precision bf16 would run them slower than fp32 (`finetune env` measures both; per recipe: "
            "docs/bf16-recipes.md)")


def peak_memory(device) -> tuple[int, str]:
    """(bytes, what was measured): ``torch.cuda.max_memory_allocated`` on a CUDA device, else the
    process's peak resident set size (``getrusage`` ``ru_maxrss``, KiB on Linux, returned in bytes)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_max_rss"


def _rate(count: float, seconds: float) -> float:
    return round(count / seconds, 3) if seconds > 0 else 0.0


def device_peak(device) -> tuple[float, str] | None:
    """(peak dense bf16/fp16 FLOP/s of ONE ``device``, its source) from ``flops.peak_flops``; None off CUDA or for
    an unknown GPU."""
    return peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def throughput(state, runtime: float, model, config, device, num_processes: int = 1, precision: str = "no") -> dict:
    """The run's token counts and rates, named by what they count: ``padded`` tokens (input positions with
    padding: what the model computed on), ``input`` tokens (without padding), ``trained`` tokens (the loss's
    items: label tokens; causal LM only). Rates are over the timed steps (every optimizer step but the first of
    each start, a warm-up: ``throughput_steps``), else over ``runtime``. FLOP/s from ``flops.training_flops_per_token``:
    model FLOP/s over input tokens at their mean length; hardware FLOP/s over padded tokens at the padded length,
    with activation checkpointing's recompute; on a CUDA device with a known peak also ``mfu`` and ``hfu``: the
    FLOP/s of all ``num_processes`` processes (the counts are over all of them) over ``num_processes`` x one
    device's peak (PaLM appendix B: achieved over the whole system's peak), so the same per-GPU speed gives the
    same MFU at any process count. On any device also ``measured_peak_flops_per_second`` (one process's matmul peak
    in ``precision``: ``peak.matmul_peak``, the best measured on this machine, measured again after a run of
    ``REMEASURE_AFTER`` seconds or more) and the model and hardware FLOP/s as shares of
    ``num_processes`` x it: ``mfu_of_measured_peak``, ``hfu_of_measured_peak``."""
    timed = state.timed_steps > 0 and state.timed_seconds > 0
    seconds = state.timed_seconds if timed else runtime
    counts = {"padded": state.timed_padded_tokens if timed else state.padded_tokens_seen,
              "input": state.timed_input_tokens if timed else state.input_tokens_seen,
              "trained": state.timed_trained_tokens if timed else state.tokens_seen}
    samples = state.timed_samples if timed else state.samples_seen
    metrics = {"train_padded_tokens": state.padded_tokens_seen, "train_input_tokens": state.input_tokens_seen,
               **({"train_trained_tokens": state.tokens_seen} if state.tokens_seen else {}),
               "throughput_steps": state.timed_steps if timed else state.step,
               "throughput_excludes_warmup": timed}
    for kind, count in counts.items():
        if kind != "trained" or state.tokens_seen:
            metrics[f"train_{kind}_tokens_per_second"] = _rate(count, seconds)
    if not samples or not seconds:
        return metrics
    model_flops = training_flops_per_token(model, counts["input"] / samples)
    hardware_flops = training_flops_per_token(model, counts["padded"] / samples,
                                              recompute=bool(config.activation_checkpointing))
    if model_flops is None or hardware_flops is None:
        return metrics
    metrics.update(model_flops_per_second=round(model_flops[0] * counts["input"] / seconds, 1),
                   hardware_flops_per_second=round(hardware_flops[0] * counts["padded"] / seconds, 1),
                   model_flops_formula=model_flops[1] + " (per input token)",
                   hardware_flops_formula=hardware_flops[1] + " (per padded token)")
    peak = device_peak(device)
    if peak is not None:
        system = num_processes * peak[0]  # one device per process
        metrics.update(mfu=round(metrics["model_flops_per_second"] / system, 4),
                       hfu=round(metrics["hardware_flops_per_second"] / system, 4),
                       mfu_peak_source=f"{num_processes} x {peak[1]}")
    # measured again after a run long enough for its FLOP/s to mean something (a second's matmuls, 2% of a minute),
    # so the cached best follows the machine; a shorter run reads the cache
    measured = matmul_peak(device, precision, refresh=seconds >= REMEASURE_AFTER)
    if measured is not None:
        system = num_processes * measured[0]
        metrics.update(measured_peak_flops_per_second=round(measured[0], 1),
                       mfu_of_measured_peak=round(metrics["model_flops_per_second"] / system, 4),
                       hfu_of_measured_peak=round(metrics["hardware_flops_per_second"] / system, 4),
                       measured_peak_source=f"{num_processes} x {measured[1]}")
    return metrics


def run_metrics(config, state, eval_results: dict, *, plan, num_processes: int, precision: str, device,
                model, eval_runtime: float, process_start: float | None) -> dict:
    """The ``metrics.json`` dict, the same for both backends.

    ``state``: a ``checkpoint.RunProgress`` (counts over all processes: ``samples_seen``; ``tokens_seen``,
    label tokens, 0 for classification; ``input_tokens_seen``, non-padding inputs; ``padded_tokens_seen``,
    input positions with padding, 0 where the backend cannot see its batches; ``step_loss_total`` over optimizer
    steps of each step's mean loss; ``train_runtime`` seconds, evaluation excluded). ``plan``: the
    ``window.StepPlan``. ``model``: for ``num_parameters`` and ``trainable_parameters`` (elements). On a
    token counts, rates and FLOP/s as ``throughput`` gives them.
    """
    trainable_parameters, num_parameters = parameter_counts(model)
    effective_batch_size = config.per_device_train_batch_size * config.gradient_accumulation_steps * num_processes
    memory, memory_kind = peak_memory(device)
    runtime = state.train_runtime
    metrics = {
        **eval_results,
        "train_loss": state.step_loss_total / max(state.step, 1),
        "final_train_loss": state.last_loss if state.last_loss is not None else float("nan"),
        "optimizer_steps": state.step,
        "skipped_optimizer_steps": state.skipped_steps,
        "epochs": round(plan.epoch_fraction(state.step), 4),
        "train_samples": state.samples_seen,
        "effective_batch_size": effective_batch_size,
        "per_device_train_batch_size": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "num_processes": num_processes,
        "num_parameters": num_parameters,
        "trainable_parameters": trainable_parameters,
        "mixed_precision": precision,
        "mixed_precision_requested": config.mixed_precision_requested or config.mixed_precision,
        "precision_choice": config.precision_choice,
        "backend": config.backend,
        "device": device.type,
        "train_runtime": round(runtime, 3),
        "train_samples_per_second": _rate(state.samples_seen, runtime),
        **throughput(state, runtime, model, config, device, num_processes, precision),
        **({"train_padding_fraction": round(1 - state.input_tokens_seen / state.padded_tokens_seen, 4)}
           if state.padded_tokens_seen else {}),
        "train_seconds_per_step": round(runtime / state.step, 4) if state.step else 0.0,
        "eval_runtime": round(eval_runtime, 3),
        "peak_memory_bytes": memory,
        "peak_memory_kind": memory_kind,
    }
    if state.best_step is not None:
        metrics.update(best_step=state.best_step, best_metric=state.best_metric)
    if process_start is not None:
        metrics["wall_time"] = round(time.time() - process_start, 3)
    return metrics


def write_outputs(engine, model, tokenizer, config, recipe, metrics: dict, writes: bool) -> None:
    """The end of a run, for both backends: the model directory (``engine.save_model``), ``metrics.json`` and
    the model card (``README.md``, with the command that reproduces the run) in ``config.output_dir``,
    written by the processes with ``writes``."""
    output_dir = Path(config.output_dir)
    engine.save_model(model, tokenizer, output_dir, config, writes)
    if writes:
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        write_card(output_dir, config, recipe, metrics)


def write_card(output_dir, config, recipe, metrics: dict, hub_repo_id: str | None = None) -> Path:
    """The model card (``README.md`` in ``output_dir``) of the run ``config``/``metrics``, with the command that
    reproduces it; ``hub_repo_id``: the Hub repository it goes to (``finetune.outputs.hub``). Returns its path; raises what
    ``card.write_model_card`` raises."""
    command = reproduce_command(config_argv(config, recipe), num_processes=metrics["num_processes"],
                                device=metrics["device"])
    return write_model_card(output_dir, config, metrics, recipe, command, hub_repo_id=hub_repo_id)


def format_summary(metrics: dict, output_dir: str) -> str:
    """The closing summary: key metrics, one per line, and where the outputs are."""
    keys = ["eval_accuracy", "eval_f1", "eval_loss", "eval_perplexity", "best_step", "train_loss", "optimizer_steps",
            "skipped_optimizer_steps", "effective_batch_size", "mixed_precision", "train_samples_per_second",
            "train_runtime", "wall_time"]
    lines = ["", "=" * 60, "Run summary"]
    for key in keys:
        if key in metrics:
            value = metrics[key]
            lines.append(f"  {key:<26} {value:.4f}" if isinstance(value, float) else f"  {key:<26} {value}")
    if "hfu_of_measured_peak" in metrics:  # what the device computed, against what its matmuls can
        lines.append(f"  {'achieved FLOP/s':<26} {metrics['hardware_flops_per_second'] / 1e9:.1f} G (model "
                     f"{metrics['model_flops_per_second'] / 1e9:.1f} G) = {metrics['hfu_of_measured_peak']:.0%} of "
                     f"the best measured {metrics['mixed_precision'] if metrics['mixed_precision'] != 'no' else 'fp32'} "
                     f"matmul peak ({metrics['num_processes']} x {metrics['measured_peak_flops_per_second'] / 1e9:.1f} G)")
    lines += [f"  outputs in {output_dir}/: model + tokenizer, metrics.json, log.jsonl, run_config.json", "=" * 60]
    return "\n".join(lines)


MARKDOWN_INLINE = "\\`*_[]()!"  # what markdown reads inside a table cell: escaped with a backslash


def _cell(value) -> str:
    """A value as one markdown table cell that renders as its text: markdown's inline characters escaped with a
    backslash, HTML's special characters, ``|`` and tabs as entities, line breaks as ``<br>`` (TensorBoard's markdown
    keeps both: ``tensorboard.plugin_util`` allows ``br``); a conversation as its turns, ``role: content``; a
    number to 6 significant digits; None as "-"."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        value = "\n".join(f"{m.get('role')}: {m.get('content')}" if isinstance(m, dict) else str(m) for m in value)
    text = "".join("\\" + c if c in MARKDOWN_INLINE else c for c in str(value))
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")
    return text.replace("\t", "&#9;").replace("\r\n", "\n").replace("\n", "<br>")


def completions_table(samples: list[dict]) -> str:
    """A markdown table of an evaluation's generated completions (``task.eval_samples``): prompt, completion,
    reward, then each reward function's, one row per held-out prompt ("" for none)."""
    if not samples:
        return ""
    names = list(samples[0].get("rewards", {}))
    head = ["prompt", "completion", "reward", *names]
    rows = [[s["prompt"], s["completion"], s["reward"], *(s["rewards"].get(n) for n in names)] for s in samples]
    lines = ["| " + " | ".join(_cell(h) for h in head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows])


def log_completions(trackers, samples: list[dict], step: int) -> None:
    """An evaluation's completions as a table in TensorBoard (``completions_table`` under ``eval/completions``,
    a text summary TensorBoard renders as a table: Accelerate's ``TensorBoardTracker.log`` writes a ``str`` with
    ``SummaryWriter.add_text``); the other trackers get none (``log.jsonl``'s evaluation record holds them).
    ``trackers``: the Accelerator's (each logs on the main process only)."""
    table = completions_table(samples)
    for tracker in trackers if table else ():
        if tracker.name == "tensorboard":
            tracker.log({"eval/completions": table}, step=step)
