"""Packing is contamination-free (issue 27): per sequence, per label, per optimizer step.

Per sequence: on tiny Llama, Qwen2, GPT-2 and Mixtral (tests/families.py), the padding-free row's logits at each
sample's positions equal the sample's logits alone (fp32, rtol 1e-5) under ``sdpa`` and ``eager``; the negative
controls (positions not reset, a 2-D all-ones mask with the row) must fail the same check, and
``packing.separation_error`` must refuse them. Per label: a row's summed loss and label tokens equal the padded
micro-batch's; with the first label of each sample left in, they do not. Per step: padding-free and packed runs
give the padded B x 1 run's weights.
"""

from __future__ import annotations

import json

import families
import pytest
import torch
from helpers import load_params, run_in_process, train_steps
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.data import packing
from finetune.errors import FinetuneError
from finetune.lifecycle.window import tokens as window_tokens
from finetune.tasks import IGNORE_INDEX, CausalLM

FAMILIES = ["llama", "qwen2", "gpt2", "mixtral"]
ATTENTION = ["sdpa", "eager"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: str(families.build(name, root / name)) for name in FAMILIES}


def _model(path, attention):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, dtype=torch.float32)


def _alone_and_packed(model, samples, row_transform=None):
    """(each sample's logits alone, the packed row's logits at its positions), fp32, no gradients."""
    model.eval()
    with torch.no_grad():
        alone = [model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in samples]
        row = packing.flatten([{"input_ids": s, "labels": s} for s in samples])
        inputs = {k: v for k, v in row.items() if k != "labels"}
        packed = model(**(row_transform(inputs) if row_transform else inputs)).logits[0]
    bounds = torch.tensor([0] + [len(s) for s in samples]).cumsum(0).tolist()
    return alone, [packed[a:b] for a, b in zip(bounds, bounds[1:])]


def _positions_not_reset(inputs):
    return {**inputs, "position_ids": torch.arange(inputs["input_ids"].shape[1]).unsqueeze(0)}


def _all_ones_mask(inputs):
    return {**inputs, "attention_mask": torch.ones_like(inputs["input_ids"])}


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_equal_each_sample_alone(family_dirs, family, attention):
    model = _model(family_dirs[family], attention)
    samples = packing.check_samples(model.config.vocab_size, lengths=(7, 5, 9, 3))
    alone, packed = _alone_and_packed(model, samples)
    for a, p in zip(alone, packed):
        torch.testing.assert_close(p, a, rtol=1e-5, atol=1e-6)
    # both layouts (one row; two padded rows, as --packing runs them): differences are float rounding
    assert packing.per_sequence_difference(model, samples) < 1e-5
    assert packing.separation_error(model, "--padding_free") is None


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mutant", [_positions_not_reset, _all_ones_mask], ids=["positions-not-reset", "2d-mask"])
def test_negative_controls_fail_the_per_sequence_check(family_dirs, family, attention, mutant):
    """The same comparison must fail for a row whose positions run on, or that carries a 2-D all-ones mask
    (transformers then builds no block-diagonal mask: masking_utils.py lines 862-870). GPT-2's learned positions
    make a 2-D mask harmless only where positions also run on; here positions reset, so the mask alone must
    show."""
    model = _model(family_dirs[family], attention)
    samples = packing.check_samples(model.config.vocab_size, lengths=(7, 5, 9, 3))
    alone, packed = _alone_and_packed(model, samples, mutant)
    # the first sample sees nothing before it: only the later ones can differ
    worst = max(float((p - a).abs().max()) for a, p in zip(alone[1:], packed[1:]))
    assert worst > 1e-3, worst
    assert packing.per_sequence_difference(model, samples, mutant) > 1e-3


def test_separation_check_refuses_a_model_that_cannot_separate(tmp_path):
    """Refused by what it computes, not its name: OPT derives positions from the attention mask and ignores
    position_ids, so packed samples see shifted positions; the check's one line names the flag."""
    path = families.build("opt", tmp_path / "opt")
    error = packing.separation_error(_model(path, "sdpa"), "--padding_free")
    assert error is not None and error.startswith("--padding_free: OPTForCausalLM") and "\n" not in error


def test_check_refuses_a_model_given_a_2d_mask(family_dirs, monkeypatch):
    """A mutant of the code under test: if flatten passed a 2-D mask, the check on the user's model must fail."""
    real = packing.flatten
    monkeypatch.setattr(packing, "flatten", lambda samples: {**real(samples),
                                                             "attention_mask": real(samples)["input_ids"] * 0 + 1})
    assert packing.separation_error(_model(family_dirs["llama"], "sdpa"), "--padding_free") is not None


# ------------------------------------------------------------------------------------------ labels
def _padded_and_row(tiny_llama, clm_texts, n=6):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = [json.loads(line)["text"] for line in open(clm_texts[0])][:n]
    features = [{"input_ids": ids} for ids in tokenizer(texts, truncation=True, max_length=48)["input_ids"]]
    padded = CausalLM().collator(tokenizer, None)(features)
    return padded, packing.flatten(packing.unpad(padded))


def test_row_trains_the_padded_batch_label_tokens(tiny_llama, clm_texts):
    """Label level: the row's summed loss and its items (label tokens after the shift) equal the padded
    micro-batch's, with the first label of every sample masked."""
    task, model = CausalLM(), AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    padded, row = _padded_and_row(tiny_llama, clm_texts)
    starts = row["position_ids"][0] == 0
    assert (row["labels"][0][starts] == IGNORE_INDEX).all() and "attention_mask" not in row
    assert row["input_ids"].numel() == padded["attention_mask"].sum() < padded["input_ids"].numel()
    assert task.count_labels(row["labels"]) == task.count_labels(padded["labels"])
    with torch.no_grad():
        loss_padded = task.loss_from_logits(model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits,
                                    padded["labels"])
        loss_row = task.loss_from_logits(model(**{k: v for k, v in row.items() if k != "labels"}).logits, row["labels"])
    torch.testing.assert_close(loss_row, loss_padded, rtol=1e-5, atol=0)


def _padded_and_row_outputs(model, padded, row, dtype, row_transform=None):
    """(each sample's logits in the padded batch, the same in the row, the padded loss, the row loss), fp32 copies;
    the forwards under CPU autocast to ``dtype`` (None: fp32)."""
    task = CausalLM()
    inputs = {k: v for k, v in row.items() if k != "labels"}
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits_padded = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits.float()
        logits_row = model(**(row_transform(inputs) if row_transform else inputs)).logits.float()
        losses = (task.loss_from_logits(logits_padded, padded["labels"]), task.loss_from_logits(logits_row, row["labels"]))
    lengths = padded["attention_mask"].sum(dim=1).tolist()
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return ([logits_padded[i, :n] for i, n in enumerate(lengths)],
            [logits_row[0, a:b] for a, b in zip(bounds, bounds[1:])], *losses)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_packed_equals_padded_within_its_rounding(tiny_llama, clm_texts, dtype):
    """bf16 and fp16 (CPU autocast, as ``--mixed_precision bf16`` runs on a CPU and fp16 on a GPU): the row's
    logits at each sample's positions and its summed loss equal the padded micro-batch's within the 16-bit type's
    own rounding, measured here as the difference between the padded batch in 16 bits and in fp32; the negative
    control (positions not reset) in 16 bits is far outside it, so the comparison can fail."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation="sdpa").eval()
    padded, row = _padded_and_row(tiny_llama, clm_texts)
    fp32_padded, _, fp32_loss, _ = _padded_and_row_outputs(model, padded, row, None)
    bf16_padded, bf16_row, bf16_loss_padded, bf16_loss_row = _padded_and_row_outputs(model, padded, row, dtype)
    scale = max(float(x.abs().max()) for x in fp32_padded)

    def worst(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) / scale

    rounding = worst(bf16_padded, fp32_padded)
    floor = {torch.bfloat16: 1e-4, torch.float16: 1e-5}[dtype]  # 8 vs 11 significant bits
    assert floor < rounding < 5e-2  # 16 bits really ran (fp32 agrees to 1e-6), and its error is theirs
    assert worst(bf16_row, bf16_padded) <= 2 * rounding
    loss_rounding = abs(float(bf16_loss_padded - fp32_loss))
    assert abs(float(bf16_loss_row - bf16_loss_padded)) <= max(2 * loss_rounding, 1e-3 * abs(float(fp32_loss)))
    _, control_row, _, _ = _padded_and_row_outputs(model, padded, row, dtype, row_transform=_positions_not_reset)
    assert worst(control_row, bf16_padded) > 10 * rounding


def test_first_label_not_masked_is_caught(tiny_llama, clm_texts):
    """Negative control at the label level: a row that keeps each sample's first label trains the previous
    sample's last token to predict it: more items than the padded batch, and another loss."""
    task = CausalLM()
    padded, row = _padded_and_row(tiny_llama, clm_texts)
    unmasked = torch.cat([s["input_ids"] for s in packing.unpad(padded)]).unsqueeze(0)
    assert task.count_labels(unmasked) == task.count_labels(padded["labels"]) + (len(packing.unpad(padded)) - 1)
    assert task.count_labels(unmasked) != task.count_labels(row["labels"])


# ------------------------------------------------------------------------------------------ packing
def test_best_fit_decreasing_keeps_every_sample_once_under_the_budget():
    lengths = [9, 3, 7, 5, 2, 8, 1, 6]
    bins = packing.best_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 5  # 41 tokens: at least 5 bins of 10
    assert packing.best_fit_decreasing([12, 3], 10) == [[0], [1]]  # longer than the budget: alone
    # balanced: the same 2 rows as best fit decreasing under 16 tokens ({10, 5}, {7, 2}), but 12 + 12
    rows = packing.balanced_rows([10, 2, 7, 5], 16)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3] and len(packing.best_fit_decreasing([10, 2, 7, 5], 16)) == 2
    assert sorted(sum([10, 2, 7, 5][i] for i in r) for r in rows) == [12, 12]


def test_packer_repacks_only_the_window_samples(tiny_llama, clm_texts):
    """window_bfd: the window's samples, each once, in micro-batches under the budget; items equal."""
    task = CausalLM()
    padded, _ = _padded_and_row(tiny_llama, clm_texts, n=8)
    window = [{k: v[i:i + 2] for k, v in padded.items()} for i in range(0, 8, 2)]
    row = int(padded["attention_mask"].sum(dim=1).max()) + 8
    for budget, rows in [(row, 1), (3 * row, 3)]:  # one row per micro-batch; up to three rows
        runs = packing.Packer("window_bfd", budget, row_length=row, pad_token_id=-1)(window)
        assert all(r["input_ids"].numel() <= budget for r in runs) and max(len(r["input_ids"]) for r in runs) == rows
        assert sum(window_tokens(r)[0] for r in runs) == int(padded["attention_mask"].sum())
        assert sum(task.count_labels(r["labels"]) for r in runs) == task.count_labels(padded["labels"])
        assert sorted(tuple(s["input_ids"].tolist()) for r in runs for s in _split(r)) == \
            sorted(tuple(s["input_ids"].tolist()) for s in packing.unpad(padded))


def test_packer_exact_keeps_the_window_micro_batch_count(tiny_llama, clm_texts):
    """exact (the Trainer backend): as many micro-batches as the window, rows shared out evenly, an empty
    micro-batch (no item, one padding position) where the window packs into fewer rows."""
    task = CausalLM()
    padded, _ = _padded_and_row(tiny_llama, clm_texts, n=8)
    window = [{k: v[i:i + 2] for k, v in padded.items()} for i in range(0, 8, 2)]
    width = padded["input_ids"].shape[1]
    runs = packing.Packer("window_bfd", 8 * width, row_length=8 * width, exact=True)(window)  # one row of all 8
    assert len(runs) == 4 and [len(r["input_ids"]) for r in runs] == [1, 1, 1, 1]
    assert [window_tokens(r) for r in runs[1:]] == [(0, 1)] * 3
    assert sum(task.count_labels(r["labels"]) for r in runs) == task.count_labels(padded["labels"])
    assert packing.group_rows([5, 9, 7, 3, 8], budget=0, count=2) == [[1, 4, 2], [0, 3]]


def test_sharding_engines_pack_exactly(tiny_llama, clm_texts):
    """Under FSDP and DeepSpeed the packer keeps every window's micro-batch count, so processes whose windows pack
    into different numbers of rows still run as many micro-batches (FSDP gathers on each); DDP packs into as few
    as fit."""
    from types import SimpleNamespace

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    config = SimpleNamespace(padding_free=False, packing=True, packing_strategy="window_bfd", max_length=48,
                             block_size=None, max_tokens_per_micro_batch=None, per_device_train_batch_size=2)
    padded, _ = _padded_and_row(tiny_llama, clm_texts, n=8)
    window = [{k: v[i:i + 2] for k, v in padded.items()} for i in range(0, 8, 2)]
    from accelerate.utils import DistributedType

    from finetune.engine import engine_class

    for engine, exact in [("FSDP", True), ("DEEPSPEED", True), ("MULTI_CPU", False), ("NO", False)]:
        pack = packing.packer_for(config, CausalLM(), model, engine_class(DistributedType[engine]))
        assert pack.exact is exact, engine
        runs = pack(window)
        assert (len(runs) == len(window)) if exact else (len(runs) < len(window)), (engine, len(runs))
    with pytest.raises(FinetuneError, match="--max_tokens_per_micro_batch is not used under FSDP"):
        packing.packer_for(SimpleNamespace(**{**vars(config), "max_tokens_per_micro_batch": 96}), CausalLM(), model,
                           engine_class(DistributedType.FSDP))


ONE_ROW_ATTENTION = "test_one_row_packing_attention"  # registered with transformers' AttentionInterface below


def _flash_like_attention(module, query, key, value, attention_mask, **kwargs):
    """What transformers 5.24's ``flash_attention_2`` computes, computed with SDPA so a CPU runs it: a packed row's
    samples kept apart only in a batch of one row (``modeling_flash_attention_utils.py`` line 855 calls
    ``_is_packed_sequence``, line 574: ``batch_size != 1`` is not packed), otherwise causal attention over the whole
    row (``flash_attn_func(causal=True)`` when there is no mask). A name outside ``AttentionMaskInterface`` gets no
    mask (``masking_utils.py`` line 830, early exit), as ``flash_attention_mask`` gives None without padding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    position_ids, mask = kwargs.get("position_ids"), None
    if _is_packed_sequence(position_ids, query.shape[0]):
        sample = torch.cumsum(position_ids[0] == 0, 0)  # which sample each position belongs to
        causal = torch.ones(len(sample), len(sample), dtype=torch.bool, device=query.device).tril()
        mask = (causal & (sample[:, None] == sample[None, :]))[None, None]
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, mask, is_causal=mask is None, **kwargs)


@pytest.fixture
def one_row_attention():
    from transformers import AttentionInterface

    AttentionInterface.register(ONE_ROW_ATTENTION, _flash_like_attention)
    return ONE_ROW_ATTENTION


def test_attention_that_separates_only_one_row_packs_one_row_per_micro_batch(tiny_llama, clm_texts,
                                                                              one_row_attention):
    """An attention that keeps packed samples apart only in a one-row batch (flash_attention_2's rule, faked on a
    CPU) fails the two-row layout and passes the one-row one: --padding_free runs, and --packing runs each
    micro-batch's rows as one row (said on the banner), with every sample once; with SDPA, several rows."""
    from types import SimpleNamespace

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation=one_row_attention)
    differences = packing.layout_differences(model, packing.check_samples(model.config.vocab_size))
    assert differences["one_row"] < 1e-5 and differences["rows"] > 1e-3  # the fake mixes rows as FA2 would
    assert packing.separated_layouts(model)[0] == ("one_row",)
    config = SimpleNamespace(padding_free=False, packing=True, packing_strategy="window_bfd", max_length=48,
                             block_size=None, max_tokens_per_micro_batch=None, per_device_train_batch_size=4)
    padded, _ = _padded_and_row(tiny_llama, clm_texts, n=8)
    window = [{k: v[i:i + 4] for k, v in padded.items()} for i in range(0, 8, 4)]
    pack = packing.packer_for(config, CausalLM(), model)
    assert pack.one_row and "one row" in pack.note and pack.eval_row_length is None
    runs = pack(window)
    assert all(r["input_ids"].shape[0] == 1 for r in runs) and len(runs) < len(window)
    assert sorted(s["input_ids"].tolist() for s in unpad_all(runs)) == \
        sorted(s["input_ids"].tolist() for b in window for s in packing.unpad(b))
    assert packing.packer_for(SimpleNamespace(**{**vars(config), "packing": False, "padding_free": True}),
                              CausalLM(), model).one_row
    sdpa = packing.packer_for(config, CausalLM(), AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32))
    assert not sdpa.one_row and sdpa.note is None and max(r["input_ids"].shape[0] for r in sdpa(window)) > 1


def unpad_all(runs):
    """The samples of one-row micro-batches, cut where positions restart."""
    found = []
    for run in runs:
        ids, positions = run["input_ids"][0], run["position_ids"][0]
        starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
        found += [{"input_ids": ids[a:b]} for a, b in zip(starts, starts[1:])]
    return found


def _split(batch):
    """The samples of a packed micro-batch built with pad_token_id -1: each row cut where positions restart,
    its padding dropped."""
    found = []
    for ids, positions in zip(batch["input_ids"], batch["position_ids"]):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
        found += [{"input_ids": ids[a:b][ids[a:b] != -1]} for a, b in zip(starts, starts[1:])]
    return found


def test_classification_keeps_padded_micro_batches(tiny_bert, tmp_path):
    with pytest.raises(FinetuneError, match="--padding_free is for causal LM and SFT"):
        run_in_process(tmp_path, "cls", model_name_or_path=tiny_bert, max_train_samples=8, max_steps=1,
                       padding_free=True)


# ------------------------------------------------------------------------------------------ per step
CLM = dict(recipe="bbc-news-clm", num_train_epochs=1, disable_dropout=True, max_length=64, learning_rate=1e-3,
           seed=3, warmup_steps=0, eval_strategy="no", max_train_samples=40)


def _relative(a: dict, b: dict) -> float:
    diff = sum(float((a[k] - b[k]).double().norm() ** 2) for k in a) ** 0.5
    return diff / sum(float(b[k].double().norm() ** 2) for k in b) ** 0.5


def test_padding_free_and_packed_runs_give_the_padded_weights(tmp_path, tiny_llama, clm_texts, monkeypatch):
    """40 samples, 8 per step: padded 8 x 1; padding-free 2 x 4 (both backends); packed under a 96-position budget
    (several one-row micro-batches per step), at its default budget (8 rows of --max_length 64: micro-batches of
    several padded rows) and in the Trainer backend (2 x 4: four micro-batches per step, as Trainer counts them)
    take the same 5 optimizer steps: same samples, items and losses per step, and the same weights to float
    rounding (relative norm of the whole difference; Adam turns rounding noise on zero-gradient tensors into
    lr-sized steps, docs/verify.md#the-ways). The layout cost is fixed (attention alone: the packed rows), so that the
    packed runs run the rows on any machine."""
    from finetune.data import packing_cost

    monkeypatch.setattr(packing_cost, "measure", lambda *args, **kwargs: packing_cost.LayoutCost(0.0, 0.0, 1.0))
    kw = dict(model_name_or_path=tiny_llama, train_file=clm_texts[0], validation_file=clm_texts[1], **CLM)
    _, ref = run_in_process(tmp_path, "ref", per_device_train_batch_size=8, gradient_accumulation_steps=1, **kw)
    runs = {name: run_in_process(tmp_path, name, **flags, **kw)[1] for name, flags in [
        ("free", dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, padding_free=True)),
        ("packed", dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, packing=True,
                        max_tokens_per_micro_batch=96)),
        ("packed-rows", dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, packing=True)),
        ("trainer-free", dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, padding_free=True,
                              backend="trainer")),
        ("trainer-packed", dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, packing=True,
                                backend="trainer"))]}
    reference = train_steps(ref)
    for name, out in runs.items():
        steps = train_steps(out)
        assert [r["samples"] for r in steps] == [r["samples"] for r in reference] == [8] * 5, name
        assert [r["trained_tokens"] for r in steps] == [r["trained_tokens"] for r in reference], name
        assert [r["input_tokens"] for r in steps] == [r["input_tokens"] for r in reference], name
        assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in reference], rel=1e-5), name
        assert _relative(load_params(out), load_params(ref)) < 1e-5, name
        assert all(r["padded_tokens"] < p["padded_tokens"] for r, p in zip(steps, reference)), name
        if "free" in name:
            assert all(r["padded_tokens"] == r["input_tokens"] for r in steps), name  # no padding computed
    assert all(r["padded_tokens"] > r["input_tokens"] for r in reference)


def test_packed_run_with_one_row_attention_gives_the_padded_weights(tmp_path, tiny_llama, clm_texts,
                                                                      one_row_attention, capsys):
    """--attn_implementation with the flash_attention_2-like fake: the packed run (one row per micro-batch) and its
    padded reference (SDPA) train the same steps and weights, and the banner says why the rows run as one."""
    kw = dict(model_name_or_path=tiny_llama, train_file=clm_texts[0], validation_file=clm_texts[1], **CLM)
    _, ref = run_in_process(tmp_path, "ref", per_device_train_batch_size=8, gradient_accumulation_steps=1, **kw)
    capsys.readouterr()
    _, out = run_in_process(tmp_path, "packed", per_device_train_batch_size=8, gradient_accumulation_steps=1,
                            packing=True, attn_implementation=one_row_attention, **kw)
    assert "each micro-batch's rows run as one row" in capsys.readouterr().out
    steps, reference = train_steps(out), train_steps(ref)
    assert [r["trained_tokens"] for r in steps] == [r["trained_tokens"] for r in reference]
    assert all(r["padded_tokens"] == r["input_tokens"] for r in steps)  # one row: no padding computed
    assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    assert _relative(load_params(out), load_params(ref)) < 1e-5


def test_fp16_with_a_grad_scaler_packed_trains_as_padded(tmp_path, tiny_llama, clm_texts, faults):
    """fp16 autocast with a GradScaler (the CPU fp16 fault: what Accelerate gives a GPU), 5 steps of 8 samples:
    packed at the default budget (several rows per micro-batch) in the accelerate loop and packed in the Trainer
    backend (2 x 4) take the padded 8 x 1 run's steps (same samples and items, the same loss scale and no skip)
    and end closer to its weights than fp16 itself moves them (the padded run in fp32; measured: packed 1.1e-4,
    fp16 against fp32 2.0e-4, relative norms: a layout change moves fp16 rounding, as any change of attention
    shapes does), with losses within fp16's rounding."""
    faults.cpu_fp16()
    kw = dict(model_name_or_path=tiny_llama, train_file=clm_texts[0], validation_file=clm_texts[1], **CLM,
              mixed_precision="fp16")
    _, ref = run_in_process(tmp_path, "ref", per_device_train_batch_size=8, gradient_accumulation_steps=1, **kw)
    _, fp32 = run_in_process(tmp_path, "fp32", per_device_train_batch_size=8, gradient_accumulation_steps=1,
                             **{**kw, "mixed_precision": "no"})
    floor = _relative(load_params(fp32), load_params(ref))  # what fp16 itself changes
    reference = train_steps(ref)
    assert all("loss_scale" in r for r in reference)  # fp16 with a scaler really ran
    for name, flags in [("packed", dict(per_device_train_batch_size=8, gradient_accumulation_steps=1)),
                        ("trainer-packed", dict(per_device_train_batch_size=2, gradient_accumulation_steps=4,
                                                backend="trainer"))]:
        _, out = run_in_process(tmp_path, name, packing=True, **flags, **kw)
        steps = train_steps(out)
        assert [r["trained_tokens"] for r in steps] == [r["trained_tokens"] for r in reference], name
        assert [(r["loss_scale"], r.get("skipped")) for r in steps] == \
            [(r["loss_scale"], r.get("skipped")) for r in reference], name
        assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in reference], rel=2e-3), name
        assert _relative(load_params(out), load_params(ref)) < floor, (name, floor)


def test_an_attention_implementation_transformers_refuses_is_one_line(tmp_path, tiny_llama, clm_texts):
    with pytest.raises(FinetuneError, match=r"^--attn_implementation no_such_attention: transformers cannot use it"):
        run_in_process(tmp_path, "bad", model_name_or_path=tiny_llama, train_file=clm_texts[0],
                       validation_file=clm_texts[1], attn_implementation="no_such_attention", **CLM)
    assert not (tmp_path / "bad").exists()


def test_two_processes_packed_equals_padded(tmp_path, tiny_llama, clm_texts):
    """DDP on 2 CPU processes through the real CLI: 36 samples, 2 x 2 per process per step (the last step holds
    4 samples and 4 masked repeats), padded, padding-free and packed in both backends, each against the padded
    B x 1 run (one process, 8 x 1) (packed in the accelerate
    loop under a 48-token budget, where the processes run different numbers of micro-batches per step; in the
    Trainer backend 2 micro-batches per step on each process): same samples, items, losses and weights. Each
    process all-reduces in exactly one backward per optimizer step, its last (DDP's comm hook observed by
    ``tests/faults`` ``install_sync_log``), and ends the process group in ``distributed.leave``
    (``install_leave_log``). The packed runs' layout cost is fixed (attention alone: the packed rows, whose count
    differs between the processes), not measured."""
    from helpers import fault_env, launch, leave_records

    common = ["--recipe", "bbc-news-clm", "--model_name_or_path", tiny_llama, "--train_file", clm_texts[0],
              "--validation_file", clm_texts[1], "--num_train_epochs", "1", "--disable_dropout", "True",
              "--max_length", "64", "--learning_rate", "1e-3", "--seed", "3", "--warmup_steps", "0",
              "--eval_strategy", "no", "--max_train_samples", "36", "--per_device_train_batch_size", "2",
              "--gradient_accumulation_steps", "2"]
    runs = {"padded": [], "padding-free": ["--padding_free", "True"],
            "packed": ["--packing", "True", "--max_tokens_per_micro_batch", "48"],
            "trainer-padding-free": ["--padding_free", "True", "--backend", "trainer"],
            "trainer-packed": ["--packing", "True", "--backend", "trainer"]}
    outs, backwards = {}, {}
    for name, extra in runs.items():
        outs[name], log = tmp_path / name, tmp_path / f"{name}-syncs"
        log.mkdir()
        result = launch(common + ["--output_dir", str(outs[name]), *extra], num_processes=2, timeout=900,
                        env=fault_env(sync_log=str(log), leave_log=str(log), layout_cost="0,0,1"))
        assert result.returncode == 0, result.stderr[-3000:]
        # each process left the group once, its last owner gone with it (the model freed first: run.run)
        assert leave_records(log) == [{"group_started": True, "handle_alive": False}] * 2, name
        backwards[name] = [[json.loads(line) for line in (log / f"rank{r}.jsonl").read_text().splitlines()]
                           for r in (0, 1)]
        for rank in backwards[name]:  # all-reduced in a backward exactly when it ended an optimizer step
            assert [b["all_reduced"] for b in rank] == [b["sync_gradients"] for b in rank], name
            assert sum(b["all_reduced"] for b in rank) == 5 and rank[-1]["all_reduced"], name
    # the packed windows differ in micro-batch count between the processes (the case one sync each must hold for)
    assert len(backwards["packed"][0]) != len(backwards["packed"][1]) or \
        [b["sync_gradients"] for b in backwards["packed"][0]] != [b["sync_gradients"] for b in backwards["packed"][1]]
    # the padded B x 1 reference: one process, micro-batch 8, no accumulation
    outs["B x 1"] = tmp_path / "one-process"
    single = list(common)
    single[single.index("--per_device_train_batch_size") + 1] = "8"
    single[single.index("--gradient_accumulation_steps") + 1] = "1"
    result = launch(single + ["--output_dir", str(outs["B x 1"])], num_processes=1, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    padded = train_steps(outs["B x 1"])
    for name in runs:
        packed = train_steps(outs[name])
        assert [r["samples"] for r in packed] == [r["samples"] for r in padded] == [8, 8, 8, 8, 4], name
        assert [r["trained_tokens"] for r in packed] == [r["trained_tokens"] for r in padded], name
        assert [r["loss"] for r in packed] == pytest.approx([r["loss"] for r in padded], rel=1e-5), name
        assert _relative(load_params(outs[name]), load_params(outs["B x 1"])) < 1e-5, name


def test_the_sync_log_catches_an_all_reduce_in_every_backward(tmp_path, tiny_llama, clm_texts):
    """The mutant of the sync check above: a loop that all-reduces in every backward (``no_sync`` defeated; the
    weights are still right, so only the log can tell) is seen doing so on both processes. Padded micro-batches:
    where packing gives the processes different micro-batch counts, the mutant deadlocks instead (one process
    all-reduces more often than the other), which is why one sync per window matters."""
    from faults.mutants import MUTANT_ENV
    from helpers import fault_env, launch

    log = tmp_path / "syncs"
    log.mkdir()
    args = ["--recipe", "bbc-news-clm", "--model_name_or_path", tiny_llama, "--train_file", clm_texts[0],
            "--validation_file", clm_texts[1], "--max_length", "64", "--eval_strategy", "no", "--max_train_samples",
            "16", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--output_dir", str(tmp_path / "out")]
    result = launch(args, num_processes=2, timeout=900,
                    env={**fault_env(sync_log=str(log)), MUTANT_ENV: "sync-every-micro-batch"})
    assert result.returncode == 0, result.stderr[-3000:]
    for r in (0, 1):
        backwards = [json.loads(line) for line in (log / f"rank{r}.jsonl").read_text().splitlines()]
        assert sum(b["sync_gradients"] for b in backwards) == 2 < len(backwards)
        assert all(b["all_reduced"] for b in backwards)


def test_padding_free_evaluation_gives_the_padded_per_sample_outputs(tiny_llama, clm_texts):
    """evaluation.evaluate(padding_free=True) scores each sample from the packed row: the same per-sample summed
    losses and label tokens as the padded batch, so eval_loss and perplexity are the padded run's."""
    task, model = CausalLM(), AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    padded, _ = _padded_and_row(tiny_llama, clm_texts)
    labels = padded.pop("labels")
    with torch.no_grad():
        reference = task.eval_from_logits(model(**padded).logits, labels)
    longest = int(padded["attention_mask"].sum(dim=1).max())
    for row_length in (None, longest, 2 * longest):  # one row; one sample per row; rows of several
        outputs = packing.eval_outputs(model, padded, labels, task, row_length)
        torch.testing.assert_close(outputs[0], reference[0], rtol=1e-5, atol=1e-5)
        assert outputs[1].tolist() == reference[1].tolist()


@pytest.mark.parametrize("mutant", [False, True], ids=["packed", "first-label-not-masked"])
def test_verify_way_packed_against_padded(tmp_path, tiny_llama, clm_texts, monkeypatch, mutant):
    """``finetune verify --packing``: the packed way against the padded reference is exact; with the first
    label of each sample left in (a mutant of flatten) the same way is NOT EXACT. Verify's samples are 32
    tokens (--max_length 32) or fewer (the variable-length texts): rows of 32 tokens hold two or more of the
    short ones, so there are boundaries to contaminate."""
    from test_verify import run_verify

    if mutant:
        real = packing.flatten

        def unmasked(samples):
            row = real(samples)
            return {**row, "labels": torch.cat([s["labels"] for s in samples]).unsqueeze(0)}

        monkeypatch.setattr(packing, "flatten", unmasked)
    code, report = run_verify(tmp_path, "--recipe", "bbc-news-clm", "--model_name_or_path", tiny_llama,
                              "--train_file", clm_texts[0], "--validation_file", clm_texts[1], "--packing", "True")
    packed = [r for r in report["rows"] if r["role"] == "packed"]  # on both backends
    assert [r["way"] for r in packed] == ["2 x 2, packed", "2 x 2, packed, Trainer"]
    assert [r["engine"] for r in packed] == ["accelerate", "trainer"]
    if mutant:
        assert code == 1 and all(r["verdict"].startswith("NOT EXACT") for r in packed), packed
    else:
        assert code == 0 and all(r["verdict"] == "exact" for r in packed), packed


def test_check_data_packing_line_counts_steps_and_padding():
    """check-data's packing line: one step of 4 samples (10, 2, 7, 5 tokens), micro-batch 2: padded positions
    2 x 10 + 2 x 7 = 34 for 24 tokens (29.4% padding); window_bfd under 12 tokens: bins {10, 2}, {7, 5}."""
    from types import SimpleNamespace

    from finetune.commands.check_data import packing_line

    config = SimpleNamespace(train_sampling_strategy="random", seed=0, max_tokens_per_micro_batch=12,
                             per_device_train_batch_size=2, max_length=16, block_size=None, packing=True,
                             packing_strategy="window_bfd", padding_free=False, backend="accelerate")
    summary = packing.packing_summary([[10, 2, 7, 5]], 2, 12, "window_bfd", 16)
    assert summary["micro_batches_per_step"] == 2 and summary["max_tokens_per_micro_batch"] == 12
    assert summary["padding_fraction_before"] == pytest.approx(1 - 24 / 34)
    line = packing_line(config, [10, 2, 7, 5], 4)
    assert "2.0 micro-batches per step (max 2)" in line and "12 tokens per micro-batch" in line
    assert "29.4% of positions before, 0.0% after" in line
    assert "padded 34, packed rows 24, one padding-free row per micro-batch 24; each step's layout is chosen" in line
    # rows of 12 under a 24-position budget: both rows in one micro-batch, no padding
    assert packing.packing_summary([[10, 2, 7, 5]], 2, 24, "window_bfd", 12)["micro_batches_per_step"] == 1
    # rows {9}, {6}: one micro-batch of 2 x 9 positions holding 15 tokens
    assert packing.packing_summary([[9, 6]], 2, 18, "window_bfd", 9)["padding_fraction_after"] == pytest.approx(1 / 6)


def test_check_data_counts_the_steps_per_layout_by_the_kept_cost(tmp_path):
    """``packing_summary`` with a cost chooses each step's layout as the packer does. One step of 9, 6, 1, 1 tokens,
    micro-batch 2 (padded [9, 6] and [1, 1]: 20 positions, 164 scores), rows of 9 under 18 positions: packed rows
    [9] and [6, 1, 1], one (2, 9) micro-batch (18 positions, 162 scores); as one row, 17 positions and 289 scores;
    the micro-batches flattened, rows of 15 and 2 (17 positions, 229 scores). With ``packing_cost.json`` in
    ``--output_dir``, check-data's line says it read that cost and counts the steps per layout."""
    from types import SimpleNamespace

    from finetune.commands.check_data import packing_line
    from finetune.data import packing_cost

    def layouts(*cost):
        summary = packing.packing_summary([[9, 6, 1, 1]], 2, 18, "window_bfd", 9, cost=packing_cost.LayoutCost(*cost))
        assert summary["positions"] == {"padded": 20, "rows": 18, "padding_free": 17}
        return [name for name, n in summary["layouts"].items() if n]

    assert layouts(0.0, 0.0, 1.0) == ["rows"]  # attention alone: 162 < 164 < 229 < 289
    assert layouts(0.0, 1.0, 0.01) == ["padding_free"]  # 17 + 2.29 < 18 + 1.62 < 17 + 2.89
    assert layouts(0.0, 1.0, 0.0) == ["one_row"]  # positions alone: 17 = 17 < 18, the tie to one_row
    assert layouts(1.0, 0.0, 0.0) == ["one_row"]  # a micro-batch dear: 1 = 1 < 2, the tie to fewer positions
    # equal lengths pad nothing: packing [8, 8] rows only lengthens them (512 scores against the padded 256)
    equal = packing.packing_summary([[8, 8, 8, 8]], 2, 32, "window_bfd", 16, cost=packing_cost.LayoutCost(0.0, 0.0, 1.0))
    assert [name for name, n in equal["layouts"].items() if n] == ["padded"] and equal["padding_fraction_after"] == 0
    packing_cost.save(tmp_path, packing_cost.LayoutCost(0.0, 1.0, 0.0))
    config = SimpleNamespace(train_sampling_strategy="random", seed=0, max_tokens_per_micro_batch=18,
                             per_device_train_batch_size=2, max_length=9, block_size=None, packing=True,
                             packing_strategy="window_bfd", padding_free=False, backend="accelerate",
                             output_dir=str(tmp_path))
    line = packing_line(config, [9, 6, 1, 1], 4)
    assert f"steps per layout by the cost kept in {tmp_path / packing_cost.FILE}" in line
    assert line.endswith("rows 0, one row 1, padding free 0, padded 0")
    assert "one padding-free row per micro-batch 17" in line


def test_packed_with_lora_and_activation_checkpointing_gives_the_padded_adapter(tmp_path, tiny_llama, clm_texts):
    """LoRA (r 4) with activation checkpointing and the chunked loss (16 label tokens per chunk): packed 8 x 1
    (96-token budget) trains the padded run's adapter (the same per-step losses; adapter weights within 1e-5 of
    their norm)."""
    from safetensors.torch import load_file

    kw = dict(model_name_or_path=tiny_llama, train_file=clm_texts[0], validation_file=clm_texts[1], **CLM,
              use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, activation_checkpointing=True,
              loss_chunk_size=16, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    _, ref = run_in_process(tmp_path, "ref", **kw)
    _, packed = run_in_process(tmp_path, "packed", packing=True, max_tokens_per_micro_batch=96, **kw)
    assert [r["loss"] for r in train_steps(packed)] == pytest.approx([r["loss"] for r in train_steps(ref)], rel=1e-5)
    a, b = load_file(str(packed / "adapter_model.safetensors")), load_file(str(ref / "adapter_model.safetensors"))
    assert _relative(a, b) < 1e-5


def test_the_planner_sizes_the_packing_budget_with_the_plan_micro_batch():
    """The token budget is the micro-batch's lever under --packing: m x --max_length positions for the plan's m
    (the padded micro-batch's most, which the planner's memory probe measured), or the user's own."""
    from types import SimpleNamespace

    from finetune.commands.plan import packing_budget_note
    from finetune.config import parse_config
    from finetune.planner import packing_budget

    config = parse_config(["--recipe", "bbc-news-clm", "--packing", "True", "--max_length", "64",
                           "--per_device_train_batch_size", "8"])
    assert packing_budget(config, SimpleNamespace(per_device_train_batch_size=3)) == 3 * 64
    assert packing_budget_note(config).startswith("--packing: 512 positions per micro-batch (micro-batch 8 x "
                                                  "--max_length 64")
    own = parse_config(["--recipe", "bbc-news-clm", "--packing", "True", "--max_tokens_per_micro_batch", "100"])
    assert packing_budget(own, SimpleNamespace(per_device_train_batch_size=3)) == 100
    assert "100 positions per micro-batch (--max_tokens_per_micro_batch)" in packing_budget_note(own)


def test_a_token_budget_under_the_trainer_backend_is_refused_with_one_line():
    """Trainer keeps a window's N micro-batches, so a budget would go unused: one error line names the fix."""
    from finetune.config import parse_config

    with pytest.raises(FinetuneError, match="--max_tokens_per_micro_batch is for --backend accelerate") as raised:
        parse_config(["--recipe", "bbc-news-clm", "--packing", "True", "--backend", "trainer",
                      "--max_tokens_per_micro_batch", "100"]).validate()
    assert "\n" not in str(raised.value)


# ------------------------------------------------------------------------------------------ the layout per window
def test_the_cost_fit_recovers_known_coefficients_and_never_goes_negative():
    """``packing_cost._fit``: probe times made from known coefficients give them back; times that a negative term
    would fit best give a fit with every term >= 0."""
    from finetune.data.packing_cost import LayoutCost, _fit, probe_shapes

    truth = LayoutCost(0.02, 3e-5, 4e-8)
    shapes = probe_shapes(512, 8 * 512)
    features = [(1.0, rows * per * n, rows * (per * n) ** 2) for rows, per, n in shapes]
    seconds = [truth.seconds([per * n] * rows) for rows, per, n in shapes]
    fitted = _fit(features, seconds)
    assert fitted == pytest.approx((truth.per_micro_batch, truth.per_position, truth.per_score), rel=1e-6)
    assert min(_fit(features, [1.0 - 1e-4 * f[1] for f in features])) >= 0.0


def _window(tiny_llama, clm_texts, n=8, m=4):
    padded, _ = _padded_and_row(tiny_llama, clm_texts, n=n)
    return padded, [{k: v[i:i + m] for k, v in padded.items()} for i in range(0, n, m)]


# The window (the first 8 texts at max_length 48, micro-batches of 4): samples of 7, 48, 23, 10 | 7, 23, 4, 15 tokens.
# Packed rows: 48, 46, 43 tokens in one micro-batch of 3 x 48 positions (6,912 scores); one row of those: 137 positions
# (18,769 scores); the window's micro-batches flattened: rows of 88 and 49 (10,145 scores), two micro-batches.
@pytest.mark.parametrize("cost, layout", [
    ((0.0, 1e-6, 1e-3), "rows"),          # attention dear: the shortest rows
    ((0.0, 1.0, 1e-4), "padding_free"),   # positions dear, attention a little: no padding, rows of one micro-batch
    ((1.0, 1e-6, 0.0), "one_row"),        # a micro-batch dear, attention free: fewest micro-batches, no padding
    ((0.0, 1.0, 0.0), "one_row"),         # positions alone: no padding; the tie with padding_free goes to one_row
])
def test_packer_runs_each_window_in_the_layout_its_cost_predicts_fastest(tiny_llama, clm_texts, cost, layout):
    """With a cost, ``--packing`` runs the layout the cost predicts fastest, with the window's samples and label
    tokens in every layout; the padding-free layout never computes more positions than the window's tokens."""
    from finetune.data.packing_cost import LayoutCost

    task = CausalLM()
    padded, window = _window(tiny_llama, clm_texts)
    row = int(padded["attention_mask"].sum(dim=1).max())
    pack = packing.Packer("window_bfd", 4 * row, row_length=row, pad_token_id=-1, cost=LayoutCost(*cost))
    runs = pack(window)
    assert pack.layouts[layout] == 1 and sum(pack.layouts.values()) == 1
    assert sum(task.count_labels(r["labels"]) for r in runs) == task.count_labels(padded["labels"])
    samples = unpad_all(runs) if layout != "rows" else [s for r in runs for s in _split(r)]
    assert sorted(s["input_ids"].tolist() for s in samples) == sorted(s["input_ids"].tolist() for s in packing.unpad(padded))
    if layout == "padding_free":
        assert len(runs) == len(window) and sum(r["input_ids"].numel() for r in runs) == int(padded["attention_mask"].sum())


def test_packed_rows_win_where_rows_are_cheap_and_are_never_taken_above_the_padded_positions(tiny_llama, clm_texts):
    """A cost where a micro-batch is dear and attention dearer picks the packed rows; the same window with rows whose
    positions exceed the padded window's never gets them, whatever the cost says."""
    from finetune.data.packing_cost import LayoutCost

    padded, window = _window(tiny_llama, clm_texts)
    row = int(padded["attention_mask"].sum(dim=1).max())
    rows_cost = LayoutCost(10.0, 0.0, 1e-3)
    pack = packing.Packer("window_bfd", 4 * row, row_length=row, pad_token_id=-1, cost=rows_cost)
    pack(window)
    assert pack.layouts["rows"] == 1
    lengths = [int(b["attention_mask"].sum()) for b in window]
    groups = [[0], [1]]
    assert pack.choose(window, [sum(lengths) + 10 ** 6, 1], groups) != "rows"  # more positions than padded


def test_the_measured_cost_is_kept_in_the_output_dir_and_read_back(tiny_llama, clm_texts, tmp_path, monkeypatch):
    """``packer_for`` with the run's loss measures the cost on the model (every coefficient >= 0, five probes; the
    model's weights, gradients and the RNG untouched) and says it on the banner; ``keep`` writes it to
    ``packing_cost.json``; a resumed run in that output directory reads it back without measuring, so it chooses
    every window's layout as the first did; a fresh run, or another row length, measures anew."""
    from types import SimpleNamespace

    from finetune.data import packing_cost

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    config = SimpleNamespace(padding_free=False, packing=True, packing_strategy="window_bfd", max_length=48,
                             block_size=None, max_tokens_per_micro_batch=None, per_device_train_batch_size=4,
                             output_dir=str(tmp_path))
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    pack = packing.packer_for(config, CausalLM(), model, loss_sum=CausalLM().loss_sum)
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    cost = pack.cost
    assert len(cost.probes) == 5 and min(cost.per_micro_batch, cost.per_position, cost.per_score) >= 0
    assert "measured cost" in pack.note and not (tmp_path / packing_cost.FILE).exists()
    pack.keep(tmp_path)  # the backends, once the output directory is prepared
    assert packing_cost.load(tmp_path, cost.key) == cost
    _, window = _window(tiny_llama, clm_texts)
    first = pack.choose(window, *_rows_and_groups(pack, window))

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(packing_cost, "measure", no_measuring)
    resumed = SimpleNamespace(**{**vars(config), "resume_from_checkpoint": "latest"})
    again = packing.packer_for(resumed, CausalLM(), model, loss_sum=CausalLM().loss_sum)
    assert again.cost == cost and again.choose(window, *_rows_and_groups(again, window)) == first
    for fresh in (config, SimpleNamespace(**{**vars(resumed), "max_length": 32})):  # a fresh run; another row length
        with pytest.raises(AssertionError, match="measured again"):
            packing.packer_for(fresh, CausalLM(), model, loss_sum=CausalLM().loss_sum)


def test_the_layout_probes_are_shortened_to_cost_seconds_whatever_the_precision(tiny_llama, monkeypatch):
    """Issue 50: the layout probes ran at the run's row length whatever a pass cost (emulated bf16 on a CPU without
    bf16 instructions: hundreds of times fp32's). The first probe's time now predicts the others', and rows are
    shortened in proportion where they would exceed ``PROBE_SECONDS``; the fit still gives every coefficient."""
    from finetune.data import packing_cost

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    monkeypatch.setattr(packing_cost, "PROBE_SECONDS", 0.0, raising=False)  # every pass too dear: the shortest rows
    cost = packing_cost.measure(model, CausalLM().loss_sum, 48, 4 * 48, "bf16")
    assert len(cost.probes) == 5 and max(tokens for _, tokens, _, _ in cost.probes) == 2 * 8  # MIN_PROBE_TOKENS
    assert min(cost.per_micro_batch, cost.per_position, cost.per_score) >= 0 and "rows<=48" in cost.key
    # the five probes hold 13 times the first one's positions: 10 s for the first predicts 130 s, so 3 s of probes
    # take rows of 512 x 3 / 130 = 11 tokens; a fast first probe keeps the run's rows
    assert packing_cost.probe_length(512, 4096, first_seconds=10.0, seconds=3.0) == 11
    assert packing_cost.probe_length(512, 4096, first_seconds=0.01, seconds=3.0) == 512
    assert packing_cost.probe_length(512, 4096, first_seconds=1e4, seconds=3.0) == packing_cost.MIN_PROBE_TOKENS


def _rows_and_groups(pack, window):
    samples = [s for batch in window for s in packing.unpad(batch)]
    lengths = [sum(len(samples[i]["input_ids"]) for i in b)
               for b in packing.balanced_rows([len(s["input_ids"]) for s in samples], pack.row_length)]
    return lengths, packing.group_rows(lengths, pack.budget, None)


def test_a_packed_run_resumed_chooses_its_layouts_as_before_and_ends_bit_identical(tmp_path, tiny_llama, clm_texts,
                                                                                   monkeypatch):
    """A --packing run stopped by SIGTERM during step 3 and resumed ends with the uninterrupted run's losses and
    weights bit for bit: the resume reads the cost the run kept (``packing_cost.json``) and does not measure,
    though a new measurement here would choose other layouts. The mutant that drops the kept cost before the
    resume measures anew, runs other layouts and does not end bit-identical."""
    from helpers import stop_during_window

    import finetune.backends.accelerate as backend
    from finetune.data import packing_cost
    from finetune.errors import TrainingStopped

    rows = packing_cost.LayoutCost(0.0, 0.0, 1.0)  # attention alone: the short packed rows
    one_row = packing_cost.LayoutCost(1.0, 1e-6, 0.0)  # a micro-batch dear: one row per micro-batch, fewest
    measured = []

    def measure_as(cost):
        def measure(*args, **kwargs):
            measured.append(cost)
            return cost
        monkeypatch.setattr(packing_cost, "measure", measure)

    kw = dict(model_name_or_path=tiny_llama, train_file=clm_texts[0], validation_file=clm_texts[1], packing=True,
              per_device_train_batch_size=4, gradient_accumulation_steps=2, max_tokens_per_micro_batch=128,
              checkpointing_steps=1, **CLM)
    measure_as(rows)
    _, full = run_in_process(tmp_path, "full", **kw)
    for name in ("killed", "mutant"):
        original = stop_during_window(monkeypatch, index=2)
        with pytest.raises(TrainingStopped):
            run_in_process(tmp_path, name, **kw)
        monkeypatch.setattr(backend, "iter_windows", original)
    assert measured == [rows] * 3
    measure_as(one_row)  # what the resume would choose by, were it to measure
    _, killed = run_in_process(tmp_path, "killed", resume_from_checkpoint="latest", **kw)
    assert measured == [rows] * 3  # read back, not measured
    assert [r["loss"] for r in train_steps(killed)] == [r["loss"] for r in train_steps(full)]
    full_params, killed_params = load_params(full), load_params(killed)
    assert all(torch.equal(full_params[k], killed_params[k]) for k in full_params)
    (tmp_path / "mutant" / packing_cost.FILE).unlink()
    _, mutant = run_in_process(tmp_path, "mutant", resume_from_checkpoint="latest", **kw)
    assert measured == [rows] * 3 + [one_row]
    after = [(r["padded_tokens"], r["input_tokens"]) for r in train_steps(mutant)][3:]
    assert all(padded == tokens for padded, tokens in after)  # one row per micro-batch: no padding computed
    assert any(r["padded_tokens"] > r["input_tokens"] for r in train_steps(full)[3:])  # the kept rows pad
    mutant_params = load_params(mutant)
    assert not all(torch.equal(full_params[k], mutant_params[k]) for k in full_params)


def test_a_window_kept_padded_trains_exactly_as_the_padded_run(tmp_path, tiny_llama, clm_texts, monkeypatch):
    """Where the cost keeps every window padded (``choose_layout`` made to say so), a --packing run is the padded
    run bit for bit: the same micro-batches reach the loop (attention mask, no position ids), in both backends."""
    monkeypatch.setattr(packing, "choose_layout", lambda *args: ("padded", {}))
    kw = dict(model_name_or_path=tiny_llama, train_file=clm_texts[0], validation_file=clm_texts[1],
              per_device_train_batch_size=4, gradient_accumulation_steps=2, **CLM)
    for backend in ("accelerate", "trainer"):
        _, ref = run_in_process(tmp_path, f"ref-{backend}", backend=backend, **kw)
        _, packed = run_in_process(tmp_path, f"packed-{backend}", backend=backend, packing=True, **kw)
        assert [r["loss"] for r in train_steps(packed)] == [r["loss"] for r in train_steps(ref)], backend
        assert [r["padded_tokens"] for r in train_steps(packed)] == [r["padded_tokens"] for r in train_steps(ref)]
        a, b = load_params(packed), load_params(ref)
        assert all(torch.equal(a[k], b[k]) for k in a), backend
