"""TRL 1.16's own CLI example configuration (``examples/cli_configs/example_config.yaml``, the YAML of its CLI
docs) through ``finetune train --config`` and through ``trl sft --config``, and the same keys through ``trl dpo``:
the YAML unchanged but for the model and dataset paths (the tiny chat Llama, local ``save_to_disk`` folders shaped
as ``stanfordnlp/imdb`` and as implicit-prompt conversational pairs), every optimizer step's loss equal within
2e-6 (fp32, the same order). Figures and the differences that remain: docs/recipes.md#equal-to-trl-sft-and-trl-dpo.

Added on both command lines, for fp32 on a CPU and a short run: ``--bf16 false`` (``_BaseConfig`` turns bf16 on by
default, trl ``trainer/base_config.py`` lines 62-69 and 104), ``--output_dir``, ``--max_steps``; on TRL's alone
``--use_cpu true`` and ``--logging_steps 1`` (``_BaseConfig``'s is 10, line 55; ours logs every step).

Why the two runs are the same run (trl 1.16, transformers 5.24, accelerate 1.15):

- the hyperparameters: the YAML sets the learning rate and the schedule; the rest are the configs' defaults, which
  the ``clm``/``sft``/``dpo`` recipes carry where ours differ (``recipes/*.py``: SFTConfig's learning rate 2e-5,
  ``sft_config.py`` line 140, max_length 1024, line 202; DPOConfig's learning rate 1e-6, ``dpo_config.py`` line
  156, disable_dropout, line 185; TrainingArguments' ``adamw_torch_fused``, ``training_args.py`` line 811); the
  batch (8), epochs (3), seed (42), clipping (1.0), AdamW's betas and epsilon are equal defaults already;
- the data: ``trl sft`` loads ``load_dataset(dataset_name)`` (``scripts/sft.py`` lines 97-99) and trains its whole
  train split, no eval (``eval_strategy`` "no"); ours validates on the folder's ``test`` split (imdb has one), so
  trains every train row too (without one it holds out 20%); each text ends with the eos token (``SFTTrainer.
  _prepare_dataset``'s ``add_eos``, ``sft_trainer.py`` lines 1286-1306; ours: ``--add_eos``, the clm recipe's
  default), is cut at max_length keeping its start (lines 1436-1454) and trains every token (no mask, lines
  1404-1432); the pairs: ``extract_prompt`` then the chat template (``dpo_trainer.py`` lines 1049-1125);
- the order: both samplers are Accelerate's ``SeedableRandomSampler`` (``data_loader.py`` lines 73-107), seeded
  with the seed plus the epoch: Trainer's ``RandomSampler`` (``trainer.py`` line 1145) swapped for it by
  ``accelerator.prepare`` (``use_seedable_sampler`` on, ``data_seed`` None: ``torch.random.initial_seed()`` after
  ``set_seed(42)``, ``trainer.py`` lines 839 and 1486); ours with ``data_seed`` = ``--seed``
  (``finetune/engine/__init__.py``). The runs cross an epoch, so the re-seeding is checked too, and each step's
  tokens are compared (TRL's ``num_tokens``, ``sft_trainer.py`` lines 1646-1657);
- the loss: TRL's step loss is the sum of the token losses over ``num_items_in_batch``, the step's label tokens
  (``sft_trainer.py`` lines 1611-1619; transformers ``trainer.py`` lines 2306-2343), logged unrounded
  (line 2262); ours is the window's summed token loss over its label tokens; DPO's as ``tests/trl_peer.py`` says.
- the conversational pairs use the tiny chat Llama with SmolLM2's own template, whose newline after ``<|im_end|>``
  both train: a side's completion is everything the template writes after the prompt (``dpo_trainer.py`` lines
  1103-1125; ours: ``finetune/data/preference.py``'s ``_encode_completion``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_args_in_process, train_steps
from tiny_models import SMOLLM2_CHAT_TEMPLATE, build_tiny_chat_llama

trl = pytest.importorskip("trl", reason="trl is not installed: the peer runs need TRL 1.16's CLI "
                                        "(pip install -e '.[test]' installs trl==1.16.0)")
from trl_peer import reset_accelerate_state  # noqa: E402

from finetune.config import parse_config  # noqa: E402

TOLERANCE = 2e-6
WORDS = "the market rose as shares in the bank fell after the match ended with a late goal".split()
# TRL's examples/cli_configs/example_config.yaml, but for the model and the dataset (see the module docstring)
EXAMPLE_CONFIG = """\
model_name_or_path:
  {model}
dataset_name:
  {dataset}
report_to:
  none
learning_rate:
  0.0001
lr_scheduler_type:
  cosine
"""
ADDED = ["--bf16", "false"]  # and --output_dir, --max_steps: on both command lines
TRL_ADDED = ["--use_cpu", "true", "--logging_steps", "1"]


@pytest.fixture(scope="module", autouse=True)
def fresh_accelerate_state():
    """Our in-process runs leave Accelerate's process-wide state behind: the tests after these start clean."""
    yield
    reset_accelerate_state()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    """The tiny chat Llama with 1,024 positions: SFTConfig's and DPOConfig's max_length fit it, as they fit the
    models TRL's example names (ours refuses a max_length above a model's position limit)."""
    return str(build_tiny_chat_llama(tmp_path_factory.mktemp("chat-llama"), max_positions=1024))


@pytest.fixture(scope="module")
def imdb_like(tmp_path_factory) -> str:
    """A ``save_to_disk`` DatasetDict shaped as ``stanfordnlp/imdb``: ``text`` + ``label``, 40 train rows of 2-60
    words (one ending with the eos token already: not doubled), 8 test rows."""
    import datasets

    rng = random.Random(0)

    def split(n):
        texts = [words(rng, rng.choice([2, 5, 13, 34, 60])) for _ in range(n)]
        return datasets.Dataset.from_dict({"text": texts, "label": [rng.randint(0, 1) for _ in texts]})

    train = split(40).map(lambda row, i: {"text": row["text"] + ("<|im_end|>" if i == 3 else "")}, with_indices=True)
    folder = tmp_path_factory.mktemp("imdb-like") / "imdb"
    datasets.DatasetDict({"train": train, "test": split(8)}).save_to_disk(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> str:
    """A ``save_to_disk`` DatasetDict of implicit-prompt conversational pairs (``chosen``/``rejected`` whole
    conversations, as ``trl-lib/ultrafeedback_binarized``): 24 train rows, 4 test rows."""
    import datasets

    rng = random.Random(1)

    def split(n):
        rows = {"chosen": [], "rejected": []}
        for _ in range(n):
            prompt = [{"role": "user", "content": words(rng, rng.choice([3, 8, 21]))}]
            rows["chosen"].append(prompt + [{"role": "assistant", "content": words(rng, rng.choice([1, 2, 6]))}])
            rows["rejected"].append(prompt + [{"role": "assistant", "content": words(rng, rng.choice([1, 3, 5]))}])
        return datasets.Dataset.from_dict(rows)

    folder = tmp_path_factory.mktemp("pairs") / "pairs"
    datasets.DatasetDict({"train": split(24), "test": split(4)}).save_to_disk(str(folder))
    return str(folder)


def write_config(folder: Path, model: str, dataset: str) -> str:
    path = folder / "example_config.yaml"
    path.write_text(EXAMPLE_CONFIG.format(model=model, dataset=dataset))
    return str(path)


def start_trl(command: str, config: str, output_dir: Path, steps: int, home: Path) -> subprocess.Popen:
    """``trl COMMAND --config CONFIG`` plus what fp32 on a CPU and a short run need, in a process of its own (``trl``
    launches its script through ``accelerate launch``); ``HF_HOME`` a fresh folder: no Accelerate config of this
    machine's, no dataset cache shared with ours."""
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = [sys.executable, "-m", "trl.cli.main", command, "--config", config, *ADDED, *TRL_ADDED,
            "--output_dir", str(output_dir), "--max_steps", str(steps)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def trl_steps(process: subprocess.Popen, output_dir: Path, steps: int) -> list[dict]:
    """TRL's per-step records, unrounded: the ``log_history`` of the checkpoint its run saves at the end
    (``save_strategy`` "steps": transformers ``trainer_callback.py`` lines 602-604)."""
    out, _ = process.communicate(timeout=600)
    assert process.returncode == 0, out[-3000:]
    state = json.loads((output_dir / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    return [r for r in state["log_history"] if "loss" in r]


def both(tmp_path: Path, command: str, model: str, dataset: str, steps: int) -> tuple[list[dict], list[dict]]:
    """TRL's run (``trl COMMAND``) and ours (``finetune train``, in this process meanwhile) of the example YAML."""
    config = write_config(tmp_path, model, dataset)
    theirs = start_trl(command, config, tmp_path / "trl", steps, tmp_path / "hf_home")
    try:
        run_args_in_process(["--config", config, *ADDED, "--output_dir", str(tmp_path / "ours"),
                             "--max_steps", str(steps)])
    finally:
        their_steps = trl_steps(theirs, tmp_path / "trl", steps)
    return train_steps(tmp_path / "ours"), their_steps


def folder_files(folder: str) -> set[str]:
    return {str(p.relative_to(folder)) for p in Path(folder).rglob("*")}


def close(a: float, b: float, relative: bool = False) -> bool:
    return abs(a - b) <= TOLERANCE * (max(abs(a), abs(b)) if relative else 1.0)


def test_the_example_yaml_trains_as_trl_sft(tmp_path, chat_llama, imdb_like):
    """The imdb-shaped folder: the clm recipe, chosen from its ``text`` column; 6 steps of 8 texts (the second
    epoch's order from the seed plus one); each step's tokens, loss (nats per token, within 2e-6), gradient norm
    and learning rate equal to ``trl sft``'s. Our run writes nothing into the dataset's folder (``load_from_disk``
    would put its tokenized cache there, and ``trl sft``'s ``load_dataset`` then reads that cache as data)."""
    before = folder_files(imdb_like)
    ours, theirs = both(tmp_path, "sft", chat_llama, imdb_like, steps=6)
    assert folder_files(imdb_like) == before
    assert len(ours) == len(theirs) == 6
    counted = 0
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        counted += a["input_tokens"]
        assert counted == b["num_tokens"], (step, counted, b["num_tokens"])  # the same texts, each with its eos
        assert close(a["loss"], b["loss"]), (step, a["loss"], b["loss"], a["loss"] - b["loss"])
        assert close(a["grad_norm"], b["grad_norm"], relative=True), (step, a["grad_norm"], b["grad_norm"])
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-9)
    print("\nsft: |loss difference| per step", [f"{abs(a['loss'] - b['loss']):.1e}" for a, b in zip(ours, theirs)])


def test_the_example_yaml_trains_as_trl_dpo(tmp_path, chat_llama, pairs):
    """The example's keys on implicit-prompt conversational pairs: the dpo recipe, chosen from ``chosen`` +
    ``rejected``; 4 steps of 8 pairs (the fourth from the second epoch); each step's loss, gradient norm and
    ``logps/*`` (relative) and ``rewards/*`` (absolute) within 2e-6 of ``trl dpo``'s."""
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(chat_llama).chat_template == SMOLLM2_CHAT_TEMPLATE  # "\n" after <|im_end|>
    ours, theirs = both(tmp_path, "dpo", chat_llama, pairs, steps=4)
    assert len(ours) == len(theirs) == 4
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
            assert close(a[key], b[key], relative=True), (step, key, a[key], b[key])
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
            assert close(a[key], b[key]), (step, key, a[key], b[key])
    # the same tokens trained, "\n" after <|im_end|> included: measured 1.2e-7 at most (2 fp32 ulps of ln 2), where
    # ours stopping at <|im_end|> differed by 9.8e-6
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(ours, theirs)) <= 5e-7
    print("\ndpo: |loss difference| per step", [f"{abs(a['loss'] - b['loss']):.1e}" for a, b in zip(ours, theirs)],
          "logps/chosen", [f"{abs(a['logps/chosen'] - b['logps/chosen']):.1e}" for a, b in zip(ours, theirs)],
          "grad_norm rel", [f"{abs(a['grad_norm'] / b['grad_norm'] - 1):.1e}" for a, b in zip(ours, theirs)])


@pytest.mark.parametrize("command, recipe", [("sft", "clm"), ("dpo", "dpo")])
def test_the_recipes_carry_trls_defaults(tmp_path, chat_llama, imdb_like, pairs, command, recipe):
    """A TRL YAML that leaves a hyperparameter out gets TRL's default for it: the recipe chosen from the data
    carries SFTConfig's (DPOConfig's) learning rate, optimizer, max_length, and disable_dropout, and the clm recipe
    TRL's eos at the end of each text."""
    dataset = imdb_like if command == "sft" else pairs
    path = tmp_path / "c.yaml"
    path.write_text(f"model_name_or_path: {chat_llama}\ndataset_name: {dataset}\n")
    config = parse_config(["--config", str(path)])
    theirs = (trl.SFTConfig if command == "sft" else trl.DPOConfig)(output_dir=str(tmp_path / "x"), use_cpu=True)
    assert config.recipe == recipe
    assert (config.learning_rate, config.optim, config.max_length) == (
        theirs.learning_rate, str(getattr(theirs.optim, "value", theirs.optim)), theirs.max_length)
    if command == "dpo":
        assert config.disable_dropout is theirs.disable_dropout is True
    else:
        assert config.add_eos is True
        assert parse_config(["--recipe", "bbc-news-clm"]).add_eos is False  # the shipped clm recipes: as they were
