"""How often a 2-process gloo run aborts in interpreter teardown with and without ``finetune.distributed.leave``.

Each trial launches ``torchrun --nproc_per_node 2`` on a small DDP script (3 backwards of a Linear through
``DistributedDataParallel``); rank 0 then sleeps ``--delay`` seconds, as it does while it writes the final
model, and rank 1 is done. ``without``: both processes return with the group alive; ``with``: both drop the model
and call ``finetune.distributed.leave()`` (``gc.collect``, a barrier, then ``destroy_process_group``) first; both
import it, and ``torch.distributed.nn`` before the group starts, as ``distributed.process_state`` does. The two
ways alternate (ABBA). Printed: per way, the launches that failed, and (counted apart) the launches whose output holds
"terminate called without an active exception". Run: ``python bench/gloo_teardown.py --trials 40``.
Figures: docs/resume.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from finetune.distributed import leave  # in both ways: they differ in the call only
import torch.distributed.nn  # before the group starts, as distributed.process_state does
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
if dist.get_rank() == 0:
    time.sleep(float(sys.argv[2]))
if sys.argv[3] == "with":
    del model  # leave() after the model is dropped, as the commands do (docs/resume.md#leaving-the-process-group)
    leave()
"""


def trial(script: str, way: str, delay: float) -> tuple[bool, bool]:
    """One launch; returns (the launcher failed, the output held the teardown abort's message)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, root,
                             str(delay), way], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return result.returncode != 0, "terminate called without an active exception" in result.stderr + result.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40, help="launches per way")
    parser.add_argument("--delay", type=float, default=0.5, help="seconds rank 0 works on after rank 1 is done")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "ddp.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        counts = {way: [0, 0] for way in ("without", "with")}
        start = time.time()
        for i in range(args.trials):
            for way in (("without", "with") if i % 2 == 0 else ("with", "without")):
                failed, aborted = trial(script, way, args.delay)
                counts[way][0] += failed
                counts[way][1] += aborted
            print(f"\r{i + 1}/{args.trials} trials per way, {time.time() - start:.0f} s", end="", file=sys.stderr)
        print(file=sys.stderr)
    for way, (failed, aborted) in counts.items():
        print(f"{way} leave(): {failed} of {args.trials} launches failed, {aborted} with the teardown abort")
    return 0


if __name__ == "__main__":
    sys.exit(main())
