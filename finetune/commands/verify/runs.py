"""verify's runs: one way trained for K optimizer steps with its backend into its own output directory, observed
(``observation``), its log read back, its failure kept as the way's error (out of memory, a non-finite gradient,
a model that cannot train so) where other ways still run. Every process runs every way."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from pathlib import Path

import torch
import transformers

from finetune import distributed
from finetune.backends import accelerate as accelerate_backend
from finetune.backends import trainer as trainer_backend
from finetune.commands.verify.observation import _loss_after, _model_notes, _Observer, _padding_effect
from finetune.commands.verify.ways import Outcome, Way, _floor_model, _in_chunks, _RowsReversed
from finetune.engine import engine_for
from finetune.errors import FinetuneError, NumericalError
from finetune.lifecycle.run_log import read_log


def run_way(way: Way, base, recipe, root: Path, steps: int, keep: bool, vary=None, rows_after: int = 1) -> Outcome:
    """Train ``way`` for ``steps`` optimizer steps into ``root / way.slug`` and collect its ``Outcome`` (tensors
    on global rank 0 only: ``keep``; the padding probe on every process). ``vary(built)``: the control's change;
    ``rows_after``: the batch size (samples) of the loss after the last update, the same for every way.
    Collective: every process runs every way."""
    config = dataclasses.replace(base, per_device_train_batch_size=way.micro, gradient_accumulation_steps=way.accumulation,
                                 max_steps=steps, output_dir=str(root / way.slug), backend=way.backend,
                                 **dict(way.packing), **dict(way.flags))
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
        outcome.base = observer.base_hashes()  # after every forward of the way's run, the probes' eval ones too
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


def _unclip(gradients: dict, grad_norm: float | None, max_norm: float) -> dict:
    """Step 1's gradients before clipping: torch's ``clip_grad_norm_`` multiplied them by
    ``min(1, max_norm / (norm + 1e-6))`` (torch 2.13 ``nn/utils/clip_grad.py`` ``_clip_grads_with_norm_``)."""
    if not max_norm or max_norm <= 0 or grad_norm is None:
        return gradients
    coefficient = min(1.0, max_norm / (grad_norm + 1e-6))
    return {n: g / coefficient for n, g in gradients.items()}
