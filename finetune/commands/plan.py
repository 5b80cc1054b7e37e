"""``finetune plan``: the batch planner's table without training.

    finetune plan [accelerate launcher flags] --recipe NAME --total_batch_size B [training flags] [--time]

Every exact plan of B (micro-batch x accumulation x processes) under every lever setting the planner considers
(activation checkpointing off/on; for causal LM the plain and the chunked loss), with the memory estimated from
the model and a probe pass: weights, gradients, optimizer state and activations, each shown, and whether it fits.
``--time`` adds the timing probes and the plan ``--auto_find_batch_size`` would choose (the same table). On a GPU,
where fitting is an out-of-memory probe, the probe's measured peak stands beside the estimate.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from finetune import distributed
from finetune.argv import take_switch, wants_help
from finetune.config import parse_config
from finetune.data.packing import budget as packing_budget
from finetune.data.packing import row_length
from finetune.errors import FinetuneError, reports_errors
from finetune.lifecycle.resolve import resolve
from finetune.models.quantization import describe_base
from finetune.planner import held_before_probes, probe_and_choose
from finetune.planner.plans import valid_plans
from finetune.planner.probes import Probe, levers

MIB = 2**20


def memory_rows(probe: Probe, plans: list[tuple[int, int]]) -> tuple[dict, list[dict]]:
    """(the lever's fixed parts, one row per plan): the weights by layout, gradients and the optimizer's state in
    bytes (the probe's count, ``planner.memory.model_memory``: a 4-bit or 8-bit base with its constants, AdamW's
    moments in 32 or 8 bits; DDP's buckets as much again as the gradients), activations saved for backward at each
    micro-batch (the probe's linear model from micro-batch 1 and 2, bytes), the estimated peak and whether it fits
    (``Probe.fits``)."""
    memory = probe.memory
    buckets = memory["gradients"] if distributed.world_size() > 1 else 0
    parts = {"weights": memory["weights"]["total"], "quantized_weights": memory["weights"]["quantized"],
             "full_weights": memory["weights"]["full"], "quantization": describe_base(probe.model),
             "gradients": memory["gradients"], "optimizer_state": memory["optimizer_state"],
             "optimizer": memory["optimizer"], "dequantized": memory["dequantized"], "ddp_buckets": buckets,
             "activations_per_sample": getattr(probe, "per_sample_bytes", None),
             "fixed": getattr(probe, "fixed_bytes", None), "held": getattr(probe, "held", None),
             "optimizer_step_peak": getattr(probe, "step_peak_bytes", None), "loading": probe.loading_bytes,
             "left": getattr(probe, "left_bytes", None),
             "reference": probe.task.resident_bytes(),
             "generation": probe.generation, "generation_peak": getattr(probe, "generation_peak_bytes", None)}
    rows = []
    for micro, accumulation in plans:
        activations = (None if parts["activations_per_sample"] is None
                       else probe.fixed_pass_bytes + micro * parts["activations_per_sample"])
        if probe.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(probe.device)
        fits = probe.fits(micro)
        measured = torch.cuda.max_memory_allocated(probe.device) if probe.device.type == "cuda" else None
        rows.append({"micro_batch": micro, "accumulation": accumulation, "activations": activations,
                     "estimated_peak": probe.estimate(micro), "measured_peak": measured, "fits": fits})
    return parts, rows


def _mib(value) -> str:
    return "-" if value is None else f"{value / MIB:.0f}"


def render(lever, parts: dict, rows: list[dict]) -> str:
    """One lever setting's block of the table."""
    weights = f"weights {_mib(parts['weights'])} MiB"
    if parts["quantization"]:
        weights += (f" ({parts['quantization']}: {_mib(parts['quantized_weights'])} MiB with its constants, "
                    f"{_mib(parts['full_weights'])} MiB kept unquantized; the largest layer de-quantized "
                    f"{_mib(parts['dequantized'])} MiB)")
    held = (f"; the optimizer step peaks at {_mib(parts['optimizer_step_peak'])} MiB (every gradient, the state and "
            f"its transient), loading the model at {_mib(parts.get('loading'))} MiB (it leaves "
            f"{_mib(parts.get('left'))} MiB behind, in every peak); the estimate adds the "
            f"{_mib(parts['held'])} MiB this process holds"
            if parts.get("held") is not None and parts.get("optimizer_step_peak") is not None else "")
    lines = [f"{lever}: {weights}, gradients {_mib(parts['gradients'])} MiB, "
             + (f"a frozen reference {_mib(parts['reference'])} MiB, " if parts.get("reference") else "")
             + f"optimizer state ({parts['optimizer']}) {_mib(parts['optimizer_state'])} MiB, "
             + (f"DDP buckets {_mib(parts['ddp_buckets'])} MiB, " if parts["ddp_buckets"] else "") + "activations "
             + ("-" if parts["activations_per_sample"] is None else f"{parts['activations_per_sample'] / MIB:.1f}")
             + " MiB per sample" + held + generation_note(parts),
             "  micro-batch  accumulation  activations MiB  est. peak MiB  measured peak MiB  fits"]
    for r in rows:
        lines.append(f"  {r['micro_batch']:>11}  {r['accumulation']:>12}  {_mib(r['activations']):>15}  "
                     f"{_mib(r['estimated_peak']):>13}  {_mib(r['measured_peak']):>17}  {'yes' if r['fits'] else 'no'}")
    return "\n".join(lines)


def generation_note(parts: dict) -> str:
    """A generating task's (GRPO) part of a block's header: the key/value cache and logits of one prompt's group
    (``memory.generation_memory``), the generation's peak where the probe estimated it, and the reference held; ""
    for a task that does not generate."""
    generation = parts.get("generation")
    if not generation:
        return ""
    peak = (f", a peak of {_mib(parts['generation_peak'])} MiB with the weights and the state"
            if parts.get("generation_peak") else "")
    reference = ("the frozen reference counted with the weights" if parts.get("reference") else
                 "no reference copy (--beta 0, or the policy with its adapter disabled)")
    return (f"; generating {generation['sequences']} completions of a prompt: KV cache "
            f"{generation['kv_cache'] / MIB:.1f} MiB + logits {generation['logits'] / MIB:.1f} MiB{peak}; {reference}")


def packing_budget_note(config) -> str:
    """Under ``--packing``: the positions per packed micro-batch (``packing.budget``: the given
    ``--max_tokens_per_micro_batch``, else micro-batch m x ``--max_length``, the padded micro-batch's most, so the
    memory probed for m samples of ``--max_length`` tokens bounds it) and the row length."""
    rows = f"rows of at most {row_length(config)} tokens"
    if config.max_tokens_per_micro_batch:
        return (f"--packing: {config.max_tokens_per_micro_batch} positions per micro-batch "
                f"(--max_tokens_per_micro_batch), {rows}")
    return (f"--packing: {packing_budget(config)} positions per micro-batch (micro-batch {config.per_device_train_batch_size} "
            f"x --max_length {config.max_length}, the padded micro-batch's most), {rows}; "
            "give --max_tokens_per_micro_batch to change it")


def plan(config, timed: bool) -> int:
    """Print the table (main process); 0, or raises ``FinetuneError`` (no ``--total_batch_size``, bad flags)."""
    if not config.total_batch_size:
        raise FinetuneError("finetune plan needs --total_batch_size B (samples per optimizer step over all "
                            "processes): the plans are its exact splits.")
    resolution = resolve(config, writes_run=False, plans=False)  # it writes nothing; the plans are its table
    config, recipe = resolution.config, resolution.recipe
    state = distributed.process_state(timeout_seconds=config.ddp_timeout)
    say = print if state.is_main_process else (lambda *a, **k: None)
    plans = valid_plans(config.total_batch_size, state.num_processes)
    say(f"Plans for --total_batch_size {config.total_batch_size} on {state.num_processes} process(es): "
        f"{len(plans)} exact splits x {len(levers(config, recipe, state.device))} lever settings")
    held = held_before_probes(config)  # as --auto_find_batch_size counts it: before any probe model exists
    first = {}  # the allocator's and loading's, measured by the first probe (later ones reuse its memory)
    for lever in levers(config, recipe, state.device):
        probe = Probe(config, recipe, state.device, lever, held, **first)
        first = first or probe.first_measurements()
        try:
            parts, rows = memory_rows(probe, plans)
        finally:
            probe.close()
        say(render(lever, parts, rows))
    if config.packing:  # the token budget is the micro-batch's lever under --packing (docs/packing.md)
        say(packing_budget_note(config))
    if timed:
        chosen = probe_and_choose(dataclasses.replace(config, auto_find_batch_size=True), recipe, state)
        say(f"--auto_find_batch_size would choose: {chosen}")
    return 0


@reports_errors
def main(argv: list[str] | None = None) -> int:
    """``finetune plan``'s process entry (``accelerate launch --module finetune.commands.plan``): the exit code, 2 with one
    ``error:`` line for bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(__doc__)
        return 0
    timed, rest = take_switch(argv, "--time")
    code = distributed.leaving_together(lambda: plan(parse_config(rest), timed))  # an agreed error leaves first
    distributed.leave()  # every process finished: leave the process group together, not at interpreter exit
    return code


if __name__ == "__main__":
    sys.exit(main())
