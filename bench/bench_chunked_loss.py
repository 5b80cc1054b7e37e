"""Chunked vs plain causal-LM loss: memory and time of the loss alone (forward + backward), in process.

The loss is what follows the final norm: ``lm_head`` (weight vocab x hidden) and the summed next-token
cross-entropy. Plain: ``CausalLM().loss_from_logits(lm_head(hidden), labels)`` (full logits). Chunked:
``chunked_causal_lm_loss_sum(hidden, lm_head, labels, chunk_size, method=...)``. Defaults: SmolLM2-135M's
shapes (hidden 576, vocab 49152), micro-batch 8 x 512 tokens, every token a label token (4088 after the
shift), fp32 on the CPU.

Per configuration (units: bytes, shown in MiB = 2**20 bytes; seconds):

- peak allocated: the most bytes of tensor memory allocated beyond what existed before the step, during
  forward + backward (torch profiler ``profile_memory``, "Total Allocated" of its memory events). This
  includes the gradients of hidden, weight (vocab x hidden) and bias, which every method produces.
- saved for backward: ``finetune.planner.probes.saved_tensor_bytes``, the storages autograd saves (the plain
  path's include the weight, which ``lm_head`` saves; non-reentrant checkpointing hides what it saves from
  the hook, so that method's figure is not comparable: read its peak).
- time: median over ``--repeats`` interleaved repeats (A, B, C, A, B, C, ...) after one unrecorded
  warm-up of each, of forward + backward with the gradients reset to None before each.

Ratios are plain / chunked for memory (higher is better) and chunked / plain for time (lower is better).
Goals: peak memory cut >= 4x at <= 1.10x the time.

    python bench/bench_chunked_loss.py                        # the defaults above, 3 repeats
    python bench/bench_chunked_loss.py --repeats 5 --configs fused:256,fused:512,recompute:512
    python bench/bench_chunked_loss.py --smoke                # tiny shapes: checks the script only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from benchlib import format_machine, machine_info, markdown_table  # noqa: E402

from finetune.planner.probes import saved_tensor_bytes  # noqa: E402
from finetune.tasks import IGNORE_INDEX, CausalLM  # noqa: E402
from finetune.tasks.chunked_loss import METHODS, chunked_causal_lm_loss_sum  # noqa: E402

MIB = 2**20


def peak_allocated_bytes(step) -> int:
    """Peak bytes of tensor memory allocated beyond the start while ``step()`` runs (CPU allocator), from the
    torch profiler's memory events (frees of tensors allocated before the start are not seen: their memory
    still counts as in use, so the figure errs high, never low)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        return 0
    # The profiler's running total is process-wide and misses frees made between profiling sessions, so it
    # need not start at 0: measure from its value before this session's first event.
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return max(0, *(e["args"]["Total Allocated"] - start for e in memory))


def build_inputs(args):
    """hidden (batch, seq, hidden) and lm_head (vocab x hidden, no bias), both requiring grad, and labels
    (batch, seq) with the first ``--prompt_fraction`` of each row masked (IGNORE_INDEX)."""
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(args.batch, args.seq, args.hidden, generator=generator)).requires_grad_()
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 0.02, generator=generator)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    labels[:, :int(args.prompt_fraction * args.seq)] = IGNORE_INDEX
    return hidden, head, labels


def make_configs(args, hidden, head, labels) -> dict:
    """name -> a function computing the summed loss (not yet back-propagated)."""
    task = CausalLM()
    configs = {"plain": lambda: task.loss_from_logits(head(hidden), labels)}
    for method, size in args.configs:
        configs[f"{method} {size}"] = (
            lambda method=method, size=size: chunked_causal_lm_loss_sum(hidden, head, labels, size, method=method))
    return configs


def parse_configs(text: str) -> list[tuple[str, int]]:
    """"method:chunk_size,..." -> [(method, chunk_size), ...]; raises SystemExit on a malformed entry."""
    configs = []
    for entry in filter(None, text.split(",")):
        method, _, size = entry.partition(":")
        if method not in METHODS or not size.isdigit() or int(size) < 1:
            raise SystemExit(f"--configs: {entry!r} is not METHOD:CHUNK_SIZE with METHOD one of {', '.join(METHODS)}")
        configs.append((method, int(size)))
    return configs


def main(argv=None) -> int:  # noqa: C901 - over the budget; to split
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--batch", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--seq", type=int, default=512, help="tokens per sample")
    p.add_argument("--prompt_fraction", type=float, default=0.0,
                   help="leading fraction of each sample's labels masked with -100")
    p.add_argument("--configs", default="fused:256,fused:512,fused:1024,recompute:512,checkpoint:512",
                   help=f"comma-separated METHOD:CHUNK_SIZE (label tokens per chunk), METHOD of {', '.join(METHODS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num_threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 1 repeat: checks the script only")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.configs = parse_configs(args.configs)
    if args.smoke:
        args.hidden, args.vocab, args.batch, args.seq, args.repeats = 16, 512, 2, 32, 1
        args.configs = [(method, 13) for method in METHODS]
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    hidden, head, labels = build_inputs(args)
    configs = make_configs(args, hidden, head, labels)
    params = (hidden, head.weight)

    def backward(loss_fn) -> float:
        loss = loss_fn()
        loss.backward()
        return loss.item()

    def step(loss_fn) -> float:
        for t in params:
            t.grad = None
        return backward(loss_fn)

    losses, saved, peaks, times = {}, {}, {}, {name: [] for name in configs}
    for name, loss_fn in configs.items():  # memory (deterministic: once each), doubling as the warm-up
        for t in params:  # outside the profiled step: every configuration starts without gradients
            t.grad = None
        peaks[name] = peak_allocated_bytes(lambda: losses.__setitem__(name, backward(loss_fn)))  # noqa: B023 - the lambda runs inside this iteration
        for t in params:
            t.grad = None
        saved[name] = saved_tensor_bytes(loss_fn)
    for _ in range(args.repeats):
        for name, loss_fn in configs.items():
            start = time.perf_counter()
            step(loss_fn)
            times[name].append(time.perf_counter() - start)
    for t in params:
        t.grad = None

    info = machine_info()
    tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
    median = {name: statistics.median(values) for name, values in times.items()}
    rows = []
    for name in configs:
        rows.append([name, f"{peaks[name] / MIB:.1f}", f"{peaks['plain'] / max(peaks[name], 1):.2f}x",
                     f"{saved[name] / MIB:.1f}", f"{median[name]:.3f}", f"{median[name] / median['plain']:.3f}x",
                     f"{abs(losses[name] - losses['plain']) / abs(losses['plain']):.1e}"])
    print(f"# Chunked causal-LM loss vs plain{' (SMOKE: tiny shapes, numbers mean nothing)' if args.smoke else ''}\n")
    print(format_machine(info, args.num_threads))
    print(f"- torch threads: {torch.get_num_threads()}\n")
    print(f"Loss alone, forward + backward, fp32: hidden {args.hidden}, vocab {args.vocab}, micro-batch "
          f"{args.batch} x {args.seq} tokens ({tokens} label tokens); {args.repeats} repeat(s) interleaved after a "
          f"warm-up, medians. Weight {args.vocab * args.hidden * 4 / MIB:.1f} MiB, full fp32 logits "
          f"{args.batch * args.seq * args.vocab * 4 / MIB:.1f} MiB.\n")
    print(markdown_table(["config (method chunk)", "peak allocated MiB", "peak cut", "saved for backward MiB",
                          "time s", "time ratio", "loss rel. diff"], rows))
    print("\nGoals: peak cut >= 4x at time ratio <= 1.10x.")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": info, "torch_threads": torch.get_num_threads(),
            "shapes": {"hidden": args.hidden, "vocab": args.vocab, "batch": args.batch, "seq": args.seq,
                       "label_tokens": tokens},
            "results": {name: {"peak_allocated_bytes": peaks[name], "saved_bytes": saved[name],
                               "times_s": times[name], "median_s": median[name], "loss": losses[name]}
                        for name in configs}}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
