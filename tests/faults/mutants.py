"""Wrong engines for ``finetune verify`` to catch: copies of the accelerate backend's loop (``finetune/backends/accelerate.py``)
with one normalisation line changed, as a user's bad luck or a future regression would change it. Each mutant
is a list of (line as it stands, line as the mutant has it); ``mutate`` applies them to the module's source (each
must match exactly once, so a mutant that no longer applies fails loudly instead of testing the clean engine)
and runs the result in place of the module's functions.

The correct line, ``scaled = loss_sum * (K * P / counts.items)``, divides each micro-batch's summed loss by the
items (samples, or label tokens) of its whole window over every process, undoing ``accelerator.backward``'s
division by K (N for padded micro-batches, the window's own count when packing) and DDP's average over P.

- ``partial-under``: a short last window weighted by its share of N (``* len(window) / N``): Accelerate's own
  default, which divides every window's loss by N.
- ``partial-over``: a short last window scaled up as if it were full (``* N / len(window)``).
- ``drop-processes``: DDP's average over P not undone (``K / counts.items``): every gradient 1/P.
- ``own-items``: each process normalises by its own window's items, not every process's (a tensor, as such code
  would count them: a process whose window holds only repeated rows divides by 0 and gets inf, not an exception
  on one rank).
- ``mean-of-means``: each micro-batch's mean loss, divided by N: the mean of the micro-batch means.
- ``micro-batch-1%``: the first micro-batch of each window weighted 1.01 (small: at the size verify's calibrated
  control claims to catch).
- ``last-window-1.5%``: a short last window weighted 1.015 (small, likewise).

Two ways in: ``install_mutant(name, set_attr)`` in this process (``monkeypatch.setattr``, undone after the
test), or ``FAULT_MUTANT=name`` with ``tests/faults`` first on a launched process's ``PYTHONPATH``
(``sitecustomize`` → ``finetune_faults.install_on_import``).
"""

from __future__ import annotations

import inspect

MUTANT_ENV = "FAULT_MUTANT"
CORRECT = "scaled = loss_sum * (K * P / counts.items)"
COUNT = "counts = count_window(run_window, task, accelerator, run.repeats(len(window)), micro_batches)"

MUTANTS: dict[str, list[tuple[str, str]]] = {
    "partial-under": [(CORRECT, "scaled = loss_sum * (K * P / counts.items) * (len(window) / N)")],
    "partial-over": [(CORRECT, "scaled = loss_sum * (K * P / counts.items) * (N / len(window))")],
    "drop-processes": [(CORRECT, "scaled = loss_sum * (K / counts.items)")],
    "own-items": [(COUNT, COUNT + "; own_items = sum(task.count(b) for b in run_window)"),
                  (CORRECT, "scaled = loss_sum * (K / own_items)")],
    "mean-of-means": [(CORRECT, "scaled = loss_sum / task.count(batch).clamp(min=1)")],
    # small: the size verify's calibrated small controls claim to detect (finetune.commands.verify.SMALL_CONTROLS)
    "micro-batch-1%": [(CORRECT, "scaled = loss_sum * (K * P / counts.items) * (1.01 if batch is micro_batches[0] "
                                 "else 1.0)")],
    "last-window-1.5%": [(CORRECT, "scaled = loss_sum * (K * P / counts.items) * (1.015 if len(window) < N else 1.0)")],
}
SMALL_MUTANTS = ("micro-batch-1%", "last-window-1.5%")

# Not a wrong result but wasted communication, for the DDP sync log (``finetune_faults.install_sync_log``) to
# catch, not verify (its weights are right): every micro-batch all-reduces, as if ``no_sync`` were forgotten
# (DDP's forward prepares the reducer when ``require_backward_grad_sync`` is set, which ``no_sync`` clears).
SYNC_MUTANTS: dict[str, list[tuple[str, str]]] = {
    "sync-every-micro-batch": [("loss_sum = built.micro_batch_loss(model, batch)",
                                "model.require_backward_grad_sync = True; "
                                "loss_sum = built.micro_batch_loss(model, batch)")],
}


def mutated_source(name: str, source: str) -> str:
    """``source`` (``finetune/backends/accelerate.py``) with mutant ``name``'s lines changed (``MUTANTS`` or ``SYNC_MUTANTS``).
    Raises ``KeyError`` for an unknown mutant, ``ValueError`` when a line to change is not in the source exactly
    once."""
    for old, new in {**MUTANTS, **SYNC_MUTANTS}[name]:
        if source.count(old) != 1:
            raise ValueError(f"mutant {name}: {old!r} occurs {source.count(old)} times in finetune/backends/accelerate.py")
        source = source.replace(old, new)
    return source


def mutate(module, name: str, set_attr=setattr) -> None:
    """Run mutant ``name`` of ``module`` (``finetune.backends.accelerate``): its source changed, executed in a namespace of
    its own, and every function and class of the module replaced by the mutant's (``set_attr``)."""
    namespace = {"__name__": module.__name__, "__file__": module.__file__}
    exec(compile(mutated_source(name, inspect.getsource(module)), module.__file__, "exec"), namespace)
    for key, value in namespace.items():
        if (inspect.isfunction(value) or inspect.isclass(value)) and getattr(value, "__module__", None) == module.__name__:
            set_attr(module, key, value)


def install_mutant(name: str, set_attr=setattr) -> None:
    """Mutant ``name`` in this process (``set_attr``: pytest's ``monkeypatch.setattr``)."""
    import finetune.backends.accelerate

    mutate(finetune.backends.accelerate, name, set_attr)
