"""The FSDP engine (versions 1 and 2): the plain engine's loop with gradients reduce-scattered on every
micro-batch, and weights that are whole only inside a forward."""

from __future__ import annotations

from accelerate.state import GradientState
from accelerate.utils import GradientAccumulationPlugin
from torch.distributed import fsdp

from finetune.engine.plain import PlainEngine

_SHARDED_MODULES = tuple(getattr(fsdp, name) for name in ("FullyShardedDataParallel", "FSDPModule") if hasattr(fsdp, name))


class FsdpEngine(PlainEngine):
    """FSDP through Accelerate's plugin (from the launcher's config).

    ``sync_each_batch``: skipping the sync (``no_sync``) would keep every rank's full gradients alive for the
    first N-1 micro-batches, so FULL_SHARD would save no gradient memory while accumulating; synchronised on
    every micro-batch, each rank keeps only its shard (accelerate PR 2531). Exactness is unchanged: a sum of
    rank averages is the average of the sums (tested with FSDP2 on two gloo ranks, tests/test_sharded.py).
    """

    sync_each_batch = True
    generation_synced = True  # every forward all-gathers: ranks generate in lockstep
    eval_may_split_batch = False  # all-gathers run inside every forward: a rank retrying alone would hang

    def configure(self, config) -> None:
        """Replace the accumulation plugin with one that syncs each batch. Accelerate keeps it in the
        process-wide ``GradientState``, whose constructor replaces a different plugin (accelerate 1.15
        ``state.py``: "Allow plugin to be updated"); ``accumulate()`` reads it at every call."""
        GradientState(gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=config.gradient_accumulation_steps, sync_with_dataloader=False, sync_each_batch=True))
        if not self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
            raise RuntimeError(f"the gradient accumulation plugin was not updated: "
                               f"{self.accelerator.gradient_state.plugin_kwargs}")
        self.note = ("FSDP: gradients are reduce-scattered on every micro-batch (sync_each_batch), so each rank "
                     "keeps only its gradient shard while accumulating")

    def eval_model(self, model):
        """The wrapped model: its all-gathers are part of every forward."""
        return model

    def chunked_loss_refusal(self, model) -> str | None:
        if any(isinstance(module, _SHARDED_MODULES) for module in (model, *model.modules())):
            return "the model is sharded with FSDP: the lm_head weight is not whole outside its forward"
        return None
