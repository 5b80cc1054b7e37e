"""Where a training step's time goes on this device: ``torch.profiler`` over a recipe's optimizer steps (its
``--gradient_accumulation_steps`` forwards and backwards of one micro-batch of its model at ``--max_length``, random
token ids, then AdamW), in the precision asked, after two warm-up steps. Prints the step's seconds, the share of self CPU time in matrix multiplications
(``aten::mm``/``addmm``/``bmm``/``_scaled_dot_product*``/``linear`` kernels) against everything else, the
top operators, and the matmul FLOP/s those kernels reached (the profiler's FLOP counts) beside the measured matmul
peak (``finetune.outputs.peak``).

    python bench/profile_step.py --recipe bbc-news [--steps 3] [--mixed_precision bf16] [training flags]

Figures: docs/speed.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
          "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::matmul")


def main(argv=None) -> int:
    from torch.profiler import ProfilerActivity, profile

    from finetune.config import parse_config
    from finetune.machine import cpu_features, cpu_model
    from finetune.models.loading import load_tokenizer
    from finetune.outputs.peak import matmul_peak
    from finetune.recipes import load_recipe
    from finetune.tasks import get_task
    from finetune.tasks.builders import build_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="profiled optimizer steps (one micro-batch each)")
    parser.add_argument("--top", type=int, default=12, help="operators listed")
    args, rest = parser.parse_known_args(argv)
    config = parse_config(rest)
    recipe = load_recipe(config.recipe)
    task = get_task(recipe.TASK)
    tokenizer = load_tokenizer(config.model_name_or_path)
    # the planner's probe labels (a classifier's head: a few labels; its cost is negligible beside the encoder)
    model = build_model(config, task, label_names=task.probe_label_names, pad_token_id=tokenizer.pad_token_id,
                        recipe=recipe).train()
    half = {"bf16": torch.bfloat16}.get(config.mixed_precision)  # fp16 on a CPU runs fp32, as a run does
    m, length = config.per_device_train_batch_size, config.max_length
    vocab = model.config.vocab_size
    batch = {"input_ids": torch.randint(5, vocab, (m, length)), "attention_mask": torch.ones(m, length, dtype=torch.long)}
    labels = torch.randint(0, getattr(model.config, "num_labels", 2), (m,))
    # AdamW as the run builds it (``--optim adamw_torch``: torch's default, a loop over the tensors on a CPU;
    # ``adamw_torch_fused``: one fused kernel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=config.optim == "adamw_torch_fused")

    def step():  # one optimizer step: --gradient_accumulation_steps micro-batches, then AdamW
        for _ in range(config.gradient_accumulation_steps):
            with torch.autocast("cpu", dtype=half, enabled=half is not None):
                logits = model(**batch).logits
            loss = torch.nn.functional.cross_entropy(logits.float(), labels) if logits.dim() == 2 else logits.float().mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    seconds = []
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(args.steps):
            started = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - started)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = [e for e in events if e.key in MATMUL]
    matmul_time = sum(e.self_cpu_time_total for e in matmul)
    flops = sum(e.flops for e in events if e.flops)
    precision = "bf16" if half is not None else "fp32"
    peak = matmul_peak(torch.device("cpu"), "bf16" if half is not None else "no")[0]
    print(f"### {config.recipe}: micro-batch {m} x {length} tokens x {config.gradient_accumulation_steps} "
          f"micro-batches per step, {precision}, {config.optim}, dropout "
          f"{'off' if config.disable_dropout else 'on'}, {args.steps} profiled steps")
    print(f"- CPU: {cpu_model()} ({', '.join(cpu_features()) or 'no bf16 flags'}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"- step: median {statistics.median(seconds):.3f} s (profiled; the profiler adds its own overhead)")
    print(f"- self CPU time in matmul kernels: {matmul_time / total:.1%} of {total / 1e6:.2f} s")
    if flops and matmul_time:
        rate = flops / (matmul_time / 1e6)
        print(f"- matmul kernels' FLOPs (profiler count) {flops / 1e9:.1f} GFLOP: {rate / 1e9:.1f} GFLOP/s while in them; "
              f"measured peak {peak / 1e9:.1f} GFLOP/s ({rate / peak:.0%})")
    print("\n| operator | self CPU s | share | calls |\n|---|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]:
        print(f"| {e.key} | {e.self_cpu_time_total / 1e6:.3f} | {e.self_cpu_time_total / total:.1%} | {e.count} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
