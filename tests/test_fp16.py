"""fp16 loss scaling through the real engines, on the CPU: overflow skips, unscaled clipping, the skip
guard, accumulation and the Trainer backend.

Accelerate runs fp32 when asked for fp16 on a CPU; the CPU fp16 fault of ``tests/faults`` (the ``faults``
fixture: ``finetune_faults.install_cpu_fp16``, which wraps ``Accelerator.__init__``) gives the Accelerator fp16
autocast and a ``torch.amp.GradScaler("cpu")``, so these tests run the same fp16 code as a GPU. fp16 matmuls
are ~50x slower than fp32 on a CPU: tiny BERT, a few steps.

Every test runs with both optimizers: with ``adamw_torch_fused`` GradScaler always calls the optimizer's
step (the fused kernel skips the update itself), so Accelerate's ``optimizer_step_was_skipped`` stays
False on an overflow (accelerate issue 4242); our skip detection also watches the loss scale drop.

A forced overflow multiplies one micro-batch's loss by 1e30: finite in fp32 (the loss is summed in
fp32), but its scaled gradients overflow fp16 in the autocast backward, as a real overflow does.
"""

from __future__ import annotations

import pytest
import torch
from helpers import load_params, run_in_process, train_steps

from finetune.errors import NumericalError

OPTIMS = pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])

# micro-batch 4 x accumulation 2 = 8 samples per optimizer step; 32 samples -> 4 steps per epoch. Warmup 2
# then linear decay over max_steps: every step has its own learning rate, so a held schedule shows.
RUN = dict(mixed_precision="fp16", max_train_samples=32, max_eval_samples=8, per_device_train_batch_size=4,
           gradient_accumulation_steps=2, max_steps=5, max_length=32, learning_rate=1e-3, warmup_steps=2,
           disable_dropout=True, eval_strategy="no", seed=3)
OVERFLOW = 1e30


@pytest.fixture(autouse=True)
def cpu_fp16(faults):
    faults.cpu_fp16()
    return faults


def test_the_fault_is_off_by_default_and_only_for_fp16(cpu_fp16):
    """Without the CPU fp16 fault, fp16 on a CPU stays fp32 (Accelerate's behaviour); with it, only an fp16
    Accelerator changes: autocast measures fp16, and ``prepare()`` hands the scaler to the optimizer wrapper
    and wraps the forward in autocast."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from finetune.engine.precision import effective_mixed_precision

    def fresh(mixed_precision):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
        return Accelerator(mixed_precision=mixed_precision, cpu=True)

    cpu_fp16.undo()
    accelerator = fresh("fp16")
    assert accelerator.scaler is None and not accelerator.native_amp
    assert effective_mixed_precision(accelerator) == "no"
    cpu_fp16.cpu_fp16()
    for other in ("no", "bf16"):
        accelerator = fresh(other)
        assert accelerator.scaler is None and effective_mixed_precision(accelerator) == other
    accelerator = fresh("fp16")
    assert accelerator.native_amp and isinstance(accelerator.scaler, torch.amp.GradScaler)
    assert effective_mixed_precision(accelerator) == "fp16"
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert optimizer.scaler is accelerator.scaler
    seen = []
    net[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    assert model(torch.ones(2, 4)).dtype == torch.float32 and seen == [torch.float16]  # fp16 inside, fp32 out


def overflow_on(monkeypatch, micro_batches) -> None:
    """Make the 1-based training micro-batches in ``micro_batches`` (counted over the run, both engines)
    overflow fp16: their summed loss is multiplied by ``OVERFLOW``."""
    from finetune.tasks import SequenceClassification

    original = SequenceClassification.loss_from_logits
    calls = {"n": 0}

    def loss_sum(self, logits, labels):
        loss = original(self, logits, labels)
        if torch.is_grad_enabled():  # training forward passes only
            calls["n"] += 1
            if calls["n"] in micro_batches:
                return loss * OVERFLOW
        return loss

    monkeypatch.setattr(SequenceClassification, "loss_from_logits", loss_sum)


def record_weights(monkeypatch, backend: str = "accelerate") -> list[dict]:
    """Snapshots of the trainable weights: [before training, after step 1, after step 2, ...]."""
    snapshots = []

    def snapshot(model):
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})

    if backend == "accelerate":
        import finetune.backends.accelerate as engine

        setup, end_step = engine.setup, engine.Loop.end_step

        def recording_setup(*args, **kwargs):
            s = setup(*args, **kwargs)
            snapshot(s.model)
            return s

        def recording_end_step(self, *args, **kwargs):
            snapshot(self.built.model)
            return end_step(self, *args, **kwargs)

        monkeypatch.setattr(engine, "setup", recording_setup)
        monkeypatch.setattr(engine.Loop, "end_step", recording_end_step)
    else:
        from finetune.backends.trainer import BookkeepingCallback

        on_train_begin, on_step_end = BookkeepingCallback.on_train_begin, BookkeepingCallback.on_step_end

        def recording_begin(self, *args, **kwargs):
            snapshot(self.trainer.model)
            return on_train_begin(self, *args, **kwargs)

        def recording_step_end(self, *args, **kwargs):
            snapshot(self.trainer.model)
            return on_step_end(self, *args, **kwargs)

        monkeypatch.setattr(BookkeepingCallback, "on_train_begin", recording_begin)
        monkeypatch.setattr(BookkeepingCallback, "on_step_end", recording_step_end)
    return snapshots


def same_weights(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def assert_step_3_skipped(metrics, steps, weights) -> None:
    """Step 3 (micro-batches 5 and 6) overflowed: skipped, counted, weights and schedule held, scale halved;
    the steps around it trained normally."""
    assert metrics["mixed_precision"] == "fp16"  # the CPU fp16 fault really ran fp16 autocast
    assert metrics["skipped_optimizer_steps"] == 1
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r.get("skipped", False) for r in steps] == [False, False, True, False, False]
    scales = [r["loss_scale"] for r in steps]
    assert scales == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0]  # halved by the skip only (growth: 2000 steps)
    lrs = [r["learning_rate"] for r in steps]
    # linear warmup over 2 steps, then decay to 0 after step 5: 0, 5e-4, 1e-3, 2/3e-3, 1/3e-3 without a skip;
    # the skipped step 3 does not advance it, so step 4 uses step 3's rate and the schedule is one behind.
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 1e-3, 1e-3 * 2 / 3])
    assert len(weights) == 6  # before training, then after each of the 5 steps
    assert same_weights(weights[3], weights[2])  # the skipped step left the weights as they were
    assert not same_weights(weights[4], weights[3])  # and the next one trained (the check can fail)
    assert not same_weights(weights[2], weights[1])


@OPTIMS
def test_forced_overflow_skips_the_step(tmp_path, tiny_bert, monkeypatch, optim):
    overflow_on(monkeypatch, {5})  # the first (not the sync) micro-batch of step 3: carried by accumulation
    weights = record_weights(monkeypatch)
    metrics, out = run_in_process(tmp_path, "fp16", model_name_or_path=tiny_bert, optim=optim, **RUN)
    assert_step_3_skipped(metrics, train_steps(out), weights)


@OPTIMS
def test_trainer_backend_counts_a_forced_skip(tmp_path, tiny_bert, monkeypatch, optim):
    """The CPU fp16 fault reaches Trainer's own Accelerator (built in ``Trainer.__init__``, before ``train()``
    prepares the optimizer; fp16 asked for through ``training_arguments``), and the callback counts the
    skip; with the fused optimizer it also holds Trainer's schedule."""
    overflow_on(monkeypatch, {6})  # the sync micro-batch of step 3
    weights = record_weights(monkeypatch, backend="trainer")
    metrics, out = run_in_process(tmp_path, "trainer", backend="trainer", model_name_or_path=tiny_bert, optim=optim,
                                  **RUN)
    assert_step_3_skipped(metrics, train_steps(out), weights)


@OPTIMS
def test_clipping_sees_unscaled_gradients(tmp_path, tiny_bert, cpu_fp16, optim):
    """The logged grad norm is the pre-clip norm that clipping used: in fp16 it must be the unscaled
    gradient's, equal to the fp32 run's up to fp16 rounding, not 65536 (the initial loss scale) times it.

    Tolerance 1e-2 relative, at every step: fp16 keeps 11 significant bits (unit roundoff 2^-11 = 4.9e-4),
    and a 2-layer forward and backward accumulate a few such roundings, after step 1 also through slightly
    different weights. Measured: at most 3.3e-4. A scaled norm would be off by a factor of 65536.
    """
    kw = dict(RUN, max_steps=3, max_grad_norm=0.1)  # every norm is above 0.1: clipping acts
    metrics, fp16 = run_in_process(tmp_path, "fp16", model_name_or_path=tiny_bert, optim=optim, **kw)
    cpu_fp16.undo()
    reference, fp32 = run_in_process(tmp_path, "fp32", model_name_or_path=tiny_bert, optim=optim,
                                     **dict(kw, mixed_precision="no"))
    assert (metrics["mixed_precision"], reference["mixed_precision"]) == ("fp16", "no")
    norms16, norms32 = [r["grad_norm"] for r in train_steps(fp16)], [r["grad_norm"] for r in train_steps(fp32)]
    assert len(norms16) == 3 and all(n > kw["max_grad_norm"] for n in norms32)
    assert norms16 == pytest.approx(norms32, rel=1e-2)


@OPTIMS
def test_max_skipped_steps_stops_and_keeps_the_checkpoints(tmp_path, tiny_bert, monkeypatch, optim):
    """Steps 3, 4 and 5 overflow; --max_skipped_steps 2 tolerates two in a row and stops on the third with
    NumericalError naming step 5. Checkpoints (every step) up to step 4 are complete; the skipped steps'
    ones hold step 2's weights and the halved scale; nothing of step 5 and no final model is written."""
    overflow_on(monkeypatch, set(range(5, 100)))
    with pytest.raises(NumericalError, match=r"skipped 3 optimizer steps in a row \(up to step 5\)"):
        run_in_process(tmp_path, "guard", model_name_or_path=tiny_bert, optim=optim, max_skipped_steps=2,
                       save_strategy="steps", save_steps=1, **dict(RUN, max_steps=8))
    out = tmp_path / "guard"
    steps = train_steps(out)
    assert [r.get("skipped", False) for r in steps] == [False, False, True, True, True]
    assert [r["loss_scale"] for r in steps] == [65536.0, 65536.0, 32768.0, 16384.0, 8192.0]
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [f"step_{k:08d}" for k in (1, 2, 3, 4)]
    assert all((root / f"step_{k:08d}" / "COMPLETE").is_file() for k in (1, 2, 3, 4))
    good = load_params(root / "step_00000002")
    assert all(torch.equal(load_params(root / f"step_{k:08d}")[n], good[n]) for k in (3, 4) for n in good)
    assert not torch.equal(load_params(root / "step_00000001")["classifier.weight"], good["classifier.weight"])
    assert torch.load(root / "step_00000004" / "scaler.pt")["scale"] == 16384.0  # a resume keeps the scale
    assert not (out / "model.safetensors").exists()


@OPTIMS
def test_accumulation_2x4_equals_8x1_in_fp16(tmp_path, tiny_bert, monkeypatch, optim):
    """Micro-batch 2 x accumulation 4 and 8 x 1 see the same 8 samples per step; in fp16 their final weights
    differ only by rounding. Compared as one vector: ||w_2x4 - w_8x1|| / ||w_8x1 - w_0||, the difference
    relative to how far training moved the weights. Not element-wise: tensors whose gradient is zero up to
    float noise (e.g. the attention key biases, to which softmax is invariant) get Adam steps of +-lr in
    the noise's direction, so single elements can differ by 2 x lr x steps.

    Tolerance 1e-2. Measured over these 3 steps (weights moved by 0.20): 1.1e-3 in fp16 with either
    optimizer (micro-batches of 2 and 8 pad and round differently); 1.4e-6 for the same pair in fp32;
    1.2e-2 between fp16 and fp32 at 8 x 1. Broken accumulation (gradients zeroed every micro-batch) gives 1.1.
    """
    weights = record_weights(monkeypatch)
    kw = dict(RUN, max_steps=3, warmup_steps=0)
    run_in_process(tmp_path, "8x1", model_name_or_path=tiny_bert, optim=optim,
                   **dict(kw, per_device_train_batch_size=8, gradient_accumulation_steps=1))
    run_in_process(tmp_path, "2x4", model_name_or_path=tiny_bert, optim=optim,
                   **dict(kw, per_device_train_batch_size=2, gradient_accumulation_steps=4))
    initial, large, accumulated = weights[0], weights[3], weights[-1]
    assert len(weights) == 8 and same_weights(initial, weights[4])

    def flat(w):
        return torch.cat([w[n].flatten() for n in sorted(w)])

    moved = (flat(large) - flat(initial)).norm()
    rel = ((flat(accumulated) - flat(large)).norm() / moved).item()
    assert rel < 1e-2
