"""verify's phases, in the order they run: for a task that generates, the completions every way replays; the reference, the floors, the splits, the positive control, the Trainer
backend's and the packed ways, the small controls, the judgement, the auxiliary loss's second look and the report.
Each is a function of the ``Session`` they share; every process runs every phase (the ways' runs are collective),
and a phase that decides something every process must follow agrees on it once (``Session.agree``; the small
controls once per size tried, since the next size runs only where the last was not caught). Global rank 0 keeps
the tensors, measures and judges (``Session.keep``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from finetune import distributed
from finetune.commands.verify.judgement import _beyond, _explain_auxiliary, _margin, _no_way_ran, compare
from finetune.commands.verify.measurement import _measure, _tolerances
from finetune.commands.verify.observation import depends_on_padding
from finetune.commands.verify.report import write
from finetune.commands.verify.runs import run_way
from finetune.commands.verify.ways import (
    FLOOR_ROLES,
    SMALL_CONTROL_LADDER,
    SMALL_CONTROLS,
    Outcome,
    Way,
    _MisWeighted,
    _rows_for_partial_window,
    for_task,
    trainer_refusal,
    ways_for,
)
from finetune.config import check_settings
from finetune.errors import FinetuneError, together
from finetune.lifecycle.resolve import resolve
from finetune.tasks import run_task
from finetune.tasks.rollout import RECORD

# what the check turns off or fixes: dropout (it verifies accumulation, not randomness), evaluation, checkpoints,
# trackers, the planner (B is fixed by the flags or planned once here); each field declares it (``verify=``)
CHECK_SETTINGS = check_settings()
PACKING_FIELDS = ("padding_free", "packing", "max_tokens_per_micro_batch")  # a "packed" way's flags


@dataclass
class Session:
    """One verify, shared by its phases. Set at the start: the run's ``recipe``; ``base``, the config every way
    starts from (the check's settings, the data cut so that the K-th window is partial, padded); the output
    directory ``root``; K ``steps``; the per-process window ``per_process`` (samples) and the ``processes``; the
    ``ways`` in the order they run; ``keep`` (global rank 0: keeps the tensors, measures and judges); ``agree``
    (a number's maximum over every process: collective). Filled by the phases: every run's ``outcomes`` in
    order, the ``reference`` (rank 0's; None elsewhere), whether the chunked floors ``trim`` their chunks, their
    ``variant`` and ``floor_reference`` (a model with BatchNorm or an auxiliary loss), the small controls'
    ``detects`` and the ``report`` (rank 0's). ``task``: the run's task (``tasks.run_task``: what the ways may be,
    whether completions are generated); ``notes``: what the report says besides the table (ways not run, the
    completions replayed)."""

    recipe: object
    base: object
    root: Path
    steps: int
    per_process: int
    processes: int
    ways: list[Way]
    keep: bool
    agree: Callable[[float], float]
    outcomes: list[Outcome] = field(default_factory=list)
    reference: Outcome | None = None
    trim: bool = False
    variant: str = ""
    floor_reference: Outcome | None = None
    detects: list[dict] = field(default_factory=list)
    report: dict | None = None
    task: object = None
    notes: list[str] = field(default_factory=list)

    def say(self, *args, **kwargs) -> None:
        """``print`` on global rank 0 only."""
        if self.keep:
            print(*args, **kwargs)

    def of(self, *roles: str) -> list[Way]:
        """The ways of these roles, in the order they run."""
        return [way for way in self.ways if way.role in roles]

    @property
    def gross(self) -> Way:
        """The positive control's way (a wrong normalisation): the small controls run on its split."""
        return next(way for way in self.ways if way.role == "control")

    def run(self, way: Way, vary=None, against: Outcome | None = None) -> Outcome:
        """``run_way`` for ``way`` (``vary``: a control's change) with one console line; on rank 0 measured
        against ``against`` at once, so that its gradients need not be kept (but the gross control's twin's:
        the small controls are measured against it). Collective."""
        outcome = run_way(way, self.base, self.recipe, self.root, self.steps, self.keep, vary,
                          rows_after=self.per_process)
        note = "" if outcome.error is None else "(does not fit)" if outcome.error.startswith("does not fit") else "(failed)"
        self.say(f"  {way.label:44s} {note}{outcome.seconds:6.1f} s", flush=True)
        if self.keep and outcome.error is None and against is not None:
            twin = way.role == "split" and (way.micro, way.accumulation) == (self.gross.micro, self.gross.accumulation)
            outcome.measured = _measure(outcome, against)
            outcome.gradients = outcome.gradients if twin else None
        return outcome

    def run_against_reference(self, ways: list[Way]) -> None:
        """Run ``ways`` in turn, each measured against the reference; the first of the reference and the splits
        that runs (on rank 0) is the reference."""
        for way in ways:
            outcome = self.run(way, against=self.reference)
            if self.keep and self.reference is None and outcome.error is None and way.role in ("reference", "split"):
                self.reference, outcome.measured = outcome, None
            self.outcomes.append(outcome)


def start(config, steps: int) -> Session:
    """The session of one verify of ``config`` over ``steps`` optimizer steps: the run resolved, its data cut so
    that the last window is partial, the ways chosen (the user's packing as ways of their own). Raises
    ``FinetuneError``: an output directory that holds a training run, a window of one sample per process, the
    loaders' errors."""
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
    task, refusal = run_task(recipe, base), trainer_refusal(recipe, base)
    ways = for_task(ways_for(per_process, config.gradient_accumulation_steps), task, refusal)
    if packed:  # the user's own split, packed as the user asks, on both backends the user's run could use
        flags = tuple((name, getattr(config, name)) for name in packed)
        ways += [Way("packed", config.per_device_train_batch_size, config.gradient_accumulation_steps,
                     packing=flags, trainer=trainer) for trainer in (False, True)]
    session = Session(recipe, base, root, steps, per_process, processes, ways,
                      keep=distributed.process_state().is_main_process,
                      agree=distributed.all_reduce_max(distributed.distributed_state()), task=task,
                      notes=[f"Trainer backend: not run: {refusal}"] if refusal else [])
    session.say(f"finetune verify: {len(ways)} ways of the effective batch {per_process * processes}, {steps} "
                f"optimizer steps each over {samples} samples, and the small controls, into {root}", flush=True)
    return session


def record(s: Session) -> None:
    """For a task that generates (``Task.generates``): one recorded set of completions that every way replays
    (``--replay_completions``), so that the ways differ in their split only. The user's record where given; else
    the reference's window ``b x 1`` generates it (the "generation" way, judged against the replayed reference:
    its record replays to what it trained)."""
    if not s.task.generates:
        return
    if s.base.replay_completions:
        s.notes.append(f"Completions: replayed by every way from {s.base.replay_completions}.")
        return
    way = Way("generation", s.per_process, 1)
    s.outcomes.append(s.run(way))
    recorded = s.root / way.slug / RECORD
    s.base = dataclasses.replace(s.base, replay_completions=str(recorded))
    s.notes.append(f"Completions: generated once (the row {way.label}) and replayed by every other way from {recorded}.")


def reference(s: Session) -> None:
    """The reference ``b x 1``. Agreed: whether the model's outputs depend on padding (its padding probe, run on
    every process): where they do not, the chunked floors cut each chunk to its own longest sample, as splits pad."""
    s.run_against_reference(s.of("reference"))
    first = next((o for o in s.outcomes if o.way.role == "reference"), None)
    s.trim = not s.agree(float(bool(first and depends_on_padding(first.padding_effect))))


def floors(s: Session) -> None:
    """The noise floor: the reference with its samples reordered, then computed in chunks of each split's
    micro-batch size. Agreed: whether the model has BatchNorm or an auxiliary loss (rank 0's notes), which chunks
    would change: the chunked floors are then measured on the model without them, against a reference without
    them (run once, for every size)."""
    s.run_against_reference(s.of("floor"))
    chunked = s.of("chunked")
    notes = (s.reference.notes or {}) if s.reference is not None else {}
    if chunked and s.agree(float(bool(notes.get("batchnorm_modules") or notes.get("auxiliary_loss")))):
        s.variant = ", ".join(v for v, on in (("without the auxiliary loss", notes.get("auxiliary_loss")),
                                              ("BatchNorm frozen", notes.get("batchnorm_modules"))) if on)
        s.variant = s.variant or "floor model"
        s.floor_reference = s.run(Way("floor reference", chunked[0].micro, 1, variant=s.variant))
        if s.keep and s.floor_reference.error is None:  # its gradients kept: the chunked floors' reference
            s.floor_reference.measured = _measure(s.floor_reference, s.reference)
        s.outcomes.append(s.floor_reference)
    for way in chunked:
        way = dataclasses.replace(way, trim=s.trim, variant=s.variant)
        s.outcomes.append(s.run(way, against=s.floor_reference if way.variant else s.reference))


def splits(s: Session) -> None:
    """The accumulation splits ``m x N``, each against the reference."""
    s.run_against_reference(s.of("split"))


def control(s: Session) -> None:
    """The positive control: the split with the most micro-batches, the first micro-batch of each window counted
    twice, or the task's own mean of micro-batch means (``Task.mean_of_means``, trained through its flags); it must
    depart by ``CONTROL_FACTOR`` x the tolerance (judgement)."""
    way = s.gross
    vary = None if way.flags else _MisWeighted(way.accumulation).vary
    outcome = s.run(way, vary, against=s.reference)
    outcome.control = s.task.mean_of_means[0] if way.flags else "the first micro-batch of each window counted twice"
    s.outcomes.append(outcome)


def other_backends(s: Session) -> None:
    """The Trainer backend on the reference and the control's split, then the user's packing on both backends,
    each against the (padded) reference."""
    s.run_against_reference(s.of("engine", "packed"))


def small_controls(s: Session) -> None:
    """The calibrated small controls (``SMALL_CONTROLS``), on the gross control's split, each measured against
    its twin (the split of its shape, with the same engine: an engine's own error, shared by both, cancels and only
    the mis-weighting departs). Each runs at the size verify claims, then, while it is not caught (a departure
    beyond the tolerance on some comparison), at each larger size of ``SMALL_CONTROL_LADDER``. Agreed once per
    size tried: whether it was caught. Sets ``s.detects``: per control, what it mis-weights, the claimed size,
    every size tried (caught or not, its margin over the tolerance) and the threshold, the smallest size caught
    or None."""
    twin = next((o for o in s.outcomes if o.way.role == "split" and o.error is None and o.gradients is not None and
                 (o.way.micro, o.way.accumulation) == (s.gross.micro, s.gross.accumulation)), s.reference)
    tolerance = None
    if s.keep and s.reference is not None:
        _, tolerance = _tolerances([o.measured for o in s.outcomes if o.error is None and o.way.role in FLOOR_ROLES
                                    and o.measured])
    s.detects = [_ladder(s, target, claimed, twin, tolerance) for target, claimed in SMALL_CONTROLS]


def _ladder(s: Session, target: str, claimed: float, twin: Outcome | None, tolerance: dict | None) -> dict:
    """One small control up its ladder of sizes, until caught (``small_controls``)."""
    entry = {"target": target, "claimed": claimed, "tried": [], "threshold": None}
    for multiple in SMALL_CONTROL_LADDER:
        size = claimed * multiple
        way = Way("small control", s.gross.micro, s.gross.accumulation, target=target, size=size)
        outcome = s.run(way, _MisWeighted(way.accumulation, target, size, s.steps).vary, against=twin)
        outcome.control = twin.way.label if twin is not None else None
        s.outcomes.append(outcome)
        caught, margin = False, None
        if s.keep and tolerance is not None and outcome.error is None and outcome.measured is not None:
            margin = _margin(outcome.measured, _beyond(tolerance, twin.measured if twin is not s.reference else None))
            caught = margin > 1
        entry["tried"].append({"size": size, "caught": caught, "margin": margin})
        if s.agree(float(caught)):
            entry["threshold"] = size
            break
    return entry


def judge(s: Session) -> None:
    """The table and the verdict (``compare``, on rank 0). Agreed: whether neither the reference nor a split ran
    on some process; then every process raises, together. Raises ``FinetuneError``."""
    # the outcomes' errors are every process's: whether a reference ran is decided on each, so all stop together
    if s.agree(float(_no_way_ran(s.outcomes) is not None)):
        raise together(_no_way_ran(s.outcomes) or FinetuneError("verify: no way of the effective batch ran on "
                                                                 "another process; its errors are in "
                                                                 + str(s.root / "logs")))
    if s.keep:
        notes = next((o.notes for o in s.outcomes if o.notes), {})
        s.report = compare(s.outcomes, s.steps, notes, s.detects)
        s.report.update(recipe=s.recipe.NAME, processes=s.processes, effective_batch=s.per_process * s.processes,
                        notes=s.notes)


def auxiliary_loss(s: Session) -> None:
    """Agreed: whether a way is not exact on a model with an auxiliary loss. Then the splits run again with the
    auxiliary loss off, against the reference without it, and the report names the auxiliary loss as the cause
    where they are exact (``_explain_auxiliary``)."""
    report = s.report
    if not s.agree(float(bool(report and report["not_exact"] and report.get("auxiliary_loss")))):
        return
    plain = [dataclasses.replace(w, variant="without the auxiliary loss") for w in s.of("split")]
    if s.floor_reference is None:
        s.floor_reference = s.run(Way("floor reference", s.per_process, 1, variant="without the auxiliary loss"))
    again = [s.run(way) for way in plain]
    if s.keep:
        _explain_auxiliary(report, s.floor_reference, again)


def write_report(s: Session) -> int:
    """``verify.json`` and ``verify.md`` written on rank 0 (``report.write``). Agreed: the exit code (0 exact,
    1 not exact or inconclusive), returned on every process."""
    code = write(s.report, s.root) if s.keep else 0
    return int(s.agree(float(code)))
