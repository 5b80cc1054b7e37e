"""GRPO's generation side: the reward functions (``--reward_funcs``, TRL's signature), each prompt's group of
completions sampled by the policy itself under a seed of (seed, step, prompt) (so a resume, another split or another
process count samples the same completions), their record (``<output_dir>/completions.jsonl``, ``RECORD``) and its
replay (``--replay_completions``)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig

from finetune import distributed
from finetune.errors import FinetuneError

RECORD = "completions.jsonl"  # one JSON object per completion: step, prompt, generation, completion_ids, rewards


def load_function(spec: str):
    """The callable ``module:function`` names (a module on the path, or a ``.py`` file). Raises ``FinetuneError``
    for a missing module or function."""
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise FinetuneError(f"--reward_funcs {spec!r}: write each as module:function (or path/to/file.py:function).")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or not path.is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(loader)
            sys.modules.setdefault(path.stem, module)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise FinetuneError(f"--reward_funcs {spec!r}: cannot import {module_name} ({err}).") from None
    func = getattr(module, function, None)
    if not callable(func):
        raise FinetuneError(f"--reward_funcs {spec!r}: {module_name} has no function {function!r}.")
    return func


def reward_functions(specs: list[str]) -> list[tuple[str, object]]:
    """[(name, function)] of ``--reward_funcs`` entries; a function's name is its ``__name__`` (TRL's
    ``reward_func_names``). Raises ``FinetuneError`` for none, or one that cannot be loaded."""
    if not specs:
        raise FinetuneError("GRPO needs at least one reward function: pass --reward_funcs module:function (TRL's "
                            "signature: f(prompts, completions, completion_ids, **columns) -> list of float or None).")
    return [(getattr(f, "__name__", spec), f) for spec, f in ((s, load_function(s)) for s in specs)]


def call_rewards(functions, prompts: list, completions: list, completion_ids: list[list[int]],
                 columns: dict[str, list]) -> torch.Tensor:
    """(completions, functions) float32 rewards, NaN where a function gave None (TRL 1.16 ``_calculate_rewards``:
    ``reward_func(prompts=, completions=, completion_ids=, **columns)``). Raises ``FinetuneError`` for a function
    that returns another number of rewards."""
    out = torch.zeros(len(prompts), len(functions), dtype=torch.float32)
    for j, (name, func) in enumerate(functions):
        values = list(func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns))
        if len(values) != len(prompts):
            raise FinetuneError(f"reward function {name!r} returned {len(values)} rewards for {len(prompts)} "
                                "completions: return one per completion (None for no reward).")
        out[:, j] = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
    return out


def group_seed(seed: int, step: int, prompt: int) -> int:
    """The sampling seed of one prompt's group at one optimizer step: 63 bits of blake2b over (seed, step, prompt)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def cut_at_stop(row: list[int], stop_ids: list[int]) -> list[int]:
    """A generated row up to and including its first stop token (the padding after it dropped)."""
    stop = next((i for i, t in enumerate(row) if t in stop_ids), None)
    return row if stop is None else row[:stop + 1]


def generate_group(model, prompt_ids: list[int], count: int, settings: dict, stop_ids: list[int], pad_id: int,
                   seed: int) -> list[list[int]]:
    """``count`` completions of one prompt sampled by ``model`` (unwrapped) in eval mode without gradients, under
    ``seed`` (the global generators are left as they were): ``settings`` holds ``max_new_tokens``, ``temperature``,
    ``top_p``. Each completion runs to its first stop token, included."""
    config = GenerationConfig(do_sample=True, top_k=0, eos_token_id=stop_ids, pad_token_id=pad_id, **settings)
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids] * count, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(seed)
            output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    generation_config=config)
    finally:
        model.train(was_training)
    return [cut_at_stop(row, stop_ids) for row in output[:, len(prompt_ids):].tolist()]


def read_replay(path: str) -> dict[tuple[int, int], dict[int, list[int]]]:
    """{(step, prompt): {generation: completion ids}} of a ``completions.jsonl``. Raises ``FinetuneError`` for a
    missing or malformed file."""
    table: dict = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise FinetuneError(f"--replay_completions {path}: cannot read it ({err}).") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            ids = [int(t) for t in r["completion_ids"]]
            table.setdefault((int(r["step"]), int(r["prompt"])), {})[int(r["generation"])] = ids
        except (ValueError, KeyError, TypeError) as err:
            raise FinetuneError(f"--replay_completions {path} line {number}: not a completion record "
                                f"(step, prompt, generation, completion_ids): {err}.") from None
    return table


def replayed_group(table: dict, path: str, step: int, prompt: int, count: int) -> list[list[int]]:
    """The ``count`` recorded completions of ``prompt`` at ``step``. Raises ``FinetuneError`` where any is missing."""
    group = table.get((step, prompt), {})
    missing = [g for g in range(count) if g not in group]
    if missing:
        raise FinetuneError(f"--replay_completions {path} has no completion {missing[0]} of prompt {prompt} at step "
                            f"{step}: replay a record of the same data, seed and --num_generations (or drop the "
                            "flag to generate).")
    return [group[g] for g in range(count)]


def replayed_repeat(table: dict, step: int, prompt: int, count: int, stop_id: int) -> list[list[int]]:
    """The ``count`` completions of an epoch's repeated row (several processes: the last window completed with rows
    from the epoch's start, masked) in a replay: the recorded ones where the record has them, else each a lone stop
    token. They train nothing, and a run's record holds only the completions it trained, so a replay of a
    several-process run's own record has none for them."""
    group = table.get((step, prompt), {})
    return [group.get(g, [stop_id]) for g in range(count)]


def all_processes(value) -> list:
    """``value`` of every process, in process order (one ``all_gather_object``; [value] on one process)."""
    if distributed.world_size() <= 1:
        return [value]
    out = [None] * distributed.world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def keep_records(output_dir, records: list[dict], first_step: bool, step: int) -> None:
    """Append ``records`` to ``<output_dir>/completions.jsonl`` (the main process's call); at a run's first step
    (``first_step``) the records of this step and later, left by a run stopped after its checkpoint, are dropped
    first, so a resumed run's file holds each step once."""
    path = Path(output_dir) / RECORD
    if first_step and path.is_file():
        kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line)["step"] < step]
        path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    with path.open("a", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)


GENERATION = "grpo_generation"  # --num_iterations > 1: each process's current generation, for a resume inside it


def keep_generation(output_dir, step: int, batches: list[dict], figures: dict) -> None:
    """Write this process's generation of ``step`` (its completion micro-batches, old log-probabilities included,
    and the window's figures) to ``<output_dir>/grpo_generation/process-<rank>.pt`` atomically, replacing the
    previous one."""
    folder = Path(output_dir) / GENERATION
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"process-{distributed.rank()}.pt"
    tmp = path.with_name(f".tmp-{path.name}")
    torch.save({"step": step, "batches": [{k: v.cpu() for k, v in b.items()} for b in batches],
                "figures": figures}, tmp)
    tmp.replace(path)


def read_generation(output_dir, step: int) -> tuple[int, list[dict], dict]:
    """(step, batches, figures) of the generation ``keep_generation`` kept for ``step``. Raises ``FinetuneError``
    where it holds another step or none (a checkpoint older than the last generation)."""
    path = Path(output_dir) / GENERATION / f"process-{distributed.rank()}.pt"
    kept = torch.load(path, weights_only=True) if path.is_file() else None
    if kept is None or kept["step"] != step:
        raise FinetuneError(f"{path} does not hold the generation of step {step} that this resume continues "
                            f"(--num_iterations trains each generation several steps): resume from the newest "
                            "checkpoint, or one at the start of a generation.")
    return kept["step"], kept["batches"], kept["figures"]
