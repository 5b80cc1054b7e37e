"""The FSDP engine (1 and 2): gradients reduce-scattered every micro-batch; weights whole only inside a forward."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
from accelerate.state import GradientState
from accelerate.utils import GradientAccumulationPlugin
from torch.distributed import fsdp

from finetune.engine.plain import PlainEngine
from finetune.errors import FinetuneError

_SHARDED_MODULES = tuple(getattr(fsdp, name) for name in ("FullyShardedDataParallel", "FSDPModule") if hasattr(fsdp, name))


def fsdp1_full_sizes(model) -> tuple[dict, dict]:
    """Where FSDP1 (``FullyShardedDataParallel``) flattened ``model``'s parameters, their whole sizes:
    (``flat``: id(FlatParameter) -> [(owning module, numel)], for ``use_orig_params=False``, where
    ``model.parameters()`` yields the flat shards; ``views``: id(original parameter) -> numel, for
    ``use_orig_params=True``, where each original parameter is a 1-D view of its part of this rank's shard, or
    size 0). Sources: torch 2.13 ``distributed/fsdp/_flat_param.py`` (``FlatParameter._param_infos``,
    ``_shapes``, ``_params``; ``_use_sharded_views`` sets the views), ``fully_sharded_data_parallel.py``
    (``_flat_param``). ``model``: wrapped, or unwrapped (its flat parameters are still found). Both empty for a
    model without FSDP1."""
    flat, views = {}, {}
    wrapper = getattr(fsdp, "FullyShardedDataParallel", None)
    found = [getattr(m, "_flat_param", None) for m in model.modules() if wrapper is not None and isinstance(m, wrapper)]
    found += [p for p in model.parameters() if hasattr(p, "_param_infos")]  # a flat parameter, the root unwrapped
    for param in found:
        if param is None or id(param) in flat:
            continue
        numels = [shape.numel() for shape in param._shapes]
        flat[id(param)] = [(info.module, n) for info, n in zip(param._param_infos, numels)]
        for original, n in zip(getattr(param, "_params", None) or (), numels):
            views[id(original)] = n
    return flat, views


def reduce_in_fp32(plugin) -> bool:
    """Make ``plugin`` (Accelerate's ``FullyShardedDataParallelPlugin``) reduce gradients in fp32 where its mixed
    precision policy computes in bf16/fp16; returns whether it changed the policy. Accelerate 1.15 builds the policy
    with ``reduce_dtype`` equal to the parameter dtype (``utils/dataclasses.py`` ``set_mixed_precision``, lines
    2136-2143: ``dtype_args = {"param_dtype": dtype, "reduce_dtype": dtype}``, called from ``state.py`` line 1015),
    and our engine reduce-scatters every micro-batch (``sync_each_batch``): N 16-bit roundings of partial sums per
    window, 8 mantissa bits under bf16. The policy object is replaced by a copy with ``reduce_dtype=torch.float32``
    (torch's ``MixedPrecisionPolicy`` (FSDP2) / ``MixedPrecision`` (FSDP1) dataclasses), the kind Accelerate accepts
    for ``mixed_precision_policy`` and checks with ``validate_mixed_precision_policy``; ``fully_shard`` reads it at
    ``prepare`` (``utils/fsdp_utils.py`` line 779, ``"mp_policy": fsdp2_plugin.mixed_precision_policy``). Must run
    before ``accelerator.prepare``. No change without a plugin, policy or 16-bit ``param_dtype``."""
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is None or getattr(policy, "param_dtype", None) not in (torch.bfloat16, torch.float16):
        return False
    if policy.reduce_dtype == torch.float32:
        return False
    plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)
    plugin.validate_mixed_precision_policy()
    return True


# Accelerate 1.15's FSDP checkpoint files (``utils/constants.py`` lines 24 and 48: OPTIMIZER_NAME, FSDP_MODEL_NAME;
# ``utils/fsdp_utils.py`` save_fsdp_model lines 154-191, save_fsdp_optimizer lines 330-358), model and optimizer 0
FSDP_LAYOUTS = {
    "sharded": ("pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"),  # SHARDED_STATE_DICT through DCP
    "full": ("pytorch_model_fsdp.bin", "optimizer.bin"),  # FULL_STATE_DICT: whole tensors, written by rank 0
}


def fsdp_layout(path) -> str | None:
    """Which of ``FSDP_LAYOUTS`` checkpoint directory ``path`` holds ("sharded": torch distributed checkpoint
    directories with their global ``.metadata``; "full": whole state dicts), or None: per-rank files
    (``pytorch_model_fsdp_rank{i}.bin``, ``..._0_rank{i}.bin``: LOCAL_STATE_DICT, or SHARDED_STATE_DICT saved with
    ``use_dcp=False``), or no FSDP state at all."""
    return next((kind for kind, files in FSDP_LAYOUTS.items() if all((Path(path) / f).is_file() for f in files)),
                None)



class FsdpEngine(PlainEngine):
    """FSDP through Accelerate's plugin (from the launcher's config), synchronised on every micro-batch so that
    each rank keeps only its gradient shard while accumulating (see docs/multi-node.md#fsdp)."""

    holds_quantized_base = False  # not yet: a quantized base is refused (engine.check_quantized_base)

    name = "FSDP"
    sync_each_batch = True  # no_sync would keep full gradients for N-1 micro-batches (accelerate PR 2531)
    generation_synced = True  # every forward all-gathers: ranks generate in lockstep
    eval_may_split_batch = False  # all-gathers run inside every forward: a rank retrying alone would hang
    lockstep_windows = True  # all-gathers in every forward, reduce-scatters in every backward
    local_backward = False
    shards_weights = True

    def resume_on_another_count(self, before: int, now: int, path) -> str | None:
        """Resume on another process count where torch reshards the state; else refuse.

        - **FSDP2** (``fsdp_version`` 2), **sharded** (``fsdp_layout``: the default, accelerate 1.15
          ``utils/dataclasses.py`` lines 2047-2051): ``Accelerator.save_state``/``load_state`` call
          ``save_fsdp_model``/``load_fsdp_model`` and ``..._optimizer`` with ``use_dcp=True`` (``accelerator.py``
          lines 3701, 3720, 3849, 3883; ``utils/fsdp_utils.py`` lines 173-185 and 261-278, 340-352 and 403-425):
          torch distributed checkpoint. Its ``.metadata`` holds each tensor's global shape and saved chunks; on
          load each rank asks for the chunks of its own ``DTensor`` shards (torch 2.13
          ``distributed/checkpoint/default_planner.py`` ``create_default_local_load_plan`` lines 477-516,
          ``planner_helpers.py`` ``create_read_items_for_chunk_list`` line 254), so another world size reads other
          slices: the library reshards.
        - **FSDP2, full**: whole tensors in one file; ``set_model_state_dict``/``set_optimizer_state_dict`` with
          ``full_state_dict`` broadcast or distribute them onto this mesh (torch
          ``distributed/checkpoint/state_dict.py`` lines 608-617 and 1160-1163). Both are shown exact from 2 gloo
          processes onto 1 by ``tests/test_elastic_fsdp.py``.
        - **Refused**: per-rank files (``fsdp_layout`` None: LOCAL_STATE_DICT, or ``use_dcp=False``; each file is
          one rank's slice of a mesh of the checkpoint's size); FSDP1 (``FullyShardedDataParallel``: not measured;
          its 2-process full-state save ended in SIGSEGV on a CPU here)."""
        layout = fsdp_layout(path) if self.fsdp_version == 2 else None
        if layout == "sharded":
            return (f"FSDP2: the sharded state of {before} processes (torch distributed checkpoint) is resharded onto "
                    f"{now} on load")
        if layout == "full":
            return f"FSDP2: the full state dict written by {before} processes is sharded onto {now} on load"
        why = ("its FSDP state is neither a torch distributed checkpoint (pytorch_model_fsdp_0/.metadata) nor whole "
               "files (pytorch_model_fsdp.bin): files saved per rank hold one rank's slice each"
               if self.fsdp_version == 2 else
               "resharding FSDP1 (FullyShardedDataParallel) states onto another process count is not verified in "
               "this version")
        raise FinetuneError(
            f"cannot resume an FSDP checkpoint written by {before} processes on {now}: {why}. Resume on "
            f"{before} processes (the micro-batch and accumulation may change, B must not), or start a fresh run; "
            "FSDP2 checkpoints with fsdp_state_dict_type SHARDED_STATE_DICT (the default) resume on any process "
            "count.")

    @property
    def fsdp_version(self) -> int:
        """1 (``FullyShardedDataParallel``) or 2 (``fully_shard``): the launcher config's, as Accelerate's plugin
        holds it (accelerate 1.15 ``utils/dataclasses.py``, ``fsdp_version`` defaults to 1)."""
        return getattr(getattr(self.accelerator.state, "fsdp_plugin", None), "fsdp_version", 1)

    def configure(self, config, per_machine: bool = False) -> None:
        """Replace the accumulation plugin with one that syncs each batch (``RuntimeError`` if it did not take), and
        under bf16/fp16 make the gradient reductions fp32 (``reduce_in_fp32``).
        Raises ``FinetuneError`` for machines without a shared filesystem: FSDP's full state dict is gathered on
        rank 0 and its sharded checkpoints' metadata written there, so no other machine's copy would be whole."""
        if per_machine:
            raise FinetuneError("FSDP over machines needs one shared --output_dir: its checkpoints and final model "
                                "are written by global rank 0 (and each rank's shard), so a machine's own copy would "
                                "not be whole. Give every machine the same directory on a shared filesystem.")
        # GradientState's constructor replaces a different plugin (accelerate 1.15 state.py); accumulate() reads it
        GradientState(gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=config.gradient_accumulation_steps, sync_with_dataloader=False, sync_each_batch=True))
        if not self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
            raise RuntimeError(f"the gradient accumulation plugin was not updated: "
                               f"{self.accelerator.gradient_state.plugin_kwargs}")
        self.note = ("FSDP: gradients are reduce-scattered on every micro-batch (sync_each_batch), so each rank "
                     "keeps only its gradient shard while accumulating")
        if reduce_in_fp32(getattr(self.accelerator.state, "fsdp_plugin", None)):
            self.note += "; the reduce-scatters run in fp32 (reduce_dtype), the forward and backward in 16-bit"


    def configure_trainer(self) -> None:
        """Trainer builds its FSDP plugin from its own arguments and reduce-scatters in the 16-bit dtype too:
        fp32 reductions (``reduce_in_fp32``) before ``Trainer.train`` prepares the model."""
        reduce_in_fp32(getattr(self.accelerator.state, "fsdp_plugin", None))

    def eval_model(self, model):
        """The wrapped model: its all-gathers are part of every forward."""
        return model

    @contextlib.contextmanager
    def generation_model(self, model):
        """The unwrapped model to ``generate`` with, its root's weights whole while the context lasts. Under FSDP1
        ``accelerator.unwrap_model`` strips the root ``FullyShardedDataParallel`` (accelerate 1.15
        ``utils/other.py`` ``extract_model_from_parallel``: ``while isinstance(model, options): model =
        model.module``, FSDP among the options), so the root's forward, which all-gathers its flat parameter,
        never runs and the embedding is a 1-D shard ("'weight' must be 2-D"). Here the root's parameters are
        gathered first (``FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=False)``,
        torch 2.13 ``distributed/fsdp/fully_sharded_data_parallel.py``); nested FSDP units (decoder layers under
        an auto-wrap policy) still gather their own in their forwards (``recurse=False``: a forward may not run
        inside a unit whose parameters are summoned), in lockstep with ``synced_gpus``. Under ``accelerator.autocast()``,
        as ``prepare`` wraps the root's forward under mixed precision: the summoned root weights are fp32 while a
        nested unit computes in its 16-bit ``param_dtype`` ("expected m1 and m2 to have the same dtype" without it).
        Collective: every process enters it. FSDP2 (``fully_shard``) keeps its hooks on the unwrapped model:
        nothing to gather."""
        wrapper = getattr(fsdp, "FullyShardedDataParallel", None)
        if wrapper is None or not isinstance(model, wrapper):
            with super().generation_model(model) as unwrapped:
                yield unwrapped
            return
        with wrapper.summon_full_params(model, writeback=False, recurse=False), self.accelerator.autocast():
            yield self.accelerator.unwrap_model(model)

    def chunked_loss_refusal(self, model) -> str | None:
        if any(isinstance(module, _SHARDED_MODULES) for module in (model, *model.modules())):
            return "the model is sharded with FSDP: the lm_head weight is not whole outside its forward"
        return None
