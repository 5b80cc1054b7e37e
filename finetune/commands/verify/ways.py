"""verify's ways and controls: what each way is (``Way``) and what it produced (``Outcome``), which ways an
effective batch gets (``ways_for``), how much data makes the last window partial, and the changes that make a way
out of the accelerate backend's run (``vary(built)``): the floor's reordered rows, the chunked floor's loss, the
controls' mis-weighted loss, the floor model (no auxiliary loss, BatchNorm frozen). How they are judged:
docs/verify.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from finetune.errors import FinetuneError
from finetune.models.loading import load_tokenizer
from finetune.tasks import run_task, task_of
from finetune.tasks.builders import build_datasets, raw_datasets

# the calibrated small controls: (what is mis-weighted, the size verify claims to detect); a control not caught at
# that size is run again at each larger size of the ladder, and the smallest caught is the threshold stated
SMALL_CONTROLS = (("micro-batch", 0.01), ("last window", 0.015))
SMALL_CONTROL_LADDER = (1, 3, 10)  # multiples of the claimed size
FLOOR_ROLES = ("floor", "chunked")  # ways that are the reference computed another way: they set the tolerance


@dataclass(frozen=True)
class Way:
    """One way of training the effective batch: ``micro`` samples per micro-batch x ``accumulation`` micro-batches
    per process. ``role``: "reference", "floor" (the reference, each window's samples reordered), "chunked" (the
    reference, each micro-batch's loss computed over row chunks of the splits' micro-batch sizes, ``chunks`` in
    turn, with one backward: the splits' shapes, the same sum), "split", "control" (a wrong normalisation), "engine" (through ``--backend
    trainer``), "packed" (the user's ``--padding_free``/``--packing``, ``packing``: against the padded
    reference, so a user proves that their model and attention implementation keep packed sequences apart) or
    "generation" (a task that generates: the reference's run that generates the completions every way replays).
    ``flags``: the way's own training flags ((field, value), ...: a task's mean-of-means control)."""

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
    flags: tuple = ()  # "control": the task's mean of micro-batch means, ((field, value), ...) (Task.mean_of_means)

    @property
    def backend(self) -> str:
        return "trainer" if self.role == "engine" or self.trainer else "accelerate"

    @property
    def label(self) -> str:
        extra = {"floor": ", samples reordered", "chunked": f", in chunks of {'/'.join(map(str, self.chunks))}",
                 "control": ", mean of micro-batch means" if self.flags else ", wrong normalisation",
                 "engine": ", Trainer", "generation": ", generated",
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
    initial and final weights, the float buffers, a quantized base's hash as built and after the run (``base``:
    the weights every way must train on alike, and leave as they were), ``measured`` (its differences from the
    reference) and
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
    base: tuple | None = None  # a quantized base's sha256 when built and after the run; None: full precision
    measured: dict | None = None
    output_dir: str = ""
    control: str | None = None  # the control's wrong normalisation
    seconds: float = 0.0
    error: str | None = None

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


def for_task(ways: list[Way], task, trainer_refusal: str | None) -> list[Way]:
    """``ways`` as the run's ``task`` allows: no Trainer ways where its backend refuses the task
    (``trainer_refusal``), no chunked floor where the loss depends on the split by definition (a mean per micro-batch,
    which chunks change: ``Task.split_dependence``), the task's own mean-of-means control where it has one
    (``Task.mean_of_means``)."""
    control = task.mean_of_means
    return [dataclasses.replace(w, flags=tuple(control[1].items())) if w.role == "control" and control else w
            for w in ways if not (trainer_refusal and w.backend == "trainer")
            and not (task.split_dependence and w.role == "chunked")]


def trainer_refusal(recipe, config) -> str | None:
    """The Trainer backend's refusal of ``config``'s task (the task's ``FinetuneError``, as ``--backend trainer``
    would print it), or None where the task runs on it."""
    try:
        run_task(recipe, dataclasses.replace(config, backend="trainer"))
    except FinetuneError as err:
        return str(err)
    return None


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
    task = task_of(recipe)
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
