"""The training entry point (``accelerate launch finetune/run.py --recipe NAME``, ``-m finetune.run``, ``finetune
train``): flags into a ``TrainConfig``, resolved (``finetune.lifecycle.resolve``), then its backend (``--backend``:
``finetune.backends.accelerate``, the accelerate loop, or ``finetune.backends.trainer``). User errors print one ``error:`` line and
exit 2 (3 for a numerical failure, 128 + N after signal N). Importing it sets the path up for a script run; no module
of the package imports it but ``cli.py``."""

from __future__ import annotations

import os
import sys
import time

PROCESS_START = time.time()

if __package__ in (None, ""):  # run as a script (accelerate launch finetune/run.py): import the package from
    # the repository root, and keep this folder off sys.path, where its modules would shadow top-level packages
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

if __name__ == "__main__":  # before the slow imports: stop with the launcher (see finetune.signals)
    from finetune.signals import watch_launcher

    watch_launcher()

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we never tokenize inside forked workers

from finetune.config import parse_config  # noqa: E402 - after the path set-up above
from finetune.errors import FinetuneError, reports_errors  # noqa: E402
from finetune.recipes import list_recipes  # noqa: E402
from finetune.signals import watch_launcher  # noqa: E402

# The rest is imported where it is used (docs/contributing.md#imports): `--help`, `--list_recipes` and a flag
# refused while parsing need none of it, and a run imports its own backend only (the Trainer backend and its
# libraries cost a launched process seconds it does not use).


def run(config) -> dict | None:
    """Run a parsed ``config``: resolve it (``resolve.resolve``: validate, process group, output dir, hub, threads,
    the batch plan applied), then train with its backend, leave the process group (``distributed.leave``) and
    push the final outputs (``--push_to_hub``). Returns the metrics (the finished run's under
    ``--resume_from_checkpoint auto`` over one). Raises ``FinetuneError`` (``--compare``: one line naming
    ``finetune compare``, the one way to compare the backends);
    one that every process raised together (``every_rank``: a signal's stop, a numerical error, a failed
    checkpoint write, an agreed check) after leaving the group (``distributed.leaving_together``)."""
    if config.compare:
        raise FinetuneError("--compare is its own command: run `finetune compare` with the same flags (it trains "
                            "both backends, each in a process of its own, and writes the comparison).")
    from finetune import distributed  # lazy: torch, accelerate, the planner (see the imports above)
    from finetune.lifecycle.resolve import resolve

    resolution = distributed.leaving_together(lambda: resolve(config))
    if resolution.finished is not None:
        return resolution.finished
    if config.backend == "trainer":
        from finetune.backends import trainer as backend  # lazy: transformers.Trainer, --backend trainer only
    else:
        from finetune.backends import accelerate as backend  # lazy: the accelerate backend

    # An error every process raised together leaves the group first (without its traceback, nor a chained
    # exception's: the frames that hold the model go before leave()); one raised alone does not wait at a barrier.
    metrics = distributed.leaving_together(lambda: backend.train(resolution.config, resolution.recipe,
                                                                 process_start=PROCESS_START, hub=resolution.hub))
    # The run's last collective is behind us: every process leaves the group together, not at interpreter exit
    # (docs/resume.md#leaving-the-process-group), and before the main process's final push, which may
    # outlast --ddp_timeout.
    distributed.leave()
    if resolution.hub is not None:
        resolution.hub.at_end(resolution.config.output_dir)
    return metrics


@reports_errors
def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0, or ``FinetuneError.exit_code`` after one ``error:`` line). The process
    stops with its launcher (``finetune.signals``): a dead launcher's SIGTERM ends it after a checkpoint, exit 143."""
    watch_launcher()
    config = parse_config(argv)
    if config.list_recipes:
        print(list_recipes())
        return 0
    metrics = run(config)
    from finetune import distributed  # lazy (imported by run() already)
    from finetune.outputs.reporting import format_summary

    if metrics is not None and distributed.is_main_process():
        print(format_summary(metrics, config.output_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
