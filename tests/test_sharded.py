"""The FSDP and DeepSpeed pieces that a CPU can check (Accelerate 1.15 runs neither on a CPU: it turns them
into MULTI_CPU, and DeepSpeed is not installed here): the DeepSpeed config values the run writes before
``prepare``, the precision reported under DeepSpeed, which optimizer and schedule go to DeepSpeed, the
accumulation plugin per distributed type, and the loop's handling of DeepSpeed's float/None grad norm.
What only a GPU can prove (DeepSpeed really clipping at --max_grad_norm, FSDP's memory) is in
``bench/gpu_acceptance.py``."""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from accelerate.utils import DistributedType

from finetune.backends.accelerate import make_accelerator
from finetune.engine import DeepSpeedEngine, engine_for, parameter_counts
from finetune.engine.deepspeed import (
    deepspeed_config_updates,
    deepspeed_note,
    deepspeed_optimizer_and_scheduler,
    deepspeed_precision,
)
from finetune.errors import FinetuneError
from finetune.lifecycle.run_log import grad_norm_value
from finetune.lifecycle.window import plan_steps

FLAGS = dict(max_grad_norm=0.5, micro_batch=8, accumulation_steps=4)


# ------------------------------------------------------------------------------------------ --max_grad_norm
def test_auto_and_missing_values_take_the_flags():
    updates = deepspeed_config_updates({"gradient_clipping": "auto", "gradient_accumulation_steps": "auto"}, **FLAGS)
    assert updates == {"gradient_clipping": 0.5, "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 8}


def test_no_clipping_is_zero_for_deepspeed():
    for norm in (0.0, -1.0):
        assert deepspeed_config_updates({}, max_grad_norm=norm, micro_batch=8,
                                        accumulation_steps=4)["gradient_clipping"] == 0.0


def test_explicit_values_that_agree_are_kept():
    config = {"gradient_clipping": 0.5, "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 8}
    assert deepspeed_config_updates(config, **FLAGS) == {}
    assert deepspeed_config_updates({"gradient_clipping": "0.5"}, **FLAGS).keys() == {
        "gradient_accumulation_steps", "train_micro_batch_size_per_gpu"}


def test_an_explicit_value_that_contradicts_a_flag_is_refused():
    with pytest.raises(FinetuneError) as err:
        deepspeed_config_updates({"gradient_clipping": 1.0, "gradient_accumulation_steps": 2}, **FLAGS)
    message = str(err.value)
    assert "gradient_clipping: 1.0 in the DeepSpeed config, but --max_grad_norm is 0.5" in message
    assert "gradient_accumulation_steps: 2 in the DeepSpeed config, but --gradient_accumulation_steps is 4" in message
    assert "`auto`" in message


def test_the_function_is_pure():
    config = {"gradient_clipping": "auto"}
    deepspeed_config_updates(config, **FLAGS)
    assert config == {"gradient_clipping": "auto"}


def _plugin_from_yaml(name: str):
    """The DeepSpeedPlugin ``accelerate launch --config_file accelerate_configs/<name>`` would build."""
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env
    from test_accelerate_configs import _launcher_args

    args, defaults = _launcher_args(name)
    args.deepspeed_fields_from_accelerate_config = list(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    with mock.patch.dict(os.environ, {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}):
        return DeepSpeedPlugin()


@pytest.mark.parametrize("name", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_max_grad_norm_survives_accelerates_own_filling(name):
    """The shipped files leave gradient_clipping `auto`; the run writes --max_grad_norm before prepare, and
    Accelerate's later filling of `auto` values (1.0 for clipping, in ``_prepare_deepspeed``) keeps it."""
    plugin = _plugin_from_yaml(name)
    config = plugin.deepspeed_config
    assert config["gradient_clipping"] == "auto"
    config.update(deepspeed_config_updates(config, max_grad_norm=0.25, micro_batch=8, accumulation_steps=4))
    # what Accelerate 1.15's _prepare_deepspeed does next (train_batch_size from the micro-batch it reads back)
    plugin.deepspeed_config_process(must_match=False, gradient_clipping=1.0, train_micro_batch_size_per_gpu=64,
                                    train_batch_size=8 * 4 * 2)
    assert config["gradient_clipping"] == 0.25
    assert config["gradient_accumulation_steps"] == 4
    assert config["train_micro_batch_size_per_gpu"] == 8 and config["train_batch_size"] == 64


class FakeEngine:
    """The getters of a DeepSpeed engine that ``deepspeed_engine_settings`` reads."""

    def __init__(self, clip=0.5, stage=2, accumulation=4, micro=8, fp16=False, bf16=True):
        self.values = clip, stage, accumulation, micro, fp16, bf16

    def gradient_clipping(self):
        return self.values[0]

    def zero_optimization_stage(self):
        return self.values[1]

    def gradient_accumulation_steps(self):
        return self.values[2]

    def train_micro_batch_size_per_gpu(self):
        return self.values[3]

    def fp16_enabled(self):
        return self.values[4]

    def bfloat16_enabled(self):
        return self.values[5]


def test_the_engine_must_run_what_was_asked():
    from finetune.engine.deepspeed import check_deepspeed_engine, deepspeed_engine_settings

    settings = deepspeed_engine_settings(FakeEngine())
    assert settings == {"zero_stage": 2, "gradient_clipping": 0.5, "gradient_accumulation_steps": 4,
                        "train_micro_batch_size_per_gpu": 8, "precision": "bf16"}
    check_deepspeed_engine(settings, precision="bf16", **FLAGS)
    note = deepspeed_note(settings, {})
    assert note.startswith("DeepSpeed ZeRO stage 2 (as the engine reports it): gradient clipping at norm 0.5 ")
    assert "optimizer from the run (AdamW), LR schedule from the run" in note
    assert "no gradient clipping" in deepspeed_note(dict(settings, gradient_clipping=0.0), {"optimizer": {}})
    # Accelerate's `auto` fill (1.0), or an fp16 run that DeepSpeed does not run in fp16, must not pass unnoticed
    with pytest.raises(RuntimeError, match="gradient_clipping 1.0 vs 0.5"):
        check_deepspeed_engine(deepspeed_engine_settings(FakeEngine(clip=1.0)), precision="bf16", **FLAGS)
    with pytest.raises(RuntimeError, match="precision 'no' vs 'fp16'"):
        check_deepspeed_engine(deepspeed_engine_settings(FakeEngine(bf16=False)), precision="fp16", **FLAGS)


# ------------------------------------------------------------------------------------------ precision
@pytest.mark.parametrize("requested", ["no", "fp16", "bf16"])
def test_precision_is_the_one_deepspeed_runs(requested):
    plugin = _plugin_from_yaml("deepspeed_zero2.yaml")
    plugin.set_mixed_precision(requested)  # what AcceleratorState does with --mixed_precision under DeepSpeed
    assert deepspeed_precision(plugin.deepspeed_config) == requested


def test_precision_from_an_explicit_config_and_string_flags():
    assert deepspeed_precision({"fp16": {"enabled": "true"}, "bf16": {"enabled": False}}) == "fp16"
    assert deepspeed_precision({"bf16": {"enabled": True}}) == "bf16"
    assert deepspeed_precision({"fp16": {"enabled": "auto"}}) == "no"
    assert deepspeed_precision({}) == "no"


def test_running_precision_asks_deepspeed_not_autocast():
    fake = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                           state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
                               deepspeed_config={"fp16": {"enabled": True}})))
    assert engine_for(fake).precision() == "fp16"


# ------------------------------------------------------------------------------------------ optimizer, schedule
def _tiny():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    config = SimpleNamespace(learning_rate=1e-3, weight_decay=0.01)
    groups = [{"params": [model[0].weight], "weight_decay": 0.01},
              {"params": [model[0].bias, *model[1].parameters()], "weight_decay": 0.0}]
    return model, config, groups


def _choose(ds_config, num_processes=2):
    from transformers import get_scheduler

    model, config, groups = _tiny()
    made = []

    def make_schedule(optimizer):
        made.append(optimizer)
        return get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=10)

    pair = deepspeed_optimizer_and_scheduler(groups, config, 10, 2, ds_config, num_processes,
                                             make_optimizer=lambda: torch.optim.AdamW(groups, lr=1e-3),
                                             make_schedule=make_schedule)
    return pair, made


def test_neither_in_the_config_our_optimizer_and_schedule():
    (optimizer, scheduler), _ = _choose({})
    assert isinstance(optimizer, torch.optim.AdamW)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and scheduler.optimizer is optimizer


def test_optimizer_in_the_config_our_schedule_built_by_deepspeed():
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    (optimizer, scheduler), made = _choose({"optimizer": {"type": "AdamW"}})
    assert isinstance(optimizer, DummyOptim) and optimizer.lr == 1e-3 and optimizer.weight_decay == 0.01
    assert len(optimizer.params) == 2  # the no-decay grouping reaches DeepSpeed
    assert isinstance(scheduler, DummyScheduler) and made == []
    real = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    built = scheduler.lr_scheduler_callable(real)  # what DeepSpeed calls with its optimizer
    assert isinstance(built, torch.optim.lr_scheduler.LambdaLR) and built.optimizer is real


@pytest.mark.parametrize("owns_optimizer", [False, True])
def test_schedule_in_the_config_sized_for_accelerates_division(owns_optimizer):
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    ds_config = {"scheduler": {"type": "WarmupDecayLR"}, **({"optimizer": {}} if owns_optimizer else {})}
    (optimizer, scheduler), _ = _choose(ds_config, num_processes=4)
    assert isinstance(optimizer, DummyOptim if owns_optimizer else torch.optim.AdamW)
    assert isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None
    # Accelerate 1.15 writes ceil(total_num_steps / num_processes) into the DeepSpeed config: 10 optimizer steps
    assert scheduler.total_num_steps == 40 and scheduler.warmup_num_steps == 2


def test_a_wrapped_schedule_steps_once_per_call_with_our_accelerator(tmp_path):
    """Where Accelerate wraps our schedule (DeepSpeed, neither in the config), our Accelerator's
    step_scheduler_with_optimizer=False makes each call one step, whatever the number of processes."""
    from accelerate.scheduler import AcceleratedScheduler

    from finetune.config import TrainConfig

    accelerator = make_accelerator(TrainConfig(recipe="bbc-news", output_dir=str(tmp_path), report_to="none"))
    assert accelerator.step_scheduler_with_optimizer is False
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    wrapped = AcceleratedScheduler(schedule, optimizer, step_with_optimizer=accelerator.step_scheduler_with_optimizer)
    with mock.patch("accelerate.scheduler.AcceleratorState", return_value=SimpleNamespace(num_processes=8)):
        wrapped.step()
    assert schedule.last_epoch == 1


# ------------------------------------------------------------------------------------------ FSDP
@pytest.mark.parametrize("distributed_type", list(DistributedType))
def test_sync_each_batch_only_under_fsdp(distributed_type):
    engine = engine_for(SimpleNamespace(distributed_type=distributed_type))
    assert engine.sync_each_batch is (distributed_type == DistributedType.FSDP)


def test_plain_runs_keep_the_plugin_they_had(tmp_path):
    """Outside FSDP the plugin's kwargs are exactly those of the engine before sync_each_batch existed."""
    from finetune.config import TrainConfig

    accelerator = make_accelerator(TrainConfig(recipe="bbc-news", output_dir=str(tmp_path), report_to="none",
                                               gradient_accumulation_steps=3))
    assert accelerator.gradient_state.plugin_kwargs == {"num_steps": 3, "sync_with_dataloader": False}


def test_an_fsdp_accelerator_gets_sync_each_batch(tmp_path):
    """The plugin update the FSDP engine applies once the distributed type is known (here an FSDP type is
    faked on a CPU Accelerator's shared GradientState), and what ``accumulate()`` reads from it."""
    from finetune.config import TrainConfig

    config = TrainConfig(recipe="bbc-news", output_dir=str(tmp_path), report_to="none", gradient_accumulation_steps=3)
    accelerator = make_accelerator(config)
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, gradient_state=accelerator.gradient_state,
                           state=accelerator.state)  # a CPU state: no FSDP plugin
    engine_for(fsdp).configure(config)
    assert accelerator.gradient_state.plugin_kwargs["sync_each_batch"] is True
    assert accelerator.gradient_accumulation_steps == 3


# ------------------------------------------------------------------------------------------ small pieces
def test_parameter_count_sees_through_zero3_placeholders():
    model = torch.nn.Linear(3, 2)
    assert parameter_counts(model) == (8, 8)
    model.weight.ds_numel = 6  # ZeRO-3 leaves an empty tensor and the true count here
    model.weight.data = torch.empty(0)
    assert parameter_counts(model) == (8, 8)


def test_grad_norm_values():
    assert grad_norm_value(torch.tensor(2.5)) == 2.5
    assert grad_norm_value(1.5) == 1.5
    assert grad_norm_value(None) is None


def _run_state(precision: str):
    from finetune.backends.accelerate import Loop
    from finetune.lifecycle.checkpoint import RunProgress

    loop = Loop.__new__(Loop)
    loop.built = SimpleNamespace(precision=precision)
    loop.run = SimpleNamespace(progress=RunProgress())
    return loop


def test_check_finite_takes_deepspeeds_float_and_none():
    from finetune.errors import NumericalError

    run = _run_state("no")
    run.check_finite(torch.tensor(1.0), 4)
    run.check_finite(1.0, 4)
    run.check_finite(None, 4)  # DeepSpeed computed no norm
    with pytest.raises(NumericalError, match="grad norm inf"):
        run.check_finite(float("inf"), 4)
    with pytest.raises(NumericalError, match="grad norm nan"):
        run.check_finite(torch.tensor(float("nan")), 4)
    _run_state("fp16").check_finite(float("inf"), 4)  # the loss scaler's to skip


def test_deepspeed_schedule_plan_matches_accelerates_sharding():
    """Under DeepSpeed the schedule is sized before prepare, from micro_batches_per_process: the length
    Accelerate's sharded dataloader has (even_batches), checked against a real prepared dataloader split
    over 3 fake processes."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    from finetune.lifecycle.window import micro_batches_per_process

    for samples, micro, processes in [(100, 8, 3), (96, 8, 3), (7, 8, 2), (1780, 8, 4)]:
        batches = BatchSampler(SequentialSampler(range(samples)), micro, drop_last=False)
        lengths = {len(BatchSamplerShard(batches, processes, rank, even_batches=True)) for rank in range(processes)}
        assert lengths == {micro_batches_per_process(samples, micro, processes)}


# ------------------------------------------------------------------------------------------ evaluation
@pytest.mark.parametrize("distributed_type", [DistributedType.FSDP, DistributedType.DEEPSPEED,
                                              DistributedType.MULTI_GPU, DistributedType.NO])
def test_evaluation_never_splits_a_batch_under_a_sharded_engine(distributed_type):
    """An out-of-memory evaluation batch is split and retried on one rank only where no collective runs
    inside the forward: under FSDP (versions 1 and 2 are both DistributedType.FSDP) and DeepSpeed a rank
    retrying alone would desynchronise the all-gathers, so the error propagates instead."""
    from finetune.lifecycle.evaluation import evaluate
    from finetune.tasks import get_task

    class Model(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            if input_ids.shape[0] > 2:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], 3))

    accelerator = SimpleNamespace(distributed_type=distributed_type, gather_for_metrics=lambda outputs: outputs)
    batch = {"input_ids": torch.ones(4, 5, dtype=torch.long), "attention_mask": torch.ones(4, 5, dtype=torch.long),
             "labels": torch.zeros(4, dtype=torch.long)}
    task = get_task("sequence-classification")
    if distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(RuntimeError, match="out of memory"):
            evaluate(accelerator, Model(), [dict(batch)], task, {})
    else:
        assert evaluate(accelerator, Model(), [dict(batch)], task, {})["eval_samples"] == 4


# ------------------------------------------------------------------------------------------ the DeepSpeed prepare
class FakeDeepSpeedAccelerator:
    """What ``DeepSpeedEngine.prepare`` uses of an Accelerator: the DeepSpeed config, the process count,
    and ``prepare`` (here returning the objects it got, with the training loader sharded as Accelerate's)."""

    num_processes = 2

    def __init__(self, ds_config: dict):
        self.state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=ds_config))
        self.prepared = None

    def prepare(self, model, optimizer, train_dataloader, eval_dataloader, scheduler):
        self.prepared = (model, optimizer, train_dataloader, eval_dataloader, scheduler)
        sharded = list(range(-(-len(train_dataloader) // self.num_processes)))  # even_batches: ceil
        return model, optimizer, sharded, eval_dataloader, scheduler


@pytest.mark.parametrize("ds_config", [{}, {"optimizer": {}}, {"scheduler": {}}])
def test_prepare_deepspeed_hands_model_optimizer_and_schedule_to_one_prepare(tmp_path, ds_config):
    from accelerate.utils.deepspeed import DummyScheduler
    from torch.utils.data import DataLoader

    from finetune.config import TrainConfig
    config = TrainConfig(recipe="bbc-news", output_dir=str(tmp_path), per_device_train_batch_size=8,
                         gradient_accumulation_steps=2, num_train_epochs=1, warmup_steps=1, lr_scheduler_type="linear")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    accelerator = FakeDeepSpeedAccelerator(ds_config)
    train = DataLoader(list(range(100)), batch_size=8)  # 13 batches: 7 per process
    prepared = DeepSpeedEngine(accelerator).prepare(config, model, train, [], lambda n: plan_steps(n, config))
    optimizer, scheduler, plan = prepared.optimizer, prepared.scheduler, prepared.plan
    assert accelerator.prepared[0] is model and accelerator.prepared[1] is optimizer
    assert accelerator.prepared[4] is scheduler
    assert (plan.micro_batches_per_epoch, plan.max_steps) == (7, 4)
    if ds_config == {}:
        assert isinstance(optimizer, torch.optim.AdamW) and scheduler.optimizer is optimizer
        assert [group["weight_decay"] for group in optimizer.param_groups] == [config.weight_decay, 0.0]
        for _ in range(4):
            scheduler.step()
        assert scheduler.get_last_lr()[0] == 0.0  # sized in optimizer steps: linear decay reaches 0 at step 4
    elif "optimizer" in ds_config:
        assert isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None
    else:
        assert isinstance(scheduler, DummyScheduler) and scheduler.total_num_steps == 4 * 2


def test_parameter_groups_see_through_zero3_partitioned_parameters():
    """Under ZeRO-3 transformers loads the model under deepspeed.zero.Init: every parameter is a 1-D
    placeholder with its true shape in ``ds_shape``. The weight-decay grouping must use the true shape
    (found on a CPU DeepSpeed run: every weight had landed in the no-decay group)."""
    from finetune.engine import parameter_groups, parameter_shape

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for param in model.parameters():
        param.ds_shape = param.shape
        param.data = torch.empty(0)
    decay, no_decay = parameter_groups(model, SimpleNamespace(weight_decay=0.1), shape=parameter_shape)
    assert [tuple(p.ds_shape) for p in decay["params"]] == [(4, 4)] and decay["weight_decay"] == 0.1
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


def test_prepare_deepspeed_leaves_out_an_empty_parameter_group(tmp_path):
    """DeepSpeed drops an empty parameter group from the optimizer; our schedule must not hold a learning
    rate for it (LoRA-like: only 2-D weights, no biases or norms)."""
    from torch.utils.data import DataLoader

    from finetune.config import TrainConfig
    config = TrainConfig(recipe="bbc-news", output_dir=str(tmp_path), per_device_train_batch_size=8,
                         gradient_accumulation_steps=2, num_train_epochs=1)
    model = torch.nn.Linear(4, 4, bias=False)
    prepared = DeepSpeedEngine(FakeDeepSpeedAccelerator({})).prepare(config, model,
                                                                     DataLoader(list(range(32)), batch_size=8), [],
                                                                     lambda n: plan_steps(n, config))
    optimizer, scheduler = prepared.optimizer, prepared.scheduler
    assert len(optimizer.param_groups) == 1 and len(scheduler.base_lrs) == 1


FSDP2_SCRIPT = '''
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

def train(sync_each_batch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1 + dist.get_rank())
    for step in range(3):
        for micro in range(4):  # what Accelerate's accumulate() does with FSDP2, with and without sync_each_batch
            model.set_requires_gradient_sync(sync_each_batch or micro == 3)
            model(torch.randn(5, 8, generator=data)).pow(2).sum().backward()
            if sync_each_batch:  # reduce-scattered at once: each rank holds only its shard of the gradient
                assert all(p.grad.to_local().shape == p.to_local().shape for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.full_tensor() for k, v in model.state_dict().items()}

dist.init_process_group("gloo")
each, once = train(True), train(False)
difference = max((each[k] - once[k]).abs().max().item() for k in each)
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(str(difference))
dist.destroy_process_group()
os._exit(0)  # all done: torch 2.13's interpreter teardown after gloo + FSDP2 aborts 1 run in ~10 ("terminate called
             # without an active exception", after the last line of the script ran on both ranks)
'''


@pytest.mark.integration
def test_fsdp2_sync_each_batch_trains_the_same_weights(tmp_path):
    """The exactness argument for sync_each_batch, checked with PyTorch's FSDP2 on two gloo CPU ranks (FSDP
    runs on a CPU through torch, not through Accelerate): reduce-scattering every micro-batch and reducing
    once per window give the same weights after three accumulated AdamW steps, up to float rounding."""
    import socket
    import subprocess
    import sys

    script, result = tmp_path / "fsdp2.py", tmp_path / "difference"
    script.write_text(FSDP2_SCRIPT)
    with socket.socket() as sock:  # a free port: torchrun's default 29500 may be taken by another run
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(port), str(script), str(result)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(result.read_text()) < 1e-6


def test_the_final_save_under_zero3_off_rank_0_writes_nothing_and_does_not_fail(tmp_path):
    """Under ZeRO-3 ``accelerator.get_state_dict`` returns DeepSpeed's consolidated 16-bit state dict, which
    is None on every rank but 0 (deepspeed 0.19 ``runtime/engine.py`` ``_zero3_consolidated_16bit_state_dict``:
    ``state_dict = OrderedDict() if dist.get_rank() == 0 else None``; accelerate 1.15 ``accelerator.py``
    ``get_state_dict`` returns it as is). The save used to call ``.items()`` on it and crash there, and torchrun
    then tore rank 0 down while it wrote the model. A process that writes needs the weights: a clear error."""
    saved = []
    model = SimpleNamespace(save_pretrained=lambda *a, **k: saved.append(a))
    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, is_main_process=False,
                                  wait_for_everyone=lambda: None, get_state_dict=lambda model: None,
                                  unwrap_model=lambda model, keep_torch_compile=False: model)
    config = SimpleNamespace(model_name_or_path="m", merge_adapter=False)
    engine = engine_for(accelerator)
    engine.save_model(model, SimpleNamespace(save_pretrained=lambda *a: saved.append(a)), tmp_path, config,
                      writes=False)
    assert saved == []
    with pytest.raises(FinetuneError, match="shared --output_dir"):
        engine.save_model(model, None, tmp_path, config, writes=True)


def test_ddp_evaluation_never_runs_ddps_forward():
    """Evaluation under DDP calls the module DDP wraps: DDP's forward broadcasts buffers on its first call after
    a training step, and after an out-of-memory on one rank the retried halves would broadcast again on that
    rank alone (a hang; torch 2.13 ``nn/parallel/distributed.py``, ``require_forward_param_sync``). So the
    split-and-retry evaluation stays local to the rank."""
    from torch.nn.parallel import DistributedDataParallel

    from finetune.lifecycle.evaluation import evaluate
    from finetune.tasks import get_task

    class Inner(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            if input_ids.shape[0] > 2:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], 3))

    wrapped = DistributedDataParallel.__new__(DistributedDataParallel)  # no process group: DDP's forward must not run
    torch.nn.Module.__init__(wrapped)
    wrapped.module = Inner()
    accelerator = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, gather_for_metrics=lambda outputs: outputs)
    batch = {"input_ids": torch.ones(4, 5, dtype=torch.long), "attention_mask": torch.ones(4, 5, dtype=torch.long),
             "labels": torch.zeros(4, dtype=torch.long)}
    assert evaluate(accelerator, wrapped, [batch], get_task("sequence-classification"), {})["eval_samples"] == 4


def test_machines_without_a_shared_filesystem_under_sharded_engines(tmp_path):
    """Each machine keeping its own copy (no shared filesystem): DeepSpeed writes its model states on every
    machine (``checkpoint.use_node_local_storage``, as transformers 5.23's Trainer sets for save_on_each_node in
    ``integrations/deepspeed.py``); FSDP and ZeRO-3, whose full weights exist on global rank 0 only, are refused
    before training instead of writing copies marked complete that hold no weights."""
    from finetune.config import TrainConfig

    config = TrainConfig(recipe="bbc-news", output_dir=str(tmp_path), report_to="none")
    for stage in (2, 3):
        accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, state=SimpleNamespace(
            deepspeed_plugin=SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": stage}})))
        engine = engine_for(accelerator)
        engine.configure(config)  # one machine, or a shared filesystem: untouched
        assert "checkpoint" not in engine.ds_config
        if stage == 2:
            engine.configure(config, per_machine=True)
            assert engine.ds_config["checkpoint"]["use_node_local_storage"] is True
        else:
            with pytest.raises(FinetuneError, match="shared --output_dir"):
                engine.configure(config, per_machine=True)
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP)
    with pytest.raises(FinetuneError, match="shared --output_dir"):
        engine_for(fsdp).configure(config, per_machine=True)


@pytest.mark.parametrize("fsdp_version", [1, 2])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp_reduces_gradients_in_fp32_under_16_bit(tmp_path, fsdp_version, precision):
    """Accelerate 1.15 gives the FSDP plugin a policy whose ``reduce_dtype`` is the 16-bit parameter dtype
    (``utils/dataclasses.py`` ``FullyShardedDataParallelPlugin.set_mixed_precision`` lines 2136-2143, called by
    ``AcceleratorState`` in ``state.py`` line 1015 with the run's mixed precision); ``fully_shard`` then takes
    ``fsdp2_plugin.mixed_precision_policy`` as its ``mp_policy`` (``utils/fsdp_utils.py`` line 779). FSDP does not
    run on a CPU through Accelerate, so the plugin is built and given its precision as Accelerate does, the engine
    configures it, and the policy ``prepare`` would read is checked: reductions in fp32, compute still 16-bit."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from finetune.config import TrainConfig

    config = TrainConfig(recipe="bbc-news", output_dir=str(tmp_path), report_to="none", gradient_accumulation_steps=2)
    accelerator = make_accelerator(config)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=fsdp_version)
    plugin.set_mixed_precision(precision)  # what AcceleratorState does (state.py line 1015)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert plugin.mixed_precision_policy.reduce_dtype == dtype  # accelerate's own choice: the issue
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, gradient_state=accelerator.gradient_state,
                           state=SimpleNamespace(fsdp_plugin=plugin))
    engine = engine_for(fsdp)
    engine.configure(config)
    policy = plugin.mixed_precision_policy
    assert policy.reduce_dtype == torch.float32 and policy.param_dtype == dtype
    if fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        assert isinstance(policy, MixedPrecisionPolicy) and policy.output_dtype == dtype
    else:
        from torch.distributed.fsdp import MixedPrecision

        assert isinstance(policy, MixedPrecision) and policy.buffer_dtype == dtype
    assert "fp32" in engine.note


def test_the_trainer_backend_reduces_in_fp32_under_fsdp_too():
    """Trainer builds its own Accelerator and FSDP plugin (from its arguments, with Accelerate's 16-bit
    ``reduce_dtype``, as above); ``trainer_backend.train`` calls ``engine.configure_trainer()`` once the Trainer
    exists and before ``Trainer.train`` prepares the model, which reads the same plugin object
    (``accelerator.state.fsdp_plugin``)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")
    engine = engine_for(SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin)))
    engine.configure_trainer()
    assert plugin.mixed_precision_policy.reduce_dtype == torch.float32
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16


def test_fsdp_full_precision_policy_is_left_alone(tmp_path):
    """Without mixed precision Accelerate sets no policy (``state.py`` line 1014: only when it is not "no"); the
    engine adds none."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from finetune.config import TrainConfig

    config = TrainConfig(recipe="bbc-news", output_dir=str(tmp_path), report_to="none")
    accelerator = make_accelerator(config)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, gradient_state=accelerator.gradient_state,
                           state=SimpleNamespace(fsdp_plugin=plugin))
    engine_for(fsdp).configure(config)
    assert plugin.mixed_precision_policy is None


def _fsdp1_generation(rank: int, port: int, model_dir: str, nested: bool, bf16: bool, out: str) -> None:
    """One of two gloo ranks: a tiny chat Llama wrapped in FSDP1 (FULL_SHARD; ``nested``: each decoder layer its
    own unit, as Accelerate's transformer auto-wrap policy does, and ``use_orig_params``: original parameters as 1-D
    views of the shard), then ``evaluation.generation_eval`` as a run
    calls it. The stand-in accelerator's ``unwrap_model`` is Accelerate's own: ``Accelerator.unwrap_model`` returns
    ``extract_model_from_parallel(model, ...)`` (accelerate 1.15 ``accelerator.py`` line 3286), which strips the
    root FSDP wrapper (``utils/other.py`` lines 317-320: FSDP among the options, ``while isinstance(model,
    options): model = model.module``) and leaves its flat parameter sharded. Its ``autocast`` is what
    ``Accelerator.autocast`` enters (``accelerator.py`` line 4239, ``get_mixed_precision_context_manager``,
    ``utils/modeling.py`` lines 2078-2117): ``torch.autocast`` in bf16 under bf16 mixed precision, else
    ``contextlib.nullcontext()``; ``bf16``: FSDP1's ``MixedPrecision`` with 16-bit parameters as Accelerate
    configures it (``param_dtype`` and ``buffer_dtype`` bf16; fp32 reductions, as this engine sets them)."""
    import contextlib
    import functools
    import json

    from accelerate.utils import extract_model_from_parallel
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from finetune.distributed import process_state
    from finetune.lifecycle import evaluation
    from finetune.tasks import get_task

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", ACCELERATE_USE_CPU="1")
    state = process_state(cpu=True)  # gloo; accelerate's gather_object needs its state
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(1)  # larger weights, the same on both ranks: the random model then writes words, not spaces
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.5)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": f"Write the headline of this BBC News article. The striker scored goal {i}.",
             "completion": "Late goal"} for i in range(3)]
    recipe = SimpleNamespace(GENERATION={"max_new_tokens": 6, "batch_size": 2}, METRICS={})
    config, sft = SimpleNamespace(max_length=64), get_task("sft")
    plain = SimpleNamespace(process_index=0, num_processes=1, distributed_type=DistributedType.NO,
                            unwrap_model=extract_model_from_parallel)
    _, expected = evaluation.generation_eval(plain, model, tokenizer, rows, recipe, config, sft)  # whole, one rank
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}) if nested else None
    from torch.distributed.fsdp import MixedPrecision

    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                               buffer_dtype=torch.bfloat16) if bf16 else None
    wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), auto_wrap_policy=policy,
                                       sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=nested,
                                       mixed_precision=precision)
    autocast = (lambda: torch.autocast(device_type="cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    accelerator = SimpleNamespace(process_index=state.process_index, num_processes=2, autocast=autocast,
                                  distributed_type=DistributedType.FSDP, unwrap_model=extract_model_from_parallel)
    try:
        _, predictions = evaluation.generation_eval(accelerator, wrapped, tokenizer, rows, recipe, config, sft)
        result = {"expected": expected, "predictions": predictions}
    except Exception as err:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(err).__name__}: {err}"}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    # leave together: a rank that tears gloo down while its peer still sends aborts the peer (SIGABRT, seen once
    # in 4 runs with other jobs on the cores)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("nested, bf16", [(False, False), (True, False), (True, True)],
                         ids=["one-unit", "nested", "nested-bf16"])
def test_generation_under_fsdp1_uses_whole_weights(tmp_path, nested, bf16):
    """Evaluation with generation (bbc-headlines, eval_on_start) under FSDP1 on two real gloo ranks: each rank
    generates its share and every rank gets the same completions a single whole model gives. Before the fix it
    generated on ``accelerator.unwrap_model(model)``, the root's flat parameter still a 1-D shard: "'weight' must
    be 2-D" on every rank. Under bf16 (16-bit parameters in the nested units, the summoned root's fp32) the
    ranks agree with each other (the whole fp32 model may round otherwise)."""
    import json

    import torch.multiprocessing as mp
    from helpers import free_port
    from tiny_models import build_tiny_chat_llama

    model_dir = build_tiny_chat_llama(tmp_path / "model")
    port = free_port()  # its own: parallel tests (pytest -n) start other process groups beside it
    mp.spawn(_fsdp1_generation, args=(port, str(model_dir), nested, bf16, str(tmp_path / "result")), nprocs=2,
             join=True)
    results = [json.loads((tmp_path / f"result.{rank}").read_text()) for rank in (0, 1)]
    for result in results:
        assert "error" not in result, result["error"]
        assert len(result["predictions"]) == 3 and any(result["predictions"])
        if not bf16:
            assert result["predictions"] == result["expected"]
    assert results[0]["predictions"] == results[1]["predictions"]
