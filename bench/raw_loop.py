"""The floor under the engine: a bare PyTorch accumulation loop, for ``bench_accumulation.py``.

    python bench/raw_loop.py --model DIR --micro_batch 8 --accumulation 4 --samples 384 --max_length 128

Trains ``AutoModelForSequenceClassification`` (5 labels, dropout on) with plain AdamW on random token ids of
exactly ``max_length`` tokens (no padding, no data loader, no logging, no loss normalisation beyond / N):
forward, ``backward`` per micro-batch, one optimizer step per ``accumulation`` micro-batches, over
``samples`` samples. Prints one JSON line: ``seconds`` (the loop only, after one unrecorded warm-up
micro-batch), ``samples``, ``samples_per_second``. What the engine adds over this is its own overhead;
the ratio of two configurations here is what the hardware charges for smaller micro-batches.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    """Parse flags, run the loop, print the JSON line."""
    import torch
    from transformers import AutoModelForSequenceClassification

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model directory (or hub id)")
    p.add_argument("--micro_batch", type=int, required=True, help="samples per forward/backward")
    p.add_argument("--accumulation", type=int, required=True, help="micro-batches per optimizer step")
    p.add_argument("--samples", type=int, required=True, help="samples in all (a multiple of micro x accumulation)")
    p.add_argument("--max_length", type=int, required=True, help="tokens per sample")
    args = p.parse_args(argv)
    if args.samples % (args.micro_batch * args.accumulation):
        p.error("--samples must be a multiple of micro_batch x accumulation")

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=5)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.vocab_size
    input_ids = torch.randint(1000, vocab, (args.samples, args.max_length))
    attention_mask = torch.ones_like(input_ids)
    labels = torch.randint(0, 5, (args.samples,))

    def micro_step(start: int) -> None:
        end = start + args.micro_batch
        out = model(input_ids=input_ids[start:end], attention_mask=attention_mask[start:end], labels=labels[start:end])
        (out.loss / args.accumulation).backward()

    micro_step(0)  # warm-up: allocator and kernels
    optimizer.zero_grad()
    start = time.perf_counter()
    position = 0
    for _ in range(args.samples // (args.micro_batch * args.accumulation)):
        for _ in range(args.accumulation):
            micro_step(position)
            position += args.micro_batch
        optimizer.step()
        optimizer.zero_grad()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "samples": args.samples, "samples_per_second": args.samples / seconds}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
