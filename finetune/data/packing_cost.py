"""What a packed micro-batch costs on this device, measured: the seconds of a training forward and backward as
``per_micro_batch + per_position x positions + per_score x sum over rows of row_length^2`` (the last term: the
attention's scores, which SDPA and eager attention compute over a whole row, its block-diagonal mask only zeroing
them), fitted to timed probes of the run's own model and loss. ``--packing`` asks it, per window, which layout is
fastest: the packed rows, one padding-free row per micro-batch, or the padded window (``packing.choose_layout``;
docs/packing.md#the-layout-per-window).

The fitted cost is kept in ``<output_dir>/packing_cost.json`` and read back by a resumed run that finds it there for
the same model shape, row length, budget, precision and attention, so it chooses every window's layout as the run it
continues did; a fresh run measures anew."""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from finetune.data.loading import IGNORE_INDEX

FILE = "packing_cost.json"
FORMAT = 1
PROBE_SECONDS = 3.0  # what the probes may cost together, about (one pass each; short ones are repeated once)
MIN_PROBE_TOKENS = 8  # the shortest row a shortened probe uses (probe_length)


@dataclass(frozen=True)
class LayoutCost:
    """A micro-batch's predicted seconds (forward and backward): ``per_micro_batch`` (seconds) + ``per_position``
    (seconds per computed position, padding included) x positions + ``per_score`` (seconds per attention score) x
    the sum of each row's length squared. ``probes``: the measurements it was fitted to, (rows, tokens per row,
    samples per row, seconds) each; ``key``: what it was measured for (``cost_key``)."""

    per_micro_batch: float
    per_position: float
    per_score: float
    probes: tuple = ()
    key: str = ""

    def seconds(self, row_lengths: list[int]) -> float:
        """Predicted seconds of one micro-batch of rows with these ``row_lengths`` (tokens), each right-padded to the
        longest (``packing.pack_rows``), so every row computes that many positions and its square in scores."""
        if not row_lengths:
            return self.per_micro_batch
        width = max(row_lengths)
        return (self.per_micro_batch + self.per_position * width * len(row_lengths)
                + self.per_score * width * width * len(row_lengths))

    def describe(self) -> str:
        """One line for the banner: the three coefficients, each in the unit that reads best (s, ms, us, ns)."""
        return (f"{_duration(self.per_micro_batch)} per micro-batch + {_duration(self.per_position)} per position + "
                f"{_duration(self.per_score)} per attention score")


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def cost_key(model, row_length: int, budget: int, precision: str) -> str:
    """What a measured cost holds for: the model's class and shape (layers, width, vocabulary), the attention
    implementation, the row length and budget (tokens), the precision that runs and the device type."""
    config = getattr(model, "config", None)
    shape = [getattr(config, name, None) for name in ("num_hidden_layers", "hidden_size", "vocab_size")]
    attention = getattr(config, "_attn_implementation", None)
    device = next(model.parameters()).device.type
    return (f"{type(model).__name__}{shape} attn={attention} rows<={row_length} budget={budget} "
            f"precision={precision} device={device}")


def probe_shapes(row_length: int, budget: int) -> list[tuple[int, int, int]]:
    """The probes, (rows, samples per row, tokens per sample): a full row and a half row alone, two full rows in
    one micro-batch and the same two samples flattened into one row, two half rows: positions and scores vary apart,
    in 6.5 rows' worth of positions whatever the budget (the scores' cost is per score, so rows of two samples
    measure it; ``budget`` is kept in the key, not probed)."""
    half = max(1, row_length // 2)
    return [(1, 1, half), (1, 1, row_length), (2, 1, row_length), (1, 2, row_length), (2, 1, half)]


def probe_length(row_length: int, budget: int, first_seconds: float, seconds: float | None = None) -> int:
    """The row length (tokens) the probes use: ``row_length``, or shorter where their passes, predicted from the
    first probe's ``first_seconds`` (its warm-up: ``probe_shapes``' first shape) in proportion to positions, would
    take more than ``seconds`` (default ``PROBE_SECONDS``; an emulated bf16 matmul is hundreds of times slower than fp32's): shortened in
    proportion (the attention scores' share shrinks faster, so the prediction errs long), at least
    ``MIN_PROBE_TOKENS``. The coefficients fitted at the shorter rows are per position and per score, so they hold
    for the run's rows as well."""
    seconds = PROBE_SECONDS if seconds is None else seconds
    shapes = probe_shapes(row_length, budget)
    positions = [rows * per_row * tokens for rows, per_row, tokens in shapes]
    predicted = first_seconds * sum(positions) / positions[0]
    if predicted <= seconds:
        return row_length
    return max(MIN_PROBE_TOKENS, min(row_length, int(row_length * seconds / predicted)))


def _inputs(rows: int, per_row: int, tokens: int, vocab: int, device, generator) -> dict:
    width = per_row * tokens
    ids = torch.randint(1, max(vocab, 2), (rows, width), generator=generator).to(device)
    positions = torch.arange(tokens, device=device).repeat(per_row).expand(rows, width).contiguous()
    labels = ids.clone()
    labels[:, ::tokens] = IGNORE_INDEX  # each sample's first label, as packing.flatten masks it
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "use_cache": False}


def _fit(features: list[tuple[float, float, float]], seconds: list[float]) -> tuple[float, float, float]:
    """Least squares with every coefficient >= 0: the best of the fits over each subset of the three terms (the
    others held at 0) whose coefficients all come out non-negative."""
    a = torch.tensor(features, dtype=torch.float64)
    b = torch.tensor(seconds, dtype=torch.float64).unsqueeze(1)
    best, best_error = (float(min(seconds)), 0.0, 0.0), float("inf")
    for size in (1, 2, 3):
        for terms in itertools.combinations(range(3), size):
            solution = torch.linalg.lstsq(a[:, terms], b).solution.squeeze(1)
            if (solution < 0).any():
                continue
            error = float(((a[:, terms] @ solution.unsqueeze(1)) - b).square().sum())
            if error < best_error:
                coefficients = [0.0, 0.0, 0.0]
                for term, value in zip(terms, solution.tolist()):
                    coefficients[term] = value
                best, best_error = tuple(coefficients), error
    return best


def measure(model, loss_sum, row_length: int, budget: int, precision: str = "no", repeats: int = 2,
            quick: float = 0.5) -> LayoutCost:
    """Time a training forward and backward (``loss_sum(model, batch)`` then ``backward``) of ``model`` on each of
    ``probe_shapes`` (random token ids, packed positions, under the autocast of ``precision``: "no", "fp16",
    "bf16") after one warm-up pass: the fastest of ``repeats`` timings where one takes under ``quick`` seconds, else
    one timing (a long probe's noise is small beside it); and fit ``LayoutCost`` to them. The probes' rows are
    ``probe_length``'s, shortened from ``row_length`` where the warm-up predicts them over ``PROBE_SECONDS``. The
    model is left as it was: its gradients (set back), its mode (train during the probes, as training runs) and the
    random number generators (forked). Every process must call it with the same arguments (a sharded model's
    forward gathers over them)."""
    device = next(model.parameters()).device
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 2) or 2)
    generator = torch.Generator().manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    was_training = model.training
    probes = []
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            model.train()

            def run(shape) -> float:
                batch = _inputs(*shape, vocab, device, generator)
                started = time.perf_counter()
                with torch.autocast(device.type, dtype=half) if half else contextlib.nullcontext():
                    loss = loss_sum(model, batch)
                loss.float().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                for p in params:
                    p.grad = None
                return time.perf_counter() - started

            first = run(probe_shapes(row_length, budget)[0])  # warm-up: first-call allocations and kernel choices
            length = probe_length(row_length, budget, first)
            if length < row_length:
                run(probe_shapes(length, budget)[0])  # warm-up at the shorter rows
            for shape in probe_shapes(length, budget):
                seconds = run(shape)
                if seconds < quick:
                    seconds = min([seconds] + [run(shape) for _ in range(repeats - 1)])
                rows, per_row, tokens = shape
                probes.append((rows, per_row * tokens, per_row, seconds))
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        model.train(was_training)
    features = [(1.0, float(rows * width), float(rows * width * width)) for rows, width, _, _ in probes]
    fitted = _fit(features, [p[3] for p in probes])
    return LayoutCost(*fitted, probes=tuple(probes), key=cost_key(model, row_length, budget, precision))


def load(output_dir, key: str | None) -> LayoutCost | None:
    """The cost kept in ``output_dir`` for ``key`` (None: whatever it was measured for), or None (no file, another
    key, an unreadable file)."""
    path = Path(output_dir) / FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != FORMAT or (key is not None and data.get("key") != key):
        return None
    return LayoutCost(float(data["per_micro_batch"]), float(data["per_position"]), float(data["per_score"]),
                      tuple(tuple(p) for p in data.get("probes", ())), data.get("key", ""))


def save(output_dir, cost: LayoutCost) -> None:
    """Write ``cost`` to ``output_dir/packing_cost.json`` (the directory is created)."""
    path = Path(output_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": FORMAT, **asdict(cost)}, indent=1) + "\n")
