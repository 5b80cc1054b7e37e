"""The merged model: peft's ``merge_and_unload`` on the run's model (the LoRA update folded into the base weights, no
peft left), saved as a plain Hugging Face folder with the tokenizer, its chat template, and a generation config that
stops at the end-of-turn token; the merge's peak memory measured (``MergeResult``)."""

from __future__ import annotations

import json
import resource
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from finetune.errors import FinetuneError
from finetune.export.source import Source, load_source, load_tokenizer_of

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class MergeResult:
    """What ``merge`` wrote and measured: ``folder``; ``weights_bytes``: the merged weights in memory (fp32, as merged);
    ``layer_bytes``: the largest decoder layer's weights; ``peak_anon_increase_bytes``: the peak of the process's
    anonymous resident memory (allocated, not file-backed: ``RssAnon``, sampled every 2 ms) during the merge above
    its value before; ``peak_rss_increase_bytes``: the same for the whole resident set (``ru_maxrss``), which also
    counts the clean page-cache pages of the safetensors files mapped while reading and writing them; ``seconds``:
    the merge's wall time; ``eos_token_ids``: the generation config's stop tokens."""

    folder: Path
    weights_bytes: int
    layer_bytes: int
    peak_anon_increase_bytes: int
    peak_rss_increase_bytes: int
    seconds: float
    eos_token_ids: list[int]

    @property
    def within_bound(self) -> bool:
        """Whether the merge's allocated memory stayed within the weights plus one layer."""
        return self.peak_anon_increase_bytes <= self.weights_bytes + self.layer_bytes


def _peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def anon_bytes() -> int:
    """This process's anonymous resident memory (``/proc/self/status`` ``RssAnon``; elsewhere the whole RSS)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return psutil.Process().memory_info().rss


class PeakMemory:
    """A context that samples ``anon_bytes`` every ``interval`` seconds on a thread; ``peak_increase``: the largest
    sample (and the value at exit) above the value at entry, in bytes."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak_increase = interval, 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_increase = max(self.peak_increase, anon_bytes() - self.before)

    def __enter__(self) -> PeakMemory:
        self.before = anon_bytes()
        self._thread = threading.Thread(target=self._sample, name="finetune-peak-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_increase = max(self.peak_increase, anon_bytes() - self.before)


def largest_layer_bytes(model) -> int:
    """The bytes of the largest repeated block (``model.layers.N``, ``transformer.h.N``...) of ``model``: the
    parameters under the longest-named module path ending in a number, grouped by that prefix."""
    sizes: dict[str, int] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        index = next((i for i in range(len(parts) - 1, -1, -1) if parts[i].isdigit()), None)
        if index is not None:
            key = ".".join(parts[: index + 1])
            sizes[key] = sizes.get(key, 0) + param.numel() * param.element_size()
    return max(sizes.values(), default=0)


def unmerged(model):
    """The plain model of ``model``: peft's ``merge_and_unload()`` for a ``PeftModel`` (the LoRA update added into the
    base weights in place, layer by layer, the LoRA modules removed), else ``model`` itself."""
    from finetune.models.lora import is_peft_model

    return model.merge_and_unload() if is_peft_model(model) else model


def end_of_turn_token_ids(tokenizer) -> list[int]:
    """The ids a generation stops at: the chat template's end-of-turn token and eos (``chat.end_of_turn_ids``); eos
    alone for a tokenizer without a chat template."""
    from finetune.data.chat import end_of_turn_ids

    if getattr(tokenizer, "chat_template", None):
        return end_of_turn_ids(tokenizer)
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def merge(source: Source, folder: Path, dtype: str = "float32") -> MergeResult:
    """Load ``source`` (``load_source``), merge it (``unmerged``), cast it to ``dtype`` (one of ``DTYPES``) and save it
    into ``folder`` (``model.safetensors``, ``config.json``, ``generation_config.json`` with ``eos_token_id`` the
    end-of-turn tokens, the tokenizer and ``chat_template.jinja``, the run's ``run_config.json``). Returns the
    ``MergeResult``; raises ``FinetuneError`` when the source cannot be loaded or the folder written."""
    import torch

    tokenizer = load_tokenizer_of(source)
    before, started = psutil.Process().memory_info().rss, time.perf_counter()
    with PeakMemory() as sampler:
        model = unmerged(load_source(source))
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        layer = largest_layer_bytes(model)
        if dtype != "float32":
            model = model.to(getattr(torch, dtype))
        stops = end_of_turn_token_ids(tokenizer)
        model.config.eos_token_id = stops[0] if len(stops) == 1 else stops
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.eos_token_id = stops
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        _save(model, tokenizer, source, folder)
        del model
    peak = max(0, _peak_rss_bytes() - before)
    return MergeResult(folder=folder, weights_bytes=weights, layer_bytes=layer,
                       peak_anon_increase_bytes=sampler.peak_increase, peak_rss_increase_bytes=peak,
                       seconds=time.perf_counter() - started, eos_token_ids=stops)


def _save(model, tokenizer, source: Source, folder: Path) -> None:
    """``model`` and ``tokenizer`` saved into ``folder``, with the run's ``run_config.json``; ``FinetuneError`` when
    the folder cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if (source.run_dir / "run_config.json").is_file():
            shutil.copyfile(source.run_dir / "run_config.json", folder / "run_config.json")
    except OSError as err:
        raise FinetuneError(f"could not write the merged model into {folder} ({err}). Pass --output_dir on a "
                            "writable disk with room for the weights.") from None


def saved_eos(folder: Path) -> list[int]:
    """``generation_config.json``'s ``eos_token_id`` of ``folder``, as a list ([] without one)."""
    try:
        value = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return value if isinstance(value, list) else [] if value is None else [value]
