"""Benchmark: the memory levers of training (micro-batch x accumulation, activation checkpointing, chunked
loss, LoRA), each configuration in its own fresh process.

    python bench/bench_memory.py --smoke                                  # tiny models, all suites, < 1 min
    python bench/bench_memory.py --suite bbc --markdown bench-memory-bbc.md --json bench-memory-bbc.json
    python bench/bench_memory.py --suite smollm2 --micro_batch 8 --steps 2
    python bench/bench_memory.py --suite lora --micro_batch 2 --steps 2 --repeats 1   # reduced size

Unlike the other scripts in ``bench/`` this one does not run ``finetune/run.py``: each measurement is this
script re-started as a worker (``python bench/bench_memory.py --worker SPEC``), a fresh process that builds
the model with the engine's own builder (``finetune.tasks.builders.build_model``: loading, activation
checkpointing, LoRA) and trains it with a bare loop on random token ids of exactly ``max_length`` tokens
(the worst case: no padding), labels for the task (a random class of 5; the input ids themselves for a
causal LM). So the process max RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is that configuration's
alone. A worker:

1. measures the bytes autograd saves for backward during one micro-batch's forward
   (``finetune.planner.probes.saved_tensor_bytes``, the planner's own measurement);
2. runs one warm-up optimizer step (untimed; it creates AdamW's state), then ``--steps`` timed optimizer
   steps: ``accumulation`` micro-batches (forward, loss summed over items / items of the step, backward),
   then one ``torch.optim.AdamW`` step and ``zero_grad(set_to_none=True)``;
3. reports the time per sample (seconds per sample over the timed steps), the peak RSS (bytes), and the
   trainable parameters.

Memory accounting (fp32 training): saved-for-backward bytes of one micro-batch + gradient bytes (trainable
parameters x 4) + AdamW state bytes (trainable x 8, two fp32 moments) = "training memory". (The planner,
``finetune.planner.probes.Probe``, counts the same activations less the weights among them, and adds all the
weights: it plans for a process in which no model exists yet.) Configurations are repeated interleaved (round r runs every
configuration once) and medians are reported; ratios are computed within one run of this script.

Suites (``--suite``, comma-separated, default all three):

- ``bbc``: all-MiniLM-L6-v2 classifier (5 labels) at 512 tokens: 32x1, 8x4, 8x4 + activation checkpointing,
  32x1 + activation checkpointing.
- ``smollm2``: SmolLM2-135M-Instruct (the fetched GGUF, de-quantized once per run into the work directory) at
  512 tokens, micro-batch 8: plain; 2x4 (plain, a quarter of the micro-batch, the same effective batch: what
  checkpointing at 4x the micro-batch competes with); + chunked loss (only where ``finetune.tasks.chunked_loss`` exists); +
  activation checkpointing; + LoRA (r=16, alpha=32, peft's default targets); + LoRA + checkpointing; then
  the levers stacked: chunked loss + checkpointing, and chunked loss + checkpointing + LoRA.
- ``lora``: full fine-tune vs LoRA, SmolLM2 at 256 tokens, micro-batch 4: the ratio LoRA / full of the
  training memory (goal <= 0.6), peak RSS, time per sample and trainable parameters.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402

SCRIPT = Path(__file__).resolve()
RESULT_PREFIX = "BENCH_MEMORY_RESULT "  # the worker's result line on stdout
SUITES = ("bbc", "smollm2", "lora")
NUM_LABELS = 5  # bbc-news topics
LORA_RATIO_GOAL = 0.6  # LoRA / full fine-tune training memory
DEFAULT_CHUNK_SIZE = 1024  # label tokens per chunk when finetune.tasks.chunked_loss names no default
# Per suite: tokens, micro-batch, timed optimizer steps, repeats (full mode). Smoke: 32 tokens, 1 repeat.
SUITE_DEFAULTS = {
    "bbc": {"max_length": 512, "micro_batch": None, "steps": 3, "repeats": 3},  # micro-batches fixed: 32x1, 8x4
    "smollm2": {"max_length": 512, "micro_batch": 8, "steps": 2, "repeats": 2},
    "lora": {"max_length": 256, "micro_batch": 4, "steps": 3, "repeats": 3},
}
CHUNKED_HELPERS = ("causal_lm_hidden_and_head",)  # finetune.tasks.chunked_loss: forward -> (hidden states, lm_head)


# ============================================================================================ worker
def chunked_loss_api():
    """``(chunked_causal_lm_loss_sum, hidden-states helper or None, default chunk size)`` from
    ``finetune.tasks.chunked_loss``, or None when that module (or its loss function) does not exist. The helper is
    the first of ``CHUNKED_HELPERS`` the module has: ``helper(model, batch) -> (hidden_states, lm_head)``."""
    try:
        if importlib.util.find_spec("finetune.tasks.chunked_loss") is None:
            return None
    except ImportError:
        return None
    import finetune.tasks.chunked_loss as module

    loss = getattr(module, "chunked_causal_lm_loss_sum", None)
    if loss is None:
        return None
    helper = next((getattr(module, name) for name in CHUNKED_HELPERS if hasattr(module, name)), None)
    return loss, helper, getattr(module, "DEFAULT_CHUNK_SIZE", DEFAULT_CHUNK_SIZE)


def build_model(spec: dict):
    """The model of a configuration, built by the engine's own builder (``finetune.tasks.builders.build_model``) from
    a ``TrainConfig`` of the spec's model, length, checkpointing and LoRA settings, in train mode."""
    # imported in the worker, as this script's other engine imports: the parent (--dry_run, the report) stays light
    from finetune.config import TrainConfig
    from finetune.tasks import builders, get_task

    config = TrainConfig(model_name_or_path=spec["model"], max_length=spec["max_length"],
                         activation_checkpointing=spec["checkpointing"], use_peft=spec["lora"], lora_r=spec["lora_r"],
                         lora_alpha=spec["lora_alpha"], lora_dropout=spec["lora_dropout"])
    if spec["task"] == "cls":
        model = builders.build_model(config, get_task("sequence-classification"),
                                     [f"topic{i}" for i in range(NUM_LABELS)])
    else:
        model = builders.build_model(config, get_task("causal-lm"))
    model.train()
    return model


def saved_storages(run_step):
    """``finetune.planner.probes.saved_storages``: the storages autograd saves for backward while ``run_step()``
    builds its graph (``{data_ptr: bytes}``) and the loss, not back-propagated."""
    from finetune.planner.probes import saved_storages as measure

    return measure(run_step)


def run_worker(spec: dict) -> dict:
    """Measure one configuration in this (fresh) process and return its figures (bytes, seconds).

    ``spec``: ``task`` ("cls" or "clm"), ``model`` (path), ``max_length`` (tokens), ``micro_batch`` and
    ``accumulation`` (samples, micro-batches per optimizer step), ``checkpointing``, ``lora`` (with
    ``lora_r``, ``lora_alpha``, ``lora_dropout``), ``chunked`` (with ``chunk_size``: label tokens per chunk),
    ``steps`` (timed optimizer steps), ``seed``.

    Returns: ``trainable_parameters``, ``total_parameters``; ``saved_tensor_bytes`` (one micro-batch's forward,
    ``finetune.planner.probes.saved_tensor_bytes``) and ``saved_parameter_bytes`` (the part of it that is parameter
    storage, weights autograd keeps for backward; measured on the warm-up's first micro-batch, whose total
    ``saved_tensor_bytes_warmup`` must equal ``saved_tensor_bytes``); ``gradient_bytes`` (trainable x 4),
    ``adamw_state_bytes`` (trainable x 8), ``training_memory_bytes`` (their sum with ``saved_tensor_bytes``),
    ``gradient_bytes_measured`` and ``adamw_state_bytes_measured`` (what the tensors really held);
    ``weight_bytes`` (all parameters); ``rss_after_load_bytes`` (RSS once the model is built),
    ``max_rss_before_training_bytes`` and ``peak_rss_bytes`` (process max RSS before the first step and at the
    end); ``seconds`` and ``seconds_per_sample`` of the timed steps; ``losses`` (one per optimizer step).
    """
    import psutil
    import torch

    from finetune.engine import parameter_counts
    from finetune.planner.probes import saved_tensor_bytes
    from finetune.tasks import CausalLM, SequenceClassification

    torch.manual_seed(spec["seed"])
    model = build_model(spec)
    trainable, total = parameter_counts(model)
    params = [p for p in model.parameters() if p.requires_grad]
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rss_after_load = psutil.Process().memory_info().rss
    max_rss_before = max_rss_bytes()

    m, n, length = spec["micro_batch"], spec["accumulation"], spec["max_length"]
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(spec["seed"])
    task = SequenceClassification() if spec["task"] == "cls" else CausalLM()
    items_per_step = m * n if spec["task"] == "cls" else m * n * (length - 1)  # samples, or label tokens
    chunked = chunked_loss_api() if spec["chunked"] else None
    if spec["chunked"] and chunked is None:
        raise RuntimeError("finetune.tasks.chunked_loss is not available")

    def micro_batch():
        ids = torch.randint(0, vocab, (m, length), generator=generator)
        if spec["task"] == "cls":
            labels = torch.randint(0, NUM_LABELS, (m,), generator=generator)
        else:
            labels = ids
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels

    def loss_of(batch, labels):
        """The micro-batch's loss: summed over items, divided by the items of the optimizer step."""
        if chunked is not None:
            loss_fn, helper, _ = chunked
            if helper is not None:
                hidden, head = helper(model, batch)
            else:  # no helper: the base model's last hidden states and the output embedding
                hidden = model.model(**batch).last_hidden_state
                head = model.get_output_embeddings()
            loss_sum = loss_fn(hidden, head, labels, spec["chunk_size"])
        else:
            loss_sum = task.loss_from_logits(model(**batch).logits, labels)
        return loss_sum / items_per_step

    # 1. the planner's measurement: bytes saved for backward by one micro-batch's forward
    batch, labels = micro_batch()
    saved = saved_tensor_bytes(lambda: loss_of(batch, labels))
    model.zero_grad(set_to_none=True)

    optimizer = torch.optim.AdamW(params, lr=1e-5)
    losses = []

    def optimizer_step(record_saved: bool = False) -> dict:
        storages, total_loss = None, 0.0
        for k in range(n):
            batch, labels = micro_batch()
            if record_saved and k == 0:
                storages, loss = saved_storages(lambda: loss_of(batch, labels))  # noqa: B023 - the lambda runs inside this iteration
            else:
                loss = loss_of(batch, labels)
            loss.backward()
            total_loss += loss.item()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total_loss)
        return {"storages": storages, "grads": grads}

    # 2. one warm-up step (creates AdamW's state), untimed; it also says which saved storages are weights
    warm = optimizer_step(record_saved=True)
    storages = warm["storages"]
    adamw_measured = sum(value.numel() * value.element_size() for state in optimizer.state.values()
                         for key, value in state.items() if key != "step" and torch.is_tensor(value))
    start = time.perf_counter()
    for _ in range(spec["steps"]):
        optimizer_step()
    seconds = time.perf_counter() - start
    samples = spec["steps"] * m * n
    gradient_bytes, adamw_bytes = 4 * trainable, 8 * trainable
    return {
        "trainable_parameters": trainable, "total_parameters": total,
        "saved_tensor_bytes": saved,
        "saved_tensor_bytes_warmup": sum(storages.values()),
        "saved_parameter_bytes": sum(size for ptr, size in storages.items() if ptr in param_storages),
        "gradient_bytes": gradient_bytes, "adamw_state_bytes": adamw_bytes,
        "training_memory_bytes": saved + gradient_bytes + adamw_bytes,
        "gradient_bytes_measured": warm["grads"], "adamw_state_bytes_measured": adamw_measured,
        "weight_bytes": weight_bytes,
        "rss_after_load_bytes": rss_after_load, "max_rss_before_training_bytes": max_rss_before,
        "peak_rss_bytes": max_rss_bytes(),
        "timed_steps": spec["steps"], "timed_samples": samples, "seconds": seconds,
        "seconds_per_sample": seconds / samples if samples else None,
        "losses": losses, "torch_threads": torch.get_num_threads(),
        "chunked_helper": None if chunked is None else (chunked[1].__name__ if chunked[1] else "model.model (fallback)"),
    }


def max_rss_bytes() -> int:
    """This process's max RSS so far, bytes (``getrusage(RUSAGE_SELF).ru_maxrss``: KiB on Linux, bytes on macOS)."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024


def convert_gguf(source: str, dest: str) -> None:
    """De-quantize a ``.gguf`` causal LM once (``finetune.models.loading.load_causal_lm``, fp32) and save it as a model
    directory at ``dest``, so workers load it fast and without the de-quantization's own peak."""
    from finetune.models.loading import load_causal_lm

    load_causal_lm(source).save_pretrained(dest)


# ============================================================================================ parent
def lscpu_model_name() -> str | None:
    """``lscpu``'s "Model name", or None where lscpu is missing or says nothing."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.strip().lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def parse_args(argv=None):
    """Flags; per-suite defaults are filled in (see ``SUITE_DEFAULTS``; ``--smoke``: 32 tokens, 1 repeat, 2
    timed steps, 1 thread)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--suite", default=",".join(SUITES), help=f"comma-separated subset of {','.join(SUITES)}")
    p.add_argument("--smoke", action="store_true",
                   help="tiny BERT/Llama built from a config (tests/tiny_models.py), 32 tokens, 1 repeat: checks the "
                        "pipeline; its numbers mean nothing")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per configuration, interleaved (default per suite: bbc 3, smollm2 2, lora 3; smoke 1)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed optimizer steps per run, after 1 warm-up step (default: bbc 3, smollm2 2, lora 3; smoke 2)")
    p.add_argument("--micro_batch", type=int, default=None,
                   help="micro-batch (samples) of the smollm2 and lora suites (default 8 and 4); bbc's are fixed")
    p.add_argument("--accumulation", type=int, default=1,
                   help="micro-batches per optimizer step in the smollm2 and lora suites")
    p.add_argument("--max_length", type=int, default=None,
                   help="tokens per sample, every suite (default: bbc 512, smollm2 512, lora 256; smoke 32)")
    p.add_argument("--bbc_model", default=None, help="classifier model (default all-MiniLM-L6-v2; smoke a tiny BERT)")
    p.add_argument("--clm_model", default=None,
                   help="causal LM, a model directory or .gguf (default the fetched SmolLM2-135M-Instruct GGUF; smoke a "
                        "tiny Llama)")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05, help="the engine's default")
    p.add_argument("--chunk_size", type=int, default=None,
                   help="label tokens per chunk of the chunked loss (default: finetune.tasks.chunked_loss's own)")
    p.add_argument("--num_threads", type=int, default=None,
                   help="OMP_NUM_THREADS of the workers (default: torch's own choice; smoke 1)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per worker before it is killed (default 3600; smoke 300)")
    p.add_argument("--start", choices=("auto", "subprocess", "forkserver"), default="auto",
                   help="how each fresh worker process starts: a new Python interpreter (subprocess), or forked from "
                        "a server that has only imported torch, transformers, peft and finetune, no model and no "
                        "tensor (forkserver: ~5 s less per run; its max RSS starts from that import baseline, less the "
                        "library pages the worker never touches). auto: forkserver with --smoke, else subprocess")
    p.add_argument("--configs", default=None,
                   help="comma-separated configuration names to run (as the tables name them, e.g. '2x4,checkpointing'); "
                        "default all of the chosen suites")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry_run", action="store_true", help="print each configuration's worker spec and exit")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where tiny models and the de-quantized SmolLM2 go (default: a temporary directory, removed)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the report as Markdown to this file")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one measurement, a JSON spec
    p.add_argument("--convert_gguf", nargs=2, default=None, help=argparse.SUPPRESS)  # internal: SRC DEST
    args = p.parse_args(argv)
    if args.worker or args.convert_gguf:
        return args
    args.suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown or not args.suites:
        p.error(f"--suite: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SUITES)}")
    for name in ("repeats", "steps", "micro_batch", "accumulation", "max_length", "lora_r", "chunk_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be >= 1")
    if args.max_length is None and args.smoke:
        args.max_length = 32
    if args.max_length is not None and args.max_length < 2:
        p.error("--max_length must be >= 2 (a causal LM needs a next token)")
    if args.num_threads is None and args.smoke:
        args.num_threads = 1
    if args.timeout is None:
        args.timeout = 300 if args.smoke else 3600
    if args.start == "auto":
        args.start = "forkserver" if args.smoke else "subprocess"
    return args


def suite_setting(args, suite: str, name: str):
    """A suite's setting: the flag if given, else the smoke value, else ``SUITE_DEFAULTS``."""
    given = getattr(args, name)
    if given is not None:
        return given
    if args.smoke and name in ("repeats", "steps"):
        return {"repeats": 1, "steps": 2}[name]
    return SUITE_DEFAULTS[suite][name]


def build_configs(args, models: dict) -> tuple[list[dict], list[str]]:
    """The configurations of the chosen suites (each a dict: ``label``, ``suite``, ``repeats``, ``spec``, the
    worker's spec) and notes on rows left out (the chunked loss where ``finetune.tasks.chunked_loss`` is missing, a
    suite whose model is missing)."""
    configs, notes = [], []
    chunked = chunked_loss_api()
    chunk_size = args.chunk_size or (chunked[2] if chunked else DEFAULT_CHUNK_SIZE)

    def add(suite, label, task, micro, accumulation, checkpointing=False, lora=False, use_chunked=False):
        spec = {"task": task, "model": models[task], "max_length": suite_setting(args, suite, "max_length"),
                "micro_batch": micro, "accumulation": accumulation, "checkpointing": checkpointing, "lora": lora,
                "lora_r": args.lora_r, "lora_alpha": args.lora_alpha, "lora_dropout": args.lora_dropout,
                "chunked": use_chunked, "chunk_size": chunk_size, "steps": suite_setting(args, suite, "steps"),
                "seed": args.seed}
        configs.append({"label": f"{suite}: {label}", "suite": suite, "name": label,
                        "repeats": suite_setting(args, suite, "repeats"), "spec": spec})

    for suite in args.suites:
        task = "cls" if suite == "bbc" else "clm"
        if models.get(task) is None:
            notes.append(f"{suite} skipped: {models.get(task + '_missing')}")
            continue
        if suite == "bbc":
            add(suite, "32x1", task, 32, 1)
            add(suite, "8x4", task, 8, 4)
            add(suite, "8x4 + checkpointing", task, 8, 4, checkpointing=True)
            add(suite, "32x1 + checkpointing", task, 32, 1, checkpointing=True)
            continue
        micro = suite_setting(args, suite, "micro_batch")
        if suite == "smollm2":
            add(suite, "plain", task, micro, args.accumulation)
            if micro % 4 == 0:  # the same effective batch at a quarter of the micro-batch: what checkpointing competes with
                add(suite, f"{micro // 4}x{4 * args.accumulation}", task, micro // 4, 4 * args.accumulation)
            if chunked is not None:
                add(suite, "chunked loss", task, micro, args.accumulation, use_chunked=True)
            else:
                notes.append("smollm2: the chunked-loss row is skipped: finetune.tasks.chunked_loss (with "
                             "chunked_causal_lm_loss_sum) does not exist in this checkout")
            add(suite, "checkpointing", task, micro, args.accumulation, checkpointing=True)
            add(suite, "LoRA", task, micro, args.accumulation, lora=True)
            add(suite, "LoRA + checkpointing", task, micro, args.accumulation, checkpointing=True, lora=True)
            if chunked is not None:  # the levers stacked, as a memory-bound user would stack them
                add(suite, "chunked loss + checkpointing", task, micro, args.accumulation, checkpointing=True,
                    use_chunked=True)
                add(suite, "chunked loss + checkpointing + LoRA", task, micro, args.accumulation, checkpointing=True,
                    lora=True, use_chunked=True)
        else:  # lora
            add(suite, "full", task, micro, args.accumulation)
            add(suite, "LoRA", task, micro, args.accumulation, lora=True)
    if args.configs:
        wanted = {name.strip() for name in args.configs.split(",") if name.strip()}
        unknown = wanted - {c["name"] for c in configs}
        if unknown:
            raise SystemExit(f"error: --configs: unknown {', '.join(sorted(unknown))}; the chosen suites have "
                             f"{', '.join(c['name'] for c in configs)}")
        configs = [c for c in configs if c["name"] in wanted]
    return configs, notes


def prepare_models(args, workdir: Path) -> dict:
    """Model paths per task (``cls``, ``clm``): the smoke tiny models, the flags', or the defaults (a ``.gguf``
    is de-quantized once into ``workdir`` by a subprocess). A missing model is None, with ``<task>_missing``
    saying why."""
    from finetune.models.fetch import FETCH_COMMAND, smollm2_gguf_path

    models: dict = {}
    needs_cls = "bbc" in args.suites
    needs_clm = any(s in args.suites for s in ("smollm2", "lora"))
    if args.smoke:
        if needs_cls:
            models["cls"] = args.bbc_model or str(bl.build_tiny_bert(workdir / "tiny-bert"))
        if needs_clm:
            models["clm"] = args.clm_model or str(bl.build_tiny_llama(workdir / "tiny-llama"))
        return models
    if needs_cls:
        from finetune.recipes.bbc_news import default_model_path

        models["cls"] = args.bbc_model or default_model_path()
    if needs_clm:
        clm = args.clm_model or str(smollm2_gguf_path())
        if not Path(clm).exists():
            models["clm"] = None
            models["clm_missing"] = f"its model {clm} is missing (fetch it with `{FETCH_COMMAND}`)"
        elif clm.endswith(".gguf") and not args.dry_run:
            dest = workdir / (Path(clm).stem + "-fp32")
            if not (dest / "config.json").is_file():
                print(f"[prepare] de-quantizing {clm} into {dest} (once) ...", end="", file=sys.stderr, flush=True)
                result = subprocess.run([sys.executable, str(SCRIPT), "--convert_gguf", clm, str(dest)],
                                        capture_output=True, text=True, env=bl.child_env(args.num_threads),
                                        cwd=bl.REPO, timeout=args.timeout)
                if result.returncode != 0:
                    raise bl.BenchError(f"de-quantizing {clm} failed:\n{result.stderr[-3000:]}")
                print(" done", file=sys.stderr, flush=True)
            models["clm"] = str(dest)
            models["clm_source"] = clm
        else:
            models["clm"] = clm
    return models


def run_one(config: dict, args, log_path: Path) -> dict:
    """One fresh worker process for ``config`` (``--start``: forked from the fork server, or a new interpreter);
    returns its result dict, or ``{"error": ...}`` when it failed (e.g. killed for lack of memory), with the
    worker's wall time (seconds) as ``wall_seconds``. The worker's output goes to ``log_path``."""
    start = time.perf_counter()
    if args.start == "forkserver":
        status, payload = _run_forked(config["spec"], args.num_threads, args.timeout, log_path)
    else:
        status, payload = _run_subprocess(config["spec"], args, log_path)
    wall = time.perf_counter() - start
    if status != "ok":
        tail = "\n".join(Path(log_path).read_text(errors="replace").strip().splitlines()[-15:]) \
            if Path(log_path).is_file() else ""
        return {"error": f"{payload}\n{tail}", "wall_seconds": wall,
                "log": str(log_path) if args.workdir else None}  # a temporary work directory is removed
    return {**payload, "wall_seconds": wall}


def _run_subprocess(spec: dict, args, log_path: Path) -> tuple[str, object]:
    argv = [sys.executable, str(SCRIPT), "--worker", json.dumps(spec)]
    with open(log_path, "w") as log:
        try:
            result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=bl.child_env(args.num_threads),
                                    cwd=bl.REPO, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return "error", f"timed out after {args.timeout:.0f} s"
        log.write(result.stdout)
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if result.returncode != 0 or not lines:
        return "error", _exit_text(result.returncode)
    return "ok", json.loads(lines[-1][len(RESULT_PREFIX):])


def _exit_text(code) -> str:
    killed = code is not None and code in (-9, 137)
    return f"exit {code}" + (" (killed: likely out of memory)" if killed else "")


# Imported once by the fork server, so each forked worker starts with them loaded (and no model, no tensor).
FORKSERVER_PRELOAD = ["torch", "psutil", "transformers", "peft", "finetune.data.loading", "finetune.tasks", "finetune.models.lora",
                      "finetune.tasks.builders", "finetune.planner"]
_CONTEXT = None


def _forkserver_context(num_threads: int | None):
    """The ``multiprocessing`` fork-server context, its server started with the workers' environment
    (``benchlib.child_env``: offline hub, ``OMP_NUM_THREADS``) and ``FORKSERVER_PRELOAD`` imported."""
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing

        os.environ.update(bl.child_env(num_threads))  # inherited by the fork server when it starts
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(FORKSERVER_PRELOAD)
    return _CONTEXT


def _forked_worker(spec: dict, log_path: str, conn) -> None:
    """The body of a forked worker: output to ``log_path``, ``run_worker(spec)``, the result (or the traceback)
    sent on ``conn``."""
    import traceback

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(fd, 1), os.dup2(fd, 2)
    try:
        conn.send(("ok", run_worker(spec)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        traceback.print_exc()
        conn.send(("error", traceback.format_exc().strip().splitlines()[-1]))
    finally:
        conn.close()
        sys.stdout.flush(), sys.stderr.flush()


def _run_forked(spec: dict, num_threads: int | None, timeout: float, log_path: Path) -> tuple[str, object]:
    ctx = _forkserver_context(num_threads)
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_forked_worker, args=(spec, str(log_path), send), daemon=True)
    process.start()
    send.close()
    message = None
    if receive.poll(timeout):
        try:
            message = receive.recv()
        except EOFError:
            pass
    process.join(timeout=30 if message else 1)
    if process.is_alive():
        process.kill()
        process.join()
        if message is None:
            return "error", f"timed out after {timeout:.0f} s"
    if message is None:
        return "error", _exit_text(process.exitcode)
    return message


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)


def run_interleaved(configs: list[dict], args) -> None:
    """Round r runs, in order, every configuration with at least r repeats, each in a fresh worker process;
    its result is appended to ``config["runs"]`` (failures to ``config["errors"]``). Progress on stderr."""
    rounds = max(c["repeats"] for c in configs)
    total = sum(c["repeats"] for c in configs)
    done = 0
    for r in range(rounds):
        for config in configs:
            if r >= config["repeats"]:
                continue
            done += 1
            print(f"[{done}/{total}] {config['label']} (repeat {r + 1}/{config['repeats']}) ...", end="",
                  file=sys.stderr, flush=True)
            log_path = args.log_dir / f"{_slug(config['label'])}-r{r + 1}.log"
            result = run_one(config, args, log_path)
            result["repeat"] = r + 1
            if "error" in result:
                config.setdefault("errors", []).append(result)
                print(f" FAILED: {result['error'].splitlines()[0]}", file=sys.stderr, flush=True)
                continue
            config.setdefault("runs", []).append(result)
            print(f" {result['seconds_per_sample']:.4g} s/sample, peak RSS {result['peak_rss_bytes'] / bl.MIB:.0f} MiB, "
                  f"training memory {result['training_memory_bytes'] / bl.MIB:.0f} MiB", file=sys.stderr, flush=True)


MEDIAN_KEYS = ("trainable_parameters", "total_parameters", "saved_tensor_bytes", "saved_parameter_bytes",
               "gradient_bytes", "adamw_state_bytes", "training_memory_bytes", "gradient_bytes_measured",
               "adamw_state_bytes_measured", "weight_bytes", "rss_after_load_bytes", "max_rss_before_training_bytes",
               "peak_rss_bytes", "seconds_per_sample", "torch_threads")


def summarize(configs: list[dict], notes: list[str]) -> dict:
    """Per configuration, the medians of its runs (bytes, seconds per sample), plus ``activation_bytes``
    (saved for backward less the weights among them) and ``peak_rss_above_loaded_bytes``; per suite, the
    ratios: bbc against 32x1, smollm2 against plain, lora LoRA / full (training memory, goal <= 0.6)."""
    out: dict = {"configs": {}, "suites": {}, "notes": list(notes), "failed": []}
    for c in configs:
        runs = c.get("runs", [])
        med = {k: (statistics.median([r[k] for r in runs if r.get(k) is not None])
                   if any(r.get(k) is not None for r in runs) else None) for k in MEDIAN_KEYS}
        if med["saved_tensor_bytes"] is not None and med["saved_parameter_bytes"] is not None:
            med["activation_bytes"] = med["saved_tensor_bytes"] - med["saved_parameter_bytes"]
        if med["peak_rss_bytes"] is not None and med["rss_after_load_bytes"] is not None:
            med["peak_rss_above_loaded_bytes"] = med["peak_rss_bytes"] - med["rss_after_load_bytes"]
        deterministic = len({r["saved_tensor_bytes"] for r in runs}) <= 1
        out["configs"][c["label"]] = {
            "suite": c["suite"], "name": c["name"], "spec": c["spec"],
            "micro_batch": c["spec"]["micro_batch"], "accumulation": c["spec"]["accumulation"],
            "runs": runs, "errors": [e["error"] for e in c.get("errors", [])], "median": med,
            "saved_bytes_same_every_run": deterministic,
        }
        if c.get("errors"):
            out["failed"].append(c["label"])
    for suite in SUITES:
        rows = {c["name"]: out["configs"][c["label"]]["median"] for c in configs if c["suite"] == suite}
        if not rows:
            continue
        base_name = {"bbc": "32x1", "smollm2": "plain", "lora": "full"}[suite]
        base = rows.get(base_name, {})
        ratios = {}
        for name, med in rows.items():
            ratios[name] = {
                "training_memory_ratio": bl.ratio(med.get("training_memory_bytes"), base.get("training_memory_bytes")),
                "saved_tensor_bytes_ratio": bl.ratio(med.get("saved_tensor_bytes"), base.get("saved_tensor_bytes")),
                "peak_rss_ratio": bl.ratio(med.get("peak_rss_bytes"), base.get("peak_rss_bytes")),
                "peak_rss_difference_bytes": (None if med.get("peak_rss_bytes") is None or base.get("peak_rss_bytes") is None
                                              else med["peak_rss_bytes"] - base["peak_rss_bytes"]),
                "time_per_sample_ratio": bl.ratio(med.get("seconds_per_sample"), base.get("seconds_per_sample")),
            }
        summary = {"baseline": base_name, "ratios_over_baseline": ratios}
        if suite == "lora":
            lora = rows.get("LoRA", {})
            r = bl.ratio(lora.get("training_memory_bytes"), base.get("training_memory_bytes"))
            without_weights = bl.ratio(_sum_or_none(lora, "activation_bytes", "gradient_bytes", "adamw_state_bytes"),
                                       _sum_or_none(base, "activation_bytes", "gradient_bytes", "adamw_state_bytes"))
            summary.update({
                "training_memory_ratio_lora_over_full": r, "goal": LORA_RATIO_GOAL,
                "goal_met": None if r is None else r <= LORA_RATIO_GOAL,
                "training_memory_ratio_lora_over_full_without_saved_weights": without_weights,
                "peak_rss_ratio_lora_over_full": bl.ratio(lora.get("peak_rss_bytes"), base.get("peak_rss_bytes")),
                "time_per_sample_ratio_lora_over_full": bl.ratio(lora.get("seconds_per_sample"),
                                                                 base.get("seconds_per_sample")),
                "trainable_parameters": {"full": base.get("trainable_parameters"),
                                         "LoRA": lora.get("trainable_parameters")},
            })
        out["suites"][suite] = summary
    return out


def _sum_or_none(row: dict, *keys):
    values = [row.get(k) for k in keys]
    return None if any(v is None for v in values) else sum(values)


def _mib(value) -> str:
    return bl.fmt(None if value is None else value / bl.MIB, ".1f")


SUITE_TITLES = {
    "bbc": "bbc: all-MiniLM-L6-v2 classifier (5 labels)",
    "smollm2": "smollm2: SmolLM2-135M-Instruct, causal LM",
    "lora": "lora: full fine-tune vs LoRA, SmolLM2-135M-Instruct",
}


def render(args, info: dict, configs: list[dict], results: dict, models: dict) -> str:
    """The Markdown report: machine (CPU from lscpu, torch, threads), one table per suite, its ratios, notes."""
    threads = sorted({r["torch_threads"] for c in configs for r in c.get("runs", [])})
    smoke = " (SMOKE: tiny models, numbers mean nothing)" if args.smoke else ""
    lines = [f"# Memory levers{smoke}", "",
             f"- Machine: {info['cpu_lscpu'] or info['cpu']} (CPU model, lscpu), {info['cpu_cores']} logical cores "
             f"({info['cpu_cores_usable']} usable)",
             f"- GPU: {info['gpu']} x {info['gpu_count']} (not used: CPU run)" if info["gpu"] else "- GPU: none (CPU run)",
             f"- torch {info['torch']}, Python {info['python']}, {info['platform']}",
             f"- Worker threads (torch.get_num_threads): {', '.join(map(str, threads)) or 'n/a'}"
             + (f" (OMP_NUM_THREADS={args.num_threads})" if args.num_threads else " (torch's default)")]
    load = info.get("load_average_1min")
    if load is not None:
        busy = load > 0.5 * (info["cpu_cores_usable"] or 1)
        lines.append(f"- Load average at start: {load}" + (" -- the machine was busy: timings are noisy (byte "
                                                            "accounting is exact)" if busy else ""))
    how = ("a new Python interpreter" if args.start == "subprocess" else
           "forked from a server that had only imported the libraries")
    lines += ["", f"Each configuration runs in its own fresh process ({how}): random token ids of exactly max_length "
              "tokens, fp32, AdamW (torch), 1 warm-up optimizer step then the timed ones; repeats interleaved, "
              "medians reported."]
    if models.get("clm_source"):
        lines.append(f"Causal LM: {models['clm_source']}, de-quantized to fp32 once for this run.")
    for suite in SUITES:
        rows_cfg = [c for c in configs if c["suite"] == suite]
        if not rows_cfg:
            continue
        spec0 = rows_cfg[0]["spec"]
        model = models.get("cls" if suite == "bbc" else "clm")
        lines += ["", f"## {SUITE_TITLES[suite]}", "",
                  f"Model {model}; {spec0['max_length']} tokens per sample; {spec0['steps']} timed optimizer step(s); "
                  f"{rows_cfg[0]['repeats']} repeat(s)" + (f"; LoRA r={args.lora_r}, alpha={args.lora_alpha}, "
                                                            f"dropout {args.lora_dropout}, peft's default targets"
                                                            if any(c['spec']['lora'] for c in rows_cfg) else "")
                  + (f"; chunked loss {spec0['chunk_size']} label tokens per chunk"
                     if any(c['spec']['chunked'] for c in rows_cfg) else "") + ".", ""]
        table = []
        ratios = results["suites"][suite]["ratios_over_baseline"]
        for c in rows_cfg:
            r = results["configs"][c["label"]]
            med = r["median"]
            if not r["runs"]:
                table.append([c["name"], f"{c['spec']['micro_batch']}x{c['spec']['accumulation']}",
                              "FAILED: " + r["errors"][0].splitlines()[0]] + ["n/a"] * 10)
                continue
            ratio = ratios[c["name"]]
            table.append([
                c["name"], f"{c['spec']['micro_batch']}x{c['spec']['accumulation']}",
                f"{int(med['trainable_parameters']):,}", _mib(med["saved_tensor_bytes"]), _mib(med["saved_parameter_bytes"]),
                _mib(med["gradient_bytes"]), _mib(med["adamw_state_bytes"]), _mib(med["training_memory_bytes"]),
                bl.fmt(ratio["training_memory_ratio"], ".3f"), _mib(med["peak_rss_bytes"]),
                _mib(med.get("peak_rss_above_loaded_bytes")), bl.fmt(med["seconds_per_sample"], ".4g"),
                bl.fmt(ratio["time_per_sample_ratio"], ".3f")])
        base = results["suites"][suite]["baseline"]
        lines.append(bl.markdown_table(
            ["config", "micro-batch x accumulation", "trainable params", "saved for backward MiB",
             "of which weights MiB", "gradients MiB", "AdamW state MiB", "training memory MiB",
             f"training memory / {base}", "peak RSS MiB", "peak RSS above loaded model MiB", "time per sample s",
             f"time / {base}"], table))
        if suite == "lora":
            s = results["suites"]["lora"]
            lines += ["", bl.markdown_table(["figure", "value"], [
                ["training memory ratio LoRA / full", bl.fmt(s["training_memory_ratio_lora_over_full"], ".3f")],
                [f"goal <= {LORA_RATIO_GOAL}", bl.goal_text(s["training_memory_ratio_lora_over_full"], "<=",
                                                            LORA_RATIO_GOAL)],
                ["training memory ratio LoRA / full, weights saved for backward left out",
                 bl.fmt(s["training_memory_ratio_lora_over_full_without_saved_weights"], ".3f")],
                ["peak RSS ratio LoRA / full", bl.fmt(s["peak_rss_ratio_lora_over_full"], ".3f")],
                ["peak RSS difference LoRA - full MiB", _mib(ratios.get("LoRA", {}).get("peak_rss_difference_bytes"))],
                ["time per sample ratio LoRA / full", bl.fmt(s["time_per_sample_ratio_lora_over_full"], ".3f")],
                ["trainable parameters full / LoRA",
                 f"{s['trainable_parameters']['full'] or 0:,} / {s['trainable_parameters']['LoRA'] or 0:,}"],
            ])]
    lines += ["", "Notes:",
              "- Training memory = saved for backward (one micro-batch's forward, `finetune.planner.probes.saved_tensor_bytes`, "
              "the planner's measurement) + gradients (trainable parameters x 4 bytes) + AdamW state (trainable x 8 bytes); "
              "`planner.probes.Probe` counts these activations less the weights among them, plus all the weights. \"Of which weights\": the parameter storages among the saved tensors "
              "(weights a linear layer keeps to compute its input's gradient; the model holds them anyway, frozen or not).",
              "- Under activation checkpointing, saved for backward counts what the forward keeps (each checkpointed "
              "layer's inputs and everything outside the layers), not the one layer recomputed at a time in backward.",
              "- Peak RSS: the worker's max RSS (getrusage ru_maxrss), with the Python/torch baseline and the model; "
              "\"above loaded model\" subtracts the RSS once the model was built. Compare differences in MiB rather "
              "than ratios.",
              "- Time per sample: seconds per sample over the timed optimizer steps (forward + backward of each "
              "micro-batch, one AdamW step), after one warm-up step."]
    lines += [f"- {note}" for note in results["notes"]]
    if results["failed"]:
        lines.append(f"- FAILED configurations: {', '.join(results['failed'])} (see the JSON for their output)")
    return "\n".join(lines)


def print_configs(configs: list[dict], notes: list[str]) -> None:
    """``--dry_run``: each configuration's worker spec, and the notes."""
    for c in configs:
        print(f"{c['label']} (x{c['repeats']}): {json.dumps(c['spec'])}")
    for note in notes:
        print(f"note: {note}")


def main(argv=None) -> int:
    """Run the benchmark (or, internally, one worker); print the report. Exit 0, or 1 if a configuration failed."""
    args = parse_args(argv)
    if args.worker:
        print(RESULT_PREFIX + json.dumps(run_worker(json.loads(args.worker))), flush=True)
        return 0
    if args.convert_gguf:
        convert_gguf(*args.convert_gguf)
        return 0
    info = {**bl.machine_info(), "cpu_lscpu": lscpu_model_name()}
    with bl.Workdir(args.workdir) as workdir:
        models = prepare_models(args, workdir)
        configs, notes = build_configs(args, models)
        if args.dry_run:
            print_configs(configs, notes)
            return 0
        if not configs:
            raise bl.BenchError("no configuration to run: " + "; ".join(notes))
        args.log_dir = workdir / "logs"
        args.log_dir.mkdir(parents=True, exist_ok=True)
        run_interleaved(configs, args)
    results = summarize(configs, notes)
    settings = {k: (str(v) if hasattr(v, "__fspath__") else v) for k, v in vars(args).items()}
    record = {"benchmark": "memory", "mode": "smoke" if args.smoke else "full", "machine": info, "settings": settings,
              "models": models, "results": results}
    bl.emit(render(args, info, configs, results, models), record, args)
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(bl.main_guard(main))
