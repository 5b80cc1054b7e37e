"""How far an fp32 merge can be from the run's adapter, against fp32's own rounding: the largest logit difference on
the run's validation sequences (as ``finetune export`` verifies them) between

- merged (fp32) and the run's model (the unmerged ``PeftModel``), both computed in fp32 (what the export reports);
- the same two sets of fp32 weights computed in float64 (what is left is the merge's own rounding of each weight
  ``W + s B A`` to fp32);
- the run's model in fp32 against itself in float64, and merged likewise (fp32's rounding of the forward: the
  floor under any fp32 comparison of two different computations).

    python bench/export_noise_floor.py --model RUN_DIR --merged RUN_DIR/export/merged [--samples 16]

Figures: docs/export.md#tolerances.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def logits(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's logits (positions x vocabulary) as float64, no gradients."""
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0].to(torch.float64) for ids in sequences]


def largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM

    from finetune.export.source import load_source, load_tokenizer_of, resolve_source
    from finetune.export.verify import verify_set

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the run's --output_dir (a LoRA run)")
    parser.add_argument("--merged", required=True, help="the export's merged/ folder")
    parser.add_argument("--samples", type=int, default=16, help="validation rows (as --verify_samples)")
    args = parser.parse_args(argv)
    source = resolve_source(args.model)
    inputs = verify_set(source, load_tokenizer_of(source), args.samples)
    run = load_source(source).eval()
    merged = AutoModelForCausalLM.from_pretrained(args.merged, dtype=torch.float32).eval()
    started = time.perf_counter()
    run32, merged32 = logits(run, inputs.sequences), logits(merged, inputs.sequences)
    fp32_seconds = time.perf_counter() - started
    run.double()
    merged.double()
    started = time.perf_counter()
    run64, merged64 = logits(run, inputs.sequences), logits(merged, inputs.sequences)
    fp64_seconds = time.perf_counter() - started
    scale = max(float(x.abs().max()) for x in run64)
    rows = [("merged vs run, computed in fp32", largest(run32, merged32)),
            ("merged vs run, the same fp32 weights computed in float64", largest(run64, merged64)),
            ("run: fp32 vs float64 computation", largest(run32, run64)),
            ("merged: fp32 vs float64 computation", largest(merged32, merged64))]
    print(f"{len(inputs.sequences)} sequences, {inputs.positions} positions; largest |logit| {scale:.4g}; "
          f"fp32 {fp32_seconds:.1f} s, float64 {fp64_seconds:.1f} s (both models)")
    print("| comparison | largest logit difference | relative to the largest logit |\n|---|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.3g} | {value / max(1.0, scale):.2g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
