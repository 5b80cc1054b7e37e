"""Padded vs padding-free vs packed micro-batches, and TRL's padding-free / BFD packing, on identical samples.

Each optimizer step's samples are the recipe's seeded order (micro-batch m x accumulation N, one process).
Every mode computes the forward and backward of that step's samples from the same weights (no optimizer
update, so every mode sees the same model and its per-step loss is comparable): seconds per step, and the
step's loss (summed token loss / the step's label tokens). Modes, in an ABBA order per step (A B C D E then
E D C B A). A step's time in a mode is the median of its timings; throughput is the steps' samples (tokens) over
the sum of their times, so a step with long samples weighs what it costs (a median over steps would drop them):

- ``padded``: our collator's right-padded micro-batches (``tasks.CausalLMCollator`` / ``sft.SFTCollator``);
- ``padding_free``: each micro-batch one row (``finetune.data.packing.Packer(None)``, ``--padding_free``);
- ``packed``: the step's samples as ``--packing`` runs them (``window_bfd``): each step in the layout that the
  cost measured on the model at the start predicts fastest (``finetune.data.packing_cost.measure``, as a run
  measures it): the packed rows (rows of at most ``--max_length`` tokens, grouped into micro-batches of at most the
  budget's positions), those micro-batches each as one row, or the step's own micro-batches each as one row;
- ``packed_rows``: always the packed rows (``--packing`` before it chose a layout per window);
- ``trl_padding_free``: TRL's ``DataCollatorForLanguageModeling(padding_free=True)`` on the same micro-batches;
- ``trl_bfd``: TRL's ``pack_dataset(strategy="bfd", seq_length=max_length)`` on the step's samples, then its
  padding-free collator on micro-batches of m packed rows, each flattened into one row, as ``SFTTrainer`` does
  (TRL packs a whole dataset; here the step's own samples, so they are identical).

Reported: samples/s, input tokens/s (real tokens), padded tokens/s (computed positions), trained tokens/s, the
ratios to padded, and the per-step losses of every mode. Run: ``python bench/bench_packing.py --recipe
bbc-lead-headlines`` (defaults to the recipe's model, SmolLM2-135M from its GGUF file; ``--model_name_or_path``
for another). Figures: docs/packing.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

MODES = ("padded", "padding_free", "packed", "packed_rows", "trl_padding_free", "trl_bfd")


def step_batches(config, recipe, limit_steps: int):
    """(model, task, list of steps: each a list of padded micro-batches, as the training loop sees them)."""
    from torch.utils.data import DataLoader

    from finetune.models.loading import load_tokenizer
    from finetune.tasks import get_task
    from finetune.tasks.builders import build_datasets, build_model

    task = get_task(recipe.TASK)
    tokenizer = load_tokenizer(config.model_name_or_path)
    datasets, _, _ = build_datasets(recipe, config, tokenizer, task)
    collator = task.collator(tokenizer, None)
    loader = DataLoader(datasets["train"], batch_size=config.per_device_train_batch_size, shuffle=True,
                        collate_fn=collator, generator=torch.Generator().manual_seed(config.seed))
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == limit_steps * config.gradient_accumulation_steps:
            break
    n = config.gradient_accumulation_steps
    steps = [batches[i:i + n] for i in range(0, len(batches), n)]
    model = build_model(config, task, pad_token_id=tokenizer.pad_token_id, recipe=recipe)
    return model, task, steps, tokenizer


def trl_micro_batches(mode: str, window: list[dict], row_length: int, pad_token_id: int) -> list[dict]:
    """TRL's padding-free rows for ``window``: its collator on each micro-batch, or its BFD packing of the step
    into rows of ``row_length`` tokens, m rows (the window's micro-batch) per micro-batch, as its dataloader takes
    them."""
    import datasets
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from finetune.data.packing import unpad

    collate = DataCollatorForLanguageModeling(pad_token_id=pad_token_id, padding_free=True)
    keep = ("input_ids", "labels", "position_ids")

    def rows(features):
        out = collate(features)
        return {k: out[k] for k in keep}

    if mode == "trl_padding_free":
        return [rows([{"input_ids": s["input_ids"].tolist(), "labels": s["labels"].tolist()} for s in unpad(b)])
                for b in window]
    samples = [s for b in window for s in unpad(b)]
    data = datasets.Dataset.from_list([{"input_ids": s["input_ids"].tolist(), "labels": s["labels"].tolist()}
                                       for s in samples])
    packed = pack_dataset(data, seq_length=row_length, strategy="bfd")
    m = window[0]["input_ids"].shape[0]
    return [rows([packed[j] for j in range(i, min(i + m, len(packed)))]) for i in range(0, len(packed), m)]


def micro_batches(mode: str, window: list[dict], budget: int, row_length: int, pad_token_id: int,
                  cost=None) -> tuple[list[dict], str]:
    """(the micro-batches ``mode`` runs for ``window``, the layout: for ``packed``, the one ``cost`` chose)."""
    from finetune.data.packing import Packer

    if mode == "padded":
        return window, "padded"
    if mode == "padding_free":
        return Packer(None)(window), "padding_free"
    if mode in ("packed", "packed_rows"):
        packer = Packer("window_bfd", budget, row_length, pad_token_id, cost=cost if mode == "packed" else None)
        batches = packer(window)
        return batches, next(name for name, n in packer.layouts.items() if n)
    return trl_micro_batches(mode, window, row_length, pad_token_id), mode


def run_step(model, task, batches: list[dict]) -> tuple[float, float, int, int]:
    """(seconds, summed loss, positions computed, label tokens) of forward + backward over ``batches``."""
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    total, positions, items = 0.0, 0, 0
    for batch in batches:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if "attention_mask" not in inputs:
            inputs["use_cache"] = False
        logits = model(**inputs).logits
        loss = task.loss_from_logits(logits, batch["labels"])
        loss.backward()
        total += float(loss.detach())
        positions += batch["input_ids"].numel()
        items += int(task.count_labels(batch["labels"]))
    sync()
    return time.perf_counter() - start, total, positions, items


def main(argv=None) -> int:
    from benchlib import format_machine, machine_info

    from finetune.config import parse_config
    from finetune.recipes import load_recipe

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps measured (each in every mode)")
    parser.add_argument("--repeats", type=int, default=1, help="ABBA repeats per step")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)} "
                        "(padded is always run: the ratios are to it)")
    args, rest = parser.parse_known_args(argv)
    modes = ("padded", *(m for m in MODES if m != "padded" and m in args.modes.split(",")))
    config = parse_config(rest)
    recipe = load_recipe(config.recipe)
    from finetune.data.packing import budget as packing_budget
    from finetune.data.packing import row_length as packing_row_length

    budget, row_length = packing_budget(config), packing_row_length(config)  # TRL's BFD rows: the same length
    info = machine_info()
    torch.manual_seed(0)
    model, task, steps, tokenizer = step_batches(config, recipe, args.steps)
    model.to(args.device).train()
    steps = [[{k: v.to(args.device) for k, v in b.items()} for b in window] for window in steps]
    for module in model.modules():  # dropout off: modes must compute the same function
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seconds = {m: [] for m in modes}  # per step: the median of its timings in that mode
    losses = {m: [] for m in modes}
    positions = {m: 0 for m in modes}
    counts = {"samples": 0, "input_tokens": 0, "trained_tokens": 0}
    micro = {m: [] for m in modes}
    from finetune.data import packing_cost

    cost = packing_cost.measure(model, task.loss_sum, row_length, budget) if "packed" in modes else None
    if cost is not None:
        print(f"measured layout cost: {cost.describe()}", file=sys.stderr, flush=True)
    chosen = []
    run_step(model, task, micro_batches("padded", steps[0], budget, row_length, pad)[0])  # warm-up
    for window in steps:
        counts["samples"] += sum(b["input_ids"].shape[0] for b in window)
        counts["input_tokens"] += sum(int(b["attention_mask"].sum()) for b in window)
        built, layouts = {}, {}
        for m in modes:
            built[m], layouts[m] = micro_batches(m, window, budget, row_length, pad, cost)
        chosen.append(layouts.get("packed"))
        step_loss, timings = {}, {m: [] for m in modes}
        for _ in range(args.repeats):
            for m in (*modes, *reversed(modes)):
                s, loss, pos, items = run_step(model, task, built[m])
                timings[m].append(s)
                print(f"  step {len(losses['padded']) + 1}: {m} {s:.2f} s", file=sys.stderr, flush=True)
                step_loss.setdefault(m, (loss / items, pos, items))
        for m in modes:
            seconds[m].append(statistics.median(timings[m]))
            losses[m].append(step_loss[m][0])
            positions[m] += step_loss[m][1]
            micro[m].append(len(built[m]))
        counts["trained_tokens"] += step_loss["padded"][2]
    n_steps = len(steps)
    result = {"machine": info, "recipe": config.recipe, "model": config.model_name_or_path,
              "micro_batch": config.per_device_train_batch_size, "accumulation": config.gradient_accumulation_steps,
              "max_length": config.max_length, "budget": budget, "row_length": row_length, "steps": n_steps, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "modes": {},
              "layout_cost": None if cost is None else {"per_micro_batch": cost.per_micro_batch,
                                                        "per_position": cost.per_position,
                                                        "per_score": cost.per_score, "probes": cost.probes},
              "packed_layouts": chosen}
    for m in modes:
        per_step = sum(seconds[m]) / n_steps
        result["modes"][m] = {
            "seconds_per_step": per_step, "step_seconds": seconds[m], "samples_per_s": counts["samples"] / n_steps / per_step,
            "input_tokens_per_s": counts["input_tokens"] / n_steps / per_step,
            "padded_tokens_per_s": positions[m] / n_steps / per_step,
            "trained_tokens_per_s": counts["trained_tokens"] / n_steps / per_step,
            "micro_batches_per_step": statistics.mean(micro[m]),
            "padding_fraction": 1 - counts["input_tokens"] / positions[m],
            "losses": [round(x, 6) for x in losses[m]]}
    base = result["modes"]["padded"]["samples_per_s"]
    lines = [f"### {config.recipe}: micro-batch {config.per_device_train_batch_size} x {config.gradient_accumulation_steps}, "
             f"--max_length {config.max_length}, packed rows of at most {row_length} tokens, budget {budget} positions, {n_steps} steps x {args.repeats} ABBA repeat(s)",
             format_machine(info), f"- torch threads: {torch.get_num_threads()}",
             *([f"- packed: the cost measured on the model, {cost.describe()}; layout per step: {', '.join(chosen)}"]
               if cost is not None else []), "",
             "| mode | s/step (mean of per-step medians) | samples/s | x padded | input tok/s | computed tok/s | trained tok/s | "
             "micro-batches/step | padding | per-step losses |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in result["modes"].items():
        lines.append(f"| {m} | {r['seconds_per_step']:.2f} | {r['samples_per_s']:.2f} | {r['samples_per_s'] / base:.2f} | "
                     f"{r['input_tokens_per_s']:.0f} | {r['padded_tokens_per_s']:.0f} | {r['trained_tokens_per_s']:.0f} | "
                     f"{r['micro_batches_per_step']:.1f} | {r['padding_fraction']:.1%} | "
                     f"{', '.join(f'{x:.5f}' for x in r['losses'])} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
