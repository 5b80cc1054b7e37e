"""Two "machines" without a shared filesystem: two `accelerate launch --num_machines 2 --machine_rank 0|1`
on 127.0.0.1, each with its own --output_dir. Each machine keeps a complete copy of the run; a stopped run
resumes on both to the weights of one process with twice the micro-batch; and machines that hold different
checkpoints fail alike with one clear error instead of one of them waiting forever in a collective."""

from __future__ import annotations

import shutil
import signal
import socket
import time

import pytest
import torch
from helpers import run_args_in_process, start_launch, train_steps
from test_launcher_signals import assert_same_weights

pytestmark = pytest.mark.integration

# 96 samples; 2 machines x 1 process x micro-batch 2 = one process with micro-batch 4: 24 optimizer steps
STEPS = 24


def common(model: str) -> list[str]:
    return ["--recipe", "bbc-news", "--model_name_or_path", model, "--max_train_samples", "96", "--max_eval_samples",
            "8", "--gradient_accumulation_steps", "1", "--num_train_epochs", "1", "--max_length", "32",
            "--disable_dropout", "--eval_strategy", "no", "--learning_rate", "1e-3", "--warmup_steps", "0",
            "--seed", "5"]


def one_process_reference(shared_runs, model: str):
    """The uninterrupted run that two processes of micro-batch 2 must equal: one process, micro-batch 4 (24
    optimizer steps), trained once per session (test_launcher_signals.py compares with it too)."""
    return shared_runs.launched([*common(model), "--per_device_train_batch_size", "4"], timeout=300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_machines(tmp_path, name: str, args: list[str]) -> list:
    """Start machine 0 and machine 1 (one process each), each writing into ``tmp_path/m<rank>``."""
    port = free_port()
    return [start_launch([*args, "--output_dir", str(tmp_path / f"m{rank}")], tmp_path / f"{name}.m{rank}",
                         num_processes=2, machine=(rank, 2, port)) for rank in (0, 1)]


def wait_all(processes, timeout: float) -> list[int]:
    """The launchers' exit codes; all are killed (and the test fails) if one still runs after ``timeout``."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_machines_with_their_own_output_dirs_stop_resume_and_disagree(tmp_path, tiny_bert, shared_runs):
    args = [*common(tiny_bert), "--per_device_train_batch_size", "2"]
    reference = one_process_reference(shared_runs, tiny_bert)

    # train with a checkpoint every 3 steps; stop both machines by SIGTERM to their launchers after the first
    machines = start_machines(tmp_path, "stopped", [*args, "--save_steps", "3"])
    try:
        deadline = time.monotonic() + 240
        while not any((tmp_path / "m1" / "checkpoints").glob("step_*/COMPLETE")):
            assert all(p.poll() is None for p in machines) and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.05)
        for p in machines:
            p.send_signal(signal.SIGTERM)
    finally:
        wait_all(machines, timeout=120)
    stopped_at = len(train_steps(tmp_path / "m0"))
    assert 3 <= stopped_at < STEPS
    for rank in (0, 1):
        out, stderr = tmp_path / f"m{rank}", (tmp_path / f"stopped.m{rank}.err").read_text()
        # each machine tells the checkpoint it really wrote, in its own directory
        assert f"error: stopped by SIGTERM after optimizer step {stopped_at}; checkpoint: {out}/checkpoints/" in stderr
        assert f"--machine_rank {rank}" in stderr  # its own resume command
        assert (out / "run_config.json").is_file() and len(train_steps(out)) == stopped_at
        for step in (3, stopped_at):
            checkpoint = out / "checkpoints" / f"step_{step:08d}"
            assert (checkpoint / "COMPLETE").is_file(), sorted(p.name for p in out.rglob("*"))
            # both ranks' random-number states on both machines: either copy resumes anywhere
            assert {p.name for p in checkpoint.glob("random_states_*.pkl")} == {"random_states_0.pkl",
                                                                                 "random_states_1.pkl"}
        assert not list((out / "checkpoints").glob(".tmp-*"))

    # resume on both: each from its own copy; both end with the weights of one process with twice the micro-batch
    resumed = start_machines(tmp_path, "resumed", [*args, "--save_steps", "3", "--resume_from_checkpoint", "latest"])
    assert wait_all(resumed, timeout=300) == [0, 0], (tmp_path / "resumed.m1.err").read_text()[-3000:]
    reference_losses = [r["loss"] for r in train_steps(reference)]
    for rank in (0, 1):
        out = tmp_path / f"m{rank}"
        assert [r["step"] for r in train_steps(out)] == list(range(1, STEPS + 1))
        assert [r["loss"] for r in train_steps(out)] == pytest.approx(reference_losses, rel=1e-5)
        assert_same_weights(out, reference)
        assert (out / "metrics.json").is_file() and (out / "config.json").is_file()

    # machine 1 loses its newest checkpoint: both machines refuse alike, naming it and the fixes, in bounded time
    newest = sorted((tmp_path / "m1" / "checkpoints").glob("step_*"))[-1]
    shutil.rmtree(newest)
    started = time.monotonic()
    refused = start_machines(tmp_path, "refused", [*args, "--save_steps", "3", "--resume_from_checkpoint", "latest"])
    codes = wait_all(refused, timeout=180)
    assert all(code != 0 for code in codes), codes
    assert time.monotonic() - started < 180
    lines = []
    for rank in (0, 1):
        stderr = (tmp_path / f"refused.m{rank}.err").read_text()
        errors = sorted({line for line in stderr.splitlines() if line.startswith("error: ")})
        assert len(errors) == 1, stderr[-3000:]
        lines.append(errors[0])
    assert lines[0] == lines[1]  # the same message on both machines
    previous = int(newest.name.removeprefix("step_")) - 3
    for fragment in ("every process must resume from the same checkpoint",
                     f"machine 0 (rank 0) would resume from {newest.name}",
                     f"machine 1 (rank 1) would resume from step_{previous:08d}",
                     f"copy {newest.name} from {tmp_path / 'm0' / 'checkpoints'} on machine 0 to "
                     f"{tmp_path / 'm1' / 'checkpoints'} on machine 1",
                     f"resume every machine from step {previous}, which all hold"):
        assert fragment in lines[0], (fragment, lines[0])
    for rank in (0, 1):  # a user error: no traceback from our code (torchrun adds its own ChildFailedError)
        stderr = (tmp_path / f"refused.m{rank}.err").read_text()
        assert not [line for line in stderr.splitlines() if line.strip().startswith("File ") and "/finetune/" in line]


def test_the_trainer_backend_keeps_a_copy_on_each_machine(tmp_path, tiny_bert):
    """Without a shared filesystem the Trainer backend, like the accelerate engine, writes a complete copy on
    each machine (its own ``--output_dir``): the same log, Trainer's checkpoints with every file a resume of
    that machine needs, and the final model, equal to one process with twice the micro-batch."""
    from safetensors.torch import load_file

    args = [*common(tiny_bert), "--backend", "trainer", "--max_train_samples", "32", "--save_steps", "4"]
    machines = start_machines(tmp_path, "trainer", [*args, "--per_device_train_batch_size", "2"])
    codes = wait_all(machines, timeout=420)
    assert codes == [0, 0], [(tmp_path / f"trainer.m{r}.err").read_text()[-3000:] for r in (0, 1)]
    # the reference, one process with micro-batch 4, in this process: the machines are what is launched here
    reference = tmp_path / "reference"
    run_args_in_process([*args, "--per_device_train_batch_size", "4", "--output_dir", str(reference)])
    expected = [r["loss"] for r in train_steps(reference)]
    assert len(expected) == 8
    for rank in (0, 1):
        out = tmp_path / f"m{rank}"
        assert (out / "run_config.json").is_file() and (out / "metrics.json").is_file()
        # Adam turns float noise on zero-gradient tensors into lr-sized updates (DESIGN): compare the losses
        # closely, the weights by the relative norm of the whole difference
        assert [r["loss"] for r in train_steps(out)] == pytest.approx(expected, rel=1e-3)
        checkpoint = out / "checkpoints" / "checkpoint-4"
        # Trainer's state, and ours: the progress (with what a step means), manifest and COMPLETE marker
        assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "finetune_progress.json").is_file()
        assert (checkpoint / "COMPLETE").is_file() and (checkpoint / "manifest.json").is_file()
        assert (checkpoint / f"rng_state_{rank}.pth").is_file()  # this machine's process resumes from its own copy
        final, single = load_file(str(out / "model.safetensors")), load_file(str(reference / "model.safetensors"))
        assert final.keys() == single.keys()
        difference = torch.cat([(final[k] - single[k]).flatten() for k in single]).norm()
        assert difference / torch.cat([t.flatten() for t in single.values()]).norm() < 2e-3  # measured 6e-4


def test_a_stuck_peer_fails_the_run_after_ddp_timeout(tmp_path, tiny_bert):
    """--ddp_timeout is the collective timeout (TrainingArguments' name): a machine whose peer stops answering
    (its training process frozen with SIGSTOP, as a hung node would be) fails after that many seconds instead
    of torch's 30 minutes. (A peer that dies outright closes its sockets and gloo fails at once.)"""
    import psutil

    args = [*common(tiny_bert), "--per_device_train_batch_size", "2", "--ddp_timeout", "20"]
    machines = start_machines(tmp_path, "stuck", args)
    frozen = None
    try:
        deadline = time.monotonic() + 240
        while len(train_steps(tmp_path / "m0")) < 2 if (tmp_path / "m0" / "log.jsonl").is_file() else True:
            assert all(p.poll() is None for p in machines) and time.monotonic() < deadline, "no training"
            time.sleep(0.05)
        frozen = [c for c in psutil.Process(machines[1].pid).children(recursive=True) if "run.py" in " ".join(c.cmdline())]
        assert frozen
        for child in frozen:
            child.suspend()
        stopped = time.monotonic()
        code = machines[0].wait(timeout=150)
        waited = time.monotonic() - stopped
    finally:
        for child in frozen or []:
            child.kill()
        wait_all(machines, timeout=30)
    assert code != 0 and waited < 120, (code, waited)


def test_each_machine_keeps_the_merged_lora_model(tmp_path, tiny_llama, clm_texts):
    """LoRA with --merge_adapter on two machines without a shared filesystem: each machine's copy holds the
    adapter and the merged model. transformers 5 writes save_pretrained on global rank 0 only, so machine 1's
    merged/ stayed empty while its adapter directory claimed to be complete."""
    from safetensors.torch import load_file

    train, valid = clm_texts
    args = ["--recipe", "bbc-news-clm", "--model_name_or_path", tiny_llama, "--train_file", train,
            "--validation_file", valid, "--max_steps", "2", "--eval_strategy", "no", "--max_length", "32",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--mixed_precision", "no",
            "--use_peft", "--merge_adapter", "--learning_rate", "1e-3", "--seed", "5"]
    codes = wait_all(start_machines(tmp_path, "lora", args), timeout=300)
    assert codes == [0, 0], [(tmp_path / f"lora.m{r}.err").read_text()[-3000:] for r in (0, 1)]
    merged = [load_file(str(tmp_path / f"m{rank}" / "merged" / "model.safetensors")) for rank in (0, 1)]
    assert merged[0].keys() == merged[1].keys() and all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])
    for rank in (0, 1):
        assert (tmp_path / f"m{rank}" / "adapter_model.safetensors").is_file()
        assert (tmp_path / f"m{rank}" / "merged" / "tokenizer.json").is_file()


# ------------------------------------------------- auto over machines whose newest checkpoints differ
def _write_checkpoint(output_dir, step: int, processes: int = 2):
    """A complete, verified checkpoint as ``save_checkpoint`` leaves it (its files, then ``manifest.json`` and the
    ``COMPLETE`` marker by the same ``_commit``), small stand-in contents: the agreement reads no weights."""
    import json
    from dataclasses import asdict

    from finetune.lifecycle import checkpoint as ckpt

    final = ckpt.checkpoint_path(output_dir, step)
    tmp = final.parent / f".tmp-{final.name}"
    tmp.mkdir(parents=True)
    for rank in range(processes):
        (tmp / f"random_states_{rank}.pkl").write_bytes(b"rng %d" % rank)
    (tmp / "model.safetensors").write_bytes(b"w" * 64)
    (tmp / ckpt.STATE_FILE).write_text(json.dumps(asdict(ckpt.RunProgress(step=step, num_processes=processes))))
    ckpt._commit(tmp, final, step)
    assert ckpt.verify_checkpoint(final)
    return final


def test_the_newest_checkpoint_all_hold():
    """``common_checkpoint``: the newest step in every process's set of resumable checkpoints, or None."""
    from finetune.lifecycle.checkpoint import common_checkpoint

    assert common_checkpoint([{"held": [3, 6]}, {"held": [3]}]) == 3
    assert common_checkpoint([{"held": [3, 6, 9]}, {"held": [6, 9]}, {"held": [3, 6]}]) == 6
    assert common_checkpoint([{"held": [6]}, {"held": [3]}]) is None
    assert common_checkpoint([{"held": []}, {"held": [3]}]) is None


def _agree_auto(rank: int, port: int, root: str, out: str) -> None:
    import json
    import os

    from finetune.distributed import process_state
    from finetune.errors import FinetuneError
    from finetune.lifecycle.checkpoint import agree_on_checkpoint

    # each rank a machine of its own (LOCAL_WORLD_SIZE 1), each with its own output dir
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK="0",
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), ACCELERATE_USE_CPU="1")
    state = process_state(cpu=True)
    try:
        path = agree_on_checkpoint(state, f"{root}/m{rank}", "auto")
        result = {"path": str(path)}
    except FinetuneError as err:
        result = {"error": str(err)}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


def test_auto_takes_the_newest_checkpoint_every_machine_holds(tmp_path, capfd):
    """Two machines without a shared filesystem (two gloo ranks, each its own ``--output_dir``): machine 0 holds
    steps 3 and 6, machine 1 step 3 and a step 6 that does not verify (its weights truncated). ``auto`` resumes
    both from step 3, the newest both hold complete and verified, and says why (before: every process raised
    "every process must resume from the same checkpoint")."""
    import json

    import torch.multiprocessing as mp

    for machine in (0, 1):
        for step in (3, 6):
            _write_checkpoint(tmp_path / f"m{machine}", step)
    weights = tmp_path / "m1" / "checkpoints" / "step_00000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:10])
    mp.spawn(_agree_auto, args=(free_port(), str(tmp_path), str(tmp_path / "result")), nprocs=2, join=True)
    for machine in (0, 1):
        result = json.loads((tmp_path / f"result.{machine}").read_text())
        assert result == {"path": str(tmp_path / f"m{machine}" / "checkpoints" / "step_00000003")}, result
    printed = capfd.readouterr().out
    assert ("--resume_from_checkpoint auto: the processes' newest resumable checkpoints differ (machine 0 (rank 0): "
            "step_00000006; machine 1 (rank 1): step_00000003); resuming every process from step_00000003") in printed


def test_auto_on_two_machines_resumes_from_the_newest_checkpoint_both_hold(tmp_path, tiny_bert):
    """Through the real launcher: two machines, each its own --output_dir, run with ``auto`` to the end
    (checkpoints at steps 3 and 6 of 8); then machine 1's step 6 is damaged (its optimizer state truncated) and
    the final outputs removed (a preemption before the end). ``auto`` resumes both machines from step 3, the newest
    both hold verified, and they finish with the first run's weights (before: both refused, "every process must
    resume from the same checkpoint")."""
    args = [*common(tiny_bert), "--per_device_train_batch_size", "2", "--max_train_samples", "32", "--save_steps",
            "3", "--resume_from_checkpoint", "auto"]
    first = start_machines(tmp_path, "first", args)
    assert wait_all(first, timeout=300) == [0, 0], (tmp_path / "first.m1.err").read_text()[-3000:]
    for rank in (0, 1):
        shutil.copytree(tmp_path / f"m{rank}", tmp_path / f"reference{rank}")
        for leftover in ("model.safetensors", "metrics.json"):
            (tmp_path / f"m{rank}" / leftover).unlink()
    optimizer = tmp_path / "m1" / "checkpoints" / "step_00000006" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    again = start_machines(tmp_path, "again", args)
    assert wait_all(again, timeout=300) == [0, 0], (tmp_path / "again.m1.err").read_text()[-3000:]
    said = (tmp_path / "again.m0.out").read_text()
    assert ("resuming every process from step_00000003, the newest that all of them hold complete and verified"
            in said), said[-3000:]
    for rank in (0, 1):
        out = tmp_path / f"m{rank}"
        assert f"Resuming from {out / 'checkpoints' / 'step_00000003'}" in (tmp_path / f"again.m{rank}.out").read_text()
        assert [r["step"] for r in train_steps(out)] == list(range(1, 9))
        assert_same_weights(out, tmp_path / f"reference{rank}")
