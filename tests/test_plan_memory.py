"""The planner's count of a quantized base and of an 8-bit optimizer's state (``finetune.planner.memory``) against the
bytes of real bitsandbytes tensors: every storage a layer or an optimizer allocates, counted once; and ``finetune
plan`` naming the quantized base and the optimizer it counted."""

from __future__ import annotations

import re

import pytest
import torch
from tiny_models import build_tiny_chat_llama

pytest.importorskip("bitsandbytes")

from finetune.planner import memory  # noqa: E402


def storages(*tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (None skipped)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def layer_storages(param) -> int:
    """What one bitsandbytes weight really holds: a ``Params4bit``'s packed data and every tensor of its
    ``QuantState`` (absmax, code; nested: the nested absmax and code, the offset); an ``Int8Params``'s int8 matrix
    (``CB`` is its data) and row scales ``SCB``."""
    state = getattr(param, "quant_state", None)
    if state is None:
        return storages(param.data, param.CB, param.SCB)
    nested = (state.state2.absmax, state.state2.code, state.offset) if state.nested else ()
    return storages(param.data, state.absmax, state.code, *nested)


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat-llama")))


@pytest.mark.parametrize("flags", [["--load_in_4bit"], ["--load_in_4bit", "--bnb_4bit_quant_type", "fp4"],
                                   ["--load_in_4bit", "--use_bnb_nested_quant"], ["--load_in_8bit"]])
def test_the_count_of_a_quantized_base_is_its_tensors_bytes(chat_llama, flags):
    from finetune.config import parse_config
    from finetune.models.loading import load_causal_lm
    from finetune.models.quantization import bnb_config

    config = parse_config(["--model_name_or_path", chat_llama, "--use_peft", *flags])
    model = load_causal_lm(chat_llama, quantization=bnb_config(config))
    quantized = [(n, p) for n, p in model.named_parameters() if type(p).__name__ in ("Params4bit", "Int8Params")]
    assert len(quantized) == 14  # 2 layers x 7 linear layers; embeddings, norms and the tied lm_head stay fp32
    for name, param in quantized:
        assert memory.parameter_bytes(param) == layer_storages(param), name
    kept = [p for p in model.parameters() if type(p).__name__ not in ("Params4bit", "Int8Params")]
    assert all(p.dtype == torch.float32 for p in kept)
    counted = memory.weight_bytes(model)
    assert counted["quantized"] == sum(layer_storages(p) for _, p in quantized)
    assert counted["full"] == storages(*kept)
    # the layout by hand (every tiny layer's element count a multiple of 64): 4 bits a weight + an fp32 scale per 64
    # + the 16-value code; 8 bits a weight + an fp32 scale per output row
    if "--load_in_8bit" in flags:
        assert counted["quantized"] == sum(p.numel() + 4 * p.shape[0] for _, p in quantized)
    elif "--use_bnb_nested_quant" not in flags:
        sizes = [p.quant_state.shape.numel() for _, p in quantized]
        assert counted["quantized"] == sum(n // 2 + 4 * (n // 64) + 4 * 16 for n in sizes)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("shape", [(33, 7), (64, 64), (300, 257)])
def test_the_4bit_count_rounds_as_bitsandbytes_pads(shape, nested):
    """Shapes whose element count is odd, or not a multiple of the 64-element block or of the 256 nested blocks."""
    from bitsandbytes.nn import Params4bit

    param = Params4bit(torch.randn(*shape), requires_grad=False, compress_statistics=nested, quant_type="nf4")
    param = param.to("cpu")  # quantized on its first move (Params4bit.to -> _quantize)
    assert param.quant_state is not None and param.quant_state.nested == nested
    assert memory.four_bit_bytes(shape[0] * shape[1], nested) == layer_storages(param)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit"])
def test_the_count_of_the_optimizer_state_is_its_tensors_bytes(optim):
    """The run's own optimizer (``engine.build_optimizer`` for ``--optim``) after one step, every state tensor but the
    step counters: 8 bits a moment from bitsandbytes' 4096 elements up, with a scale per 256; fp32 below."""
    from finetune.config import parse_config
    from finetune.engine import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"big": torch.nn.Linear(100, 70), "edge": torch.nn.Linear(64, 64, bias=False),
                                 "small": torch.nn.Linear(40, 30)})  # 7000 + 70, 4096, 1200 + 30 elements
    optimizer = build_optimizer(model, parse_config(["--optim", optim]))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    held = [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    assert memory.optimizer_state_bytes(model.parameters(), optim) == storages(*held)
    if optim.endswith("8bit"):
        assert 2 * 7000 < storages(*held) < 2 * 4 * 7000  # the 8-bit moments are far below fp32's


def test_plan_counts_a_4bit_base_and_an_8bit_optimizer(chat_llama, tmp_path, capsys):
    """``finetune plan --load_in_4bit --optim adamw_bnb_8bit``: the probe's weights are the quantized base's bytes
    (not its full-precision size), its optimizer state bitsandbytes' 8-bit, and the table names both."""
    from finetune.commands.plan import main
    from finetune.config import parse_config
    from finetune.planner.plans import Lever
    from finetune.planner.probes import Probe
    from finetune.recipes import load_recipe

    flags = ["--recipe", "bbc-headlines", "--model_name_or_path", chat_llama, "--use_peft", "--load_in_4bit",
             "--optim", "adamw_bnb_8bit", "--max_length", "32", "--lora_target_modules", "all-linear",
             "--mixed_precision", "no"]
    probe = Probe(parse_config(flags), load_recipe("bbc-headlines"), torch.device("cpu"), Lever(False, 0), held=0)
    try:
        params = list(probe.model.parameters())
        quantized = [p for p in params if hasattr(p, "quant_state")]
        assert probe.memory["weights"]["quantized"] == sum(layer_storages(p) for p in quantized)
        trainable = [p for p in params if p.requires_grad]
        assert probe.memory["optimizer_state"] == memory.optimizer_state_bytes(trainable, "adamw_bnb_8bit")
        assert probe.memory["dequantized"] == 12 * max(p.quant_state.shape.numel() for p in quantized)
        assert probe.fixed_bytes == (probe.fixed_pass_bytes + probe.memory["weights"]["total"] + probe.left_bytes
                                     + probe.memory["optimizer_state"])
        # the pass's measured peak holds the adapters' gradients and a 4-bit layer de-quantized (transient)
        assert probe.pass_bytes(1) >= probe.memory["gradients"] + probe.memory["dequantized"]
        # loading the model is a peak of its own (the process's peak RSS's rise while it was built)
        assert probe.loading_bytes >= 0 and probe.estimate(1) >= probe.loading_bytes
    finally:
        probe.close()
    assert main([*flags, "--total_batch_size", "2", "--loss_chunk_size", "0", "--activation_checkpointing", "True",
                 "--output_dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^checkpointing, plain loss: weights \d+ MiB \(NF4 \(4-bit, bitsandbytes; compute float32; 14 "
                     r"linear layers\): \d+ MiB with its constants, \d+ MiB kept unquantized; the largest layer "
                     r"de-quantized \d+ MiB\), gradients \d+ MiB, optimizer state \(AdamW 8-bit, bitsandbytes\)",
                     out, flags=re.M), out
    assert not (tmp_path / "out").exists()


# a probe whose build keeps 64 MiB (a tensor it does not free: the fault), in a process of its own, as ``finetune plan``
# runs: in a pytest worker, what earlier tests left (heap they freed, garbage collected during the build) moves the RSS
# the count is read from by as much as the fault (CI saw 5,504 bytes measured)
LEAKY_PROBE = """
import sys, torch
from finetune.config import parse_config
from finetune.planner import probes
from finetune.planner.plans import Lever
from finetune.recipes import load_recipe
config = parse_config(["--recipe", "bbc-headlines", "--model_name_or_path", sys.argv[1], "--max_length", "32",
                       "--mixed_precision", "no", "--loss_chunk_size", "0"])
kept, real_build = [], probes.build_model
def build(*args, **kwargs):
    if sys.argv[2] == "leaky":
        kept.append(torch.ones(16 * 2**20))  # 64 MiB, touched, never freed
    return real_build(*args, **kwargs)
probes.build_model = build
probe = probes.Probe(config, load_recipe("bbc-headlines"), torch.device("cpu"), Lever(False, 0), held=0, overhead=1.0,
                     loading=0)
print(probe.left_bytes)
"""


def test_what_loading_leaves_behind_is_in_every_peak(chat_llama):
    """A build that leaves memory in the process beyond the model's weights (a GGUF base de-quantized through numpy
    leaves 180 to 400 MiB of freed heap; bitsandbytes' compiled de-quantization stays) raises the pass's, the
    optimizer step's and the estimate's peaks by it: a build that keeps 64 MiB more (a tensor it does not free, the
    fault installed here) is measured at least that much more than the same build without it (``Probe.left_bytes``,
    each in a fresh process), and a probe given 64 MiB more (``left``) estimates every peak exactly 64 MiB higher.
    Before this count, the full fine-tune of SmolLM2 with 8-bit AdamW was estimated 15% under its measured peak
    (docs/plan.md)."""
    import os
    import subprocess
    import sys

    from helpers import REPO

    from finetune.config import parse_config
    from finetune.planner import probes
    from finetune.planner.plans import Lever
    from finetune.recipes import load_recipe

    measured = {}
    for build in ("plain", "leaky"):
        result = subprocess.run([sys.executable, "-c", LEAKY_PROBE, chat_llama, build], capture_output=True,
                                text=True, cwd=REPO, timeout=300,
                                env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-3000:]
        measured[build] = int(result.stdout.split()[-1])
    # the fault's pages, less the odd page reused
    assert measured["leaky"] - measured["plain"] >= 64 * 2**20 * 0.98, measured
    config = parse_config(["--recipe", "bbc-headlines", "--model_name_or_path", chat_llama, "--max_length", "32",
                           "--mixed_precision", "no", "--loss_chunk_size", "0"])
    recipe, cpu, lever = load_recipe("bbc-headlines"), torch.device("cpu"), Lever(False, 0)
    made = [probes.Probe(config, recipe, cpu, lever, held=0, overhead=1.0, loading=0, left=left)
            for left in (0, 64 * 2**20)]
    try:
        plain, more = made
        assert more.step_peak_bytes - plain.step_peak_bytes == 64 * 2**20
        assert (more.fixed_bytes - more.fixed_pass_bytes) - (plain.fixed_bytes - plain.fixed_pass_bytes) == 64 * 2**20
        for probe in made:  # held 0, loading 0, no generation: the pass's peak or the optimizer step's
            assert probe.estimate(1) == max(probe.fixed_bytes + probe.per_sample_bytes, probe.step_peak_bytes)
    finally:
        for probe in made:
            probe.close()


def test_a_built_base_is_freed_before_its_quantized_copy_loads(chat_llama, monkeypatch):
    """``quantize_built`` (a GGUF base quantized for QLoRA): the full-precision model is let go once saved, before
    ``from_pretrained`` builds the quantized one, so a QLoRA run from a GGUF file never holds both."""
    import gc
    import weakref

    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from finetune.config import parse_config
    from finetune.models.quantization import bnb_config, quantize_built

    built, alive = [], []
    real = LlamaForCausalLM.from_pretrained.__func__

    def build():
        model = AutoModelForCausalLM.from_pretrained(chat_llama)
        built.append(weakref.ref(model))
        return model

    def from_pretrained(cls, *args, **kwargs):  # transformers' own, after noting whether the built model is alive
        if built:  # not the build's own load (AutoModelForCausalLM goes through it too)
            gc.collect()
            alive.append(built[0]() is not None)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", classmethod(from_pretrained))
    model = quantize_built(build, bnb_config(parse_config(["--use_peft", "--load_in_4bit"])))
    assert alive == [False]
    assert sum(type(p).__name__ == "Params4bit" for p in model.parameters()) == 14


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_bnb_8bit"])
def test_the_optimizer_steps_transient_is_what_it_allocates(optim):
    """``optimizer_step_bytes``: the most one step of the run's optimizer allocates beyond its state (the profiler's
    allocation events, ``probes.allocation_peak``), for a tensor of 100,000 elements: 5 fp32 copies under
    bitsandbytes' 8-bit AdamW on a CPU, 2 under torch's; what else it allocates is under 5% of that."""
    from finetune.config import parse_config
    from finetune.engine import build_optimizer
    from finetune.planner.probes import allocation_peak

    torch.manual_seed(0)
    model = torch.nn.Linear(400, 250, bias=False)
    optimizer = build_optimizer(model, parse_config(["--optim", optim, "--weight_decay", "0"]))
    model.weight.grad = torch.randn_like(model.weight)
    optimizer.step()  # the state is allocated on the first step
    measured = allocation_peak(optimizer.step)
    counted = memory.optimizer_step_bytes(model.parameters(), optim)
    assert counted == (5 if optim.endswith("8bit") else 2) * 4 * 100_000
    assert counted <= measured <= 1.05 * counted, (measured, counted)


def mapped_files() -> dict[str, list[tuple[int, int]]]:
    """This process's file mappings (``/proc/self/maps``): path -> its address ranges."""
    maps: dict[str, list[tuple[int, int]]] = {}
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip().startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            maps.setdefault(fields[5].strip().removesuffix(" (deleted)"), []).append((start, end))
    return maps


def checkpoint_views(model) -> list[str]:
    """The parameters and buffers of ``model`` whose storage lies in a mapped ``.safetensors`` file."""
    ranges = [r for path, rs in mapped_files().items() if path.endswith(".safetensors") for r in rs]
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    return [name for name, t in named if any(a <= t.untyped_storage().data_ptr() < b for a, b in ranges)]


@pytest.mark.parametrize("flags, source", [(["--load_in_4bit"], "built"), (["--load_in_8bit"], "directory")])
def test_a_quantized_base_keeps_no_view_of_its_checkpoint(chat_llama, monkeypatch, flags, source):
    """transformers memory-maps a ``.safetensors`` checkpoint, and the tensors it does not quantize (embeddings, norms,
    the tied ``lm_head``) stay views of the map: the whole file's pages then stay in the process (SmolLM2's 405 MiB,
    docs/plan.md). ``off_the_checkpoint`` copies them out, so no map of the checkpoint outlives the load, from a model
    directory and from a built model (a GGUF base, ``quantize_built``); without it (the mutant) they are views."""
    import gc

    from transformers import AutoModelForCausalLM

    from finetune.config import parse_config
    from finetune.models import loading, quantization
    from finetune.models.quantization import bnb_config

    config = bnb_config(parse_config(["--use_peft", *flags]))

    def load():
        if source == "directory":
            return loading.load_causal_lm(chat_llama, quantization=config)
        return quantization.quantize_built(lambda: AutoModelForCausalLM.from_pretrained(chat_llama), config)

    with monkeypatch.context() as mutant:
        for module in (loading, quantization):
            mutant.setattr(module, "off_the_checkpoint", lambda model, _: model)
        kept = load()
        assert "model.embed_tokens.weight" in checkpoint_views(kept)
        del kept
        gc.collect()
    model = load()
    gc.collect()
    assert checkpoint_views(model) == []
    # Only this checkpoint's files: another test in the same worker may hold its own model's map (a tiny BERT).
    assert not [path for path in mapped_files() if path.startswith(str(chat_llama)) and path.endswith(".safetensors")]
    assert model.model.embed_tokens.weight is model.lm_head.weight  # the tie is kept
    assert sum(type(p).__name__ in ("Params4bit", "Int8Params") for p in model.parameters()) == 14


def test_the_generation_count_is_what_generate_holds(chat_llama):
    """``generation_memory``: the key/value cache equals the bytes of the cache ``generate`` returns (every layer's
    keys and values, ``return_dict_in_generate``) after ``max_new_tokens`` sampled tokens; with one step's logits it
    is under what a whole sampling ``generate`` allocates at its peak (the profiler's allocations), which exceeds it
    by less than the prompt's forward (the prefill: its hidden states and temporaries, which the training pass's own
    forward over more rows and tokens bounds)."""
    from transformers import AutoModelForCausalLM

    from finetune.planner.probes import allocation_peak

    model = AutoModelForCausalLM.from_pretrained(chat_llama).eval()
    rows, prompt, new = 4, 40, 24
    ids = torch.randint(3, 100, (rows, prompt))
    settings = dict(do_sample=True, top_k=0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True,
                             **settings)
        assert out.sequences.shape == (rows, prompt + new)
        cache = out.past_key_values
        held = storages(*[t for layer in cache.layers for t in (layer.keys, layer.values)])
        del out, cache
        counted = memory.generation_memory(model, rows, prompt, new)
        assert counted["kv_cache"] == held == 2 * 2 * 2 * 16 * (prompt + new - 1) * rows * 4  # 2 layers, 2 x 16 kv
        assert counted["logits"] == rows * model.config.vocab_size * 3 * 4
        peak = allocation_peak(lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **settings))
        prefill = allocation_peak(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))
    total = counted["kv_cache"] + counted["logits"]
    assert total <= peak <= total + prefill, (peak, counted, prefill)


@pytest.mark.parametrize("flags", [["--beta", "0.1"], ["--use_peft", "--beta", "0.1"]])
def test_plan_counts_the_generation_and_the_reference(chat_llama, tmp_path, capsys, flags):
    """``finetune plan`` on a GRPO recipe: the header names the generation's key/value cache and logits (one prompt's
    ``--num_generations`` completions of ``--max_length`` + ``--max_completion_length`` tokens) and the frozen
    reference where ``--beta`` > 0 without LoRA (its bytes: the policy's); with LoRA none (the disabled adapter);
    every plan's estimate at least the generation's peak."""
    from finetune.commands.plan import main, memory_rows, render
    from finetune.config import parse_config
    from finetune.planner.plans import Lever
    from finetune.planner.probes import Probe
    from finetune.recipes import load_recipe

    common = ["--recipe", "bbc-topic-grpo", "--model_name_or_path", chat_llama, "--max_length", "384",
              "--num_generations", "4", "--max_completion_length", "8", "--mixed_precision", "no", *flags]
    lever = Lever(False, 0)
    probe = Probe(parse_config(common), load_recipe("bbc-topic-grpo"), torch.device("cpu"), lever, held=0)
    try:
        kv = 2 * 2 * 2 * 16 * (384 + 8 - 1) * 4 * 4
        assert probe.generation["kv_cache"] == kv
        reference = probe.task.resident_bytes()
        full = "--use_peft" not in flags
        assert reference == (sum(p.numel() * 4 for p in probe.model.parameters()) if full else 0)
        assert probe.generation_peak_bytes == (probe.memory["weights"]["total"] + reference + probe.left_bytes
                                               + probe.memory["optimizer_state"] + kv + probe.generation["logits"])
        assert probe.estimate(1) >= probe.generation_peak_bytes
        out = render(lever, *memory_rows(probe, [(2, 1)]))  # the block finetune plan prints
    finally:
        probe.close()
    if full:  # the command itself, once
        assert main([*common, "--total_batch_size", "2", "--loss_chunk_size", "0", "--activation_checkpointing",
                     "True", "--output_dir", str(tmp_path / "out")]) == 0
        printed = capsys.readouterr().out
        assert re.search(r"^checkpointing[^:]*: .*generating 4 completions", printed, flags=re.M), printed
        assert not (tmp_path / "out").exists()
    reference = r"a frozen reference \d+ MiB, " if full else ""
    assert re.search(rf"^no checkpointing, plain loss: weights \d+ MiB, gradients \d+ MiB, {reference}optimizer state", out,
                     flags=re.M), out
    named = (r"the frozen reference counted with the weights" if full
             else r"no reference copy \(--beta 0, or the policy with its adapter disabled\)")
    assert re.search(rf"generating 4 completions of a prompt: KV cache {kv / 2**20:.1f} MiB \+ logits [\d.]+ MiB, a "
                     rf"peak of \d+ MiB with the weights and the state; {named}$", out, flags=re.M), out
