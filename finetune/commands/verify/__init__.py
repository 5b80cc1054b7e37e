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
``verify.json`` and ``verify.md`` to ``--output_dir`` (default ``outputs/<recipe>-verify``). A task that generates
(GRPO): every way replays one recorded set of completions (generated first, or ``--replay_completions``), its
control is the mean of micro-batch means, and ``--loss_type bnpo`` is judged split-dependent. How it decides:
docs/verify.md.
"""

# The package, one concern a module, lowest first: ways (the ways and controls, what a way produced),
# measurement (differences from the reference, the noise floor and tolerance), observation (what a run is seen to
# do), runs (one way trained), judgement (the verdict and its causes), report (verify.json, verify.md) and phases
# (the runs in order, agreed across processes); here the command: parse, verify, main.
# docs/verify.md#the-package-and-its-phases

from __future__ import annotations

import dataclasses
import sys

from finetune import distributed
from finetune.argv import given, take_values, wants_help
from finetune.commands.verify import phases
from finetune.commands.verify.judgement import CONTROL_FACTOR, DETERMINISM_TOLERANCE, compare, detects_line
from finetune.commands.verify.measurement import (
    FLOOR_FACTOR,
    MIN_TOLERANCE,
    gradient_difference,
    loss_difference,
    weight_difference,
)
from finetune.commands.verify.observation import (
    PADDING_PROBE_FACTOR,
    PADDING_PROBE_MINIMUM,
    PADDING_PROBE_TOKENS,
    depends_on_padding,
    determinism,
)
from finetune.commands.verify.phases import CHECK_SETTINGS, PACKING_FIELDS
from finetune.commands.verify.report import render
from finetune.commands.verify.runs import _unclip, run_way
from finetune.commands.verify.ways import (
    FLOOR_ROLES,
    SMALL_CONTROL_LADDER,
    SMALL_CONTROLS,
    Outcome,
    Way,
    _trimmed,
    chunk_sizes,
    partial_window_samples,
    ways_for,
)
from finetune.config import parse_config
from finetune.errors import FinetuneError, reports_errors

# the names this package has always offered (tests/, bench/ and docs/ use them as ``verify.NAME``), from its modules
__all__ = ["CHECK_SETTINGS", "CONTROL_FACTOR", "DEFAULT_STEPS", "DETERMINISM_TOLERANCE", "FLOOR_FACTOR", "FLOOR_ROLES",
           "MIN_TOLERANCE", "PACKING_FIELDS", "PADDING_PROBE_FACTOR", "PADDING_PROBE_MINIMUM", "PADDING_PROBE_TOKENS",
           "SMALL_CONTROLS", "SMALL_CONTROL_LADDER", "USAGE", "Outcome", "Way", "_trimmed", "_unclip", "chunk_sizes",
           "compare", "depends_on_padding", "detects_line", "determinism", "gradient_difference", "loss_difference",
           "main", "parse", "partial_window_samples", "render", "run_way", "verify", "ways_for", "weight_difference"]

DEFAULT_STEPS = 3
USAGE = __doc__.split("\n\n")[1].strip()


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


def verify(config, steps: int) -> int:
    """Run every way and write the report; returns the exit code (0 exact, 1 not exact or inconclusive), the same
    on every process. Raises ``FinetuneError`` for input that cannot run. The phases run in this order on every
    process, each agreeing across processes on what it decides (``phases``); for a task that generates, every way
    replays one recorded set of completions (``phases.record``)."""
    session = phases.start(config, steps)
    for phase in (phases.record, phases.reference, phases.floors, phases.splits, phases.control, phases.other_backends,
                  phases.small_controls, phases.judge, phases.auxiliary_loss):
        phase(session)
    return phases.write_report(session)


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
