"""FSDP2 checkpoints resume on another process count (issue 28, docs/resume.md): the library reshards them.

Accelerate runs no FSDP on a CPU (it turns it into MULTI_CPU), so the save and load run here are Accelerate's own
functions (accelerate 1.15 ``utils/fsdp_utils.py``: ``save_fsdp_model``, ``save_fsdp_optimizer``,
``load_fsdp_model``, ``load_fsdp_optimizer``; ``Accelerator.save_state``/``load_state`` call them with the
plugin, the accelerator, model and optimizer 0 and the checkpoint directory, ``accelerator.py`` lines 3701, 3720,
3849, 3883) on a model sharded by torch's ``fully_shard`` over a CPU device mesh of 2 gloo processes, then loaded
by 1. The stand-in accelerator holds what those functions read of it (``num_processes``, ``process_index``,
``is_fsdp2``, ``is_main_process``, ``wait_for_everyone``); Accelerate's logging needs its ``PartialState``."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from finetune.backends import accelerate as train
from finetune.engine.fsdp import fsdp_layout
from finetune.errors import FinetuneError
from finetune.lifecycle import elastic

KINDS = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # 7 rows over 2 ranks: uneven shards (4 and 3), another slicing on 1 rank
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _fsdp2_worker(rank: int, world: int, port: int, out: str, save: bool) -> None:
    """One of ``world`` gloo ranks: a model under ``fully_shard`` (each Linear and the root, as Accelerate's
    auto-wrap does for layers) and AdamW. ``save``: two optimizer steps on rank-specific data, then each
    ``state_dict_type`` saved through Accelerate's functions into ``out/<type>``, and rank 0 writes the whole
    state (``reference.pt``). Else: another initial model (seed 1) loads each type, and rank 0 writes the whole
    state it then holds (``loaded.pt``)."""
    import copy

    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ACCELERATE_USE_CPU="1")
    PartialState(cpu=True)  # the gloo group
    mesh = init_device_mesh("cpu", (world,))
    model = _model(0 if save else 1)
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    accelerator = SimpleNamespace(num_processes=world, process_index=rank, is_fsdp2=True, is_main_process=rank == 0,
                                  wait_for_everyone=torch.distributed.barrier)
    whole = StateDictOptions(full_state_dict=True)  # collective: all-gathers the shards

    def state() -> dict:  # copied: on one rank the whole tensors may be the parameters themselves
        return copy.deepcopy({"model": get_model_state_dict(model, options=whole),
                              "optimizer": get_optimizer_state_dict(model, optimizer, options=whole)})

    results = {}
    if save:
        generator = torch.Generator().manual_seed(rank)
        for _ in range(2):
            model(torch.randn(4, 5, generator=generator)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        results["reference"] = state()
    else:
        results["before"] = state()
    for kind in KINDS:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=kind)
        where = os.path.join(out, kind)
        if save:
            save_fsdp_model(plugin, accelerator, model, where, 0)
            save_fsdp_optimizer(plugin, accelerator, optimizer, model, where, 0)
        else:
            load_fsdp_model(plugin, accelerator, model, where, 0)
            load_fsdp_optimizer(plugin, accelerator, optimizer, model, where, 0)
            results[kind] = state()
    if rank == 0:
        torch.save(results, os.path.join(out, "reference.pt" if save else "loaded.pt"))
    torch.distributed.barrier()  # leave together (a rank tearing gloo down while its peer sends aborts the peer)
    torch.distributed.destroy_process_group()


def _flat(state: dict) -> dict:
    """name -> tensor for a whole model + optimizer state (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter)."""
    tensors = {f"model.{k}": v for k, v in state["model"].items()}
    for name, per_param in state["optimizer"]["state"].items():
        tensors.update({f"optimizer.{name}.{k}": torch.as_tensor(v) for k, v in per_param.items()})
    return tensors


def test_fsdp2_state_saved_by_2_processes_loads_exactly_on_1(tmp_path):
    """Saved by 2 gloo ranks (uneven shards), loaded by 1 through Accelerate's own FSDP functions: every weight
    and every AdamW moment and step is bit-equal to the 2-process run's whole state, for the sharded state dict
    (torch distributed checkpoint: ``optimizer_0/`` and ``pytorch_model_fsdp_0/`` with their ``.metadata``) and
    the full one. The loading model starts from other weights, so a load that left anything unread fails."""
    import torch.multiprocessing as mp

    port = 29400 + (os.getpid() % 250) * 2
    mp.spawn(_fsdp2_worker, args=(2, port, str(tmp_path), True), nprocs=2, join=True)
    assert fsdp_layout(tmp_path / "SHARDED_STATE_DICT") == "sharded"
    assert fsdp_layout(tmp_path / "FULL_STATE_DICT") == "full"
    mp.spawn(_fsdp2_worker, args=(1, port + 1, str(tmp_path), False), nprocs=1, join=True)
    reference = _flat(torch.load(tmp_path / "reference.pt", weights_only=False)["reference"])
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    before = _flat(loaded["before"])
    assert sum(1 for k, v in reference.items() if k.startswith("model.") and not torch.equal(v, before[k])) == 4
    for kind in KINDS:
        state = _flat(loaded[kind])
        assert state.keys() == reference.keys() and len(state) == 4 + 4 * 3, kind
        unequal = [k for k, v in reference.items() if not torch.equal(v, state[k])]
        assert unequal == [], (kind, unequal)


# ------------------------------------------------------------------------------------------ the resume path
def _meaning(p: int) -> dict:
    return {"recipe": "r", "seed": 1, **elastic.batch_meaning(
        SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=4 // p), p)}


def _checkpoint(path, layout: str):
    """The files Accelerate 1.15 writes for FSDP model and optimizer 0 (``utils/fsdp_utils.py`` lines 154-191 and
    330-358): ``sharded`` (DCP directories), ``full`` (rank 0's whole files) or ``per-rank`` (LOCAL_STATE_DICT, or
    SHARDED_STATE_DICT with ``use_dcp=False``: ``{name}_0_rank{i}.bin``)."""
    path.mkdir()
    names = {"sharded": ["pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp",
                         "optimizer_0/.metadata", "optimizer_0/__0_0.distcp"],
             "full": ["pytorch_model_fsdp.bin", "optimizer.bin"],
             "per-rank": [f"{n}_0_rank{i}.bin" for n in ("pytorch_model_fsdp", "optimizer") for i in (0, 1)]}[layout]
    for name in names:
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_bytes(b"x")
    return path


def _run_state(engine_name: str, fsdp_version: int | None, processes: int, loads: list):
    """A stand-in for ``train.Loop`` holding what ``Loop._load`` reads: its engine, the launch's step
    meaning, the training set's length, the seed, and an accelerator whose ``load_state`` records the directory
    (``Accelerator.load_state`` would call ``load_fsdp_model``/``load_fsdp_optimizer`` on it, lines 3849, 3883)."""
    from accelerate.utils import DistributedType

    from finetune.engine import engine_for

    kind = {"FSDP": DistributedType.FSDP, "DeepSpeed": DistributedType.DEEPSPEED}[engine_name]
    plugin = SimpleNamespace(fsdp_version=fsdp_version)  # Accelerate's plugin holds it (its default: 1)
    engine = engine_for(SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin)))
    return SimpleNamespace(built=SimpleNamespace(engine=engine, train_dataloader=SimpleNamespace(dataset=range(40))),
                           run=SimpleNamespace(meaning=_meaning(processes), resume_notes=[]),
                           config=SimpleNamespace(seed=1), accelerator=SimpleNamespace(load_state=loads.append))


@pytest.mark.parametrize("layout", ["sharded", "full"])
def test_the_resume_loads_an_fsdp2_checkpoint_on_another_process_count(tmp_path, layout, monkeypatch):
    """2 processes -> 1: ``Loop._load`` lets Accelerate's ``load_state`` run (the resharding load), moves the
    position to the new split, and the banner says what changed, the resharding and the re-seeding."""
    from finetune.lifecycle.checkpoint import RunProgress

    monkeypatch.setattr(elastic, "reseed", lambda seed, step: None)  # the process's generators stay the test's
    path, loads = _checkpoint(tmp_path / "step_00000002", layout), []
    state = _run_state("FSDP", 2, 1, loads)
    progress = RunProgress(step=2, micro_batches_done=4, samples_done=16, step_meaning=_meaning(2))
    train.Loop._load(state, path, progress)
    assert loads == [str(path)] and (progress.samples_done, progress.micro_batches_done) == (16, 8)
    assert state.run.resume_notes[0] == "resumed on 1 process from a run on 2: micro-batch 2 x 2 -> 2 x 4 (B = 8 " \
                                    "samples per step)"
    assert state.run.resume_notes[1] == {
        "sharded": "FSDP2: the sharded state of 2 processes (torch distributed checkpoint) is resharded onto 1 on load",
        "full": "FSDP2: the full state dict written by 2 processes is sharded onto 1 on load"}[layout]
    assert state.run.resume_notes[2] == elastic.RNG_NOTE


@pytest.mark.parametrize("engine, version, layout, why", [
    ("FSDP", 2, "per-rank", "files saved per rank hold one rank's slice"),
    ("FSDP", 1, "sharded", "FSDP1"),
    ("DeepSpeed", None, "sharded", "ds_to_universal.py"),
])
def test_checkpoints_that_cannot_reshard_are_refused_before_loading(tmp_path, engine, version, layout, why):
    """Per-rank FSDP files, FSDP1 and DeepSpeed onto another process count: one ``error:`` line naming the
    checkpoint's process count, and nothing loaded. On the checkpoint's own count they load as before."""
    from finetune.lifecycle.checkpoint import RunProgress

    path, loads = _checkpoint(tmp_path / "step_00000002", layout), []
    progress = RunProgress(step=2, micro_batches_done=4, samples_done=16, step_meaning=_meaning(2))
    with pytest.raises(FinetuneError, match="written by 2 processes on 1: .*Resume on 2 processes") as err:
        train.Loop._load(_run_state(engine, version, 1, loads), path, progress)
    assert why in str(err.value) and "\n" not in str(err.value) and loads == []
    train.Loop._load(_run_state(engine, version, 2, loads), path, progress)  # same count: loads
    assert loads == [str(path)]


def test_the_fsdp_engine_reads_its_version_from_accelerates_plugin():
    """``FsdpEngine.fsdp_version``, which its ``resume_on_another_count`` reads: the plugin's (Accelerate's
    default 1)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from finetune.engine import engine_for

    for version in (1, 2):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
        accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin))
        assert engine_for(accelerator).fsdp_version == version
