"""verify's judgement: each way's verdict against the tolerance, the positive control's margin, the small
controls' thresholds, the premises (determinism, item counts), the verdict (exact, not exact, inconclusive) and its
causes. Works on the ``Outcome``s of global rank 0; no collective. How it decides: docs/verify.md."""

from __future__ import annotations

from finetune.commands.verify.measurement import (
    FLOOR_FACTOR,
    _first_departure,
    _measure,
    _norm,
    _tolerances,
)
from finetune.commands.verify.observation import PADDING_PROBE_TOKENS, depends_on_padding
from finetune.commands.verify.ways import FLOOR_ROLES, Outcome
from finetune.errors import FinetuneError

CONTROL_FACTOR = 10  # the positive control must exceed the tolerance this many times, or "inconclusive"
DETERMINISM_TOLERANCE = 1e-4  # a micro-batch's gradients computed twice may differ this much (GPU atomics)


def compare(outcomes: list[Outcome], steps: int, model_notes: dict, detects: list[dict] | None = None) -> dict:
    """The table and the verdict from every way's ``Outcome`` (each already ``measured`` against the reference,
    or measured here): tolerances from the floor ways, each way's departures, the control's margin, the small
    controls (``detects``, from the small controls phase: "exact" needs each caught at its claimed size), the
    premises (determinism, item counts) and the causes. Raises ``FinetuneError`` if no reference ran."""
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
        row, failed = _row(o, reference, tolerance, detects)
        if o.error is None and o.way.role == "control":
            control_margin = _control_margin(row, tolerance, grads_seen)
        rows.append(row)
        failures += [o.way.label] if failed else []
    dependent = _split_dependent(rows, failures, tolerance, model_notes.get("split_dependence"))
    determinism = reference.determinism or {}
    random = determinism.get("difference") is not None and determinism["difference"] > DETERMINISM_TOLERANCE
    moved = reference.base is not None and reference.base[1] != reference.base[0]  # the reference's own base
    verdict = _verdict(random or moved, failures, control_margin, detects)
    verdict = "split-dependent" if dependent and not (random or moved or failures) else verdict
    causes = [dependent] if verdict == "split-dependent" else []
    if random:
        causes.append(_nondeterminism_cause(determinism))
    if moved:
        causes.append(f"the quantized base changed during the reference's run (sha256 {reference.base[0][:12]}... as "
                      f"built, {reference.base[1][:12]}... after): a frozen base must stay bit for bit what it was, or "
                      "no way can be compared with it (bitsandbytes repacks 4-bit weights for its CPU kernel in eval "
                      "mode unless its layers' support_avx512bf16_for_cpu is off: finetune turns it off)")
    if failures:
        causes += _causes(outcomes, reference, tolerance, model_notes)
    elif not (random or moved) and verdict == "inconclusive":
        causes += _unproven(control_margin, detects, grads_seen)
    last = reference.samples[-1] if reference.samples else None
    # how far the correct ways stand from the floor (FLOOR_FACTOR is set from this, measured: docs/verify.md)
    judged = [r for r in rows if r["role"] in ("split", "engine", "packed") and r.get("loss_difference") is not None]
    over_floor = max((_margin(r, tolerance) * FLOOR_FACTOR for r in judged), default=None)
    return {"split_over_floor": over_floor, "verdict": verdict, "precision": model_notes.get("precision", "no"),
            "verify_steps": steps, "detects": detects or [], "detects_line": detects_line(detects or []),
            "tolerance": tolerance, "noise_floor": floor, "control_margin": control_margin,
            "reference": reference.way.label, "rows": rows, "not_exact": failures, "causes": causes,
            "gradients_compared": grads_seen, "determinism": determinism, "last_window_samples": last,
            "quantized_base_sha256": reference.base[0] if reference.base else None,
            **model_notes}


def _row(o: Outcome, reference: Outcome, tolerance: dict, detects: list[dict] | None) -> tuple[dict, bool]:
    """(the table's row for ``o``, whether ``o`` fails the check): a way that failed to run where others run (not
    for want of memory, and not a control) fails, and so does a way judged beyond the tolerance; the reference, the
    floors and the controls are measured, not judged."""
    row = {"way": o.way.label, "role": o.way.role, "engine": o.way.backend, "micro_batch": o.way.micro,
           "accumulation": o.way.accumulation, "seconds": round(o.seconds, 2), "error": o.error,
           "skipped_steps": o.skipped, "items": o.items}
    if o.error is not None:
        failed = not o.error.startswith("does not fit") and o.way.role not in ("control", "small control")
        if failed:  # a way that fails (a non-finite gradient, ...) where others run
            row["verdict"] = f"NOT EXACT: {o.error}"
        return row, failed
    if o is reference:
        row["verdict"] = "reference"
        return row, False
    row.update(o.measured)
    if o.way.role == "small control":
        tried = next((t for d in detects or [] if d["target"] == o.way.target for t in d["tried"]
                      if t["size"] == o.way.size), {})
        row["verdict"] = (f"small control: {'caught' if tried.get('caught') else 'NOT caught'} "
                          f"({_fmt(tried.get('margin'))} x the tolerance and {o.control}'s own noise; "
                          f"against {o.control})")
    elif o.way.role == "control":
        row["verdict"] = f"control: {o.control}"
    elif o.way.role == "floor reference":
        row["verdict"] = "reference of the chunked floor"
    elif o.way.role in FLOOR_ROLES:
        row["verdict"] = "noise floor"
    else:
        bad = _departures(row, o, reference, tolerance)
        row["verdict"] = "exact" if not bad else "NOT EXACT: " + "; ".join(bad)
        return row, bool(bad)
    return row, False


def _split_dependent(rows: list[dict], failures: list[str], tolerance: dict, dependence: str | None) -> str | None:
    """Where the run's loss depends on the split by its definition (``Task.split_dependence``: TRL's bnpo), its
    splits' departures are measured, not judged: each such row says so and leaves ``failures``. Returns the cause
    with the largest departure measured, or None where the loss does not."""
    if not dependence:
        return None
    splits = [r for r in rows if r["role"] == "split" and r.get("error") is None and "loss_difference" in r]
    for r in splits:
        if r["way"] in failures:
            failures.remove(r["way"])
            r["verdict"] = "split-dependent by definition: " + r["verdict"].removeprefix("NOT EXACT: ")
    worst = max(splits, key=lambda r: _margin(r, tolerance), default=None)
    if worst is None:
        return dependence
    return (f"{dependence}; measured: {worst['way']} departs by {_margin(worst, tolerance):.3g} x the tolerance "
            f"(gradients {_fmt(worst.get('gradient_difference'))} at step 1, final weights "
            f"{_fmt(worst.get('weight_difference'))} of the distance trained)")


def _verdict(premise_failed: bool, failures: list, control_margin: float | None, detects: list[dict] | None) -> str:
    """"inconclusive" where a premise fails (determinism, the reference's quantized base unchanged by its run),
    "not exact" where a way fails, "inconclusive" where the positive control or a small control at its claimed size
    was not caught, else "exact"."""
    if premise_failed:
        return "inconclusive"
    if failures:
        return "not exact"
    if control_margin is None or control_margin < CONTROL_FACTOR:
        return "inconclusive"
    if detects is not None and not all(d["threshold"] == d["claimed"] for d in detects):
        return "inconclusive"
    return "exact"


def _unproven(control_margin: float | None, detects: list[dict] | None, gradients: bool) -> list[str]:
    """The causes of an inconclusive verdict without failures: the positive control not far enough out, the small
    controls not caught at their claimed size."""
    causes = []
    if control_margin is None or control_margin < CONTROL_FACTOR:
        causes.append("the positive control (a wrong normalisation) did not depart by "
                      f"{CONTROL_FACTOR} x the tolerance, so these comparisons could not be shown to see one")
    return causes + [_undetected(d, gradients) for d in detects or [] if d["threshold"] != d["claimed"]]

def _unlike_inputs(row: dict) -> list[str]:
    """What in ``row`` says the way did not train what the reference trained, in words: other item counts, another
    quantized base or one changed during the run."""
    bad = []
    if "items_differ" in row:
        step, items, expected = row["items_differ"]
        bad.append(f"step {step} trains {items:g} items where the reference trains {expected:g}")
    if "base_differs" in row:
        own, theirs = row["base_differs"]
        bad.append(f"it trains on another quantized base (sha256 {own}... where the reference's is {theirs}...)")
    if "base_changed" in row:
        built, after = row["base_changed"]
        bad.append(f"its quantized base changed during its run (sha256 {built}... as built, {after}... after)")
    return bad


def _departures(row: dict, o: Outcome, reference: Outcome, tolerance: dict) -> list[str]:
    """What in ``row`` (``_measure``) exceeds ``tolerance``, or could not be compared, in words; empty when
    ``o`` is exact."""
    bad = _unlike_inputs(row)
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
    items another way), a quantized base other than the reference's or changed during a run, BatchNorm (its running
    statistics differ), a model-added auxiliary loss, outputs that depend on padding; else that no cause was
    identified."""
    found = []
    for o in outcomes:
        if o.measured and "items_differ" in o.measured and "control" not in o.way.role:  # a control counts its own
            step, items, expected = o.measured["items_differ"]
            found.append(f"item counts: {o.way.label} divides step {step}'s loss by {items:g} items where the "
                         f"reference counts {expected:g}; the two count the loss's items (samples, or label tokens) "
                         "differently")
        if o.measured and "base_differs" in o.measured:
            own, theirs = o.measured["base_differs"]
            found.append(f"the quantized base: {o.way.label} was quantized otherwise than the reference (sha256 "
                         f"{own}... where the reference's is {theirs}...): its base weights are not the reference's")
        if o.measured and "base_changed" in o.measured:
            built, after = o.measured["base_changed"]
            found.append(f"the quantized base: {o.way.label}'s changed during its run (sha256 {built}... as built, "
                         f"{after}... after): a frozen base must stay what it was")
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

def _fmt(value) -> str:
    return "" if value is None else f"{value:.2e}" if isinstance(value, float) else str(value)

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
