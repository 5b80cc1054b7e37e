"""Pairs per second of our preference task (DPO) against TRL 1.16's ``DPOTrainer`` on identical pairs, with the
reference as a frozen copy of the model and with its log-probabilities precomputed (``--precompute_ref_log_probs``).

Every run is a whole training run in this process, from the same model directory: ours through the accelerate
backend (``finetune.backends.accelerate.train``), TRL's ``DPOTrainer`` given our tokenised pairs in our order
(``tests/trl_peer.py``: the same machinery as ``tests/test_dpo_peer.py``, which shows both compute the same numbers).
The four configurations run interleaved, ABBA (ours/TRL x frozen/precomputed, then the reverse), ``--repeats`` times;
the figures are medians over the runs.

Measured, the same way on both sides:

- training pairs/s: the pairs of steps 2..K over the time from the end of step 1 to the end of step K, each step's
  end stamped by a torch optimizer step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``:
  the inner AdamW steps once per optimizer step in both). Step 1 (warm-up) and the set-up (loading, tokenising,
  building the optimizer) are left out;
- the precomputation of the reference log-probabilities of the training pairs: ours (``reference.compute``, wrapped
  here), TRL's (``_precompute_ref_logps``), in seconds; "with the pass" is the pairs/s of an epoch of training
  plus that pass, ``1 / (1 / training + seconds / pairs)``;
- the loss of every step on both sides (the same pairs from the same weights: they agree to float noise).

Both sides record the pairs of each micro-batch they compute (a few tensor-to-list conversions per micro-batch:
ours gives TRL its order from them), and the first run of the invocation (ours, frozen reference) also warms the
process up; the per-round ratios show what that costs.

Full mode: the bbc-headlines-dpo pairing (the real headline over another of the same topic) on the articles' lead
paragraphs of at most ``--max_words`` words, so that no prompt is cut (TRL's rows hold one prompt for both sides;
ours cuts a long prompt per side), ``--pairs`` pairs, micro-batch 2 x accumulation 4 (the recipe's), fp32, sigmoid,
``--threads`` torch threads. ``--model smollm2-small`` (the default): SmolLM2-135M-Instruct's tokenizer, chat
template and 49,152-token vocabulary on 4 layers of 256 (random weights); ``--model smollm2-135m``: the model itself,
de-quantized once from the recipes' GGUF file into ``--work_dir``. ``--quick``: the tests' tiny chat Llama on 16
generated pairs, one ABBA round (seconds of training; the numbers mean nothing). Figures:
docs/dpo.md#speed-against-dpotrainer.

    python bench/bench_dpo_peer.py                # 16 runs: about 12 minutes on a busy 2-core machine
    python bench/bench_dpo_peer.py --model smollm2-135m --repeats 1
    python bench/bench_dpo_peer.py --quick
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

CONFIGS = (("ours", False), ("trl", False), ("ours", True), ("trl", True))  # (who, precomputed reference)
# SmolLM2-135M is 30 layers of 576 (9 heads of 64, 3 key-value heads, MLP 1536); this keeps its head size and ratios
SMALL = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64)
WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()


def smollm2_dir(work_dir: Path) -> str:
    """The recipes' SmolLM2-135M-Instruct GGUF file de-quantized to fp32 and saved with its tokenizer (chat
    template included) into ``work_dir/smollm2-135m``, once: both trainers load this directory."""
    from finetune.models.fetch import smollm2_gguf_path
    from finetune.models.gguf import load_gguf_causal_lm

    out = work_dir / "smollm2-135m"
    if not (out / "config.json").is_file():
        model, tokenizer = load_gguf_causal_lm(smollm2_gguf_path())
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return str(out)


def smollm2_small_dir(work_dir: Path) -> str:
    """SmolLM2-135M-Instruct scaled down (``SMALL``: 4 layers, 256 wide; random weights, seed 0) with its tokenizer,
    chat template and 49,152-token vocabulary, saved into ``work_dir/smollm2-small``: the real model's vocabulary
    projection and log-softmax, at a cost a busy 2-core machine measures in minutes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.models.fetch import smollm2_gguf_path
    from finetune.models.gguf import load_gguf_tokenizer

    out = work_dir / "smollm2-small"
    if not (out / "config.json").is_file():
        tokenizer = load_gguf_tokenizer(smollm2_gguf_path())
        config = LlamaConfig(vocab_size=49152, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                             pad_token_id=tokenizer.pad_token_id, max_position_embeddings=2048,
                             rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, **SMALL)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
        tokenizer.save_pretrained(out)
    return str(out)


def bbc_lead_pairs(n: int, max_words: int) -> list[dict]:
    """``n`` preference rows of the bbc-headlines-dpo recipe's training split (the real headline over another of
    the same topic, ``pair_rows``), the prompt built from the article's lead paragraph, of leads of at most
    ``max_words`` words (so that no pair needs its prompt cut)."""
    import datasets

    from finetune.recipes.bbc_headlines import dedup_articles
    from finetune.recipes.bbc_headlines_dpo import pair_rows
    from finetune.recipes.bbc_lead_headlines import lead_paragraph
    from finetune.recipes.bbc_news import _articles, corpus_dir

    data_dir = corpus_dir()
    topics = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    kept, _ = dedup_articles(_articles(str(data_dir)))
    features = datasets.Features({"headline": datasets.Value("string"), "body": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=topics)})
    train = datasets.Dataset.from_list(kept, features=features).train_test_split(
        test_size=0.2, stratify_by_column="label", seed=42)["train"]
    articles = [dict(a, body=lead_paragraph(a["body"])) for a in train if len(lead_paragraph(a["body"]).split())
                <= max_words]
    return pair_rows(articles)[:n]


def word_pairs(n: int, seed: int) -> list[dict]:
    """``n`` rows of random words of unequal lengths (``--quick``)."""
    rng = random.Random(seed)
    return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 8, 21]))),
             "chosen": " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 6]))),
             "rejected": " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 5])))} for _ in range(n)]


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


class Stamps:
    """The end of every optimizer step of any optimizer (a global post-hook), and the seconds ours spends in
    ``reference.compute`` on the training split (wrapped: it is looked up at call time)."""

    def __init__(self, train_pairs: int):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from finetune.tasks import reference

        self.steps, self.precompute_seconds = [], 0.0
        self.handle = register_optimizer_step_post_hook(
            lambda *_: self.steps.append(time.perf_counter()))
        original = reference.compute

        def timed(task, model, dataset, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(task, model, dataset, *args, **kwargs)
            finally:
                if len(dataset) == train_pairs:  # not the held-out split's
                    self.precompute_seconds += time.perf_counter() - start

        reference.compute = timed
        self._restore = lambda: setattr(reference, "compute", original)

    def start(self) -> None:
        self.steps, self.precompute_seconds = [], 0.0

    def close(self) -> None:
        self.handle.remove()
        self._restore()


def setting(args, work: Path) -> dict:
    """The model directory, the pairs, the batch plan and the ABBA rounds of this invocation."""
    if args.quick:
        from tiny_models import build_tiny_chat_llama

        return dict(model_dir=str(build_tiny_chat_llama(work / "tiny-chat-llama")), rows=word_pairs(16, seed=0),
                    micro_batch=2, accumulation=2, repeats=1)
    model_dir = smollm2_dir(work) if args.model == "smollm2-135m" else smollm2_small_dir(work)
    return dict(model_dir=model_dir, rows=bbc_lead_pairs(args.pairs, args.max_words),
                micro_batch=args.micro_batch, accumulation=args.accumulation, repeats=args.repeats)


def measure(args, work: Path, model_dir: str, rows: list[dict], micro_batch: int, accumulation: int,
            repeats: int) -> dict:
    """Every configuration's runs, ABBA: {config: [{pairs_per_second, precompute_seconds}, ...]}, and the per-step
    pairs and losses, the tokenised pairs (``results["pairs"]``, ``["losses"]``, ``["tokenised"]``)."""
    from trl_peer import order_of, reset_accelerate_state, run_ours, run_trl, trl_config

    shutil.rmtree(work / "runs", ignore_errors=True)  # an earlier invocation's, into the same --work_dir
    train_file = write_rows(work / "train.jsonl", rows)
    valid_file = write_rows(work / "valid.jsonl", rows[:2])
    common = dict(learning_rate=5e-6, warmup_steps=0, lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=1.0,
                  beta=0.1, seed=42, loss_type="sigmoid")

    def ours(name: str, precompute: bool):
        flags = dict(recipe="bbc-headlines-dpo", output_dir=work / "runs" / name, model_name_or_path=model_dir,
                     train_file=train_file, validation_file=valid_file, max_length=args.max_length, num_train_epochs=1,
                     max_train_samples=len(rows), eval_strategy="no", eval_on_start=False, save_strategy="no",
                     mixed_precision="no", report_to="none", per_device_train_batch_size=micro_batch,
                     per_device_eval_batch_size=args.precompute_batch,
                     gradient_accumulation_steps=accumulation, precompute_ref_log_probs=precompute, **common)
        return run_ours([a for flag, value in flags.items() for a in (f"--{flag}", str(value))])

    stamps = Stamps(len(rows))
    runs = {config: [] for config in CONFIGS}
    tokenised, order, pairs_per_step, losses = None, None, None, {}
    try:
        for index, (who, precompute) in enumerate(c for _ in range(repeats) for c in (*CONFIGS, *reversed(CONFIGS))):
            name = f"{index:02d}-{who}-{'precomputed' if precompute else 'frozen'}"
            gc.collect()
            stamps.start()
            if who == "ours":
                run, tokenised_here = ours(name, precompute)
                if order is None:  # the first run: the pairs and the order TRL is given, and the pairs of each step
                    tokenised, order = tokenised_here, order_of(run.batches, tokenised_here)
                    pairs_per_step = [r["samples"] for r in run.steps]
                precompute_seconds = stamps.precompute_seconds
            else:
                config = trl_config(work / "runs" / name, per_device_train_batch_size=micro_batch,
                                    gradient_accumulation_steps=accumulation, precompute_ref_log_probs=precompute,
                                    precompute_ref_batch_size=args.precompute_batch, **common)
                run = run_trl(model_dir, tokenised, order, config)
                precompute_seconds = run.precompute_seconds
            steps = list(stamps.steps)
            if len(steps) != len(pairs_per_step) or len(steps) < 2:
                raise RuntimeError(f"{name}: {len(steps)} optimizer steps stamped, expected {len(pairs_per_step)} "
                                   "(at least 2)")
            rate = sum(pairs_per_step[1:]) / (steps[-1] - steps[0])
            runs[who, precompute].append({"pairs_per_second": rate, "precompute_seconds": precompute_seconds})
            losses.setdefault((who, precompute), [r["loss"] for r in run.steps])
            print(f"  {name}: {rate:.3f} pairs/s (steps end at "
                  + ", ".join(f"{t - steps[0]:.1f}" for t in steps[1:]) + " s after step 1)"
                  + (f", precomputed in {precompute_seconds:.1f} s" if precompute else ""), file=sys.stderr, flush=True)
            del run
    finally:
        stamps.close()
        reset_accelerate_state()
    return {"runs": runs, "pairs": pairs_per_step, "losses": losses, "tokenised": tokenised}


def summarise(runs: dict, pairs: int) -> dict:
    """Per reference (frozen, precomputed): each side's median pairs/s and its runs, the ratio ours / TRL of the
    medians and of each round's runs (ABBA: a round's ours with its TRL); precomputed: the seconds of the pass and
    the pairs/s with it (``1 / (1 / training + seconds / pairs)``)."""
    table = {}
    for precompute in (False, True):
        row = {}
        for who in ("ours", "trl"):
            rates = [r["pairs_per_second"] for r in runs[who, precompute]]
            row[who] = {"pairs_per_second": statistics.median(rates), "runs": rates}
            if precompute:
                seconds = statistics.median(r["precompute_seconds"] for r in runs[who, precompute])
                row[who].update(precompute_seconds=seconds,
                                with_pass_pairs_per_second=1 / (1 / row[who]["pairs_per_second"] + seconds / pairs))
        row["ratio"] = row["ours"]["pairs_per_second"] / row["trl"]["pairs_per_second"]
        row["ratio_per_round"] = [a / b for a, b in zip(row["ours"]["runs"], row["trl"]["runs"])]
        if precompute:
            row["with_pass_ratio"] = (row["ours"]["with_pass_pairs_per_second"]
                                      / row["trl"]["with_pass_pairs_per_second"])
        table["precomputed" if precompute else "frozen"] = row
    return table


def render(result: dict, info: dict) -> str:
    """The Markdown report: the setting, the machine, one row per reference."""
    from benchlib import format_machine

    tokens = result["pair_tokens"]
    lines = [f"### DPO (sigmoid, fp32): ours against TRL {result['trl']} DPOTrainer, {result['pairs']} identical pairs "
             f"(prompt and longer side {tokens['min']}-{tokens['max']} tokens, median {tokens['median']:.0f}), "
             f"micro-batch {result['micro_batch']} x {result['accumulation']}, {result['steps']} optimizer steps per "
             f"run, {result['repeats']} ABBA round(s): {2 * result['repeats']} runs per configuration",
             format_machine(info), f"- torch threads: {result['threads']}",
             f"- the per-step losses of ours and TRL's agree within {result['max_loss_relative_difference']:.1e} "
             "(relative)", "",
             "| reference | ours pairs/s | TRL pairs/s | ours / TRL (medians) | ours / TRL per round | "
             "precompute s: ours / TRL | with the pass: ours / TRL pairs/s (ratio) |",
             "|---|---|---|---|---|---|---|"]
    for name, row in result["results"].items():
        cells = [name, f"{row['ours']['pairs_per_second']:.3f}", f"{row['trl']['pairs_per_second']:.3f}",
                 f"{row['ratio']:.2f}", ", ".join(f"{r:.2f}" for r in row["ratio_per_round"]), "-", "-"]
        if name == "precomputed":
            cells[5] = f"{row['ours']['precompute_seconds']:.1f} / {row['trl']['precompute_seconds']:.1f}"
            cells[6] = (f"{row['ours']['with_pass_pairs_per_second']:.3f} / "
                        f"{row['trl']['with_pass_pairs_per_second']:.3f} ({row['with_pass_ratio']:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch
    import trl
    from benchlib import machine_info  # puts tests/ on sys.path: tiny_models, trl_peer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny chat Llama, 16 word pairs, one ABBA round")
    parser.add_argument("--model", choices=("smollm2-small", "smollm2-135m"), default="smollm2-small",
                        help="SmolLM2-135M-Instruct itself (de-quantized from the recipes' GGUF file), or scaled down "
                        "to 4 layers of 256 with its vocabulary (random weights; the default: minutes on 2 cores)")
    parser.add_argument("--pairs", type=int, default=24, help="training pairs per run (full mode)")
    parser.add_argument("--max_words", type=int, default=60, help="longest lead paragraph, in words (full mode)")
    parser.add_argument("--max_length", type=int, default=256, help="--max_length (tokens per side)")
    parser.add_argument("--micro_batch", type=int, default=2, help="pairs per micro-batch (full mode)")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step (full mode)")
    parser.add_argument("--precompute_batch", type=int, default=4, help="pairs per forward of the precomputation "
                        "(ours: --per_device_eval_batch_size; TRL: precompute_ref_batch_size)")
    parser.add_argument("--repeats", type=int, default=2, help="ABBA rounds (each runs every configuration twice; "
                        "--quick: 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both trainers (1: on a busy "
                        "machine two threads of 2 cores ran a forward and backward 2.3 x slower than one)")
    parser.add_argument("--work_dir", default=None, help="where the model and the runs go (default: a temporary "
                        "folder; the de-quantized model is kept there between invocations)")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        info = machine_info()
        work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-dpo-peer-"))
        work.mkdir(parents=True, exist_ok=True)
        chosen = setting(args, work)
        measured = measure(args, work, **chosen)
        result_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)  # run in-process by its smoke test: the process's own again
    losses = measured["losses"]
    lengths = [len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in measured["tokenised"]]
    result = {"machine": info, "quick": args.quick, "model": chosen["model_dir"], "pairs": len(chosen["rows"]),
              "micro_batch": chosen["micro_batch"], "accumulation": chosen["accumulation"],
              "steps": len(measured["pairs"]), "repeats": chosen["repeats"], "threads": result_threads,
              "trl": trl.__version__,
              "pair_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
              "max_loss_relative_difference": max(abs(a - b) / abs(b) for p in (False, True)
                                                  for a, b in zip(losses["ours", p], losses["trl", p])),
              "results": summarise(measured["runs"], len(chosen["rows"]))}
    print(render(result, info))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
