"""Verification of an export on the run's own validation prompts: two models' next-token logits compared on the
same token sequences (the largest absolute difference, top-1 agreement, mean per-token KL divergence) and their
greedy continuations compared string for string; each comparison judged against its ``Tolerance``. A reduced-dtype
merge's tolerance is calibrated on the run itself (``calibrate``: the adapter's effect and the dtype's rounding
floor)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from finetune.errors import FinetuneError

DEFAULT_SAMPLES = 16
DEFAULT_MAX_NEW_TOKENS = 32


@dataclass
class VerifySet:
    """The inputs of every comparison: ``sequences``, token ids the models read teacher-forced (a validation row's
    prompt and reference, as training encodes it); ``prompts``, what greedy decoding continues (message lists for a
    chat run, strings otherwise); ``chat``; ``max_new_tokens``, ``max_length``: the run's generation settings."""

    sequences: list[list[int]]
    prompts: list
    chat: bool
    max_new_tokens: int
    max_length: int | None

    @property
    def positions(self) -> int:
        return sum(len(s) for s in self.sequences)


@dataclass
class Tolerance:
    """What a comparison must meet (None: reported, not judged): ``max_logit_diff`` on the largest absolute logit
    difference relative to the reference's logit scale, ``max|ref - test| / max(1, max|ref|)`` (fp32 rounding of a
    merge grows with the logits' size: 1.6e-4 absolute on logits up to 41 measured, 3.9e-6 relative); ``min_top1`` on the fraction of positions whose argmax agrees; ``max_kl`` on the mean per-token KL(ref || test)
    in nats; ``greedy_identical``: every greedy continuation equal."""

    max_logit_diff: float | None = None
    min_top1: float | None = None
    max_kl: float | None = None
    greedy_identical: bool = False


@dataclass
class Comparison:
    """One comparison's figures (``measure``) and verdict (``judge``)."""

    name: str
    positions: int = 0
    max_abs_logit_diff: float = 0.0
    max_abs_ref_logit: float = 0.0
    relative_logit_diff: float = 0.0
    top1_agreement: float = 1.0
    mean_kl: float = 0.0
    greedy_identical: int = 0
    greedy_total: int = 0
    seconds: float = 0.0
    tolerance: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def verify_set(source, tokenizer, samples: int = DEFAULT_SAMPLES) -> VerifySet:
    """The first ``samples`` rows of the run's validation split (its ``run_config.json`` replayed: recipe, data flags,
    ``max_eval_samples``), encoded by the run's task as training encodes them (``task.tokenize``; every sequence of a
    row, ``task.sequences``: both sides of a preference pair); the prompts greedy decoding continues are the rows'
    (``task.prompt_and_reference``) for a chat task, else each sequence's first half. Raises ``FinetuneError`` when
    the run's data cannot be loaded or encoded, or yields no rows."""
    import datasets

    from finetune.config import parse_config
    from finetune.recipes import load_recipe
    from finetune.tasks import task_of
    from finetune.tasks.builders import raw_datasets

    config_file = source.run_dir / "run_config.json"
    if not config_file.is_file():
        raise FinetuneError(f"{source.run_dir} holds no run_config.json, so its validation prompts are unknown. "
                            "Export the --output_dir of a finetune training run.")
    config = parse_config(["--config", str(config_file)])
    recipe = load_recipe(config.recipe)
    task = task_of(recipe)
    rows = raw_datasets(recipe, config, task, check=False)["validation"]
    rows = rows.select(range(min(samples, len(rows))))
    if len(rows) == 0:
        raise FinetuneError(f"the run's validation split is empty: nothing to verify {source.name} on.")
    spec = getattr(recipe, "GENERATION", None) or {}
    max_new = int(spec.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    max_length = config.max_length
    tokenized = task.tokenize(datasets.DatasetDict({"validation": rows}), tokenizer, config,
                              recipe.TEXT_COLUMNS)["validation"]
    sequences = [ids for row in tokenized for ids, _ in task.sequences(row).values() if len(ids) > 1]
    if not sequences:
        raise FinetuneError(f"the run's first {len(rows)} validation rows encode to no sequence of 2 tokens or more: "
                            "nothing to verify on.")
    if task.chat:
        prompts = [task.prompt_and_reference(row, f"validation row {i}")[0] for i, row in enumerate(rows)]
        return VerifySet(sequences, prompts, True, max_new, max_length)
    prompts = [tokenizer.decode(ids[: len(ids) // 2], skip_special_tokens=True) for ids in sequences]
    return VerifySet(sequences, prompts, False, max_new, max_length)


@torch.no_grad()
def _logits(model, ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu()


class _Tally:
    """The logit figures of one ``Comparison``, accumulated sequence by sequence (``add``) and finished
    (``result``): the largest absolute difference, top-1 agreement, and the mean per-token KL(ref || test), computed
    in float64 (fp32's rounding of a log-softmax is of the size of the KL a reduced-dtype merge's rounding gives)."""

    def __init__(self, comparison: Comparison):
        self.comparison, self.agree, self.kl_sum = comparison, 0, 0.0

    def add(self, ref: torch.Tensor, test: torch.Tensor) -> None:
        """One sequence's logits, ``[positions, vocabulary]`` each (fp32)."""
        result = self.comparison
        if ref.shape != test.shape:
            raise FinetuneError(f"{result.name}: the models' logits differ in shape ({tuple(ref.shape)} vs "
                                f"{tuple(test.shape)}): not the same vocabulary.")
        result.positions += ref.shape[0]
        result.max_abs_logit_diff = max(result.max_abs_logit_diff, float((ref - test).abs().max()))
        result.max_abs_ref_logit = max(result.max_abs_ref_logit, float(ref.abs().max()))
        self.agree += int((ref.argmax(-1) == test.argmax(-1)).sum())
        log_p, log_q = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
        self.kl_sum += float((log_p.exp() * (log_p - log_q)).sum())

    def result(self) -> Comparison:
        result = self.comparison
        result.top1_agreement = self.agree / max(1, result.positions)
        result.mean_kl = max(0.0, self.kl_sum / max(1, result.positions))  # rounding can leave -1e-16 for equal models
        result.relative_logit_diff = result.max_abs_logit_diff / max(1.0, result.max_abs_ref_logit)
        return result


def measure(name: str, reference, candidate, tokenizers: tuple, inputs: VerifySet, tolerance: Tolerance,
            reference_outputs: list[str] | None = None) -> tuple[Comparison, list[str]]:
    """Compare ``candidate`` with ``reference`` (causal LMs) on ``inputs``: logits on every sequence position (fp32),
    then greedy continuations (``greedy`` with ``tokenizers``: the reference's and the candidate's; those must encode
    every prompt alike); ``reference_outputs`` reuses the reference's continuations. Returns the judged
    ``Comparison`` and the candidate's continuations."""
    started = time.perf_counter()
    tally = _Tally(Comparison(name=name, tolerance=asdict(tolerance)))
    for ids in inputs.sequences:
        tally.add(_logits(reference, ids), _logits(candidate, ids))
    result = tally.result()
    ours = reference_outputs if reference_outputs is not None else greedy(reference, tokenizers[0], inputs)
    theirs = greedy(candidate, tokenizers[1], inputs)
    result.greedy_total = len(ours)
    result.greedy_identical = sum(a == b for a, b in zip(ours, theirs))
    judge(result, tolerance)
    if tokenizers[0] is not tokenizers[1] and not same_tokens(tokenizers[0], tokenizers[1], inputs):
        result.failures.append("the two tokenizers encode the prompts differently")
    result.seconds = time.perf_counter() - started
    return result, theirs


@dataclass
class Calibration:
    """What a merge's tolerance is calibrated on, both measured against the run's model on the verification
    sequences: ``effect``, the un-adapted base (the adapter disabled) vs the run's model: what a merge that drops the
    adapter departs by (None for a run without an adapter); ``floor``, the run's model with every weight rounded to
    the export's dtype and computed in fp32, as the merged folder is read back: what a correct merge departs by
    (None for a float32 merge of a full-precision base, exact to fp32's rounding). ``quantized``: the run's
    quantized base (``quantization.describe_base``), whose floor is the quantization floor: the run's model on its
    base de-quantized (``dequantized_copy``), adapter applied and not merged, against the run as trained."""

    effect: Comparison | None
    floor: Comparison | None
    seconds: float = 0.0
    quantized: str | None = None

    def as_dict(self) -> dict:
        return {"adapter_effect": self.effect.as_dict() if self.effect else None,
                "floor": self.floor.as_dict() if self.floor else None, "quantized_base": self.quantized,
                "seconds": self.seconds}


# A reduced-dtype merge may depart from the run's model by the dtype's rounding (FLOOR_FACTOR times the floor's
# figure) plus a small fraction of the adapter's effect: EFFECT_FRACTION of it in logits, its square in KL (KL grows
# with the square of a small logit change). Dropping the adapter departs by the whole effect, doubling its scaling
# by the effect again, so both are beyond the bound whatever the run's learning rate (docs/export.md#tolerances).
FLOOR_FACTOR = {"max_logit_diff": 2.0, "max_kl": 1.5}  # the floor's largest logit difference is a maximum: noisier
EFFECT_FRACTION = 0.5


def _round(model, dtype: str):
    """``model`` with its floating-point weights (its ``state_dict``: parameters and saved buffers, what a merged
    folder holds) rounded to ``dtype`` in place and kept in their dtype (fp32)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(getattr(torch, dtype)))
    return model


def rounded_copy(model, dtype: str):
    """A copy of ``model`` whose floating-point weights are rounded to ``dtype`` and kept in fp32."""
    import copy

    return _round(copy.deepcopy(model), dtype)


def dequantized_copy(model, dtype: str):
    """A copy of ``model`` (the run's model on a bitsandbytes 4-bit or 8-bit base, a ``peft.PeftModel``) whose
    quantized linear layers are torch ``Linear`` layers holding their own weights de-quantized in fp32
    (transformers' ``dequantize_bnb_weight``: bitsandbytes' ``dequantize_4bit`` or ``int8_vectorwise_dequant`` of
    the layer's stored bytes and constants), the adapter kept, every floating-point weight then rounded to
    ``dtype`` and kept in fp32. Built from the run's model itself, not by the merge's loader."""
    import copy

    from transformers.integrations.bitsandbytes import dequantize_bnb_weight

    from finetune.models.quantization import quantized_modules

    plain = copy.deepcopy(model)
    for name, module in quantized_modules(plain):
        weight = dequantize_bnb_weight(module.weight, getattr(module, "state", None)).float()
        linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                 device=weight.device)
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if module.bias is not None:
            linear.bias = torch.nn.Parameter(module.bias.detach().float(), requires_grad=False)
        plain.set_submodule(name, linear)
    return _round(plain, dtype)


def calibrate(model, inputs: VerifySet, dtype: str) -> Calibration:
    """``Calibration`` of a merge into ``dtype`` (one of ``merge.DTYPES``) of ``model`` (the run's model: a
    ``peft.PeftModel`` for LoRA) on ``inputs``' sequences. Holds a rounded copy of ``model`` beside it (for
    bfloat16/float16), or its de-quantized copy (a quantized base: ``dequantized_copy``); runs three forwards per
    sequence."""
    from finetune.models.lora import is_peft_model
    from finetune.models.quantization import describe_base

    quantized = describe_base(model)
    effect = _Tally(Comparison(name="adapter effect: base vs run")) if is_peft_model(model) else None
    if quantized is not None:
        rounding = "" if dtype == "float32" else f", rounded to {dtype}"
        floor = _Tally(Comparison(name=f"quantization floor: run on its base de-quantized{rounding} vs run"))
    else:
        floor = _Tally(Comparison(name=f"{dtype} floor: run rounded to {dtype} vs run")) if dtype != "float32" else None
    if effect is None and floor is None:  # a full run's float32 export: nothing to calibrate
        return Calibration(None, None)
    if floor is None:
        rounded = None
    else:
        rounded = dequantized_copy(model, dtype) if quantized is not None else rounded_copy(model, dtype)
    started = time.perf_counter()
    for ids in inputs.sequences:
        ref = _logits(model, ids)
        if effect is not None:
            with model.disable_adapter():
                effect.add(ref, _logits(model, ids))
        if floor is not None:
            floor.add(ref, _logits(rounded, ids))
    del rounded
    return Calibration(effect.result() if effect else None, floor.result() if floor else None,
                       time.perf_counter() - started, quantized)


def calibrated_tolerance(calibration: Calibration) -> Tolerance:
    """A reduced-dtype merge's ``Tolerance`` from ``calibration``: relative logit difference at most
    ``FLOOR_FACTOR`` x the floor's + ``EFFECT_FRACTION`` x the effect's; mean KL at most ``FLOOR_FACTOR`` x the
    floor's + ``EFFECT_FRACTION``² x the effect's (no effect term without an adapter). Top-1 agreement and greedy
    continuations are reported, not judged: near-ties flip under any rounding."""
    floor, effect = calibration.floor, calibration.effect
    if floor is None:
        raise ValueError("calibrated_tolerance needs a floor: a bfloat16 or float16 merge")
    logit = FLOOR_FACTOR["max_logit_diff"] * floor.relative_logit_diff
    kl = FLOOR_FACTOR["max_kl"] * floor.mean_kl
    if effect is not None:
        logit += EFFECT_FRACTION * effect.relative_logit_diff
        kl += EFFECT_FRACTION ** 2 * effect.mean_kl
    return Tolerance(max_logit_diff=logit, max_kl=kl)


def quantized_tolerance(calibration: Calibration, float32: Tolerance) -> Tolerance:
    """The ``Tolerance`` of a merge into a de-quantized base (a QLoRA run's), from ``calibration``'s quantization
    floor: relative logit difference at most ``float32.max_logit_diff`` (the merge's own fp32 rounding, as a float32
    LoRA merge's bound) + ``FLOOR_FACTOR`` x the floor's. A floor within that float32 bound (4-bit layers that
    compute in fp32 on their de-quantized weights, exported in float32: the de-quantized base is the run's base) keeps
    ``float32``'s top-1 and greedy bounds; a larger one (a reduced compute dtype or export dtype, LLM.int8()'s
    quantized activations) bounds the mean KL at ``FLOOR_FACTOR`` x the floor's, top-1 and greedy reported. No
    adapter-effect term: a merge into a base other than the run's (the original weights, a re-quantized merge)
    departs by the quantization's effect, whatever the adapter's size."""
    floor = calibration.floor
    logit = float32.max_logit_diff + FLOOR_FACTOR["max_logit_diff"] * floor.relative_logit_diff
    if floor.relative_logit_diff <= float32.max_logit_diff:
        return Tolerance(logit, float32.min_top1, float32.max_kl, float32.greedy_identical)
    return Tolerance(max_logit_diff=logit, max_kl=FLOOR_FACTOR["max_kl"] * floor.mean_kl)


def judge(result: Comparison, tolerance: Tolerance) -> Comparison:
    """Fill ``result.failures`` with each bound of ``tolerance`` it breaks (one phrase each)."""
    if tolerance.max_logit_diff is not None and not result.relative_logit_diff <= tolerance.max_logit_diff:
        result.failures.append(f"largest logit difference {result.max_abs_logit_diff:.3g} ({result.relative_logit_diff:.3g}"
                               f" of the largest logit {result.max_abs_ref_logit:.3g}) > {tolerance.max_logit_diff:.3g}")
    if tolerance.min_top1 is not None and not result.top1_agreement >= tolerance.min_top1:
        result.failures.append(f"top-1 agreement {result.top1_agreement:.4%} < {tolerance.min_top1:.4%}")
    if tolerance.max_kl is not None and not result.mean_kl <= tolerance.max_kl:
        result.failures.append(f"mean KL {result.mean_kl:.3g} > {tolerance.max_kl:.3g}")
    if tolerance.greedy_identical and result.greedy_identical != result.greedy_total:
        result.failures.append(f"greedy continuations differ on {result.greedy_total - result.greedy_identical} "
                               f"of {result.greedy_total} prompts")
    return result


def greedy(model, tokenizer, inputs: VerifySet) -> list[str]:
    """Greedy continuations of ``inputs.prompts`` by ``model``: for a chat run ``chat.generate_completions`` (as the
    run's own evaluation generates: the chat template, stop at the end-of-turn token); otherwise the decoded new
    tokens of ``model.generate`` (greedy)."""
    if inputs.chat:
        from finetune.data.chat import generate_completions

        return generate_completions(model, tokenizer, inputs.prompts, inputs.max_new_tokens, 8, inputs.max_length)
    outputs = []
    for prompt in inputs.prompts:
        encoded = tokenizer(prompt, return_tensors="pt")  # a BERT-style tokenizer adds token_type_ids: not passed
        with torch.no_grad():
            out = model.generate(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"],
                                 max_new_tokens=inputs.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        outputs.append(tokenizer.decode(out[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return outputs


def same_tokens(reference_tokenizer, candidate_tokenizer, inputs: VerifySet) -> bool:
    """Whether both tokenizers give the same ids for every prompt rendered with the chat template (or as text)."""
    for prompt in inputs.prompts:
        if inputs.chat:
            a, b = (t.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
                    for t in (reference_tokenizer, candidate_tokenizer))
            if a != b:
                return False
            text = a
        else:
            text = prompt
        if (reference_tokenizer(text, add_special_tokens=False)["input_ids"]
                != candidate_tokenizer(text, add_special_tokens=False)["input_ids"]):
            return False
    return True
