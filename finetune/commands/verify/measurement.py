"""verify's measurement: how far a way departs from the reference (each optimizer step's gradients, the per-step
losses, the loss after the last update, the final weights as a fraction of the distance trained, the items per
step) and the noise floor and tolerance the floor ways give. Relative differences throughout (norms over the whole
model, in float64 sums of fp32 tensors)."""

from __future__ import annotations

import math

from finetune.commands.verify.ways import Outcome

# The smallest tolerance: 16 units in the last place of fp32 (relative), for ways whose floors are bit-identical.
# Lower precisions get theirs from the floor ways, which change shapes as splits do (docs/verify.md).
MIN_TOLERANCE = 16 * 2.0**-24
FLOOR_FACTOR = 2  # tolerance = FLOOR_FACTOR x the noise floor (at least MIN_TOLERANCE); measured: docs/verify.md


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
    per-step losses, the final weights, the per-step items, the trainable parameters that could not be
    compared (names on one side only), and a quantized base other than the reference's or changed during the run
    (``base_differs``, ``base_changed``: the hashes' first 12 hex digits)."""
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
    if o.base is not None and reference.base is not None:
        if o.base[0] != reference.base[0]:  # quantized otherwise: not the reference's weights
            row["base_differs"] = [o.base[0][:12], reference.base[0][:12]]
        if o.base[1] != o.base[0]:  # the frozen base changed during the run
            row["base_changed"] = [o.base[0][:12], o.base[1][:12]]
    departs = next((i for i, (a, b) in enumerate(zip(o.items, reference.items)) if a != b), None)
    if departs is not None:
        row["items_differ"] = [departs + 1, o.items[departs], reference.items[departs]]
    return row


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
