"""Completions per second of our grpo task against TRL 1.16's ``GRPOTrainer`` on the same prompts and settings: each
side sampling its own completions, and each trained on one recorded set of completions (no generation).

Every run is a whole training run in this process, from the same model directory: ours through the accelerate
backend (``tests/trl_grpo_replay.run_ours``), TRL's ``GRPOTrainer`` with ``GRPOConfig`` set as ours (fp32, no
gradient checkpointing, dropout off, the transformers generation path: no vLLM). "generate": both sample (ours
each prompt's group in one ``generate`` call, TRL the whole generation batch in one, left-padded); "replay": ours
with ``--replay_completions`` of the first generating run's record, TRL given the same record by the stand-in of
``tests/trl_grpo_replay.py`` (the machinery of ``tests/test_grpo_peer.py``, which shows both then compute the same
numbers). The four configurations run interleaved, ABBA (ours/TRL x generate/replay, then the reverse),
``--repeats`` times; the figures are medians over the runs.

Measured the same way on both sides: completions/s, the completions of steps 2..K over the time from the end of
step 1 to the end of step K, each step's end stamped by a torch optimizer step post-hook (the inner AdamW steps once
per optimizer step in both); a step's time holds its generation (or replay), rewards, reference-free loss, forward
and backward. Step 1 (warm-up) and the set-up are left out. The mean completion length each side logged is printed:
the model is random, so it rarely ends a completion and both sample ``--max_completion_length`` tokens nearly always
(the same work).

Full mode: ``--model smollm2-small`` (SmolLM2-135M-Instruct's tokenizer, chat template and 49,152-token vocabulary
on 4 layers of 256, random weights; ``bench/bench_dpo_peer.py``), ``--prompts`` bbc-headlines prompts (the
instruction and a lead paragraph of at most ``--max_words`` words, as a user turn), ``--num_generations`` 4, micro-
batch 1 prompt (ours; TRL's ``per_device_train_batch_size`` counts completions: 4) x accumulation 2, max completion
32 tokens, dapo, beta 0 (GRPOConfig's defaults), ``--threads`` torch threads. ``--quick``: the tests' tiny chat
Llama on 8 word prompts, one ABBA round (seconds; the numbers mean nothing). Figures: docs/speed.md.

    python bench/bench_grpo_peer.py --repeats 1     # 8 runs
    python bench/bench_grpo_peer.py --quick
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

CONFIGS = (("ours", "generate"), ("trl", "generate"), ("ours", "replay"), ("trl", "replay"))
WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()


def prompt_rows(args) -> list[dict]:
    """Conversational prompt rows: bbc-headlines prompts (full mode) or random words (``--quick``)."""
    if args.quick:
        rng = random.Random(0)
        return [{"prompt": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.choice(
            [3, 8, 21])))}]} for _ in range(8)]
    from bench_dpo_peer import bbc_lead_pairs

    return [{"prompt": [{"role": "user", "content": row["prompt"]}]}
            for row in bbc_lead_pairs(args.prompts, args.max_words)]


class Stamps:
    """The end of every optimizer step of any optimizer (a global post-hook)."""

    def __init__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.steps = []
        self.handle = register_optimizer_step_post_hook(lambda *_: self.steps.append(time.perf_counter()))


def measure(args, work: Path, model_dir: str, rows: list[dict], repeats: int) -> dict:
    """Every configuration's runs, ABBA: {config: [completions/s, ...]}, and each side's logged mean completion
    length and per-step losses of its first run."""
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl_grpo_replay import generation_batches, length_and_parity, replay_config, run_ours, run_trl_replay
    from trl_peer import reset_accelerate_state

    shutil.rmtree(work / "runs", ignore_errors=True)
    train = work / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    G, L, micro, accumulation = args.num_generations, args.max_completion_length, 1, 2
    common = dict(learning_rate=1e-6, warmup_steps=0, lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=1.0,
                  seed=42, beta=0.0, loss_type="dapo", num_generations=G, max_completion_length=L, temperature=1.0)
    steps = len(rows) // (micro * accumulation)
    record, order = None, None
    stamps, runs, lengths, losses = Stamps(), {c: [] for c in CONFIGS}, {}, {}
    try:
        for index, (who, mode) in enumerate(c for _ in range(repeats) for c in (*CONFIGS, *reversed(CONFIGS))):
            name = f"{index:02d}-{who}-{mode}"
            out = work / "runs" / name
            gc.collect()
            stamps.steps = []
            if who == "ours":
                flags = dict(recipe="grpo", output_dir=out, model_name_or_path=model_dir, train_file=train,
                             validation_file=work / "valid.jsonl", num_train_epochs=1, eval_strategy="no",
                             save_strategy="no", mixed_precision="no", report_to="none", max_length=args.max_length,
                             per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                             reward_funcs="trl_grpo_replay:length_and_parity", **common)
                if mode == "replay":
                    flags["replay_completions"] = record
                run = run_ours([a for flag, value in flags.items() for a in (f"--{flag}", str(value))])
                if record is None:  # the first run generates: its record is what every replaying run trains on
                    record = out / "completions.jsonl"
                    order = [b[i]["prompt"] for b in generation_batches(record) for i in range(0, len(b), G)]
                steps_logged = run.steps
            else:
                config = replay_config(out, per_device_train_batch_size=micro * G,
                                       gradient_accumulation_steps=accumulation, **common)
                if mode == "replay":
                    run, _ = run_trl_replay(model_dir, rows, generation_batches(record), config, [length_and_parity],
                                            order=order)
                    steps_logged = run.steps
                else:
                    reset_accelerate_state()
                    trainer = trl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir),
                                              reward_funcs=[length_and_parity], args=config,
                                              train_dataset=__import__("datasets").Dataset.from_list(rows),
                                              processing_class=AutoTokenizer.from_pretrained(model_dir))
                    trainer.train()
                    steps_logged = [r for r in trainer.state.log_history if "loss" in r]
                    del trainer
            stamped = list(stamps.steps)
            if len(stamped) != steps or steps < 2:
                raise RuntimeError(f"{name}: {len(stamped)} optimizer steps stamped, expected {steps} (at least 2)")
            rate = (steps - 1) * micro * accumulation * G / (stamped[-1] - stamped[0])
            runs[who, mode].append(rate)
            lengths.setdefault((who, mode), statistics.mean(r["completions/mean_length"] for r in steps_logged))
            losses.setdefault((who, mode), [r["loss"] for r in steps_logged])
            print(f"  {name}: {rate:.3f} completions/s (steps end at "
                  + ", ".join(f"{t - stamped[0]:.1f}" for t in stamped[1:]) + " s after step 1)", file=sys.stderr,
                  flush=True)
    finally:
        stamps.handle.remove()
        reset_accelerate_state()
    return {"runs": runs, "lengths": lengths, "losses": losses, "steps": steps}


def summarise(runs: dict) -> dict:
    """Per mode: each side's median completions/s and its runs, the ratio ours / TRL of the medians and of each
    round's runs (ABBA: a round's ours with its TRL)."""
    table = {}
    for mode in ("generate", "replay"):
        row = {who: {"completions_per_second": statistics.median(runs[who, mode]), "runs": runs[who, mode]}
               for who in ("ours", "trl")}
        row["ratio"] = row["ours"]["completions_per_second"] / row["trl"]["completions_per_second"]
        row["ratio_per_round"] = [a / b for a, b in zip(row["ours"]["runs"], row["trl"]["runs"])]
        table[mode] = row
    return table


def render(result: dict, info: dict) -> str:
    """The Markdown report: the setting, the machine, one row per mode."""
    from benchlib import format_machine

    lines = [f"### GRPO (dapo, beta 0, fp32): ours against TRL {result['trl']} GRPOTrainer, {result['prompts']} "
             f"prompts x {result['num_generations']} completions of at most {result['max_completion_length']} tokens, "
             f"micro-batch 1 prompt x 2, {result['steps']} optimizer steps per run, {result['repeats']} ABBA "
             f"round(s): {2 * result['repeats']} runs per configuration",
             format_machine(info), f"- torch threads: {result['threads']}",
             "- mean completion length logged: " + ", ".join(f"{who} {mode} {v:.1f}"
                                                             for (who, mode), v in result["lengths"].items()),
             f"- replay: the per-step losses of ours and TRL's agree within {result['replay_loss_difference']:.1e} "
             "(absolute)", "",
             "| mode | ours completions/s | TRL completions/s | ours / TRL (medians) | ours / TRL per round |",
             "|---|---|---|---|---|"]
    for mode, row in result["results"].items():
        lines.append(f"| {mode} | {row['ours']['completions_per_second']:.3f} | "
                     f"{row['trl']['completions_per_second']:.3f} | {row['ratio']:.2f} | "
                     + ", ".join(f"{r:.2f}" for r in row["ratio_per_round"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch
    import trl
    from benchlib import machine_info  # puts tests/ on sys.path: tiny_models, trl_grpo_replay

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny chat Llama, 8 word prompts, one ABBA round")
    parser.add_argument("--prompts", type=int, default=8, help="training prompts per run (full mode; 2 a step)")
    parser.add_argument("--max_words", type=int, default=60, help="longest lead paragraph, in words (full mode)")
    parser.add_argument("--num_generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max_completion_length", type=int, default=32, help="tokens per completion at most")
    parser.add_argument("--max_length", type=int, default=512, help="--max_length (prompt tokens at most)")
    parser.add_argument("--repeats", type=int, default=2, help="ABBA rounds (--quick: 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both trainers")
    parser.add_argument("--work_dir", default=None, help="where the model and the runs go (default: a temporary "
                        "folder)")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        info = machine_info()
        work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-grpo-peer-"))
        work.mkdir(parents=True, exist_ok=True)
        if args.quick:
            from tiny_models import build_tiny_chat_llama

            model_dir, repeats = str(build_tiny_chat_llama(work / "tiny-chat-llama")), 1
        else:
            from bench_dpo_peer import smollm2_small_dir

            model_dir, repeats = smollm2_small_dir(work), args.repeats
        rows = prompt_rows(args)
        measured = measure(args, work, model_dir, rows, repeats)
        result_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)  # run in-process by a smoke test: the process's own again
    losses = measured["losses"]
    result = {"machine": info, "quick": args.quick, "model": model_dir, "prompts": len(rows),
              "num_generations": args.num_generations, "max_completion_length": args.max_completion_length,
              "steps": measured["steps"], "repeats": repeats, "threads": result_threads, "trl": trl.__version__,
              "lengths": measured["lengths"],
              "replay_loss_difference": max(abs(a - b) for a, b in zip(losses["ours", "replay"],
                                                                      losses["trl", "replay"])),
              "results": summarise(measured["runs"])}
    print(render(result, info))
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "lengths": {f"{w} {m}": v for (w, m), v in
                                                                    result["lengths"].items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
