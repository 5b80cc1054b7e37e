"""The Accelerate config files in ``accelerate_configs/``: each loads with Accelerate's own loader, has
the distributed type its name promises and consistent process counts, and opens with its launch
command. The FSDP, DeepSpeed and multi-node files are also pushed through the launcher's own argument
handling (no process is started), because ``accelerate launch`` silently ignores a misspelt key inside
``fsdp_config`` / ``deepspeed_config``: we check the environment the launcher would export and the
plugin Accelerate would build from it."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from unittest import mock

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "accelerate_configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.yaml"))

EXPECTED_TYPE = {
    "single_gpu.yaml": DistributedType.NO,
    "multi_gpu.yaml": DistributedType.MULTI_GPU,
    "multi_cpu_2proc.yaml": DistributedType.MULTI_GPU,  # + ACCELERATE_USE_CPU=1: two gloo ranks on the CPU
    "fsdp.yaml": DistributedType.FSDP,
    "fsdp2.yaml": DistributedType.FSDP,
    "deepspeed_zero2.yaml": DistributedType.DEEPSPEED,
    "deepspeed_zero3.yaml": DistributedType.DEEPSPEED,
    "multi_node.yaml": DistributedType.MULTI_GPU,
}


def test_every_expected_config_exists():
    assert {p.name for p in CONFIG_FILES} == set(EXPECTED_TYPE), "add new config files to EXPECTED_TYPE"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_loads_with_expected_type_and_counts(path):
    config = load_config_from_file(str(path))
    assert config.distributed_type == EXPECTED_TYPE[path.name]
    assert isinstance(config.num_processes, int) and isinstance(config.num_machines, int)
    assert config.num_machines >= 1
    assert 0 <= config.machine_rank < config.num_machines
    if config.distributed_type == DistributedType.NO:
        assert config.num_processes == 1 and config.num_machines == 1
    else:
        assert config.num_processes >= 2
    # num_processes is the total over all machines; each machine runs the same number of processes.
    assert config.num_processes % config.num_machines == 0
    if config.num_machines > 1:
        assert config.main_process_ip and config.main_process_port
    # precision is a flag of the run (--mixed_precision), never of a config file
    assert config.mixed_precision == "no"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_opens_with_its_launch_command(path):
    first_line = path.read_text(encoding="utf-8").splitlines()[0]
    assert first_line.startswith("#")
    assert f"accelerate launch --config_file accelerate_configs/{path.name} " in first_line
    match = re.search(r"accelerate launch --config_file \S+ (\S+) --recipe (\S+)", first_line)
    assert match, first_line
    script, recipe = match.groups()
    assert (REPO / script).is_file()
    from finetune.recipes import RECIPES

    assert recipe in RECIPES


def _launcher_args(name: str):
    """What ``accelerate launch --config_file accelerate_configs/<name> finetune/run.py`` resolves to,
    without launching: (args namespace, loaded config). Uses the launcher's own (private) validation."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(
        ["--config_file", str(CONFIG_DIR / name), "finetune/run.py", "--recipe", "bbc-news"]
    )
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


def _tiny_bert_classifier():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=64, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=32, num_labels=3)
    return BertForSequenceClassification(config)


def test_fsdp_config_reaches_the_plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env
    from torch.distributed.fsdp import ShardingStrategy, StateDictType
    from transformers.models.bert.modeling_bert import BertLayer

    args, _ = _launcher_args("fsdp.yaml")
    with mock.patch("accelerate.utils.launch.is_port_in_use", return_value=False):
        env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert env["FSDP_VERSION"] == "1"
    assert env["FSDP_SHARDING_STRATEGY"] == "FULL_SHARD"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "BertLayer"
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    assert env["FSDP_USE_ORIG_PARAMS"] == "true"
    assert env["FSDP_SYNC_MODULE_STATES"] == "true"

    # sync_module_states makes the plugin look for an accelerator device; this check runs on a CPU.
    plugin_env = {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_"))}
    plugin_env["FSDP_SYNC_MODULE_STATES"] = "false"
    with mock.patch.dict(os.environ, plugin_env):
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 1
    assert plugin.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.use_orig_params is True
    assert plugin.cpu_offload.offload_params is False
    plugin.set_auto_wrap_policy(_tiny_bert_classifier())  # raises if a listed class is not in the model
    assert plugin.auto_wrap_policy.keywords["transformer_layer_cls"] == {BertLayer}


def test_deepspeed_config_reaches_the_plugin():
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args, defaults = _launcher_args("deepspeed_zero2.yaml")
    args.deepspeed_fields_from_accelerate_config = list(defaults.deepspeed_config)  # set by launch_command
    _, env = prepare_deepspeed_cmd_env(args)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] == "none"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "none"
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "auto"

    plugin_env = {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}
    with mock.patch.dict(os.environ, plugin_env):
        plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 2
    assert plugin.deepspeed_config["zero_optimization"]["offload_optimizer"]["device"] == "none"
    assert plugin.deepspeed_config["zero_optimization"]["offload_param"]["device"] == "none"
    # `auto` takes the run's --gradient_accumulation_steps, as Accelerator.prepare does:
    assert plugin.get_value("gradient_accumulation_steps") == "auto"
    plugin.fill_match("gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=4)
    assert plugin.get_value("gradient_accumulation_steps") == 4
    # left to --max_grad_norm, which the run writes before prepare (tests/test_sharded.py)
    assert plugin.get_value("gradient_clipping") == "auto"


def test_fsdp2_config_reaches_the_plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env
    from torch.distributed.fsdp import StateDictType
    from transformers.models.bert.modeling_bert import BertLayer

    args, config = _launcher_args("fsdp2.yaml")
    fsdp1_only = {"fsdp_sharding_strategy", "fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_use_orig_params",
                  "fsdp_sync_module_states"}
    assert not fsdp1_only & set(config.fsdp_config), "FSDP1-only keys do nothing under FSDP2"
    with mock.patch("accelerate.utils.launch.is_port_in_use", return_value=False):
        env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert env["FSDP_VERSION"] == "2"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "true"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "BertLayer"
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"

    plugin_env = {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_"))}
    with mock.patch.dict(os.environ, plugin_env), warnings.catch_warnings():
        warnings.simplefilter("error")  # Accelerate warns about settings FSDP2 ignores: there must be none
        plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True  # FULL_SHARD
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert not isinstance(plugin.cpu_offload, CPUOffloadPolicy)  # fsdp_offload_params: false
    assert plugin.use_orig_params is None and plugin.sync_module_states is None and plugin.backward_prefetch is None
    plugin.set_auto_wrap_policy(_tiny_bert_classifier())
    assert plugin.auto_wrap_policy.keywords["transformer_layer_cls"] == {BertLayer}


def test_deepspeed_zero3_config_reaches_the_plugin():
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args, defaults = _launcher_args("deepspeed_zero3.yaml")
    args.deepspeed_fields_from_accelerate_config = list(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
    assert "ACCELERATE_GRADIENT_CLIPPING" not in env

    with mock.patch.dict(os.environ, {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}):
        plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 3 and plugin.zero3_init_flag is True
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # needed by accelerator.get_state_dict
    assert zero["offload_optimizer"]["device"] == "none" and zero["offload_param"]["device"] == "none"
    assert plugin.get_value("gradient_accumulation_steps") == "auto"
    assert plugin.get_value("gradient_clipping") == "auto"


def test_multi_node_config_splits_processes_per_machine():
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, config = _launcher_args("multi_node.yaml")
    assert (config.num_machines, config.num_processes, config.machine_rank) == (2, 16, 0)
    with mock.patch("accelerate.utils.launch.is_port_in_use", return_value=False):
        prepare_multi_gpu_env(args)
    assert args.nproc_per_node == "8" and args.nnodes == "2" and args.node_rank == 0
    # Rendezvous at main_process_ip:main_process_port: as master_addr/master_port when the launcher
    # honours same_network, else as the static rendezvous endpoint (Accelerate 1.15 reads
    # same_network only from the --same_network flag); torchrun treats both the same for "static".
    assert args.rdzv_backend == "static"
    endpoint = getattr(args, "rdzv_endpoint", None) or f"{args.master_addr}:{args.master_port}"
    assert endpoint == f"{config.main_process_ip}:{config.main_process_port}"


@pytest.mark.integration
def test_multi_cpu_config_really_starts_two_gloo_ranks(tmp_path):
    """The documented command (first line of the file) gives two ranks of one MULTI_CPU group."""
    import os
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    # one file per rank: two processes printing to one pipe can interleave their lines
    script.write_text("import sys\nfrom accelerate import Accelerator\n"
                      "a = Accelerator()\n"
                      "open(f'{sys.argv[1]}/rank{a.process_index}', 'w')"
                      ".write(f'rank {a.process_index} of {a.num_processes} {a.distributed_type.value}')\n")
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                             str(CONFIG_DIR / "multi_cpu_2proc.yaml"), str(script), str(tmp_path)],
                            capture_output=True, text=True,
                            timeout=180, env={**os.environ, "ACCELERATE_USE_CPU": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = sorted(p.read_text() for p in tmp_path.glob("rank[0-9]*"))
    assert ranks == ["rank 0 of 2 MULTI_CPU", "rank 1 of 2 MULTI_CPU"]
