"""A mixture-of-experts model's router load-balancing loss is trained: with one micro-batch the micro-batch loss
divided by its items is the model's own loss (cross-entropy + router_aux_loss_coef x aux_loss), in the plain and
the chunked loss; each micro-batch's auxiliary term counts by its items; a model without one is unchanged. And
the DeepSpeed engine reads the fp32 master weights through ``deepspeed.utils.safe_get_full_fp32_param``."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from accelerate import Accelerator
from tiny_models import build_tiny_moe
from transformers import AutoModelForCausalLM

from finetune.config import parse_config
from finetune.tasks import CausalLM, auxiliary_loss_sum
from finetune.tasks.loss import loss_function


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(build_tiny_moe(tmp_path_factory.mktemp("mixtral"), "mixtral"))


def batch(seed=0, rows=3, length=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 900, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # a padded row
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


@pytest.mark.parametrize("chunk", ["0", "4"])
def test_one_micro_batch_trains_the_models_own_loss(mixtral, chunk):
    config = parse_config(["--recipe", "bbc-news-clm", "--loss_chunk_size", chunk])
    task = CausalLM()
    loss = loss_function(task, config, Accelerator(cpu=True))
    inputs, labels = batch()
    ours = loss(mixtral, {**inputs, "labels": labels}) / task.count_labels(labels)
    own = mixtral(**inputs, labels=labels).loss  # transformers: CE (mean over label tokens) + coef x aux_loss
    assert float(ours.detach()) == pytest.approx(float(own.detach()), rel=1e-5)
    without = task.loss_from_logits(mixtral(**inputs).logits, labels) / task.count_labels(labels)
    assert abs(float(ours.detach()) - float(without.detach())) > 1e-3  # the auxiliary term is really in it (coef 0.1)


def test_each_micro_batch_term_is_weighted_by_its_items(mixtral):
    task = CausalLM()
    inputs, labels = batch()
    outputs = mixtral(**inputs)
    term = auxiliary_loss_sum(outputs, mixtral, task.count_labels(labels))
    items = float(task.count_labels(labels))
    assert float(term.detach()) == pytest.approx(0.1 * float(outputs.aux_loss.detach()) * items, rel=1e-6)
    no_aux = types.SimpleNamespace(aux_loss=None)
    assert auxiliary_loss_sum(no_aux, mixtral, task.count_labels(labels)) is None


def test_deepspeed_engine_reads_the_fp32_master_weights(monkeypatch):
    """deepspeed 0.19 ``utils/tensor_fragment.py``: ``safe_get_full_fp32_param(param)`` returns the whole fp32
    master of a (possibly partitioned) parameter; faked here, as DeepSpeed is not installed in CI."""
    from finetune.engine.deepspeed import DeepSpeedEngine

    masters = {"weight": torch.full((2, 2), 0.5, dtype=torch.float32)}
    module = torch.nn.Linear(2, 2, bias=False).to(torch.bfloat16)
    fake = types.ModuleType("deepspeed.utils")
    fake.safe_get_full_fp32_param = lambda param: masters["weight"] if param is module.weight else None
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    monkeypatch.setitem(sys.modules, "deepspeed.utils", fake)
    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)
    weights = engine.full_parameters(types.SimpleNamespace(module=module))
    assert list(weights) == ["weight"] and weights["weight"].dtype == torch.float32
    assert torch.equal(weights["weight"], masters["weight"])
