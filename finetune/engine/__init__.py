"""The engine seam: plain/DDP, FSDP or DeepSpeed, from the Accelerator's ``distributed_type``. Only this package
names FSDP or DeepSpeed; the rest asks ``engine_for(accelerator)`` (precision, prepare, save, parameter sizes)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from accelerate.utils import DistributedType

from finetune.engine.deepspeed import DeepSpeedEngine, parameter_numel, parameter_shape
from finetune.engine.fsdp import FsdpEngine, fsdp1_full_sizes
from finetune.engine.plain import PlainEngine, build_optimizer, parameter_groups
from finetune.errors import FinetuneError

__all__ = ["PlainEngine", "FsdpEngine", "DeepSpeedEngine", "engine_class", "engine_for", "build_optimizer",
           "check_quantized_base",
           "check_tracker", "local_mlflow_store",
           "parameter_groups", "parameter_counts", "parameter_sizes", "parameter_shape"]

# Accelerate 1.15's trackers (accelerate.utils.LoggerType) and the package each imports (accelerate/tracking.py)
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "comet_ml": "comet_ml",
                   "aim": "aim", "mlflow": "mlflow", "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab"}


def check_tracker(report_to: str) -> None:
    """Raise ``FinetuneError`` when the ``--report_to`` tracker's package is not installed (``all`` takes those
    that are, as Accelerate's ``filter_trackers`` does)."""
    module = TRACKER_MODULES.get(report_to)
    if module is None:
        return
    if importlib.util.find_spec(module) is None and not (module == "tensorboard" and
                                                         importlib.util.find_spec("tensorboardX")):
        raise FinetuneError(f"--report_to {report_to}: the {module} package is not installed "
                            f"(pip install {module}), or use --report_to none.")


def local_mlflow_store(config) -> str | None:
    """Under ``--report_to mlflow`` (or ``all`` with mlflow installed) and no ``MLFLOW_TRACKING_URI``: point MLflow
    at a local store in ``<output_dir>/mlruns`` (``sqlite:///.../mlruns/mlflow.db``, MLflow 3's local backend;
    artifacts beside it), set in this process's environment, where Accelerate's ``MLflowTracker`` and transformers'
    ``MLflowCallback`` read it. Returns the URI set, or None where none was (a tracking server named by the
    environment is left as it is)."""
    if config.report_to not in ("mlflow", "all") or os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    if config.report_to == "all" and importlib.util.find_spec("mlflow") is None:
        return None
    store = Path(config.output_dir).resolve() / "mlruns"
    store.mkdir(parents=True, exist_ok=True)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{store / 'mlflow.db'}"
    return os.environ["MLFLOW_TRACKING_URI"]


def engine_class(distributed_type) -> type[PlainEngine]:
    """The engine class for Accelerate's ``distributed_type`` (its class facts, such as ``lockstep_windows``, are
    there before any Accelerator is: the Trainer backend asks before Trainer builds one)."""
    if distributed_type == DistributedType.DEEPSPEED:
        return DeepSpeedEngine
    if distributed_type == DistributedType.FSDP:
        return FsdpEngine
    return PlainEngine


def check_quantized_base(config, engine: type[PlainEngine] | PlainEngine) -> None:
    """Raise ``FinetuneError`` for a quantized base (``--load_in_4bit``/``--load_in_8bit``) on an engine that does
    not hold one (``holds_quantized_base``: FSDP and DeepSpeed, not yet)."""
    if (config.load_in_4bit or config.load_in_8bit) and not engine.holds_quantized_base:
        raise FinetuneError(f"--{'load_in_4bit' if config.load_in_4bit else 'load_in_8bit'} runs on one process or "
                            f"DDP; {engine.name} with a quantized base is not supported yet. Launch without the "
                            f"{engine.name} config (each process holds the whole quantized base).")


def engine_for(accelerator) -> PlainEngine:
    """The engine for ``accelerator`` (anything with ``distributed_type``; a stand-in without one is plain)."""
    return engine_class(getattr(accelerator, "distributed_type", DistributedType.NO))(accelerator)


def parameter_sizes(model) -> list[tuple[object, int, bool]]:
    """Each parameter of ``model`` once, whole, as (the module that holds it, its true element count, trainable),
    whatever the engine did to it: a ZeRO-3 placeholder counts its ``ds_numel`` (``parameter_numel``), an FSDP1
    flat parameter or a view of one its original parameters' full sizes (``fsdp.fsdp1_full_sizes``), an FSDP2
    ``DTensor`` its global size (``DTensor.numel`` is the logical one). A parameter shared by two modules (tied
    embeddings) is listed once, under the first module that holds it (``model.modules()`` order)."""
    flat, views = fsdp1_full_sizes(model)
    sizes, seen = [], set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if id(param) in flat:
                sizes += [(owner, n, param.requires_grad) for owner, n in flat[id(param)]]
            else:
                sizes.append((module, views.get(id(param), parameter_numel(param)), param.requires_grad))
    return sizes


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, all) parameters in elements, true counts under every engine (``parameter_sizes``)."""
    sizes = parameter_sizes(model)
    return sum(n for _, n, trainable in sizes if trainable), sum(n for _, n, _ in sizes)
