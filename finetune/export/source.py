"""What ``finetune export`` exports: a run's output directory or one of its checkpoints, of either backend, full or
LoRA (``resolve_source``), loaded as the run uses it (``load_source``: the adapter applied, not merged)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.lifecycle.checkpoint import MARKER, checkpoints_dir, is_complete

ADAPTER_CONFIG = "adapter_config.json"  # finetune.models.lora's name, without importing peft here
BASE_DIR = "base_model"  # finetune.models.lora.BASE_DIR: a GGUF base, de-quantized once by the run


@dataclass(frozen=True)
class Source:
    """A model to export. ``run_dir``: the run's output directory (its ``run_config.json``); ``model_dir``: the
    folder holding the weights (the run directory or a checkpoint); ``checkpoint``: the checkpoint folder or None;
    ``lora``: whether ``model_dir`` is a peft adapter (``adapter_config.json``)."""

    run_dir: Path
    model_dir: Path
    checkpoint: Path | None
    lora: bool

    @property
    def name(self) -> str:
        """The run's folder name, with the checkpoint's (``lora-run/step_00000002``)."""
        return self.run_dir.name + (f"/{self.checkpoint.name}" if self.checkpoint is not None else "")

    def run_config(self) -> dict:
        """The run's ``run_config.json`` ({} if absent or unreadable)."""
        try:
            config = json.loads((self.run_dir / "run_config.json").read_text())
        except (OSError, ValueError):
            return {}
        return config if isinstance(config, dict) else {}


def _checkpoint_folder(run_dir: Path, name: str) -> Path:
    """``<run>/checkpoints/<name>``: ``step_N`` (zero-padded or not), ``checkpoint-N`` (the Trainer backend's), ``N``,
    or a path. Raises ``FinetuneError`` listing the run's checkpoints when none matches."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    folder = checkpoints_dir(run_dir)
    match = re.fullmatch(r"(?:step_|checkpoint-)?0*(\d+)", name)
    if match:
        step = int(match.group(1))
        for candidate in (folder / f"step_{step:08d}", folder / f"checkpoint-{step}"):
            if candidate.is_dir():
                return candidate
    held = sorted(p.name for p in folder.glob("*") if p.is_dir() and not p.name.startswith(".")) if folder.is_dir() else []
    raise FinetuneError(f"--checkpoint {name!r}: {run_dir} has no such checkpoint (it holds: "
                        f"{', '.join(held) or 'none'}). Pass one of those, or leave --checkpoint out to export the "
                        "run's final model.")


def resolve_source(model: str, checkpoint: str | None = None) -> Source:
    """The ``Source`` of ``--model`` (a run's output directory, or a checkpoint folder in it) and ``--checkpoint``.
    Raises ``FinetuneError`` (exit 2: the problem and the fix) for a missing folder, an unfinished run, an
    incomplete checkpoint (no ``COMPLETE`` marker), or a folder that holds no model nor adapter."""
    path = Path(model).expanduser()
    where = f"--model {model!r}"
    if not path.is_dir():
        raise FinetuneError(f"{where}: no such directory. Pass the --output_dir of a finished training run (or a "
                            "checkpoint folder in it).")
    if (path / MARKER).is_file() or path.parent.name == "checkpoints":  # a checkpoint folder given directly
        if checkpoint is not None:
            raise FinetuneError(f"{where} is a checkpoint already; drop --checkpoint, or pass the run's directory.")
        run_dir, folder = path.parent.parent, path
    elif checkpoint is not None:
        run_dir, folder = path, _checkpoint_folder(path, checkpoint)
    else:
        run_dir, folder = path, None
    if folder is not None and not is_complete(folder):
        raise FinetuneError(f"checkpoint {folder} is incomplete (no {MARKER} marker: its write did not finish). "
                            "Pass another checkpoint of the run.")
    model_dir = folder if folder is not None else run_dir
    lora = (model_dir / ADAPTER_CONFIG).is_file()
    if not lora and not (model_dir / "config.json").is_file():
        hint = (" It holds run_config.json but no model: the run did not finish; export one of its checkpoints "
                "(--checkpoint step_N)." if (model_dir / "run_config.json").is_file() else "")
        raise FinetuneError(f"{model_dir} holds neither a model (config.json) nor a LoRA adapter "
                            f"({ADAPTER_CONFIG}).{hint}")
    return Source(run_dir=run_dir, model_dir=model_dir, checkpoint=folder, lora=lora)


def base_path(source: Source) -> str:
    """The base model of a LoRA ``source``: its ``adapter_config.json``'s ``base_model_name_or_path``, except that a
    ``.gguf`` base is taken from the run's de-quantized ``base_model/`` when the run wrote one (a checkpoint's adapter
    config still names the .gguf file)."""
    adapter = json.loads((source.model_dir / ADAPTER_CONFIG).read_text())
    base = adapter.get("base_model_name_or_path") or ""
    if base.endswith(".gguf") and (source.run_dir / BASE_DIR / "config.json").is_file():
        return str(source.run_dir / BASE_DIR)
    return base


def check_causal_lm(source: Source) -> None:
    """Raise ``FinetuneError`` unless ``source`` is a causal LM (GGUF and generation need one)."""
    if source.lora:
        task = json.loads((source.model_dir / ADAPTER_CONFIG).read_text()).get("task_type")
        if task != "CAUSAL_LM":
            raise FinetuneError(f"{source.model_dir} is a {task} adapter; finetune export writes causal language "
                                "models (a classifier has no GGUF form).")
        return
    architectures = json.loads((source.model_dir / "config.json").read_text()).get("architectures") or []
    if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise FinetuneError(f"{source.model_dir} holds a {', '.join(architectures) or 'model without a head'}; "
                            "finetune export writes causal language models (a classifier has no GGUF form).")


def architecture(source: Source) -> str:
    """The model class the merged folder's ``config.json`` names (``architectures``), read from configs before any
    weight is loaded: the class ``AutoModelForCausalLM`` builds for the run's model (a LoRA run's base; a ``.gguf``
    base through transformers' GGUF reader). Raises ``FinetuneError`` when the config cannot be read or names no
    causal LM transformers knows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if source.lora:
        path = base_path(source)
    else:
        path = str(source.model_dir if (source.model_dir / "config.json").is_file() else source.run_dir)
    try:
        if path.endswith(".gguf"):
            config = AutoConfig.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
        else:
            config = AutoConfig.from_pretrained(path)
        return AutoModelForCausalLM._model_mapping[type(config)].__name__
    except (OSError, ValueError, KeyError) as err:
        raise FinetuneError(f"the configuration of {path} could not be read as a causal LM's "
                            f"({str(err).splitlines()[0] if str(err) else type(err).__name__}). A LoRA run needs its "
                            "base model where adapter_config.json's base_model_name_or_path points.") from None


def load_tokenizer_of(source: Source):
    """The tokenizer the run saved with its weights (the checkpoint's, else the run's), chat template included."""
    from finetune.models.loading import load_tokenizer

    folder = source.model_dir if (source.model_dir / "tokenizer_config.json").is_file() else source.run_dir
    return load_tokenizer(str(folder))


def load_base(path: str, quantization=None):
    """The fp32 causal LM at ``path`` (a model folder, a .gguf file, or an earlier run's adapter directory merged:
    ``lora.load_base_model``), eval mode. With ``quantization`` (the ``BitsAndBytesConfig`` of a QLoRA run:
    ``run_quantization``) the base is quantized as the run's loader quantized it (``loading.load_causal_lm``; a built
    base through ``quantization.quantize_built``), then de-quantized (``dequantized``): the weights the run trained
    on, in fp32, as plain ``Linear`` layers."""
    import torch

    from finetune.models.lora import load_base_model

    if quantization is None:
        return load_base_model(path, torch.float32).float().eval()
    from finetune.models.loading import load_causal_lm
    from finetune.models.quantization import quantize_built

    if (Path(path) / ADAPTER_CONFIG).is_file():  # an earlier run's adapter, merged: a built base
        quantized = quantize_built(load_base_model(path, torch.float32), quantization)
    else:
        quantized = load_causal_lm(path, quantization=quantization)
    return dequantized(quantized).eval()  # fp32 already; a still-quantized model refuses .float()


def run_quantization(source: Source):
    """The ``BitsAndBytesConfig`` a LoRA run loaded its base with (``quantization.bnb_config`` of its
    ``run_config.json``: ``--load_in_4bit``/``--load_in_8bit`` and the ``--bnb_4bit_*`` flags), or None for a
    full-precision base or a full run. Raises ``FinetuneError`` (the ``qlora`` extra named) without bitsandbytes."""
    config = source.run_config()
    if not source.lora or not (config.get("load_in_4bit") or config.get("load_in_8bit")):
        return None
    from finetune.config import parse_config
    from finetune.config.lora import require_bitsandbytes
    from finetune.models.quantization import bnb_config

    require_bitsandbytes("--load_in_4bit" if config.get("load_in_4bit") else "--load_in_8bit")

    return bnb_config(parse_config(["--config", str(source.run_dir / "run_config.json")]))


def dequantized(model):
    """``model`` (a bitsandbytes 4-bit or 8-bit model) with every quantized linear layer replaced by a torch
    ``Linear`` holding its de-quantized fp32 weight, the quantization config removed: transformers'
    ``PreTrainedModel.dequantize`` (5.24 ``integrations/bitsandbytes.py`` ``dequantize_and_replace``: bitsandbytes'
    ``dequantize_4bit`` or ``int8_vectorwise_dequant``), the base peft's and transformers' docs merge a QLoRA adapter
    into."""
    import torch

    return model.dequantize(dtype=torch.float32)


def load_source(source: Source):
    """The run's model as it runs: fp32, eval mode; for LoRA a ``peft.PeftModel`` (the adapter applied, not merged;
    a QLoRA run's on its base de-quantized: ``load_base``), for a full run's checkpoint the run's model with the
    checkpoint's weights. Raises ``FinetuneError`` when the model or its base cannot be loaded."""
    try:
        if source.lora:
            from peft import PeftModel

            base = load_base(base_path(source), run_quantization(source))
            return PeftModel.from_pretrained(base, str(source.model_dir)).eval()
        model = load_base(str(source.model_dir if (source.model_dir / "config.json").is_file() else source.run_dir))
    except (OSError, ValueError) as err:
        raise FinetuneError(f"{source.model_dir} could not be loaded: {str(err).splitlines()[0]} (a LoRA run needs "
                            "its base model where adapter_config.json's base_model_name_or_path points).") from None
    if source.checkpoint is not None:  # names may carry DDP's or torch.compile's prefix: loaded by name again
        from finetune.lifecycle.checkpoint import load_checkpoint_weights

        load_checkpoint_weights(model, source.checkpoint, f"--checkpoint {source.checkpoint.name}")
    return model


def rebuild_run_model(source: Source):
    """The run's model rebuilt as training built it, for verification, without the loader ``load_source`` (whose
    resolution of a LoRA adapter's base is what is being checked): for LoRA, ``run_config.json`` replayed through
    ``tasks.builders.build_model`` (the task's own ``load_model`` of ``--model_name_or_path``, then the run's LoRA
    flags), the adapter's saved weights loaded into it; a full run's folder holds the whole model, so it is
    ``load_source``. fp32, eval mode. Raises ``FinetuneError`` when the run cannot be rebuilt or its adapter's
    weights do not fit the rebuilt adapter."""
    if not source.lora:
        return load_source(source)
    from peft import get_peft_model_state_dict, load_peft_weights, set_peft_model_state_dict

    from finetune.config import parse_config
    from finetune.recipes import load_recipe
    from finetune.tasks import run_task
    from finetune.tasks.builders import build_model

    if not (source.run_dir / "run_config.json").is_file():
        raise FinetuneError(f"{source.run_dir} holds no run_config.json, so the model it trained cannot be rebuilt "
                            "to verify against. Export the --output_dir of a finetune training run.")
    config = parse_config(["--config", str(source.run_dir / "run_config.json")])
    recipe = load_recipe(config.recipe)
    try:
        model = build_model(config, run_task(recipe, config), recipe=recipe)
        weights = load_peft_weights(str(source.model_dir), device="cpu")
    except (OSError, ValueError) as err:
        raise FinetuneError(f"the model of {source.name} could not be rebuilt from its run_config.json "
                            f"({str(err).splitlines()[0]}): --model_name_or_path {config.model_name_or_path} must "
                            "still be where the run loaded it from.") from None
    expected = set(get_peft_model_state_dict(model))
    result = set_peft_model_state_dict(model, weights)
    if result.unexpected_keys or set(weights) != expected:
        raise FinetuneError(f"{source.model_dir}'s adapter weights do not fit the adapter its run_config.json "
                            f"builds ({len(expected ^ set(weights))} tensors differ). Export the run whose "
                            "--output_dir holds it.")
    return model.float().eval()
