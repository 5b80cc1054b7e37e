"""``finetune verify``: prove that this model, precision, engine and launch train, under accumulation, the weights
the large batch trains.

    finetune verify [accelerate launcher flags] --recipe NAME|path.py [training flags] [--verify_steps K]

From the same initial weights and sample order, K optimizer steps (default 3) of one effective batch B run in
several ways, one after the other in the same launch: B x 1 per process (the reference), the reference with each
window's samples reordered and in chunks (the noise floor), accumulation splits m x N, a positive control with a
deliberately wrong normalisation, calibrated small controls (one micro-batch per window weighted 1.01, the last
window 1.015: the verdict states the smallest mis-weighting they were caught at), the Trainer backend, and with
``--packing``/``--padding_free`` the packed way on both backends. Compared: every step's gradients, the per-step
losses, the loss after the last update, the final weights (as a fraction of the distance trained). Exit 0: exact;
1: not exact, or inconclusive; 2: bad input. Writes
``verify.json`` and ``verify.md`` to ``--output_dir`` (default ``outputs/<recipe>-verify``). How it decides:
docs/verify.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch.optim.optimizer import register_optimizer_step_pre_hook

from finetune import distributed
from finetune.argv import given, take_values, wants_help
from finetune.backends import accelerate as accelerate_backend
from finetune.backends import trainer as trainer_backend
from finetune.config import check_settings, parse_config
from finetune.engine import engine_for
from finetune.errors import FinetuneError, NumericalError, reports_errors, together
from finetune.lifecycle.elastic import SAMPLE_IDS
from finetune.lifecycle.resolve import resolve
from finetune.lifecycle.run_log import read_log
from finetune.models.loading import load_tokenizer
from finetune.tasks import get_task, split_labels
from finetune.tasks.builders import build_datasets, raw_datasets

DEFAULT_STEPS = 3
# The smallest tolerance: 16 units in the last place of fp32 (relative), for ways whose floors are bit-identical.
# Lower precisions get theirs from the floor ways, which change shapes as splits do (docs/verify.md).
MIN_TOLERANCE = 16 * 2.0**-24
FLOOR_FACTOR = 2  # tolerance = FLOOR_FACTOR x the noise floor (at least MIN_TOLERANCE); measured: docs/verify.md
CONTROL_FACTOR = 10  # the positive control must exceed the tolerance this many times, or "inconclusive"
PADDING_PROBE_TOKENS = 8  # pad tokens the padding probe appends to one batch
# the padding probe (fp32) calls outputs padding-dependent above PADDING_PROBE_FACTOR x its own noise (rows computed
# one by one) and at least PADDING_PROBE_MINIMUM, relative to the largest logit: fp32 rounding at another sequence
# length stays below
PADDING_PROBE_FACTOR = 3
PADDING_PROBE_MINIMUM = 1e-5
# the calibrated small controls: (what is mis-weighted, the size verify claims to detect); a control not caught at
# that size is run again at each larger size of the ladder, and the smallest caught is the threshold stated
SMALL_CONTROLS = (("micro-batch", 0.01), ("last window", 0.015))
SMALL_CONTROL_LADDER = (1, 3, 10)  # multiples of the claimed size
DETERMINISM_TOLERANCE = 1e-4  # a micro-batch's gradients computed twice may differ this much (GPU atomics)
USAGE = __doc__.split("\n\n")[1].strip()
# what the check turns off or fixes: dropout (it verifies accumulation, not randomness), evaluation, checkpoints,
# trackers, the planner (B is fixed by the flags or planned once here); each field declares it (``verify=``)
CHECK_SETTINGS = check_settings()
PACKING_FIELDS = ("padding_free", "packing", "max_tokens_per_micro_batch")  # a "packed" way's flags
FLOOR_ROLES = ("floor", "chunked")  # ways that are the reference computed another way: they set the tolerance


@dataclass(frozen=True)
class Way:
    """One way of training the effective batch: ``micro`` samples per micro-batch x ``accumulation`` micro-batches
    per process. ``role``: "reference", "floor" (the reference, each window's samples reordered), "chunked" (the
    reference, each micro-batch's loss computed over row chunks of the splits' micro-batch sizes, ``chunks`` in
    turn, with one backward: the splits' shapes, the same sum), "split", "control" (a wrong normalisation), "engine" (through ``--backend
    trainer``) or "packed" (the user's ``--padding_free``/``--packing``, ``packing``: against the padded
    reference, so a user proves that their model and attention implementation keep packed sequences apart)."""

    role: str
    micro: int
    accumulation: int
    variant: str = ""  # "without the auxiliary loss" (router_aux_loss_coef 0), "BatchNorm frozen": _floor_model
    chunks: tuple = ()  # the chunked floor's rows per chunk, in turn
    packing: tuple = ()  # "packed": the user's packing flags, ((field, value), ...) (finetune.data.packing)
    trainer: bool = False  # "packed": through --backend trainer
    trim: bool = False  # "chunked": each chunk cut to its own longest sample, as a split's micro-batch pads
    target: str = ""  # "small control": what is mis-weighted ("micro-batch" or "last window")
    size: float = 0.0  # "small control": by how much (0.01: 1% too heavy)

    @property
    def backend(self) -> str:
        return "trainer" if self.role == "engine" or self.trainer else "accelerate"

    @property
    def label(self) -> str:
        extra = {"floor": ", samples reordered", "chunked": f", in chunks of {'/'.join(map(str, self.chunks))}",
                 "control": ", wrong normalisation", "engine": ", Trainer",
                 "small control": f", {self.target} x {1 + self.size:g}",
                 "packed": (", packed" if dict(self.packing).get("packing") else ", padding-free")
                 + (", Trainer" if self.trainer else "")}
        variant = f", {self.variant}" if self.variant else ""
        return f"{self.micro} x {self.accumulation}{extra.get(self.role, '')}{variant}"

    @property
    def slug(self) -> str:
        small = f"-{self.target.replace(' ', '-')}-{self.size:g}" if self.role == "small control" else ""
        return (f"{self.role.replace(' ', '-')}-{self.micro}x{self.accumulation}{small}"
                + ("-trainer" if self.trainer else "") + ("-variant" if self.variant else ""))


@dataclass
class Outcome:
    """What one way produced (on global rank 0; other ranks keep nothing): per-step ``losses``, ``items`` (loss
    items over all processes) and ``samples``, ``skipped`` steps (fp16 loss scaling), ``gradients`` before
    clipping per optimizer step (step -> name -> fp32 tensor; None where the optimizer steps inside a sharding
    engine's backward; dropped once measured, but for the reference), the trainable parameters' names, the
    initial and final weights, the float buffers, ``measured`` (its differences from the reference) and
    ``error`` for a way that did not run (out of memory)."""

    way: Way
    losses: list = field(default_factory=list)
    items: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    gradients: dict | None = None
    trainable: list | None = None
    initial: dict | None = None
    final: dict | None = None
    buffers: dict | None = None
    padding_effect: tuple | None = None  # the reference: (logits moved by more padding, the probe's noise)
    after: float | None = None  # the loss after the last update (``_loss_after``)
    determinism: dict | None = None  # the reference: a micro-batch's gradients computed twice
    notes: dict | None = None  # the reference's model: BatchNorm modules, an auxiliary loss; precision, engine
    measured: dict | None = None
    output_dir: str = ""
    control: str | None = None  # the control's wrong normalisation
    seconds: float = 0.0
    error: str | None = None


def parse(argv: list[str]) -> tuple:
    """(config, verify steps K): ``--verify_steps`` taken out, the rest parsed as training flags; the output
    directory defaults to ``outputs/<recipe>-verify``. Raises ``FinetuneError``."""
    steps = DEFAULT_STEPS
    values, rest = take_values(argv, "--verify_steps")
    for value in ("" if v is None else v for v in values):
        try:
            steps = int(value)
        except ValueError:
            steps = 0
        if steps < 1:
            raise FinetuneError(f"--verify_steps must be a positive number of optimizer steps, got {value!r}.")
    given_output = given(rest, "--output_dir")
    config = parse_config(rest)
    if not given_output:
        config = dataclasses.replace(config, output_dir=f"{config.output_dir}-verify")
    return config, steps


def ways_for(per_process_batch: int, accumulation: int) -> list[Way]:
    """The ways for a per-process window of ``per_process_batch`` samples (B / processes): the reference
    ``b x 1``, its floors (samples reordered; in chunks of each split's micro-batch size, one way per size), up to three
    splits (the run's own accumulation, micro-batch 1, the smallest split), the control (on the split with the most
    micro-batches), and the Trainer backend on the reference and that split. Raises ``FinetuneError`` where ``b``
    is 1 (nothing to split)."""
    b = per_process_batch
    if b < 2:
        raise FinetuneError(f"the effective batch is {b} sample(s) per process: there is nothing to accumulate. "
                            "Raise --per_device_train_batch_size or --gradient_accumulation_steps.")
    divisors = [n for n in range(2, b + 1) if b % n == 0]
    chosen = sorted({n for n in (accumulation, b, divisors[0]) if n in divisors})
    most = chosen[-1]
    sizes = tuple(sorted({b // n for n in chosen}, reverse=True))
    return [Way("reference", b, 1), Way("floor", b, 1), *(Way("chunked", b, 1, chunks=(size,)) for size in sizes),
            *(Way("split", b // n, n) for n in chosen), Way("control", b // most, most), Way("engine", b, 1),
            Way("engine", b // most, most)]


def partial_window_samples(steps: int, effective_batch: int) -> int:
    """The training samples verify keeps so that its last optimizer step's window is partial: K·B − B/2 (the
    last window holds B/2 samples, rounded down, at least 1). A wrong weighting of a short window (Accelerate's
    default divides every window's loss by N) is then visible. Units: samples."""
    return steps * effective_batch - max(effective_batch // 2, 1)


def _rows_for_partial_window(config, recipe, steps: int, effective_batch: int) -> int:
    """``--max_train_samples`` (raw rows) for a partial K-th window. One training sample per row: K·B − B/2
    (``partial_window_samples``). Rows joined into ``--block_size`` blocks: the fewest rows whose blocks end
    inside the K-th window (bisected over the tokenized block count; the most rows with more than (K−1)·B
    blocks where no count ends inside it). Raises the loaders' ``FinetuneError``s."""
    wanted = partial_window_samples(steps, effective_batch)
    limit = config.max_train_samples
    if not config.block_size:
        return wanted if limit is None else min(wanted, limit)
    task = get_task(recipe.TASK)
    tokenizer = load_tokenizer(config.model_name_or_path)
    rows = len(raw_datasets(recipe, config, task)["train"])

    def blocks(n: int) -> int:
        tokenized, _, _ = build_datasets(recipe, dataclasses.replace(config, max_train_samples=n), tokenizer, task)
        return len(tokenized["train"])

    low, high = 1, rows  # the fewest rows with more than (K-1)·B blocks
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if blocks(middle) <= (steps - 1) * effective_batch else (low, middle)
    return low


class _RowsReversed:
    """A prepared dataloader whose micro-batches come with their rows in reverse order: for a ``b x 1`` way each
    window's samples reordered, the same sum in another float order (the noise floor)."""

    def __init__(self, dataloader):
        self._dataloader = dataloader

    def __iter__(self):
        for batch in self._dataloader:
            yield {k: v.flip(0) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in batch.items()}

    def __len__(self):
        return len(self._dataloader)

    def __getattr__(self, name):
        return getattr(self._dataloader, name)


def chunk_sizes(sizes: tuple, rows: int) -> tuple:
    """The chunked floor's rows per chunk, in turn, for a micro-batch of ``rows`` rows: the sizes smaller than
    ``rows``; () where none is (the micro-batch is one chunk, as a split of that size computes it). verify's
    floors have one size each, a split's micro-batch size, so each reproduces one split's shapes; size 1 is
    always one of them (the split 1 x b), which cuts every micro-batch of 2 rows or more."""
    if rows < 2:
        return ()
    return tuple(n for n in sizes if n < rows)


def _trimmed(part: dict) -> dict:
    """A chunk cut to its own longest sample: the trailing columns where every row's attention mask (every mask's:
    a preference pair's ``rejected_attention_mask`` too) is 0 dropped from each 2-D tensor of that length
    (``labels`` too, where they are per token), as a split's micro-batch pads to its own longest sample (right
    padding)."""
    masks = [v for k, v in part.items() if k.endswith("attention_mask") and torch.is_tensor(v) and v.dim() == 2]
    if not masks:  # a preference pair's two sides share one length: cut where neither side has a token left
        return part
    full = masks[0].shape[1]
    used = torch.stack([m.bool().any(dim=0) for m in masks if m.shape[1] == full]).any(dim=0).nonzero()
    length = int(used.max()) + 1 if used.numel() else full
    if length == full:
        return part
    return {k: v[:, :length] if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == full else v
            for k, v in part.items()}


def _in_chunks(sizes: tuple, trim: bool = False):
    """The chunked floor's micro-batch loss: the same rows' summed loss, computed in chunks of the splits'
    micro-batch sizes in turn (``chunk_sizes``: every micro-batch is cut, the short last window's included) and
    added up before the one backward; with ``trim`` each chunk is cut to its own longest sample (``_trimmed``), as
    a split's micro-batch pads, which verify asks only where the padding probe found outputs independent of
    padding. Kernels see the splits' shapes while the window's loss and its normalisation stay the reference's, so
    the difference is float noise of the precision and kernels. (Losses and gradients computed from 1-row and
    4-row micro-batches alone agreed to 2e-7 in bf16 where a 2-row split's loss differed by 9e-6: each shape has
    its own rounding.)"""

    def vary(built):
        loss = built.micro_batch_loss

        def chunked(model, batch):
            size = batch["labels"].shape[0]
            turns = chunk_sizes(sizes, size)
            if not turns:
                return loss(model, batch)
            total, first, turn = None, 0, 0
            while first < size:
                rows, turn = turns[turn % len(turns)], turn + 1
                part = {k: v[first:first + rows] if torch.is_tensor(v) and v.dim() > 0 else v for k, v in batch.items()}
                value = loss(model, _trimmed(part) if trim else part)
                total, first = (value if total is None else total + value), first + rows
            return total

        return dataclasses.replace(built, micro_batch_loss=chunked)

    return vary


class _MisWeighted:
    """A control's micro-batch loss, for every task alike. ``target`` "micro-batch": the first micro-batch of each
    window weighted ``1 + size`` (size 1: counted twice, an off-by-one in an accumulation loop: the gross
    control); "last window": every micro-batch of the K-th (short) window weighted ``1 + size``. Only its gradient is
    weighted, not the loss's value (the logged loss), as a wrong normalisation line does. Its gradients, later
    losses and weights depart from the reference's by a known kind and size of error, which the comparison must
    see. ``micro_batches``: N, the way's micro-batches per full window; ``steps``: K."""

    def __init__(self, micro_batches: int, target: str = "micro-batch", size: float = 1.0, steps: int = 1):
        self.micro_batches, self.target, self.size, self.steps, self.calls = micro_batches, target, size, steps, 0

    def vary(self, built):
        loss = built.micro_batch_loss

        def wrong(model, batch):
            value = loss(model, batch)
            if self.target == "micro-batch":
                hit = self.calls % self.micro_batches == 0
            else:
                hit = self.calls >= (self.steps - 1) * self.micro_batches
            self.calls += 1
            # the gradient weighted 1 + size, the loss's value (the logged loss) as it is: as a wrong
            # normalisation line in the loop would do it
            return value + self.size * (value - value.detach()) if hit else value

        return dataclasses.replace(built, micro_batch_loss=wrong)


class _Observer:
    """Observes one run of either backend: the initial weights, the gradients of every optimizer step in an
    optimizer pre-step hook (torch 2.13 ``register_optimizer_step_pre_hook``: after unscaling and clipping,
    before the update), the trainable parameters' names and the final weights. The accelerate backend's run is
    built here (``build``: ``train.setup``, then ``vary(built)`` changes it: the floor's order, a chunked loss,
    the control's loss); the Trainer backend's is handed over by ``observe(trainer)``."""

    def __init__(self, keep: bool, vary=None, check_determinism: bool = False, micro_batch: int = 1):
        self.keep, self.vary = keep, vary
        self.check_determinism, self.micro_batch = check_determinism, micro_batch
        self.built, self.trainer, self.initial, self.handle = None, None, None, None
        self.gradients, self.names, self.inner, self.trainable, self.determinism = [], {}, None, None, None

    def _watch(self, model, engine, inner=None) -> None:
        self.initial = engine.full_parameters(model) if self.keep else None
        unwrapped = engine.accelerator.unwrap_model(model, keep_torch_compile=False)
        self.names = {id(p): n for n, p in unwrapped.named_parameters()}
        self.trainable = sorted(n for n, p in unwrapped.named_parameters() if p.requires_grad)
        self.inner = inner

        def capture(optimizer, args, kwargs):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if self.inner is None and params and all(id(p) in self.names for p in params):
                self.inner = optimizer  # the Trainer's optimizer, created inside its train()
            if optimizer is not self.inner:
                return
            if not self.keep:
                self.gradients.append({})
                return
            grads = {self.names[id(p)]: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     for p in params if p.grad is not None}
            self.gradients.append({n: g.detach().float().cpu().clone() for n, g in grads.items()})

        self.handle = register_optimizer_step_pre_hook(capture)

    def build(self, config, recipe):
        """``train.setup`` for the accelerate backend, varied, determinism checked, watched."""
        built = accelerate_backend.setup(config, recipe)
        if self.vary is not None:
            built = self.vary(built)
        self.built = built
        if self.check_determinism:
            self.determinism = determinism(built, self.micro_batch)
        self._watch(built.model, built.engine, getattr(built.optimizer, "optimizer", built.optimizer))
        return built

    def observe(self, trainer) -> None:
        """The Trainer backend's run, once built."""
        self.trainer = trainer
        self._watch(trainer.model, engine_for(trainer.accelerator))

    def final(self) -> tuple[dict, dict]:
        """(parameters, float buffers) after training, whole, as fp32 CPU copies (collective)."""
        if self.trainer is not None:
            engine = engine_for(self.trainer.accelerator)
            model = self.trainer.model_wrapped
        else:
            engine, model = self.built.engine, self.built.model
        return engine.full_parameters(model), engine.full_buffers(model)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.built, self.trainer = None, None


def determinism(built, micro_batch: int) -> dict:
    """The premise that one state gives one gradient: a micro-batch of the training set (its first rows),
    forward and backward twice from the same weights, in training mode, without synchronising processes.
    Returns {"difference": ‖g₁ − g₂‖ / ‖g₁‖ over the whole model, "modules": the modules whose output differs
    between two forward passes of the same input (dropout left on, ...)}; difference None where it cannot run
    here (a sharding engine steps inside its backward). Every process calls it."""
    if not built.engine.local_backward:
        return {"difference": None, "modules": []}
    model, accelerator = built.model, built.accelerator
    loader = built.train_dataloader
    rows = [loader.dataset[i] for i in range(min(micro_batch, len(loader.dataset)))]
    batch = {k: v.to(accelerator.device) for k, v in loader.collate_fn(rows).items()}
    model.train()
    grads = []
    context = model.no_sync if hasattr(model, "no_sync") else contextlib.nullcontext
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with context():
            built.micro_batch_loss(model, batch).float().backward()
        grads.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    names = [n for n in grads[0] if n in grads[1]]
    difference = _norm(grads[0][n] - grads[1][n] for n in names) / max(_norm(grads[0][n] for n in names), 1e-30)
    if not math.isfinite(difference):
        difference = float("inf")
    return {"difference": difference, "modules": _random_modules(model, split_labels(batch)[0]) if difference > 0 else []}


def _random_modules(model, batch) -> list[str]:
    """The modules whose output differs between two forward passes of the same ``batch`` while their input is
    the same: where randomness enters (in training mode). Without gradients."""
    seen: list[dict] = [{}, {}]
    state = {"pass": 0}
    unwrapped = model.module if hasattr(model, "module") else model

    def first_tensor(value):
        if torch.is_tensor(value):
            return value
        if isinstance(value, (tuple, list)):
            return next((t for t in map(first_tensor, value) if t is not None), None)
        return None if isinstance(value, dict) else getattr(value, "last_hidden_state", None)

    def record(name):
        def hook(module, inputs, output):
            x, y = first_tensor(inputs), first_tensor(output)
            seen[state["pass"]][name] = (None if x is None else x.detach().clone(),
                                         None if y is None else y.detach().clone())
        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in unwrapped.named_modules()]
    try:
        with torch.no_grad():
            for state["pass"] in (0, 1):
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    random = []
    for name, (x0, y0) in seen[0].items():
        x1, y1 = seen[1].get(name, (None, None))
        if y0 is None or y1 is None or y0.shape != y1.shape:
            continue
        same_input = x0 is None or x1 is None or (x0.shape == x1.shape and torch.equal(x0, x1))
        if same_input and not torch.equal(y0, y1):
            random.append(name)
    # the innermost: a module whose child is random is random through it
    return [n for n in random if not any(o != n and (n == "" or o.startswith(n + ".")) for o in random)]


def _unclip(gradients: dict, grad_norm: float | None, max_norm: float) -> dict:
    """Step 1's gradients before clipping: torch's ``clip_grad_norm_`` multiplied them by
    ``min(1, max_norm / (norm + 1e-6))`` (torch 2.13 ``nn/utils/clip_grad.py`` ``_clip_grads_with_norm_``)."""
    if not max_norm or max_norm <= 0 or grad_norm is None:
        return gradients
    coefficient = min(1.0, max_norm / (grad_norm + 1e-6))
    return {n: g / coefficient for n, g in gradients.items()}


def _padding_effect(built) -> tuple[float, float] | None:
    """How much the model's outputs move when one training batch gets ``PADDING_PROBE_TOKENS`` more pad tokens
    (attention mask 0), and the probe's own noise: (max |logits change| over the real positions / max |logits|,
    the same for the batch's rows computed one at a time: other shapes, the same padding), in eval mode without
    gradients, in fp32 where the model's weights are fp32 (mixed precision's autocast off: its rounding at
    another sequence length is no dependence on padding). None where the batch has no attention mask. Every
    process calls it (a sharded forward is collective)."""
    model = built.engine.eval_model(built.model)
    batch = next(iter(built.train_dataloader))
    if "attention_mask" not in batch:
        return None
    batch = built.task.model_inputs({k: v for k, v in batch.items() if k != SAMPLE_IDS})  # the ids are no input
    pad_id = getattr(built.tokenizer, "pad_token_id", None) or 0
    longer = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() == 2:
            fill = pad_id if key == "input_ids" else 0
            extra = torch.full((value.shape[0], PADDING_PROBE_TOKENS), fill, dtype=value.dtype, device=value.device)
            longer[key] = torch.cat([value, extra], dim=1)
        else:
            longer[key] = value
    forward = getattr(model, "_original_forward", None) or model  # accelerate's autocast wrapper left out
    rows = batch["attention_mask"].shape[0]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(built.accelerator.device.type, enabled=False):
            short = forward(**batch).logits.float()
            long = forward(**longer).logits.float()
            alone = torch.cat([forward(**{k: v[i:i + 1] if torch.is_tensor(v) and v.dim() > 0 else v
                                          for k, v in batch.items()}).logits.float() for i in range(rows)])
    finally:
        model.train(was_training)
    mask = batch["attention_mask"].bool()

    def moved(other):
        a, b = short, other
        if b.dim() == 3:  # per position: compare the real positions
            a, b = a[mask], b[:, : short.shape[1]][mask]
        return float((a - b).abs().max() / a.abs().max().clamp(min=1e-12))

    return moved(long), moved(alone)


def depends_on_padding(probe: tuple[float, float] | None) -> bool:
    """The padding probe's verdict (``_padding_effect``): the logits move by more than ``PADDING_PROBE_FACTOR`` x
    the probe's own noise and more than ``PADDING_PROBE_MINIMUM`` (relative to the largest logit)."""
    return probe is not None and probe[0] > max(PADDING_PROBE_FACTOR * probe[1], PADDING_PROBE_MINIMUM)


def _loss_after(model, dataset, collate, task, rows: int, device) -> float | None:
    """The loss after the last update: one forward of every training sample (the K windows' samples, in order,
    ``rows`` per batch: the same shapes for every way) on the final weights, in eval mode without gradients, in
    fp32 where the weights are (mixed precision's autocast off: bf16 rounding of the forward would add noise that
    flips with any change of the weights), the task's loss (an auxiliary loss left out) summed over all the
    samples' items and divided by them (a float). Every process computes it on every sample (a sharded forward is
    collective). None where there is nothing to run."""
    if dataset is None or not len(dataset):
        return None
    forward = getattr(model, "_original_forward", None) or model  # accelerate's autocast wrapper left out
    was_training = model.training
    model.eval()
    total, items = 0.0, 0.0
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            for first in range(0, len(dataset), rows):
                batch = collate([dataset[i] for i in range(first, min(first + rows, len(dataset)))])
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items() if k != SAMPLE_IDS}
                # the task's loss without gradients (``plain_loss_sum``): the auxiliary loss is no part of it
                total += float(task.plain_loss_sum(model, forward, batch))
                items += float(task.count(batch))
    finally:
        model.train(was_training)
    return total / max(items, 1.0)


def _floor_model(built):
    """The model the floor of a model with an auxiliary loss or BatchNorm is measured on: the auxiliary loss
    off (``router_aux_loss_coef`` 0: ``loss.auxiliary_loss_sum``) and BatchNorm frozen (its running statistics
    used, not the micro-batch's, and not updated), so that chunks and splits change float rounding only."""
    model = built.accelerator.unwrap_model(built.model, keep_torch_compile=False)
    if getattr(model.config, "router_aux_loss_coef", 0.0):
        model.config.router_aux_loss_coef = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.register_forward_pre_hook(lambda m, inputs: setattr(m, "training", False))
    return built


def run_way(way: Way, base, recipe, root: Path, steps: int, keep: bool, vary=None, rows_after: int = 1) -> Outcome:
    """Train ``way`` for ``steps`` optimizer steps into ``root / way.slug`` and collect its ``Outcome`` (tensors
    on global rank 0 only: ``keep``; the padding probe on every process). ``vary(built)``: the control's change;
    ``rows_after``: the batch size (samples) of the loss after the last update, the same for every way.
    Collective: every process runs every way."""
    config = dataclasses.replace(base, per_device_train_batch_size=way.micro, gradient_accumulation_steps=way.accumulation,
                                 max_steps=steps, output_dir=str(root / way.slug), backend=way.backend,
                                 **dict(way.packing))
    config.validate()
    out = Path(config.output_dir)
    outcome = Outcome(way, output_dir=str(out))
    distributed.reset_state()
    start = time.perf_counter()
    vary = {"floor": lambda built: dataclasses.replace(built, train_dataloader=_RowsReversed(built.train_dataloader)),
            "chunked": _in_chunks(way.chunks, way.trim) if way.chunks else None, "control": vary,
            "small control": vary}.get(way.role)
    if way.variant:
        vary = (lambda built, then=vary: then(_floor_model(built))) if vary else _floor_model
    observer = _Observer(keep, vary, check_determinism=way.role == "reference" and not way.variant,
                         micro_batch=way.micro)
    rank = f".rank{distributed.rank()}" if distributed.world_size() > 1 else ""
    log = root / "logs" / f"{way.slug}{rank}.log"  # each run's banner, progress and warnings: the console gets one line
    log.parent.mkdir(parents=True, exist_ok=True)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its handler writes to the stderr it found at import
    try:
        with open(log, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            _train_way(way, config, recipe, observer, keep, outcome, rows_after)
    except torch.OutOfMemoryError as err:
        if distributed.world_size() > 1:
            raise FinetuneError(f"verify: {way.label} ran out of memory ({err}). Every way must fit on every "
                                "process: lower the effective batch.") from None
        outcome.error = "does not fit (out of memory)"
    except NumericalError as err:  # a non-finite gradient where the reference's was finite: this way's failure
        outcome.error = f"failed: {str(err).split('. ')[0]}"
    except FinetuneError:
        raise
    except Exception as err:  # a model that cannot train this way (BatchNorm on micro-batches of 1, ...)
        outcome.error = f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        observer.close()
        transformers.logging.set_verbosity(verbosity)
    outcome.seconds = time.perf_counter() - start
    if keep and outcome.error is None:
        _read_outcome(outcome, out, observer, base)
    observer.gradients = []  # a model's gradients per step: freed before the cache is emptied
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outcome


def _train_way(way: Way, config, recipe, observer: _Observer, keep: bool, outcome: Outcome, rows_after: int) -> None:
    """Train one way with its backend; read the final weights and buffers from the run and the loss after the
    last update, and for the reference the padding probe and the model's notes."""
    if way.backend == "trainer":
        trainer_backend.train(config, recipe, observe=observer.observe)
    else:
        accelerate_backend.train(config, recipe, build=observer.build)
    final, buffers = observer.final()
    built = observer.built
    outcome.padding_effect = _padding_effect(built) if way.role == "reference" else None
    if built is not None:
        after = _loss_after(built.engine.eval_model(built.model), built.train_dataloader.dataset,
                            built.train_dataloader.collate_fn, built.task, rows_after, built.accelerator.device)
    else:
        after = _trainer_loss_after(observer.trainer, config, recipe, rows_after)
    if keep:
        outcome.initial, outcome.final, outcome.buffers = observer.initial, final, buffers
        outcome.trainable, outcome.determinism, outcome.after = observer.trainable, observer.determinism, after
        if built is not None:
            outcome.notes = _model_notes(built)


def _trainer_loss_after(trainer, config, recipe, rows: int) -> float | None:
    """``_loss_after`` for a Trainer backend's run: its model, training set and collator, its task's loss."""
    model = engine_for(trainer.accelerator).eval_model(trainer.model_wrapped)
    return _loss_after(model, trainer.train_dataset, trainer.data_collator, trainer.task, rows,
                       trainer.accelerator.device)


def _read_outcome(outcome: Outcome, out: Path, observer: _Observer, base) -> None:
    """Fill ``outcome`` from the way's ``log.jsonl`` (losses, items, samples, skips) and the observed gradients
    of each optimizer step that was not skipped, unclipped with that step's logged norm."""
    records = read_log(out, "step")
    outcome.losses = [r["loss"] for r in records]
    outcome.items = [r.get("trained_tokens", r.get("items", r["samples"])) for r in records]
    outcome.samples = [r["samples"] for r in records]
    outcome.skipped = [r["step"] for r in records if r.get("skipped")]
    taken = [r for r in records if not r.get("skipped")]
    if observer.gradients and len(observer.gradients) == len(taken):
        outcome.gradients = {r["step"]: _unclip(g, r.get("grad_norm"), base.max_grad_norm)
                             for r, g in zip(taken, observer.gradients)}


# ------------------------------------------------------------------------------------------ comparisons
def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def gradient_difference(grads: dict, reference: dict) -> tuple[float, str | None, float]:
    """(‖g − g_ref‖ / ‖g_ref‖ over the whole model, the worst tensor, its ‖Δ‖ / ‖g_ref‖ of that tensor)."""
    shared = [n for n in reference if n in grads]
    whole = _norm(grads[n] - reference[n] for n in shared) / max(_norm(reference[n] for n in shared), 1e-30)
    worst, worst_value = None, 0.0
    for n in shared:
        value = _norm([grads[n] - reference[n]]) / max(_norm([reference[n]]), 1e-30)
        if value > worst_value:
            worst, worst_value = n, value
    return whole, worst, worst_value


def weight_difference(final: dict, reference_final: dict, initial: dict) -> tuple[float, str | None, float]:
    """(‖w_K − w_K,ref‖ / ‖w_K,ref − w_0‖ over the whole model, the worst tensor, the same for that tensor):
    the difference as a fraction of the distance trained."""
    shared = [n for n in reference_final if n in final and n in initial]
    trained = _norm(reference_final[n] - initial[n] for n in shared)
    whole = _norm(final[n] - reference_final[n] for n in shared) / max(trained, 1e-30)
    worst, worst_value = None, 0.0
    for n in shared:
        moved = _norm([reference_final[n] - initial[n]])
        if moved == 0:
            continue
        value = _norm([final[n] - reference_final[n]]) / moved
        if value > worst_value:
            worst, worst_value = n, value
    return whole, worst, worst_value


def loss_difference(losses: list, reference: list) -> tuple[float, int | None]:
    """(max over steps of |loss − loss_ref| / |loss_ref|, the first step of that maximum)."""
    worst, at = 0.0, None
    for step, (a, b) in enumerate(zip(losses, reference), start=1):
        value = abs(a - b) / max(abs(b), 1e-30)
        if value > worst:
            worst, at = value, step
    return worst, at


def _first_departure(losses: list, reference: list, tolerance: float) -> int | None:
    return next((s for s, (a, b) in enumerate(zip(losses, reference), start=1)
                 if abs(a - b) / max(abs(b), 1e-30) > tolerance), None)


def _measure(o: Outcome, reference: Outcome) -> dict:
    """The differences of ``o`` from ``reference``: each optimizer step's gradients (where both were seen), the
    per-step losses, the final weights, the per-step items, and the trainable parameters that could not be
    compared (names on one side only)."""
    row = {}
    if o.gradients and reference.gradients:
        per_step = {step: gradient_difference(o.gradients[step], reference.gradients[step])
                    for step in sorted(reference.gradients) if step in o.gradients}
        if per_step:
            first = min(per_step)
            row.update(gradient_difference=per_step[first][0], gradient_worst_tensor=per_step[first][1],
                       gradient_worst=per_step[first][2], gradient_step=first,
                       gradient_steps={step: value[0] for step, value in per_step.items()},
                       gradient_step_worst={step: value[1] for step, value in per_step.items()})
        names = set(next(iter(reference.gradients.values())))
        seen = set(next(iter(o.gradients.values())))
        if names != seen:
            row["gradient_names_differ"] = [sorted(names - seen)[:3], sorted(seen - names)[:3]]
    loss = loss_difference(o.losses, reference.losses)
    row.update(loss_difference=loss[0], loss_worst_step=loss[1])
    if o.after is not None and reference.after is not None:
        row["after_difference"] = abs(o.after - reference.after) / max(abs(reference.after), 1e-30)
    if o.final is not None and reference.final is not None:
        w = weight_difference(o.final, reference.final, reference.initial)
        row.update(weight_difference=w[0], weight_worst_tensor=w[1], weight_worst=w[2])
        missing = [n for n in reference.trainable or [] if n not in o.final]
        if missing or (o.trainable is not None and reference.trainable is not None
                       and set(o.trainable) != set(reference.trainable)):
            row["weight_names_differ"] = missing[:3] or sorted(set(o.trainable) ^ set(reference.trainable))[:3]
    departs = next((i for i, (a, b) in enumerate(zip(o.items, reference.items)) if a != b), None)
    if departs is not None:
        row["items_differ"] = [departs + 1, o.items[departs], reference.items[departs]]
    return row


def _departures(row: dict, o: Outcome, reference: Outcome, tolerance: dict) -> list[str]:
    """What in ``row`` (``_measure``) exceeds ``tolerance``, or could not be compared, in words; empty when
    ``o`` is exact."""
    bad = []
    if "items_differ" in row:
        step, items, expected = row["items_differ"]
        bad.append(f"step {step} trains {items:g} items where the reference trains {expected:g}")
    for step, value in (row.get("gradient_steps") or {}).items():
        limit = tolerance["gradient_steps"].get(step, tolerance["gradients"])
        if value > limit:
            bad.append(f"step {step}'s gradients differ by {value:.2e} (worst: {row['gradient_step_worst'][step]})")
            break
    if reference.gradients and not row.get("gradient_steps"):
        bad.append("its gradients could not be read, so they were not compared")
    if "gradient_names_differ" in row or "weight_names_differ" in row:
        names = row.get("gradient_names_differ") or [row.get("weight_names_differ"), []]
        bad.append(f"parameters not compared (names on one side only: {names[0] or names[1]})")
    if row["loss_difference"] > tolerance["losses"]:
        bad.append(f"the loss departs at step {_first_departure(o.losses, reference.losses, tolerance['losses'])}"
                   f" ({row['loss_difference']:.2e})")
    if row.get("after_difference", 0.0) > tolerance["after"]:
        bad.append(f"the loss after the last update differs by {row['after_difference']:.2e}")
    if row.get("weight_difference", 0.0) > tolerance["weights"]:
        bad.append(f"the final weights differ by {row['weight_difference']:.2e} of the distance trained "
                   f"(worst: {row['weight_worst_tensor']})")
    if reference.final is not None and o.final is None:
        bad.append("its final weights could not be read, so they were not compared")
    if len(o.losses) != len(reference.losses):
        bad.append(f"{len(o.losses)} optimizer steps ran, the reference ran {len(reference.losses)}")
    return bad


def _tolerances(floors: list[dict]) -> tuple[dict, dict]:
    """(noise floor, tolerance) from the floor ways' rows (``_measure`` against the reference): the largest
    difference any of them shows for each comparison (per optimizer step for gradients), and
    ``FLOOR_FACTOR`` x that, at least ``MIN_TOLERANCE``."""
    steps = sorted({s for row in floors for s in (row.get("gradient_steps") or {})})
    per_step = {s: max((row.get("gradient_steps") or {}).get(s, 0.0) for row in floors) for s in steps}
    floor = {"gradients": per_step[steps[0]] if steps else 0.0,
             "losses": max((row.get("loss_difference", 0.0) for row in floors), default=0.0),
             "weights": max((row.get("weight_difference", 0.0) for row in floors), default=0.0),
             "after": max((row.get("after_difference", 0.0) for row in floors), default=0.0),
             "gradient_steps": per_step}
    limit = lambda value: max(FLOOR_FACTOR * value, MIN_TOLERANCE)  # noqa: E731
    # the loss after the last update is a loss over the same samples on weights that differ by training noise, as
    # the logged losses of later steps are: its noise is at least theirs (one scalar: two floor ways alone
    # under-estimate it, by 8 x in bf16 on the tests' tiny Llama, docs/verify.md)
    tolerance = {"gradients": limit(floor["gradients"]), "losses": limit(floor["losses"]),
                 "weights": limit(floor["weights"]), "after": limit(max(floor["after"], floor["losses"])),
                 "gradient_steps": {s: limit(v) for s, v in per_step.items()}}
    return floor, tolerance


def _control_margin(row: dict, tolerance: dict, gradients: bool) -> float | None:
    """How many times the tolerance the control departs by: over its per-step gradients where gradients are
    compared, else over its final weights (an engine that steps inside its backward)."""
    if gradients:
        values = [v / tolerance["gradient_steps"].get(s, tolerance["gradients"])
                  for s, v in (row.get("gradient_steps") or {}).items()]
        return max(values) if values else None
    value = row.get("weight_difference")
    return None if value is None else value / tolerance["weights"]


def _no_way_ran(outcomes: list[Outcome]) -> FinetuneError | None:
    """The error when neither the reference nor a split ran (each way's error listed), else None."""
    if any(o.error is None and o.way.role in ("reference", "split") for o in outcomes):
        return None
    return FinetuneError("verify: no way of the effective batch ran: "
                         + "; ".join(f"{o.way.label}: {o.error}" for o in outcomes if o.way.role not in FLOOR_ROLES)[:2000])


def compare(outcomes: list[Outcome], steps: int, model_notes: dict,  # noqa: C901 - over the budget; to split
            detects: list[dict] | None = None) -> dict:
    """The table and the verdict from every way's ``Outcome`` (each already ``measured`` against the reference,
    or measured here): tolerances from the floor ways, each way's departures, the control's margin, the small
    controls (``detects``, from ``_small_controls``: "exact" needs each caught at its claimed size), the premises
    (determinism, item counts) and the causes. Raises ``FinetuneError`` if no reference ran."""
    ran = [o for o in outcomes if o.error is None]
    reference = next((o for o in ran if o.way.role in ("reference", "split")), None)
    if reference is None:
        raise _no_way_ran(outcomes)
    for o in ran:
        if o is not reference and o.measured is None:
            o.measured = _measure(o, reference)
    floor, tolerance = _tolerances([o.measured for o in ran if o.way.role in FLOOR_ROLES and o is not reference])
    grads_seen = bool(reference.gradients)
    rows, failures, control_margin = [], [], None
    for o in outcomes:
        row = {"way": o.way.label, "role": o.way.role, "engine": o.way.backend, "micro_batch": o.way.micro,
               "accumulation": o.way.accumulation, "seconds": round(o.seconds, 2), "error": o.error,
               "skipped_steps": o.skipped, "items": o.items}
        if o.error is not None:
            if not o.error.startswith("does not fit") and o.way.role not in ("control", "small control"):
                failures.append(o.way.label)  # a way that fails (a non-finite gradient, ...) where others run
                row["verdict"] = f"NOT EXACT: {o.error}"
        elif o is reference:
            row["verdict"] = "reference"
        else:
            row.update(o.measured)
            if o.way.role == "floor reference":
                row["verdict"] = "reference of the chunked floor"
            elif o.way.role == "small control":
                tried = next((t for d in detects or [] if d["target"] == o.way.target for t in d["tried"]
                              if t["size"] == o.way.size), {})
                row["verdict"] = (f"small control: {'caught' if tried.get('caught') else 'NOT caught'} "
                                  f"({_fmt(tried.get('margin'))} x the tolerance and {o.control}'s own noise; "
                                  f"against {o.control})")
            elif o.way.role == "control":
                control_margin = _control_margin(row, tolerance, grads_seen)
                row["verdict"] = f"control: {o.control}"
            elif o.way.role in FLOOR_ROLES:
                row["verdict"] = "noise floor"
            else:
                bad = _departures(row, o, reference, tolerance)
                row["verdict"] = "exact" if not bad else "NOT EXACT: " + "; ".join(bad)
                failures += [o.way.label] if bad else []
        rows.append(row)
    determinism = reference.determinism or {}
    random = determinism.get("difference") is not None and determinism["difference"] > DETERMINISM_TOLERANCE
    if random:
        verdict = "inconclusive"
    elif failures:
        verdict = "not exact"
    elif control_margin is None or control_margin < CONTROL_FACTOR:
        verdict = "inconclusive"
    elif detects is not None and not all(d["threshold"] == d["claimed"] for d in detects):
        verdict = "inconclusive"
    else:
        verdict = "exact"
    causes = []
    if random:
        causes.append(_nondeterminism_cause(determinism))
    if failures:
        causes += _causes(outcomes, reference, tolerance, model_notes)
    elif not random and verdict == "inconclusive":
        if control_margin is None or control_margin < CONTROL_FACTOR:
            causes.append("the positive control (a wrong normalisation) did not depart by "
                          f"{CONTROL_FACTOR} x the tolerance, so these comparisons could not be shown to see one")
        causes += [_undetected(d, grads_seen) for d in detects or [] if d["threshold"] != d["claimed"]]
    last = reference.samples[-1] if reference.samples else None
    # how far the correct ways stand from the floor (FLOOR_FACTOR is set from this, measured: docs/verify.md)
    judged = [r for r in rows if r["role"] in ("split", "engine", "packed") and r.get("loss_difference") is not None]
    over_floor = max((_margin(r, tolerance) * FLOOR_FACTOR for r in judged), default=None)
    return {"split_over_floor": over_floor,"verdict": verdict, "precision": model_notes.get("precision", "no"), "verify_steps": steps,
            "detects": detects or [], "detects_line": detects_line(detects or []),
            "tolerance": tolerance, "noise_floor": floor, "control_margin": control_margin,
            "reference": reference.way.label, "rows": rows, "not_exact": failures, "causes": causes,
            "gradients_compared": grads_seen, "determinism": determinism, "last_window_samples": last,
            **model_notes}


def _percent(size: float) -> str:
    return f"{100 * size:g}%"


def detects_line(detects: list[dict]) -> str:
    """The verdict's statement of power, from the small controls: "any mis-weighting of a micro-batch of 1% or
    more, or of the last window of 1.5% or more, would have been caught" (each at its measured threshold); "" where
    no control was caught or none ran."""
    parts = [f"of {'a micro-batch' if d['target'] == 'micro-batch' else 'the last window'} of "
             f"{_percent(d['threshold'])} or more" for d in detects if d["threshold"] is not None]
    return f"any mis-weighting {', or '.join(parts)}{',' if len(parts) > 1 else ''} would have been caught" if parts else ""


def _undetected(entry: dict, gradients: bool) -> str:
    """The cause for a small control not caught at its claimed size: the size of error that cannot be excluded."""
    what = "a micro-batch" if entry["target"] == "micro-batch" else "the last window"
    tried = ", ".join(f"{_percent(t['size'])}: {'caught' if t['caught'] else 'not caught'}" for t in entry["tried"])
    limit = (f"below {_percent(entry['threshold'])}" if entry["threshold"] is not None
             else f"of up to {_percent(entry['tried'][-1]['size'])}")
    unseen = "" if gradients or entry["target"] != "last window" else (
        "; the gradients are not compared here (the engine steps inside its backward), and AdamW normalises a "
        "window-uniform scale away from the weights, so a wrong weighting of a whole window is not visible")
    return f"a mis-weighting of {what} {limit} cannot be excluded (small controls {tried}){unseen}"


def _nondeterminism_cause(determinism: dict) -> str:
    modules = determinism.get("modules") or []
    where = (f"randomness enters at {', '.join(modules[:5])}" + (f" and {len(modules) - 5} more" if len(modules) > 5
                                                                   else "")
             if modules else "no module's forward output changed, so it enters in the backward pass")
    return (f"not deterministic: one micro-batch's gradients, computed twice from the same weights, differ by "
            f"{determinism['difference']:.2e} ({where}); with dropout or other randomness left on, no split can be "
            "compared. Turn it off (--disable_dropout covers torch.nn.Dropout modules and dropout settings of the "
            "model's config).")


def _causes(outcomes: list[Outcome], reference: Outcome, tolerance: dict, notes: dict) -> list[str]:
    """What makes the ways differ, where it can be measured: item counts that differ (a way counts its loss's
    items another way), BatchNorm (its running statistics differ), a model-added auxiliary loss, outputs that
    depend on padding; else that no cause was identified."""
    found = []
    for o in outcomes:
        if o.measured and "items_differ" in o.measured:
            step, items, expected = o.measured["items_differ"]
            found.append(f"item counts: {o.way.label} divides step {step}'s loss by {items:g} items where the "
                         f"reference counts {expected:g}; the two count the loss's items (samples, or label tokens) "
                         "differently")
    if notes.get("batchnorm_modules"):
        moved = [_norm([o.buffers[n] - reference.buffers[n]]) / max(_norm([reference.buffers[n]]), 1e-30)
                 for o in outcomes if o.way.role == "split" and o.buffers and reference.buffers
                 for n in reference.buffers if n in o.buffers]
        found.append(f"BatchNorm ({', '.join(notes['batchnorm_modules'][:3])}): it normalises each micro-batch over "
                     f"its own samples, so the statistics differ with the split (running statistics differ by up to "
                     f"{max(moved, default=0.0):.2e})")
    effect = reference.padding_effect
    if depends_on_padding(effect):
        found.append(f"the model's outputs depend on padding: {PADDING_PROBE_TOKENS} more pad tokens (attention mask "
                     f"0) change its logits by {effect[0]:.2e} of their size (in fp32; the probe's own noise "
                     f"{effect[1]:.1e}), and each micro-batch pads to its own longest sample")
    return found or ["cause not identified: no BatchNorm, and outputs independent of padding" +
                     (" (the auxiliary loss is checked next)" if notes.get("auxiliary_loss") else
                      ", no auxiliary loss")]


def _model_notes(built) -> dict:
    """What the run's model has that makes training depend on the micro-batch (BatchNorm modules, an auxiliary
    loss), the precision that ran and the engine."""
    model = built.accelerator.unwrap_model(built.model, keep_torch_compile=False)
    batchnorm = [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    auxiliary = bool(getattr(model.config, "output_router_logits", False)) and bool(
        getattr(model.config, "router_aux_loss_coef", 0.0))
    engine = built.engine.label(built.accelerator.num_processes)
    return {"batchnorm_modules": batchnorm, "auxiliary_loss": auxiliary, "precision": built.precision,
            "engine": engine}


# ------------------------------------------------------------------------------------------ report
def _fmt(value) -> str:
    return "" if value is None else f"{value:.2e}" if isinstance(value, float) else str(value)


def render(report: dict) -> str:
    """``verify.md``: the table, the premises, the tolerances and the verdict."""
    last = report.get("last_window_samples")
    partial = (f"the last window holds {last} of {report['effective_batch']} samples" if last is not None
               and last < report["effective_batch"] else "no partial window (the data ended on a full one)")
    lines = [f"# finetune verify: {report['recipe']}", "",
             f"Effective batch {report['effective_batch']} samples = micro-batch x accumulation x "
             f"{report['processes']} process(es); {report['verify_steps']} optimizer steps, {partial}; precision "
             f"{report['precision']}; engine {report['engine']}; dropout off. Reference: {report['reference']}.", "",
             "| way | engine | gradients Δ (step 1 / worst step) | worst tensor | loss Δ (max) | final weights Δ / "
             "distance trained | worst tensor | items per step | fp16 skips | s | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        steps = r.get("gradient_steps") or {}
        gradients = (f"{_fmt(r.get('gradient_difference'))} / {_fmt(max(steps.values()))}" if steps else "")
        lines.append(f"| {r['way']} | {r['engine']} | {gradients} | "
                     f"{r.get('gradient_worst_tensor') or ''} | {_fmt(r.get('loss_difference'))} | "
                     f"{_fmt(r.get('weight_difference'))} | {r.get('weight_worst_tensor') or ''} | "
                     f"{','.join(f'{v:g}' for v in r.get('items') or [])} | "
                     f"{','.join(map(str, r['skipped_steps'])) or '-'} | {r['seconds']} | "
                     f"{r.get('verdict') or r.get('error') or ''} |")
    t, f = report["tolerance"], report["noise_floor"]
    determinism = report.get("determinism") or {}
    if determinism.get("difference") is not None:
        lines += ["", f"Determinism: one micro-batch's gradients computed twice differ by "
                      f"{determinism['difference']:.2e} (allowed {DETERMINISM_TOLERANCE:.0e})."]
    lines += ["", f"Noise floor (the reference with its samples reordered, and computed in chunks): gradients "
              f"{f['gradients']:.2e} at step 1, up to {max(f['gradient_steps'].values(), default=0.0):.2e}; losses "
              f"{f['losses']:.2e}; the loss after the last update {f.get('after', 0.0):.2e}; weights {f['weights']:.2e}. Tolerance ({FLOOR_FACTOR} x the floor, at least "
              f"{MIN_TOLERANCE:.1e}): gradients {t['gradients']:.2e} at step 1, losses {t['losses']:.2e}, the loss after "
              f"{t.get('after', 0.0):.2e}, weights "
              f"{t['weights']:.2e}."]
    if report["control_margin"] is not None:
        lines.append(f"Positive control (wrong normalisation): {report['control_margin']:.3g} x the "
                     f"{'gradient' if report['gradients_compared'] else 'weight'} tolerance (needs >= "
                     f"{CONTROL_FACTOR}).")
    if not report["gradients_compared"]:
        lines.append("Gradients not compared: the engine steps its optimizer inside its own backward "
                     f"({report['engine']}); losses and the fp32 master weights are, and the control is measured on "
                     "the weights.")
    for d in report.get("detects") or []:
        lines.append(f"Small control ({d['target']} mis-weighted): " + ", ".join(
            f"{_percent(t['size'])} {'caught' if t['caught'] else 'not caught'}"
            + (f" ({t['margin']:.3g} x the tolerance and its twin's noise)" if t.get("margin") is not None else "")
            for t in d["tried"]) + ".")
    line = report.get("detects_line")
    lines += ["", f"**Verdict: {report['verdict']}" + (f": {line}" if line and report["verdict"] == "exact" else "")
              + "**"]
    lines += [f"- cause: {c}" for c in report["causes"]]
    return "\n".join(lines) + "\n"


def verify(config, steps: int) -> int:  # noqa: C901 - over the budget; to split
    """Run every way and write the report; returns the exit code (0 exact, 1 not exact or inconclusive).
    Raises ``FinetuneError`` for input that cannot run."""
    resolution = resolve(config, writes_run=False)  # verify checks its own output directory, below
    config, recipe = resolution.config, resolution.recipe
    processes = distributed.world_size()
    per_process = config.per_device_train_batch_size * config.gradient_accumulation_steps
    # end the data inside the K-th window, so a wrong weighting of a short window shows
    samples = _rows_for_partial_window(config, recipe, steps, per_process * processes)
    # the ways run padded; the user's --padding_free/--packing becomes more ways against the padded reference
    packed = PACKING_FIELDS if config.padding_free or config.packing else ()
    base = dataclasses.replace(config, **CHECK_SETTINGS, batch_plan=None, max_train_samples=samples,
                               **{name: None if name == "max_tokens_per_micro_batch" else False for name in packed})
    root = Path(config.output_dir)
    if (root / "checkpoints").exists() or (root / "model.safetensors").exists():
        raise FinetuneError(f"--output_dir {root} holds a training run; verify writes its own ways there. Pass "
                            "another --output_dir.")
    ways = ways_for(per_process, config.gradient_accumulation_steps)
    if packed:  # the user's own split, packed as the user asks, on both backends the user's run could use
        flags = tuple((name, getattr(config, name)) for name in packed)
        ways += [Way("packed", config.per_device_train_batch_size, config.gradient_accumulation_steps,
                     packing=flags, trainer=trainer) for trainer in (False, True)]
    keep = distributed.process_state().is_main_process
    say = print if keep else (lambda *a, **k: None)
    agree = distributed.all_reduce_max(distributed.distributed_state())
    say(f"finetune verify: {len(ways)} ways of the effective batch {per_process * processes}, {steps} optimizer "
        f"steps each over {samples} samples, and the small controls, into {root}", flush=True)

    gross = next(w for w in ways if w.role == "control")

    def run(way, vary=None, against=None):
        outcome = run_way(way, base, recipe, root, steps, keep, vary, rows_after=per_process)
        note = "" if outcome.error is None else "(does not fit)" if outcome.error.startswith("does not fit") else "(failed)"
        say(f"  {way.label:44s} {note}{outcome.seconds:6.1f} s", flush=True)
        if keep and outcome.error is None and against is not None:  # measured now: its gradients need not be kept
            twin = way.role == "split" and (way.micro, way.accumulation) == (gross.micro, gross.accumulation)
            outcome.measured = _measure(outcome, against)
            outcome.gradients = outcome.gradients if twin else None  # the small controls' twin keeps them
        return outcome

    outcomes: list[Outcome] = []
    reference = floor_reference = None
    variant = ""
    for way in ways:
        if way.role == "chunked":
            notes = (reference.notes or {}) if reference is not None else {}
            first = outcomes[0] if outcomes else None
            # chunks cut to their own longest sample, as splits pad, unless the outputs depend on padding
            way = dataclasses.replace(way, trim=not agree(float(bool(first and depends_on_padding(first.padding_effect)))))
            if floor_reference is None and agree(float(bool(notes.get("batchnorm_modules") or notes.get("auxiliary_loss")))):
                # chunks would change what BatchNorm or the auxiliary loss compute: the chunked floors are measured
                # on the model without them, against the reference without them (run once, for every size)
                variant = ", ".join(v for v, on in (("without the auxiliary loss", notes.get("auxiliary_loss")),
                                                    ("BatchNorm frozen", notes.get("batchnorm_modules"))) if on)
                variant = variant or "floor model"
                floor_reference = run(Way("floor reference", way.micro, 1, variant=variant))
                if keep and floor_reference.error is None:  # its gradients kept: the chunked floors' reference
                    floor_reference.measured = _measure(floor_reference, reference)
                outcomes.append(floor_reference)
            if variant:
                way = dataclasses.replace(way, variant=variant)
            outcome = run(way, against=floor_reference if way.variant else reference)
        elif way.role == "control":
            outcome = run(way, _MisWeighted(way.accumulation).vary, against=reference)
            outcome.control = "the first micro-batch of each window counted twice"
        else:
            outcome = run(way, against=reference)
            if keep and reference is None and outcome.error is None and way.role in ("reference", "split"):
                reference, outcome.measured = outcome, None
        outcomes.append(outcome)
    detects = _small_controls(ways, outcomes, reference, run, steps, keep, agree)
    report = None
    # the outcomes' errors are every process's: whether a reference ran is decided on each, so all stop together
    if agree(float(_no_way_ran(outcomes) is not None)):
        raise together(_no_way_ran(outcomes) or FinetuneError("verify: no way of the effective batch ran on another "
                                                              "process; its errors are in " + str(root / "logs")))
    if keep:
        notes = next((o.notes for o in outcomes if o.notes), {})
        report = compare(outcomes, steps, notes, detects)
        report.update(recipe=recipe.NAME, processes=processes, effective_batch=per_process * processes)
    if agree(float(bool(report and report["not_exact"] and report.get("auxiliary_loss")))):
        # the splits again, the auxiliary loss off, against the reference without it
        plain = [dataclasses.replace(w, variant="without the auxiliary loss") for w in ways if w.role == "split"]
        if floor_reference is None:
            floor_reference = run(Way("floor reference", per_process, 1, variant="without the auxiliary loss"))
        again = [run(way) for way in plain]
        if keep:
            _explain_auxiliary(report, floor_reference, again)
    code = 0
    if keep:
        root.mkdir(parents=True, exist_ok=True)
        (root / "verify.json").write_text(json.dumps(report, indent=2) + "\n")
        (root / "verify.md").write_text(text := render(report))
        print(text)
        code = 0 if report["verdict"] == "exact" else 1
    return int(agree(float(code)))


def _small_controls(ways: list[Way], outcomes: list[Outcome], reference: Outcome | None, run, steps: int,
                    keep: bool, agree) -> list[dict]:
    """The calibrated small controls (``SMALL_CONTROLS``), on the gross control's split: each mis-weighting at the
    size verify claims, then, while it is not caught (a departure beyond the tolerance on some comparison), at each
    larger size of ``SMALL_CONTROL_LADDER``. Appends their outcomes to ``outcomes``; returns, per control, what
    it mis-weights, the claimed size, every size tried (caught or not, its margin over the tolerance) and the
    threshold: the smallest size caught, or None. Collective."""
    gross = next((w for w in ways if w.role == "control"), None)
    if gross is None:
        return []
    tolerance = None
    # the control's twin: the split of its shape, with the same engine; the control is measured against it, so that
    # only the mis-weighting departs (an engine's own error, shared by both, cancels)
    twin = next((o for o in outcomes if o.way.role == "split" and o.error is None and o.gradients is not None and
                 (o.way.micro, o.way.accumulation) == (gross.micro, gross.accumulation)), reference)
    if keep and reference is not None:
        _, tolerance = _tolerances([o.measured for o in outcomes if o.error is None and o.way.role in FLOOR_ROLES
                                    and o.measured])
    found = []
    for target, claimed in SMALL_CONTROLS:
        entry = {"target": target, "claimed": claimed, "tried": [], "threshold": None}
        for multiple in SMALL_CONTROL_LADDER:
            size = claimed * multiple
            way = Way("small control", gross.micro, gross.accumulation, target=target, size=size)
            outcome = run(way, _MisWeighted(way.accumulation, target, size, steps).vary, against=twin)
            outcome.control = twin.way.label if twin is not None else None
            outcomes.append(outcome)
            caught, margin = False, None
            if keep and tolerance is not None and outcome.error is None and outcome.measured is not None:
                margin = _margin(outcome.measured, _beyond(tolerance, twin.measured if twin is not reference else None))
                caught = margin > 1
            entry["tried"].append({"size": size, "caught": caught, "margin": margin})
            if agree(float(caught)):
                entry["threshold"] = size
                break
        found.append(entry)
    return found


def _beyond(tolerance: dict, noise: dict | None) -> dict:
    """What a small control's departure from its twin must exceed, per comparison, to be caught, given the twin's
    own departure from the reference (``noise``, a ``_measure`` row): for the gradients and the weights (vectors
    of many elements, where a mis-weighting and float noise are as good as orthogonal, so the twin so mis-weighted
    departs by sqrt(e² + n²) >= e) the tolerance; for the losses (scalars, where they may cancel) the tolerance
    plus n. (n is not subtracted for the vectors: on a wrong engine n holds the engine's own error, and a 1.5%
    last-window mutant then passed while its control was "caught".)"""
    if not noise:
        return tolerance
    return {**tolerance, **{t: tolerance[t] + noise.get(k, 0.0) for k, t in (("loss_difference", "losses"),
                                                                              ("after_difference", "after"))}}


def _margin(row: dict, tolerance: dict) -> float:
    """How many times its tolerance a way's largest departure is, over every comparison (gradients per step,
    losses, the loss after the last update, the final weights)."""
    values = [v / tolerance["gradient_steps"].get(s, tolerance["gradients"])
              for s, v in (row.get("gradient_steps") or {}).items()]
    values += [row.get(k, 0.0) / tolerance[t] for k, t in (("loss_difference", "losses"),
                                                           ("after_difference", "after"),
                                                           ("weight_difference", "weights"))]
    return max(values)


def _explain_auxiliary(report: dict, reference: Outcome, outcomes: list[Outcome]) -> None:
    """Name the auxiliary loss as the cause when, without it, every split is exact within the same tolerances
    (against ``reference``, the reference without it); adds the runs without it to the table."""
    exact = []
    for o in outcomes:
        if o.error is not None or reference.error is not None:
            continue
        row = _measure(o, reference)
        bad = _departures(row, o, reference, report["tolerance"])
        exact.append(not bad)
        report["rows"].append({"way": o.way.label, "role": "split", "engine": "accelerate", "seconds": round(o.seconds, 2),
                               "skipped_steps": o.skipped, "items": o.items, "error": None, **row,
                               "verdict": "exact" if not bad else "NOT EXACT: " + "; ".join(bad)})
    report["auxiliary_loss_exact_without"] = bool(exact) and all(exact)
    if report["auxiliary_loss_exact_without"]:
        report["causes"] = [c for c in report["causes"] if not c.startswith("cause not identified")]
        report["causes"].insert(0, "the model's auxiliary (router load-balancing) loss: without it (router_aux_loss_coef "
                                   "0) every split is exact, so the cross-entropy part accumulates exactly; the "
                                   "auxiliary part is computed per forward pass over its own tokens and depends on "
                                   "the micro-batch")


@reports_errors
def main(argv: list[str] | None = None) -> int:
    """``finetune verify``'s process entry (``accelerate launch --module finetune.commands.verify``): the exit code, 2 with
    one ``error:`` line for bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(__doc__)
        return 0
    # an error every process raises together leaves the group first (distributed.leaving_together)
    code = distributed.leaving_together(lambda: verify(*parse(argv)))
    distributed.leave()  # every process finished: leave the process group together, not at interpreter exit
    return code


if __name__ == "__main__":
    sys.exit(main())
