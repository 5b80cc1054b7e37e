"""``finetune verify``: prove that this model, precision, engine and launch train, under accumulation, the weights
the large batch trains.

    finetune verify [accelerate launcher flags] --recipe NAME|path.py [training flags] [--verify_steps K]

From the same initial weights and sample order, K optimizer steps (default 3) of one effective batch B run in
several ways, one after the other in the same launch: B x 1 per process (the reference), the reference with each
window's samples reordered (the noise floor), accumulation splits m x N, a positive control with a deliberately
wrong normalisation, and the Trainer engine. Compared: step 1's gradients, the per-step losses, the final weights
(as a fraction of the distance trained). Exit 0: exact; 1: not exact, or inconclusive; 2: bad input. Writes
``verify.json`` and ``verify.md`` to ``--output_dir`` (default ``outputs/<recipe>-verify``). How it decides:
docs/verify.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from finetune import distributed
from finetune import train as accelerate_engine
from finetune import trainer_backend
from finetune.builders import get_task
from finetune.config import parse_config
from finetune.errors import FinetuneError
from finetune.planner import plan_for
from finetune.recipes import load_recipe
from finetune.run import apply_plan, use_available_cpu_cores

DEFAULT_STEPS = 3
# The smallest tolerance per precision: 16 units in the last place of fp32, 2 of fp16 and bf16 (relative).
MIN_TOLERANCE = {"no": 16 * 2.0**-24, "fp16": 2 * 2.0**-11, "bf16": 2 * 2.0**-8}
FLOOR_FACTOR = 10  # tolerance = FLOOR_FACTOR x the noise floor (at least MIN_TOLERANCE)
CONTROL_FACTOR = 10  # the positive control must exceed the tolerance this many times, or "inconclusive"
PADDING_PROBE_TOKENS = 8  # pad tokens the padding probe appends to one batch
USAGE = __doc__.split("\n\n")[1].strip()
# what the check turns off or fixes: dropout (it verifies accumulation, not randomness), evaluation, checkpoints,
# trackers, the planner (B is fixed by the flags or planned once here)
CHECK_SETTINGS = dict(disable_dropout=True, lora_dropout=0.0, eval_strategy="no", eval_on_start=False,
                      save_strategy="no", checkpointing_steps=None, save_total_limit=None,
                      load_best_model_at_end=False, early_stopping_patience=None, logging_steps=1, report_to="none",
                      resume_from_checkpoint=None, overwrite_output_dir=True, total_batch_size=None,
                      auto_find_batch_size=False, compare=False, backend="accelerate")


@dataclass(frozen=True)
class Way:
    """One way of training the effective batch: ``micro`` samples per micro-batch x ``accumulation`` micro-batches
    per process. ``role``: "reference", "floor" (the reference, each window's samples reordered), "split",
    "control" (a wrong normalisation, step 1 only) or "engine" (through ``--backend trainer``)."""

    role: str
    micro: int
    accumulation: int
    variant: str = ""  # "without the auxiliary loss": the model's router_aux_loss_coef set to 0

    @property
    def backend(self) -> str:
        return "trainer" if self.role == "engine" else "accelerate"

    @property
    def label(self) -> str:
        extra = {"floor": ", samples reordered", "control": ", wrong normalisation", "engine": ", Trainer"}
        variant = f", {self.variant}" if self.variant else ""
        return f"{self.micro} x {self.accumulation}{extra.get(self.role, '')}{variant}"

    @property
    def slug(self) -> str:
        return f"{self.role}-{self.micro}x{self.accumulation}" + ("-no-aux" if self.variant else "")


@dataclass
class Outcome:
    """What one way produced (on global rank 0; other ranks keep nothing): per-step ``losses`` and ``skipped``
    steps (fp16 loss scaling), step 1's ``gradients`` before clipping (name -> fp32 tensor; None where the
    optimizer step is inside a sharding engine's backward), the initial and final weights, the float buffers, and
    ``error`` for a way that did not run (out of memory)."""

    way: Way
    losses: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    gradients: dict | None = None
    gradient_step: int | None = None
    initial: dict | None = None
    final: dict | None = None
    buffers: dict | None = None
    padding_effect: float | None = None
    notes: dict | None = None  # the reference's model: BatchNorm modules, an auxiliary loss; precision, engine
    output_dir: str = ""
    control: str | None = None  # the control's wrong normalisation
    seconds: float = 0.0
    error: str | None = None


def parse(argv: list[str]) -> tuple:
    """(config, verify steps K): ``--verify_steps`` taken out, the rest parsed as training flags; the output
    directory defaults to ``outputs/<recipe>-verify``. Raises ``FinetuneError``."""
    steps, rest, i = DEFAULT_STEPS, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--verify_steps" or arg.startswith("--verify_steps="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            try:
                steps = int(value)
            except ValueError:
                steps = 0
            if steps < 1:
                raise FinetuneError(f"--verify_steps must be a positive number of optimizer steps, got {value!r}.")
            continue
        rest.append(arg)
        i += 1
    given_output = any(a == "--output_dir" or a.startswith("--output_dir=") for a in rest)
    config = parse_config(rest)
    if not given_output:
        config = dataclasses.replace(config, output_dir=f"{config.output_dir}-verify")
    return config, steps


def ways_for(per_process_batch: int, accumulation: int) -> list[Way]:
    """The ways for a per-process window of ``per_process_batch`` samples (B / processes): the reference
    ``b x 1``, its floor, up to three splits (the run's own accumulation, micro-batch 1, the smallest split), the
    control (on the split with the most micro-batches), and the Trainer engine on the reference and that split.
    Raises ``FinetuneError`` where ``b`` is 1 (nothing to split)."""
    b = per_process_batch
    if b < 2:
        raise FinetuneError(f"the effective batch is {b} sample(s) per process: there is nothing to accumulate. "
                            "Raise --per_device_train_batch_size or --gradient_accumulation_steps.")
    divisors = [n for n in range(2, b + 1) if b % n == 0]
    chosen = sorted({n for n in (accumulation, b, divisors[0]) if n in divisors})
    most = chosen[-1]
    return [Way("reference", b, 1), Way("floor", b, 1), *(Way("split", b // n, n) for n in chosen),
            Way("control", b // most, most), Way("engine", b, 1), Way("engine", b // most, most)]


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


class _WrongNormalisation:
    """The positive control's micro-batch loss. ``mean_of_means``: each micro-batch's sum divided by its own items
    (the loop's window scale undone), the mean of the micro-batch means, which differs from the window's mean
    where item counts differ; else the loss not divided by N (N times the gradient). ``counts``: the items of
    each micro-batch seen, to tell afterwards whether they differed."""

    def __init__(self, task, mean_of_means: bool, window_items: float, micro_batches: int, processes: int):
        self.task, self.mean_of_means, self.counts = task, mean_of_means, []
        self.scale = window_items / (micro_batches * processes)  # the loop multiplies by N * P / window items
        self.micro_batches = micro_batches

    def vary(self, built):
        loss = built.micro_batch_loss

        def wrong(model, batch, labels):
            items = self.task.count(labels)
            self.counts.append(float(items))
            if self.mean_of_means:
                return loss(model, batch, labels) / items.clamp(min=1) * self.scale
            return loss(model, batch, labels) * self.micro_batches

        return dataclasses.replace(built, micro_batch_loss=wrong)


class _Observer:
    """Builds one accelerate-engine run (``train.setup``) and observes it: the initial weights, step 1's
    gradients in an optimizer pre-step hook (torch 2.13 ``register_optimizer_step_pre_hook``: after unscaling and
    clipping, before the update), and the run itself for reading the final weights. ``vary(built)`` changes the
    run (the floor's order, the control's loss)."""

    def __init__(self, keep: bool, vary=None):
        self.keep, self.vary = keep, vary
        self.built, self.initial, self.gradients, self.handle = None, None, None, None

    def build(self, config, recipe):
        built = accelerate_engine.setup(config, recipe)
        if self.vary is not None:
            built = self.vary(built)
        self.built = built
        initial = built.engine.full_parameters(built.model)
        self.initial = initial if self.keep else None
        unwrapped = built.accelerator.unwrap_model(built.model, keep_torch_compile=False)
        names = {id(p): n for n, p in unwrapped.named_parameters()}
        inner = getattr(built.optimizer, "optimizer", built.optimizer)

        def capture(optimizer, args, kwargs):
            if optimizer is not inner or self.gradients is not None:
                return
            grads = {names[id(p)]: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     for group in optimizer.param_groups for p in group["params"]
                     if p.grad is not None and id(p) in names}
            self.gradients = {n: g.detach().float().cpu().clone() for n, g in grads.items()} if self.keep else {}

        self.handle = register_optimizer_step_pre_hook(capture)
        return built

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.built = None


def _read_log(out: Path) -> list[dict]:
    path = out / "log.jsonl"
    if not path.is_file():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip()) if "loss" in r]


def _unclip(gradients: dict, grad_norm: float | None, max_norm: float) -> dict:
    """Step 1's gradients before clipping: torch's ``clip_grad_norm_`` multiplied them by
    ``min(1, max_norm / (norm + 1e-6))`` (torch 2.13 ``nn/utils/clip_grad.py`` ``_clip_grads_with_norm_``)."""
    if not max_norm or max_norm <= 0 or grad_norm is None:
        return gradients
    coefficient = min(1.0, max_norm / (grad_norm + 1e-6))
    return {n: g / coefficient for n, g in gradients.items()}


def _padding_effect(built) -> float | None:
    """How much the model's outputs move when one training batch gets ``PADDING_PROBE_TOKENS`` more pad tokens
    (attention mask 0): max |logits change| over the real positions / max |logits|, in eval mode without
    gradients. None where the batch has no attention mask. Every process calls it (a sharded forward is
    collective)."""
    model = built.engine.eval_model(built.model)
    batch = next(iter(built.train_dataloader))
    if "attention_mask" not in batch:
        return None
    batch = {k: v for k, v in batch.items() if k != "labels"}
    pad_id = getattr(built.tokenizer, "pad_token_id", None) or 0
    longer = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() == 2:
            fill = pad_id if key == "input_ids" else 0
            extra = torch.full((value.shape[0], PADDING_PROBE_TOKENS), fill, dtype=value.dtype, device=value.device)
            longer[key] = torch.cat([value, extra], dim=1)
        else:
            longer[key] = value
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            short = model(**batch).logits.float()
            long = model(**longer).logits.float()
    finally:
        model.train(was_training)
    if long.dim() == 3:  # per position: compare the real positions
        long = long[:, : short.shape[1]]
        mask = batch["attention_mask"].bool()
        short, long = short[mask], long[mask]
    scale = short.abs().max().clamp(min=1e-12)
    return float((short - long).abs().max() / scale)


def _without_auxiliary(built):
    """The run with its model's auxiliary loss off (``router_aux_loss_coef`` 0: ``loss.auxiliary_loss_sum``)."""
    model = built.accelerator.unwrap_model(built.model, keep_torch_compile=False)
    model.config.router_aux_loss_coef = 0.0
    return built


def run_way(way: Way, base, recipe, root: Path, steps: int, keep: bool, control=None) -> Outcome:
    """Train ``way`` for ``steps`` optimizer steps (the control: one) into ``root / way.slug`` and collect its
    ``Outcome`` (tensors on global rank 0 only: ``keep``). Collective: every process runs every way."""
    config = dataclasses.replace(base, per_device_train_batch_size=way.micro, gradient_accumulation_steps=way.accumulation,
                                 max_steps=1 if way.role == "control" else steps, output_dir=str(root / way.slug),
                                 backend=way.backend)
    config.validate()
    out = Path(config.output_dir)
    outcome = Outcome(way, output_dir=str(out))
    distributed.reset_state()
    start = time.perf_counter()
    vary = {"floor": lambda built: dataclasses.replace(built, train_dataloader=_RowsReversed(built.train_dataloader)),
            "control": control}.get(way.role)
    if way.variant:
        vary = _without_auxiliary
    observer = _Observer(keep, vary)
    rank = f".rank{os.environ.get('RANK', '0')}" if distributed.world_size() > 1 else ""
    log = root / "logs" / f"{way.slug}{rank}.log"  # each run's banner, progress and warnings: the console gets one line
    log.parent.mkdir(parents=True, exist_ok=True)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its handler writes to the stderr it found at import
    try:
        with open(log, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            _train_way(way, config, recipe, observer, keep, outcome)
    except torch.OutOfMemoryError as err:
        if distributed.world_size() > 1:
            raise FinetuneError(f"verify: {way.label} ran out of memory ({err}). Every way must fit on every "
                                "process: lower the effective batch.") from None
        outcome.error = "does not fit (out of memory)"
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
    observer.built = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outcome


def _train_way(way: Way, config, recipe, observer: _Observer, keep: bool, outcome: Outcome) -> None:
    """Train one way with its engine; for the accelerate engine, read the final weights, buffers and (the
    reference) the padding probe from the run it built."""
    if way.backend == "trainer":
        trainer_backend.train(config, recipe)
        return
    accelerate_engine.train(config, recipe, build=observer.build)
    built = observer.built
    final = built.engine.full_parameters(built.model)
    buffers = built.engine.full_buffers(built.model)
    padding = _padding_effect(built) if way.role == "reference" else None
    if keep:
        outcome.initial, outcome.final, outcome.buffers = observer.initial, final, buffers
        outcome.padding_effect = padding
        outcome.notes = _model_notes(built)


def _read_outcome(outcome: Outcome, out: Path, observer: _Observer, base) -> None:
    """Fill ``outcome`` from the way's ``log.jsonl`` (losses, skips), its saved model (the Trainer engine) and the
    observed gradients (unclipped)."""
    way = outcome.way
    records = _read_log(out)
    outcome.losses = [r["loss"] for r in records]
    outcome.skipped = [r["step"] for r in records if r.get("skipped")]
    if way.backend == "trainer" and not base.use_peft and (out / "model.safetensors").is_file():
        outcome.final = {n: t.float() for n, t in load_file(str(out / "model.safetensors")).items()}
    if observer.gradients:
        first = next((r for r in records if not r.get("skipped")), None)
        outcome.gradient_step = first["step"] if first else None
        outcome.gradients = _unclip(observer.gradients, first.get("grad_norm") if first else None, base.max_grad_norm)


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
    """The differences of ``o`` from ``reference``: step 1's gradients (where both were seen), and except for
    the control (one step only) the per-step losses and the final weights."""
    row = {}
    if o.gradients and reference.gradients:
        g = gradient_difference(o.gradients, reference.gradients)
        row.update(gradient_difference=g[0], gradient_worst_tensor=g[1], gradient_worst=g[2],
                   gradient_step=o.gradient_step)
    if o.way.role != "control":
        loss = loss_difference(o.losses, reference.losses)
        row.update(loss_difference=loss[0], loss_worst_step=loss[1])
        if o.final is not None and reference.final is not None:
            w = weight_difference(o.final, reference.final, reference.initial)
            row.update(weight_difference=w[0], weight_worst_tensor=w[1], weight_worst=w[2])
    return row


def _departures(row: dict, o: Outcome, reference: Outcome, tolerance: dict) -> list[str]:
    """What in ``row`` (``_measure``) exceeds ``tolerance``, in words; empty when ``o`` is exact."""
    bad = []
    if row.get("gradient_difference", 0.0) > tolerance["gradients"] and o.gradient_step == reference.gradient_step:
        bad.append(f"step {o.gradient_step}'s gradients differ by {row['gradient_difference']:.2e} "
                   f"(worst: {row['gradient_worst_tensor']})")
    if row["loss_difference"] > tolerance["losses"]:
        bad.append(f"the loss departs at step {_first_departure(o.losses, reference.losses, tolerance['losses'])}"
                   f" ({row['loss_difference']:.2e})")
    if row.get("weight_difference", 0.0) > tolerance["weights"]:
        bad.append(f"the final weights differ by {row['weight_difference']:.2e} of the distance trained "
                   f"(worst: {row['weight_worst_tensor']})")
    if len(o.losses) != len(reference.losses):
        bad.append(f"{len(o.losses)} optimizer steps ran, the reference ran {len(reference.losses)}")
    return bad


def _tolerances(floor: dict, precision: str) -> dict:
    """``FLOOR_FACTOR`` x the noise floor of each comparison, at least ``MIN_TOLERANCE[precision]``."""
    minimum = MIN_TOLERANCE.get(precision, MIN_TOLERANCE["no"])
    return {key: max(FLOOR_FACTOR * value, minimum) for key, value in floor.items()}


def compare(outcomes: list[Outcome], precision: str, steps: int, model_notes: dict) -> dict:
    """The table and the verdict from every way's ``Outcome``: tolerances from the floor (``_tolerances``), each
    way against the reference, the control's margin, the causes. Raises ``FinetuneError`` if no reference ran."""
    ran = [o for o in outcomes if o.error is None]
    reference = next((o for o in ran if o.way.role in ("reference", "split")), None)
    if reference is None:
        raise FinetuneError("verify: no way of the effective batch ran: "
                            + "; ".join(f"{o.way.label}: {o.error}" for o in outcomes if o.way.role != "floor")[:2000])
    floor_outcome = next((o for o in ran if o.way.role == "floor"), None)
    measured = _measure(floor_outcome, reference) if floor_outcome else {}
    floor = {"gradients": measured.get("gradient_difference", 0.0), "losses": measured.get("loss_difference", 0.0),
             "weights": measured.get("weight_difference", 0.0)}
    tolerance = _tolerances(floor, precision)
    rows, failures, control_margin = [], [], None
    for o in outcomes:
        row = {"way": o.way.label, "role": o.way.role, "engine": o.way.backend, "micro_batch": o.way.micro,
               "accumulation": o.way.accumulation, "seconds": round(o.seconds, 2), "error": o.error,
               "skipped_steps": o.skipped}
        if o.error is not None:
            if o.way.role in ("split", "engine") and not o.error.startswith("does not fit"):
                failures.append(o.way.label)
                row["verdict"] = f"NOT EXACT: {o.error}"
        elif o is reference:
            row["verdict"] = "reference"
        else:
            row.update(_measure(o, reference))
            if o.way.role == "control":
                margin = row.get("gradient_difference")
                control_margin = margin / tolerance["gradients"] if margin is not None else None
                row["verdict"] = f"control: {o.control}"
            elif o.way.role == "floor":
                row["verdict"] = "noise floor"
            else:
                bad = _departures(row, o, reference, tolerance)
                row["verdict"] = "exact" if not bad else "NOT EXACT: " + "; ".join(bad)
                failures += [o.way.label] if bad else []
        rows.append(row)
    grads_seen = reference.gradients is not None
    if failures:
        verdict = "not exact"
    elif grads_seen and (control_margin is None or control_margin < CONTROL_FACTOR):
        verdict = "inconclusive"
    else:
        verdict = "exact"
    return {"verdict": verdict, "precision": precision, "verify_steps": steps, "tolerance": tolerance,
            "noise_floor": floor, "control_margin": control_margin, "reference": reference.way.label, "rows": rows,
            "not_exact": failures, "causes": _causes(outcomes, reference, tolerance, model_notes) if failures else [],
            "gradients_compared": grads_seen, **model_notes}


def _causes(outcomes: list[Outcome], reference: Outcome, tolerance: dict, notes: dict) -> list[str]:
    """What makes the splits differ, where it can be measured: BatchNorm (its running statistics differ), a
    model-added auxiliary loss, outputs that depend on padding; else that no cause was identified."""
    found = []
    if notes.get("batchnorm_modules"):
        moved = [_norm([o.buffers[n] - reference.buffers[n]]) / max(_norm([reference.buffers[n]]), 1e-30)
                 for o in outcomes if o.way.role == "split" and o.buffers and reference.buffers
                 for n in reference.buffers if n in o.buffers]
        found.append(f"BatchNorm ({', '.join(notes['batchnorm_modules'][:3])}): it normalises each micro-batch over "
                     f"its own samples, so the statistics differ with the split (running statistics differ by up to "
                     f"{max(moved, default=0.0):.2e})")
    effect = reference.padding_effect
    if effect is not None and effect > tolerance["losses"]:
        found.append(f"the model's outputs depend on padding: {PADDING_PROBE_TOKENS} more pad tokens (attention mask "
                     f"0) change its logits by {effect:.2e} of their size, and each micro-batch pads to its own "
                     "longest sample")
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
    engine = built.engine.name if built.engine.name != "plain" or built.accelerator.num_processes == 1 else "DDP"
    return {"batchnorm_modules": batchnorm, "auxiliary_loss": auxiliary, "precision": built.precision,
            "engine": engine}


# ------------------------------------------------------------------------------------------ report
def _fmt(value) -> str:
    return "" if value is None else f"{value:.2e}" if isinstance(value, float) else str(value)


def render(report: dict) -> str:
    """``verify.md``: the table, the tolerances and the verdict."""
    lines = [f"# finetune verify: {report['recipe']}", "",
             f"Effective batch {report['effective_batch']} samples = micro-batch x accumulation x "
             f"{report['processes']} process(es); {report['verify_steps']} optimizer steps; precision "
             f"{report['precision']}; engine {report['engine']}; dropout off. Reference: {report['reference']}.", "",
             "| way | engine | step-1 gradients Δ | worst tensor | loss Δ (max) | final weights Δ / distance trained "
             "| worst tensor | fp16 skips | s | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        lines.append(f"| {r['way']} | {r['engine']} | {_fmt(r.get('gradient_difference'))} | "
                     f"{r.get('gradient_worst_tensor') or ''} | {_fmt(r.get('loss_difference'))} | "
                     f"{_fmt(r.get('weight_difference'))} | {r.get('weight_worst_tensor') or ''} | "
                     f"{','.join(map(str, r['skipped_steps'])) or '-'} | {r['seconds']} | "
                     f"{r.get('verdict') or r.get('error') or ''} |")
    t, f = report["tolerance"], report["noise_floor"]
    lines += ["", f"Noise floor (the reference, samples reordered): gradients {f['gradients']:.2e}, losses "
              f"{f['losses']:.2e}, weights {f['weights']:.2e}. Tolerance ({FLOOR_FACTOR} x the floor, at least "
              f"{MIN_TOLERANCE.get(report['precision'], MIN_TOLERANCE['no']):.1e} for {report['precision']}): "
              f"gradients {t['gradients']:.2e}, losses {t['losses']:.2e}, weights {t['weights']:.2e}."]
    if report["control_margin"] is not None:
        lines.append(f"Positive control (wrong normalisation): {report['control_margin']:.3g} x the gradient "
                     f"tolerance (needs >= {CONTROL_FACTOR}).")
    if not report["gradients_compared"]:
        lines.append("Step-1 gradients not compared: the engine steps its optimizer inside its own backward "
                     f"({report['engine']}); losses and the fp32 master weights are.")
    lines += ["", f"**Verdict: {report['verdict']}**"]
    lines += [f"- cause: {c}" for c in report["causes"]]
    return "\n".join(lines) + "\n"


def verify(config, steps: int) -> int:
    """Run every way and write the report; returns the exit code (0 exact, 1 not exact or inconclusive).
    Raises ``FinetuneError`` for input that cannot run."""
    recipe = load_recipe(config.recipe)
    config.validate()
    if distributed.world_size() > 1:
        distributed.process_state(timeout_seconds=config.ddp_timeout)
    use_available_cpu_cores()
    plan = plan_for(config, recipe)
    if plan is not None:
        config = apply_plan(config, plan)
    processes = distributed.world_size()
    base = dataclasses.replace(config, **CHECK_SETTINGS, batch_plan=None)
    root = Path(config.output_dir)
    if (root / "checkpoints").exists() or (root / "model.safetensors").exists():
        raise FinetuneError(f"--output_dir {root} holds a training run; verify writes its own ways there. Pass "
                            "another --output_dir.")
    ways = ways_for(config.per_device_train_batch_size * config.gradient_accumulation_steps, config.gradient_accumulation_steps)
    state = distributed.process_state()
    keep = state.is_main_process
    say = print if keep else (lambda *a, **k: None)
    say(f"finetune verify: {len(ways)} ways of the effective batch "
        f"{config.per_device_train_batch_size * config.gradient_accumulation_steps * processes}, {steps} optimizer "
        f"steps each, into {root}", flush=True)
    task = get_task(recipe.TASK)
    outcomes: list[Outcome] = []
    for way in ways:
        if way.role == "control":
            outcome = _run_control(way, outcomes, task, base, recipe, root, steps, keep)
        else:
            outcome = run_way(way, base, recipe, root, steps, keep)
        say(f"  {way.label:32s} {'(does not fit)' if outcome.error else ''}{outcome.seconds:6.1f} s", flush=True)
        outcomes.append(outcome)
    report = None
    if keep:
        notes = next((o.notes for o in outcomes if o.notes), {})
        report = compare(outcomes, notes.get("precision", "no"), steps, notes)
        report.update(recipe=recipe.NAME, processes=processes,
                      effective_batch=config.per_device_train_batch_size * config.gradient_accumulation_steps * processes)
    agree = distributed.all_reduce_max(distributed.distributed_state())
    if agree(float(bool(report and report["not_exact"] and report.get("auxiliary_loss")))):
        # run with and without it: the reference and the splits again, the auxiliary loss off
        plain = [dataclasses.replace(w, variant="without the auxiliary loss") for w in ways
                 if w.role in ("reference", "split")]
        again = []
        for way in plain:
            again.append(run_way(way, base, recipe, root, steps, keep))
            say(f"  {way.label:32s} {again[-1].seconds:6.1f} s", flush=True)
        if keep:
            _explain_auxiliary(report, again)
    code = 0
    if keep:
        root.mkdir(parents=True, exist_ok=True)
        (root / "verify.json").write_text(json.dumps(report, indent=2) + "\n")
        (root / "verify.md").write_text(text := render(report))
        print(text)
        code = 0 if report["verdict"] == "exact" else 1
    return int(agree(float(code)))


def _run_control(way: Way, outcomes: list[Outcome], task, base, recipe, root: Path, steps: int,
                 keep: bool) -> Outcome:
    """The positive control's one step: the mean of the micro-batch means; run again with the loss not divided
    by N where every micro-batch had the same items (the mean of means is then the window's mean). Collective."""
    agree = distributed.all_reduce_max(distributed.distributed_state())
    reference = next((o for o in outcomes if o.error is None and o.way.role in ("reference", "split")), None)
    window_items = agree(float(_window_items(reference) if reference is not None else 0.0))
    processes = distributed.world_size()
    control = _WrongNormalisation(task, True, window_items, way.accumulation, processes)
    outcome = run_way(way, base, recipe, root, steps, keep, control.vary)
    if not agree(float(len(set(control.counts[: way.accumulation])) > 1)):  # each process saw its own counts
        control = _WrongNormalisation(task, False, window_items, way.accumulation, processes)
        outcome = run_way(way, base, recipe, root, steps, keep, control.vary)
    outcome.control = "the mean of the micro-batch means" if control.mean_of_means else "the loss not divided by N"
    return outcome


def _explain_auxiliary(report: dict, outcomes: list[Outcome]) -> None:
    """Name the auxiliary loss as the cause when, without it, every split is exact within the same tolerances;
    adds the runs without it to the table."""
    reference = next(o for o in outcomes if o.error is None)
    exact = []
    for o in outcomes:
        if o is reference or o.error is not None:
            continue
        row = _measure(o, reference)
        bad = _departures(row, o, reference, report["tolerance"])
        exact.append(not bad)
        report["rows"].append({"way": o.way.label, "role": "split", "engine": "accelerate", "seconds": round(o.seconds, 2),
                               "skipped_steps": o.skipped, "error": None, **row,
                               "verdict": "exact" if not bad else "NOT EXACT: " + "; ".join(bad)})
    report["auxiliary_loss_exact_without"] = bool(exact) and all(exact)
    if report["auxiliary_loss_exact_without"]:
        report["causes"] = [c for c in report["causes"] if not c.startswith("cause not identified")]
        report["causes"].insert(0, "the model's auxiliary (router load-balancing) loss: without it (router_aux_loss_coef "
                                   "0) every split is exact, so the cross-entropy part accumulates exactly; the "
                                   "auxiliary part is computed per forward pass over its own tokens and depends on "
                                   "the micro-batch")


def _window_items(outcome: Outcome) -> float:
    """Step 1's loss items over all processes (samples, or label tokens for causal LM), from the run's log."""
    records = _read_log(Path(outcome.output_dir))
    return float(records[0].get("trained_tokens", records[0]["samples"])) if records else 0.0


def main(argv: list[str] | None = None) -> int:
    """``finetune verify``'s process entry (``accelerate launch --module finetune.verify``): the exit code, 2 with
    one ``error:`` line for bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        config, steps = parse(argv)
        return verify(config, steps)
    except FinetuneError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
