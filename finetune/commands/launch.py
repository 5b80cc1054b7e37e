"""``finetune train``: training through Accelerate's launcher machinery (as torchtune's ``tune run`` wraps
torchrun) that passes SIGTERM/SIGINT on and waits for the checkpoint, and ends a user error with the one
``error:`` line and exit 2. Takes launcher flags mixed with training flags; a flag both know is the training
run's (see docs/multi-node.md#launching-finetune-train-and-accelerate-launch)."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys

from accelerate.commands.launch import _validate_launch_command, launch_command, launch_command_parser
from accelerate.utils import prepare_simple_launcher_cmd_env
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from finetune.argv import take_values
from finetune.commands.launch_configs import resolve_config_flag
from finetune.config import TrainConfig, check_grace_seconds
from finetune.errors import FinetuneError

TRAINING_MODULE = "finetune.run"
GRACE_FLAG = "--preemption_grace_seconds"
# torch 2.13's elastic agent waits this long after passing SIGTERM on before it SIGKILLs its workers:
# torch/distributed/launcher/api.py LaunchConfig.__post_init__ (lines 145-149) reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT
# (default 30) unless torchrun's --shutdown_timeout is given, which its parser also takes from PET_SHUTDOWN_TIMEOUT
# (torch/distributed/run.py 689-698, argparse_util.env); accelerate 1.15 has no flag for it (its multi_gpu_launcher
# passes only the torchrun arguments its own parser shares, accelerate/utils/launch.py _filter_args).
SHUTDOWN_TIMEOUT_ENV = ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT")


def launcher_spawns_processes(args) -> bool:
    """Whether Accelerate's ``launch_command`` would start processes through torchrun or DeepSpeed's launcher
    for parsed launcher ``args`` (accelerate 1.15 ``commands/launch.py``), rather than its simple launcher."""
    return not args.cpu and any((args.use_deepspeed, args.use_fsdp, args.use_megatron_lm, args.multi_gpu, args.tpu))

def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(Accelerate launcher flags, training flags): a flag ``accelerate launch`` knows and ``TrainConfig`` does not
    goes to the launcher, with its value; ``--flag=value`` stays whole."""
    parser = launch_command_parser()
    training = {f"--{name}" for name in TrainConfig.__dataclass_fields__}
    takes_value = {}
    for action in parser._actions:
        for option in action.option_strings:
            takes_value[option] = action.nargs != 0
    launcher, rest = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in takes_value and name not in training and name not in ("-h", "--help", "-m", "--module"):
            launcher.append(arg)
            if takes_value[name] and "=" not in arg and i + 1 < len(argv):
                launcher.append(argv[i + 1])
                i += 1
        else:
            rest.append(arg)
        i += 1
    return launcher, rest


def grace_seconds(training: list[str]) -> float | None:
    """The ``--preemption_grace_seconds`` among the training flags (the last one given), checked. Raises
    ``FinetuneError`` for a value that is not a positive number of seconds."""
    values = [value for value in take_values(training, GRACE_FLAG)[0] if value is not None]
    return check_grace_seconds(values[-1] if values else None)


def shutdown_timeout_env(grace: float | None) -> dict:
    """The environment that makes torchrun's agent wait ``grace`` seconds (rounded up: it takes whole seconds)
    for the workers' checkpoint after SIGTERM, instead of its default 30: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, and
    ``PET_SHUTDOWN_TIMEOUT`` too where the user set that one (it wins). Empty without a grace."""
    if grace is None:
        return {}
    seconds = str(math.ceil(grace))
    return {name: seconds for name in SHUTDOWN_TIMEOUT_ENV if name == SHUTDOWN_TIMEOUT_ENV[0] or name in os.environ}


def _exit_code(returncode: int) -> int:
    # Popen reports a child killed by signal N as -N; a shell reports 128 + N
    return 128 - returncode if returncode < 0 else returncode


def _run_forwarding_signals(cmd: list[str], env: dict) -> int:
    """Run the training process in its own session (a Ctrl-C reaches it once, through us), forward SIGINT/SIGTERM
    once each, and return its exit code once it has checkpointed and ended."""
    process = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum, frame):
        process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _exit_code(process.wait())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def train_command(argv: list[str], module: str = TRAINING_MODULE) -> int:
    """``finetune train [launcher flags] [training flags]``: returns the exit code of the training run
    (0, 2 for a user error, 3 for a numerical failure, 128 + N after signal N). ``module``: what each process
    runs (``finetune verify`` and ``plan`` launch theirs the same way: ``cli.COMMANDS``)."""
    launcher, training = split_argv(argv)
    try:
        grace = grace_seconds(training)
        launcher = resolve_config_flag(launcher)  # --config_file multi_gpu: a shipped config, by name
    except FinetuneError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    # Its "values were not passed ... defaults used" list is noise here: the run's banner says what it runs on.
    logging.getLogger("accelerate.commands.launch").setLevel(logging.ERROR)
    args = launch_command_parser().parse_args([*launcher, "--module", module, *training])
    args, defaults, mp_from_config = _validate_launch_command(args)
    # the routing of accelerate's launch_command: --cpu, or no multi-process option, is its simple launcher
    if not launcher_spawns_processes(args):
        cmd, env = prepare_simple_launcher_cmd_env(args)
        return _run_forwarding_signals(cmd, env)
    # Several processes: torchrun's elastic agent runs here, in this process. It passes SIGTERM/SIGINT on to
    # every worker and kills them TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30) seconds later, or after the
    # --preemption_grace_seconds the scheduler gives (set here, in the environment the agent reads and the
    # workers inherit). Its failures are reported by the workers' own error lines: no traceback here.
    timeout_env = shutdown_timeout_env(grace)
    previous = {name: os.environ.get(name) for name in timeout_env}
    os.environ.update(timeout_env)
    try:
        launch_command(args)
    except ChildFailedError as err:
        return max((_exit_code(f.exitcode) for f in err.failures.values()), default=1)
    except SignalException as err:
        return 128 + int(err.sigval)
    except subprocess.CalledProcessError as err:  # how a pdsh-style multi-node launcher fails
        return _exit_code(err.returncode)
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


if __name__ == "__main__":
    sys.exit(train_command(sys.argv[1:]))
