"""A SLURM job requeued onto another number of nodes resumes (issue 28; examples/slurm, docs/resume.md):
the multi-node script's own command line (``--resume_from_checkpoint auto``, ``--num_processes`` from
``SLURM_NNODES``) with ``--total_batch_size`` in ``FINETUNE_ARGS``, so that the planner splits the same effective
batch B for whatever process count the job gets. The job's first start is stood in for by the same flags run in
this process (1 process, checkpoint at step 7, run on to the end: the uninterrupted reference); its output
directory, cut back to the checkpoint, is requeued onto 2 "nodes" under the faked SLURM of tests/test_slurm.py."""

from __future__ import annotations

import pytest
from helpers import load_params, run_in_process, train_steps
from test_elastic_resume import FLOOR, RUN, STOP, _hashes, _relative_gap, _stopped_copy
from test_slurm import finish, free_port, job_env, start_job

pytestmark = pytest.mark.integration

# B = 8 planned from micro-batch 4: 4 x 2 on 1 process, 4 x 1 on 2
PLANNED = {**RUN, "total_batch_size": 8, "per_device_train_batch_size": 4}


def test_a_job_requeued_onto_more_nodes_resumes_with_the_planned_split(tmp_path, tiny_bert):
    _, reference = run_in_process(tmp_path, "reference", model_name_or_path=tiny_bert, **PLANNED)
    full = train_steps(reference)
    assert [r["step"] for r in full] == list(range(1, 11))

    job = tmp_path / "job"
    _stopped_copy(reference, job)
    log = tmp_path / "finetune-300.out"
    flags = " ".join(f"--{k} {v}" for k, v in PLANNED.items())
    env = job_env(tmp_path, tiny_bert, 300, 2, job, restarts=1, GPUS_PER_NODE=1, MAIN_PORT=free_port(),
                  FINETUNE_ARGS=f"{flags} --model_name_or_path {tiny_bert}")
    code = finish(start_job("train_multi_node.sbatch", env, log), timeout=400)
    out = log.read_text()
    assert code == 0, out[-4000:]
    assert f"Resuming from {job / 'checkpoints' / f'step_{STOP:08d}'}: optimizer step {STOP}," in out
    assert "resumed on 2 processes from a run on 1: micro-batch 4 x 2 -> 4 x 1 (B = 8 samples per step)" in out
    assert "random state: per-process generators cannot move to another process count" in out
    steps = train_steps(job)
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert _hashes(job) == _hashes(reference)  # the same samples in every step
    for mine, theirs in zip(steps[STOP:], full[STOP:]):
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-6, (mine, theirs)
    gap = _relative_gap(load_params(job), load_params(reference))
    print(f"requeued from 1 process (4 x 2) onto 2 nodes (4 x 1) at step {STOP}: relative weight gap {gap:.3g}")
    assert gap < FLOOR, gap
