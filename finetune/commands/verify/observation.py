"""verify's observation of one run: what the loop does not log and the comparison needs. ``_Observer`` sees either
backend's run (the initial weights, each optimizer step's gradients before the update, the final weights);
beside it the premises and probes measured on the built run: ``determinism`` (one state gives one gradient), the
padding probe (``_padding_effect``), the loss after the last update and the model's notes (BatchNorm, an
auxiliary loss, precision, engine)."""

from __future__ import annotations

import contextlib
import math

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from finetune.backends import accelerate as accelerate_backend
from finetune.commands.verify.measurement import _norm
from finetune.engine import engine_for
from finetune.lifecycle.elastic import SAMPLE_IDS
from finetune.models.quantization import base_identity

PADDING_PROBE_TOKENS = 8  # pad tokens the padding probe appends to one batch
# the padding probe (fp32) calls outputs padding-dependent above PADDING_PROBE_FACTOR x its own noise (rows computed
# one by one) and at least PADDING_PROBE_MINIMUM, relative to the largest logit: fp32 rounding at another sequence
# length stays below
PADDING_PROBE_FACTOR = 3
PADDING_PROBE_MINIMUM = 1e-5


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
        self.base = None

    def _watch(self, model, engine, inner=None) -> None:
        self.initial = engine.full_parameters(model) if self.keep else None
        unwrapped = engine.accelerator.unwrap_model(model, keep_torch_compile=False)
        self.names = {id(p): n for n, p in unwrapped.named_parameters()}
        self.trainable = sorted(n for n, p in unwrapped.named_parameters() if p.requires_grad)
        self.base = _base_hash(unwrapped) if self.keep else None
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

    def base_hashes(self) -> tuple | None:
        """(a quantized base's sha256 as built, the same now), or None for a full-precision base (rank 0: ``keep``;
        None elsewhere). The base is frozen: an evaluation must not change it either (bitsandbytes' CPU repacking
        of 4-bit weights in eval mode would: ``models.quantization.prepare_for_training``)."""
        if self.base is None:
            return None
        model = self.trainer.model_wrapped if self.trainer is not None else self.built.model
        engine = engine_for(self.trainer.accelerator) if self.trainer is not None else self.built.engine
        return self.base, _base_hash(engine.accelerator.unwrap_model(model, keep_torch_compile=False))

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.built, self.trainer = None, None


def _base_hash(model) -> str | None:
    """The sha256 of ``model``'s quantized base (``models.quantization.base_identity``: every 4-bit or 8-bit layer's
    packed weights and quantization constants), None for a full-precision base."""
    identity = base_identity(model)
    return None if identity is None else identity["sha256"]


def determinism(built, micro_batch: int) -> dict:
    """The premise that one state gives one gradient: a micro-batch of the training set (its first rows),
    forward and backward twice from the same weights, in training mode, without synchronising processes.
    Returns {"difference": ‖g₁ − g₂‖ / ‖g₁‖ over the whole model, "modules": the modules whose output differs
    between two forward passes of the same input (dropout left on, ...)}; difference None where it cannot run
    here (a sharding engine steps inside its backward). A task that generates trains completions, not its rows
    (prompts): its probe micro-batch (``Task.probe_batch``) of that many prompts stands in, random tokens as long
    as the longest prompt, drawn with the global generators left as they were. The task's metric sums of these
    passes are discarded (they are no step's). Every process calls it."""
    if not built.engine.local_backward:
        return {"difference": None, "modules": []}
    model, accelerator, task = built.model, built.accelerator, built.task
    loader = built.train_dataloader
    rows = [loader.dataset[i] for i in range(min(micro_batch, len(loader.dataset)))]
    batch = loader.collate_fn(rows)
    if task.generates:
        vocab = accelerator.unwrap_model(model, keep_torch_compile=False).config.vocab_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            batch = task.probe_batch(len(rows), batch["input_ids"].shape[1], vocab, "cpu")
    batch = {k: v.to(accelerator.device) for k, v in batch.items()}
    model.train()
    grads = []
    context = model.no_sync if hasattr(model, "no_sync") else contextlib.nullcontext
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with context():
            built.micro_batch_loss(model, batch).float().backward()
        grads.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    task.take_metric_sums()
    names = [n for n in grads[0] if n in grads[1]]
    difference = _norm(grads[0][n] - grads[1][n] for n in names) / max(_norm(grads[0][n] for n in names), 1e-30)
    if not math.isfinite(difference):
        difference = float("inf")
    return {"difference": difference, "modules": _random_modules(model, task.model_inputs(batch)) if difference > 0 else []}


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
    collective). None where there is nothing to run, or for a task that generates (its rows are prompts; with the
    old policy the current one, its loss's value is the advantages' alone, whatever the weights)."""
    if dataset is None or not len(dataset) or task.generates:
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


def _model_notes(built) -> dict:
    """What the run's model has that makes training depend on the micro-batch (BatchNorm modules, an auxiliary
    loss, a loss that does by its definition), the precision that ran, the engine and a quantized base (``describe_base``; None: full precision)."""
    model = built.accelerator.unwrap_model(built.model, keep_torch_compile=False)
    batchnorm = [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    auxiliary = bool(getattr(model.config, "output_router_logits", False)) and bool(
        getattr(model.config, "router_aux_loss_coef", 0.0))
    engine = built.engine.label(built.accelerator.num_processes)
    return {"batchnorm_modules": batchnorm, "auxiliary_loss": auxiliary, "precision": built.precision,
            "engine": engine, "quantized_base": (built.base or {}).get("quantization"),
            "split_dependence": built.task.split_dependence}
