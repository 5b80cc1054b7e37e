"""The Trainer engine matches the accelerate engine step for step, and the config maps to
TrainingArguments in one tested place."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from helpers import run_in_process, train_steps

from finetune.backends.trainer import training_arguments
from finetune.config import TrainConfig, parse_config
from finetune.errors import FinetuneError

# Fields that configure the run the same way in both engines, with TrainingArguments' names.
SHARED = ["per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
          "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "num_train_epochs",
          "max_steps", "lr_scheduler_type", "warmup_steps", "max_grad_norm", "seed", "optim",
          "dataloader_num_workers", "dataloader_pin_memory", "train_sampling_strategy", "torch_compile",
          "torch_compile_mode", "ddp_timeout"]


def test_every_shared_hyperparameter_reaches_training_arguments(tmp_path):
    config = parse_config(["--recipe", "bbc-news", "--output_dir", str(tmp_path), "--per_device_train_batch_size", "3",
                           "--per_device_eval_batch_size", "5", "--gradient_accumulation_steps", "7",
                           "--learning_rate", "3e-5", "--weight_decay", "0.05", "--adam_beta1", "0.8",
                           "--adam_beta2", "0.95", "--adam_epsilon", "1e-7", "--num_train_epochs", "2.5",
                           "--max_steps", "11", "--lr_scheduler_type", "cosine", "--warmup_steps", "4",
                           "--max_grad_norm", "0.5", "--seed", "9", "--optim", "adamw_torch_fused",
                           "--dataloader_num_workers", "2", "--dataloader_pin_memory", "False",
                           "--mixed_precision", "bf16", "--train_sampling_strategy", "group_by_length",
                           "--torch_compile_mode", "max-autotune", "--ddp_timeout", "77"])
    config.validate()
    args = training_arguments(config)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    for name in SHARED:
        assert name in names
        ours, theirs = getattr(config, name), getattr(args, name)
        theirs = getattr(theirs, "value", theirs)  # enums: SchedulerType.COSINE -> "cosine"
        assert theirs == ours, name
    assert args.data_seed == config.seed  # same data order as our seeded sampler
    assert args.bf16 and not args.fp16
    assert args.eval_strategy.value == "no" and args.logging_steps == 1  # evaluation runs in our callback
    assert args.output_dir == str(tmp_path / "checkpoints")  # Trainer's checkpoint-N dirs go there


@pytest.mark.parametrize("accum", [1, 4])
def test_trainer_losses_equal_accelerate_losses(tmp_path, tiny_bert, accum):
    """fp32, dropout off, same seed: per-optimizer-step losses agree to 1e-4 over 2 epochs of 22 samples,
    whose last window is partial (micro 2: 11 micro-batches; N=4 -> windows of 4, 4, 3)."""
    kw = dict(model_name_or_path=tiny_bert, max_train_samples=22, max_eval_samples=8, per_device_train_batch_size=2,
              gradient_accumulation_steps=accum, num_train_epochs=2, disable_dropout=True, max_length=32,
              learning_rate=2e-3, warmup_steps=1, seed=5, eval_strategy="epoch")
    acc_metrics, acc = run_in_process(tmp_path, "accelerate", **kw)
    tr_metrics, tr = run_in_process(tmp_path, "trainer", backend="trainer", **kw)
    a, t = train_steps(acc), train_steps(tr)
    assert len(a) == len(t) == acc_metrics["optimizer_steps"] == tr_metrics["optimizer_steps"] >= 6
    if accum == 4:
        assert [r["micro_batches"] for r in t][:3] == [4, 4, 3]
    for x, y in zip(a, t):
        assert abs(x["loss"] - y["loss"]) < 1e-4, (x, y)
        assert x["learning_rate"] == pytest.approx(y["learning_rate"], rel=1e-6)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-3)
        assert x["samples"] == y["samples"]
        assert (x["padded_tokens"], x["input_tokens"]) == (y["padded_tokens"], y["input_tokens"])
    assert a[-1]["loss"] != a[0]["loss"]  # it trained
    assert acc_metrics["eval_loss"] == pytest.approx(tr_metrics["eval_loss"], abs=1e-4)
    # padding is counted where the loop sees the batches: our engine only (Trainer's loop is its own)
    assert acc_metrics.keys() == tr_metrics.keys()  # the same figures, padding and token rates included
    assert 0.0 <= acc_metrics["train_padding_fraction"] == tr_metrics["train_padding_fraction"] < 1.0
    assert acc_metrics["train_input_tokens"] == tr_metrics["train_input_tokens"] > 0  # same non-padding count
    assert tr_metrics["backend"] == "trainer" and acc_metrics["backend"] == "accelerate"


def test_trainer_backend_steps_alike_where_trainer_reads_the_older_flag(tmp_path, tiny_bert, monkeypatch):
    """``FinetuneTrainer.compute_loss`` divides by the window's items already, so Trainer's ``training_step`` must
    back-propagate it as it is. transformers >= 5.19 asks ``loss_is_scaled_for_ga``; earlier versions (the GPU runs
    used 5.17) ask ``model_accepts_loss_kwargs``, False for a model whose forward takes no loss kwargs. Here Trainer
    asks the older flag of such a model: the steps are still the accelerate backend's (N=4: a loss divided again by
    N would give grad norms 4x smaller, and other losses from step 2 on)."""
    from transformers import BertForSequenceClassification

    from finetune.backends.trainer import FinetuneTrainer

    kw = dict(model_name_or_path=tiny_bert, max_train_samples=16, max_eval_samples=4, per_device_train_batch_size=2,
              gradient_accumulation_steps=4, max_steps=2, disable_dropout=True, max_length=32, learning_rate=2e-3,
              seed=5, eval_strategy="no")
    _, acc = run_in_process(tmp_path, "accelerate", **kw)
    monkeypatch.setattr(FinetuneTrainer, "loss_is_scaled_for_ga", None)  # as before transformers 5.19
    monkeypatch.setattr(BertForSequenceClassification, "accepts_loss_kwargs", False, raising=False)
    _, tr = run_in_process(tmp_path, "trainer", backend="trainer", **kw)
    a, t = train_steps(acc), train_steps(tr)
    assert len(a) == len(t) == 2
    assert [r["grad_norm"] for r in t] == pytest.approx([r["grad_norm"] for r in a], rel=1e-3)
    assert [r["loss"] for r in t] == pytest.approx([r["loss"] for r in a], abs=1e-4)


def test_plain_trainer_logs_the_window_sum_not_the_mean(tmp_path, tiny_bert):
    """What the README says of Trainer's own log: without our compute_loss, transformers 5 passes
    num_items_in_batch to a BERT that ignores it and skips the division by the accumulation steps, so the
    logged loss (and the gradient) is N times the mean loss per sample."""
    from transformers import AutoModelForSequenceClassification, Trainer

    from finetune.backends.trainer import training_arguments
    from finetune.models.loading import load_tokenizer
    from finetune.recipes import load_recipe
    from finetune.tasks import get_task
    from finetune.tasks.builders import build_datasets

    _, ours = run_in_process(tmp_path, "ours", backend="trainer", model_name_or_path=tiny_bert, max_train_samples=16,
                             max_eval_samples=4, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                             max_steps=1, disable_dropout=True, max_length=32, eval_strategy="no")
    config = parse_config(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir",
                           str(tmp_path / "plain"), "--max_train_samples", "16", "--max_eval_samples", "4",
                           "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4", "--max_steps",
                           "1", "--disable_dropout", "--max_length", "32", "--eval_strategy", "no"])
    recipe = load_recipe("bbc-news")
    tokenizer = load_tokenizer(tiny_bert)
    data, names, _ = build_datasets(recipe, config, tokenizer, get_task(recipe.TASK))
    from transformers import DataCollatorWithPadding, set_seed

    set_seed(config.seed)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=len(names),
                                                               hidden_dropout_prob=0.0,
                                                               attention_probs_dropout_prob=0.0)
    trainer = Trainer(model=model, args=training_arguments(config), train_dataset=data["train"],
                      data_collator=DataCollatorWithPadding(tokenizer))
    logged = trainer.train().training_loss
    true_loss = train_steps(ours)[0]["trainer_logged_loss"]
    assert train_steps(ours)[0]["loss"] == pytest.approx(true_loss, rel=1e-6)
    assert logged / true_loss == pytest.approx(4.0, rel=0.02)


def test_both_engines_keep_the_same_records_on_the_same_cadence(tmp_path, tiny_bert):
    """The shared bookkeeping: with evaluation every 2 steps, the best model by eval_loss and early stopping,
    both engines write the same sequence of records (step records with the same keys, evaluations after the
    same steps, in the same order) and stop at the same step."""
    kw = dict(model_name_or_path=tiny_bert, max_train_samples=24, max_eval_samples=8, per_device_train_batch_size=2,
              gradient_accumulation_steps=2, num_train_epochs=3, disable_dropout=True, max_length=32,
              learning_rate=2e-3, warmup_steps=1, seed=5, eval_strategy="steps", eval_steps=2, save_steps=2,
              load_best_model_at_end=True, early_stopping_patience=2)
    acc_metrics, acc = run_in_process(tmp_path, "accelerate", **kw)
    tr_metrics, tr = run_in_process(tmp_path, "trainer", backend="trainer", **kw)
    from helpers import read_log

    def shape(records):
        # sample_ids: the accelerate backend's per-step hash of its samples (elastic resume; Trainer's collator
        # drops columns its model does not take, so the Trainer backend logs none)
        return [("step" if "loss" in r else "eval", r["step"],
                 tuple(sorted(r.keys() - {"trainer_logged_loss", "sample_ids"}))) for r in records]

    a, t = read_log(acc), read_log(tr)
    assert shape(a) == shape(t)
    assert [r["step"] for r in a if "eval_loss" in r][:2] == [2, 4]
    for x, y in zip(a, t):
        assert x.get("loss", x.get("eval_loss")) == pytest.approx(y.get("loss", y.get("eval_loss")), abs=1e-4)
    assert acc_metrics["optimizer_steps"] == tr_metrics["optimizer_steps"]
    assert acc_metrics["best_step"] == tr_metrics["best_step"]


def test_trainer_counts_gpt2_items_by_the_task_not_by_the_class_name(tmp_path):
    """GPT2LMHeadModel's ``loss_type`` is None (transformers 5.24 guesses it from the class name), so Trainer's
    own ``num_items_in_batch`` counted every label token, position 0 included: 8 rows of 64 tokens gave 512 items
    where the loss sums 504, and the Trainer backend trained and logged 504/512 of the loss. Counted by the task
    (``FinetuneTrainer.get_batch_samples``), both backends log the same loss and items and train the same weights.
    Fails before the fix (items 512 vs 504, loss 10.6219 vs 10.7905 in project issue 25)."""
    from families import build
    from helpers import load_params

    model = build("gpt2", tmp_path / "gpt2")
    # --block_size 64: every row has 64 tokens, no padding, so each window of 4 x 2 = 8 rows has 8 x 63 = 504 items
    kw = dict(recipe="bbc-news-clm", model_name_or_path=model, max_train_samples=48, max_eval_samples=4,
              per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3, block_size=64,
              max_length=64, disable_dropout=True, learning_rate=1e-3, warmup_steps=0, eval_strategy="no",
              mixed_precision="no")
    _, acc = run_in_process(tmp_path, "accelerate", **kw)
    _, tr = run_in_process(tmp_path, "trainer", backend="trainer", **kw)
    a, t = train_steps(acc), train_steps(tr)
    assert len(a) == len(t) == 3
    assert [r["trained_tokens"] for r in a] == [r["trained_tokens"] for r in t] == [504, 504, 504]
    for x, y in zip(a, t):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["trainer_logged_loss"] == pytest.approx(x["loss"], rel=1e-5)  # what Trainer itself logged
    ours, theirs = load_params(acc), load_params(tr)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(theirs[name], ours[name], rtol=1e-5, atol=1e-7, msg=name)


def test_trainer_auto_resume_never_starts_over_checkpoints_it_cannot_resume(tmp_path, capsys):
    """``--resume_from_checkpoint auto`` on the Trainer backend. Trainer writes a checkpoint straight into its
    final folder (transformers 5.24 ``trainer.py`` ``_save_checkpoint``), so the lifecycle seals it afterwards like
    ours (``checkpoint.seal_checkpoint``: progress, manifest, ``COMPLETE`` last); a folder without the marker was
    interrupted: skipped with a warning for the previous one. Where none can be resumed, or only the accelerate
    backend's ``step_*`` checkpoints are there, it refuses naming them (a fresh start would delete or write over
    them)."""
    from finetune.lifecycle import checkpoint as ckpt
    from finetune.lifecycle.progress import RunProgress

    root = tmp_path / "checkpoints"
    for step in (2, 4, 10):
        (root / f"checkpoint-{step}").mkdir(parents=True)
        (root / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")  # Trainer's own: not enough
    ckpt.seal_checkpoint(root / "checkpoint-2", RunProgress(step=2))
    assert ckpt.find_resume_checkpoint(tmp_path, "auto", "trainer") == root / "checkpoint-2"
    out = capsys.readouterr().out
    assert f"warning: skipping incomplete checkpoint {root / 'checkpoint-10'}" in out
    assert f"warning: skipping incomplete checkpoint {root / 'checkpoint-4'}" in out
    (root / "checkpoint-2" / "COMPLETE").unlink()
    with pytest.raises(FinetuneError) as refused:
        ckpt.find_resume_checkpoint(tmp_path, "auto", "trainer")
    assert (f"--resume_from_checkpoint auto: no checkpoint under {root} can be resumed (checkpoint-10: no COMPLETE "
            "marker (its write was interrupted") in str(refused.value)
    assert "checkpoint-4: no COMPLETE marker" in str(refused.value) and "checkpoint-2: no COMPLETE" in str(refused.value)
    assert f"rm -r {root}" in str(refused.value)
    for step in (2, 4, 10):
        shutil.rmtree(root / f"checkpoint-{step}")
    (root / "step_00000002").mkdir()  # the accelerate backend's: not Trainer's to resume, nor to delete
    with pytest.raises(FinetuneError, match=r"\(step_00000002: written by --backend accelerate\)"):
        ckpt.find_resume_checkpoint(tmp_path, "auto", "trainer")
    (root / "step_00000002").rmdir()
    assert ckpt.find_resume_checkpoint(tmp_path, "auto", "trainer") is None  # nothing there: a fresh start


def test_a_sealed_trainer_checkpoint_that_changed_is_damaged(tmp_path, capsys):
    """The mutant for the Trainer checkpoint's manifest: a sealed ``checkpoint-N`` whose optimizer file was cut
    short after sealing is skipped by ``latest`` (the previous one resumes) and refused by path, naming the file."""
    from finetune.lifecycle import checkpoint as ckpt
    from finetune.lifecycle.progress import RunProgress

    root = tmp_path / "checkpoints"
    for step in (1, 2):
        folder = root / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "optimizer.pt").write_bytes(bytes(range(200)) * step)
        ckpt.seal_checkpoint(folder, RunProgress(step=step, num_processes=1))
    assert ckpt.read_state(root / "checkpoint-2").step == 2
    (root / "checkpoint-2" / "optimizer.pt").write_bytes(bytes(range(100)))
    assert ckpt.find_resume_checkpoint(tmp_path, "latest", "trainer") == root / "checkpoint-1"
    assert "skipping damaged checkpoint" in capsys.readouterr().out
    with pytest.raises(FinetuneError, match="optimizer.pt has 100 bytes, 400 when saved"):
        ckpt.find_resume_checkpoint(tmp_path, str(root / "checkpoint-2"), "trainer")
