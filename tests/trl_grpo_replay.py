"""TRL 1.16's ``GRPOTrainer`` on recorded completions: a stand-in for its generation, and a run of it beside ours.
Shared by ``tests/test_grpo_peer.py`` (equal numbers) and ``bench/bench_grpo_peer.py`` (speed). Needs ``trl`` (the
test extra pins 1.16.0); tests import it after ``pytest.importorskip("trl")``.

Where generation sits in TRL 1.16.0 (``trl/trainer/grpo_trainer.py``):

- ``_prepare_inputs`` (lines 1522-1551) calls ``_generate_and_score_completions`` (2324-2936) once every
  ``steps_per_generation * num_iterations`` micro-steps, shuffles the generation batch (``shuffle_sequence_dict``,
  ``trainer/utils.py`` 1092-1121, on torch's global generator), splits it into ``steps_per_generation`` micro-batches
  and buffers them for the micro-steps until the next generation;
- ``_generate_and_score_completions`` calls ``_generate`` (2193-2322), which tokenises the prompts
  (``_tokenize_prompts``, 1684-1761: the chat template with its generation prompt, or the plain text) and calls
  ``_generate_single_turn(prompt_ids, images, multimodal_fields, num_generations)`` (1763-1891; called at 2223),
  which returns ``(completion_ids, logprobs)``: one list of token ids per row of the generation batch, cut after the
  first EOS (1880-1888), and ``logprobs = None`` on the transformers path (1889);
- everything after it is TRL's own: decoding the completions for the reward functions (2228-2245), the length and
  truncation metrics (2274-2310), padding, ``num_items_in_batch`` (2498), the old policy's log-probabilities (only
  where ``gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0``, 2640-2655) and the
  reference's (2709-2737), the rewards (``_calculate_rewards``, 1579-1682), the group-normalised advantages
  (2761-2810), ``reward``/``reward_std``/``rewards/*`` (2821-2830), the loss per ``loss_type`` (``_compute_loss``,
  3020-3290: the KL times the ratio where ``use_bias_correction_kl``, 3097-3105; aggregation 3152-3184) and its
  metrics (``kl``, ``entropy``, ``clip_ratio/*``, 3253-3284), averaged over the micro-batches of a logging step by
  ``log`` (3302-3321).

``ReplayGRPOTrainer`` overrides ``_generate_single_turn``, the narrowest method that produces completion ids, and
returns the recorded ones: it samples nothing, and what TRL does with the ids is unchanged. It checks that TRL asks
for the recorded prompts, generation batch by generation batch, in the recorded order (prompt ids compared with
TRL's own tokenisation of each training row). ``order=`` replaces TRL's ``RepeatSampler`` (utils.py 859-958: a
``torch.randperm`` of the rows with a generator seeded by ``seed``, cut into generation batches of ``generation_batch_size
// num_generations`` prompts, each prompt repeated ``num_generations`` times and each batch ``num_iterations *
steps_per_generation`` times, ``_get_train_sampler`` 1280-1316) by the same structure over a given order of rows.

Determinism on a CPU: ``GRPOConfig`` inherits ``bf16=None`` (autocast bf16 on a CPU where supported) and
``gradient_checkpointing=True`` from TRL's base config; ``replay_config`` sets fp32, no checkpointing,
``use_cpu``, ``disable_dropout`` and a seed. ``__init__`` calls ``set_seed(seed)`` before a LoRA adapter is made
(line 333, as ours) and ``set_seed(seed, device_specific=True)`` later (1103): the shuffle of each generation batch
is then the same in every run of the same settings.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
import trl
from trl_peer import Run, reset_accelerate_state, trainable


def length_and_parity(prompts, completions, completion_ids, **columns) -> list[float]:
    """A reward for the peer runs (TRL's signature, ``--reward_funcs trl_grpo_replay:length_and_parity``): a
    quarter per completion token plus 1 for an odd sum of its ids, so that completions of one length differ too."""
    return [0.25 * len(ids) + float(sum(ids) % 2) for ids in completion_ids]


def even_ids(prompts, completions, completion_ids, **columns) -> list[float | None]:
    """A second reward for the peer runs: the share of even token ids; None (no reward from it) for a completion of
    one token."""
    return [None if len(ids) == 1 else sum(i % 2 == 0 for i in ids) / len(ids) for ids in completion_ids]


def run_ours(argv: list[str]) -> Run:
    """Our run of ``argv`` (``finetune train`` flags; the accelerate backend, in this process): its per-step log
    records (``Run.steps``) and its trainable weights before the first step and after the last (the ``build=``
    seam of ``finetune.backends.accelerate.train``)."""
    from helpers import train_steps

    from finetune.backends import accelerate as backend
    from finetune.config import parse_config
    from finetune.lifecycle.resolve import resolve

    reset_accelerate_state()
    resolution = resolve(parse_config(argv))
    seen = {}

    def build(config, recipe):
        built = backend.setup(config, recipe)
        seen.update(model=built.model, initial=trainable(built.model))
        return built

    backend.train(resolution.config, resolution.recipe, build=build)
    return Run(train_steps(Path(resolution.config.output_dir)), [], seen["initial"], trainable(seen["model"]))


def generation_batches(path, num_iterations: int = 1) -> list[list[dict]]:
    """Our ``completions.jsonl`` (one object per completion: ``step``, ``prompt``, ``generation``,
    ``completion_ids``, ``rewards``) as its generation batches, in order: the completions of each generating step,
    in the file's order. With ``num_iterations`` > 1 a step that reuses the previous step's completions either
    writes none or writes the same ones again; both read as one batch per generation."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]].append(record)
    steps = sorted(by_step)
    if num_iterations > 1 and steps == list(range(1, len(steps) + 1)):  # every step written: keep generating ones
        steps = [s for s in steps if (s - 1) % num_iterations == 0]
    return [by_step[s] for s in steps]


class ReplaySampler(torch.utils.data.Sampler):
    """TRL's ``RepeatSampler`` structure (utils.py 930-953) over the rows of ``order`` instead of a seeded
    permutation: ``order`` cut into chunks of ``prompts`` rows (a partial last chunk dropped, as TRL's), each chunk
    yielded ``repeat_count`` times, each row ``mini_repeat_count`` times in a row."""

    def __init__(self, order: list[int], prompts: int, mini_repeat_count: int, repeat_count: int):
        self.order, self.prompts, self.mini, self.repeat = list(order), prompts, mini_repeat_count, repeat_count

    def __iter__(self):
        chunks = [self.order[i:i + self.prompts] for i in range(0, len(self.order), self.prompts)]
        for chunk in (c for c in chunks if len(c) == self.prompts):
            for _ in range(self.repeat):
                for index in chunk:
                    yield from [index] * self.mini

    def __len__(self) -> int:
        return len(self.order) // self.prompts * self.prompts * self.mini * self.repeat


class ReplayGRPOTrainer(trl.GRPOTrainer):
    """``GRPOTrainer`` whose generation returns recorded completions (see the module docstring).

    ``generations``: one list per generation batch (``generation_batches``) of records with ``prompt`` (the row of
    ``train_dataset``), ``generation`` and ``completion_ids``, in the order TRL's rows come (each prompt's
    ``num_generations`` rows together). ``order``: the rows in the order our run drew them (None: TRL's own seeded
    ``RepeatSampler``). Raises ``AssertionError`` where TRL asks for other prompts than the recorded batch holds, or
    for more batches than were recorded. ``replayed`` holds, per generation batch, the (row, completion ids) pairs
    handed to TRL."""

    def __init__(self, *args, generations: list[list[dict]], order: list[int] | None = None, **kwargs):
        self.generations, self.order, self.replayed = [list(b) for b in generations], order, []
        super().__init__(*args, **kwargs)
        rows = [row["prompt"] for row in self.train_dataset]
        self.row_prompt_ids = [list(ids) for ids in self._tokenize_prompts(rows)[0]]

    def _get_train_sampler(self, dataset=None):
        if self.order is None:
            return super()._get_train_sampler(dataset)
        return ReplaySampler(self.order, self.args.generation_batch_size // self.num_generations,
                             self.num_generations, self.num_iterations * self.args.steps_per_generation)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not self.model.training:
            raise AssertionError("the replay covers training generations only (no evaluation is run)")
        index = len(self.replayed)
        assert index < len(self.generations), f"TRL asks for generation batch {index + 1}: {index} were recorded"
        batch = self.generations[index]
        assert len(batch) == len(prompt_ids), (index, len(batch), len(prompt_ids))
        for position, (record, ids) in enumerate(zip(batch, prompt_ids, strict=True)):
            assert list(ids) == self.row_prompt_ids[record["prompt"]], (
                f"generation batch {index + 1}, row {position}: TRL's prompt is not the recorded prompt "
                f"{record['prompt']}")
        self.replayed.append([(r["prompt"], list(r["completion_ids"])) for r in batch])
        return [list(r["completion_ids"]) for r in batch], None


def replay_config(output_dir, **arguments) -> trl.GRPOConfig:
    """A ``GRPOConfig`` for a run beside ours: ``arguments`` (batch, generations, loss, learning rate, seed, ...)
    over fp32 without gradient checkpointing on the CPU, dropout off, a record per optimizer step, one epoch,
    nothing saved, reported or printed."""
    defaults = dict(bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(),
                    disable_dropout=True, logging_steps=1, save_strategy="no", report_to="none",
                    num_train_epochs=1, log_completions=False)
    return trl.GRPOConfig(output_dir=str(output_dir), **{**defaults, **arguments})


def run_trl_replay(model_dir: str, rows: list[dict], generations: list[list[dict]], args: trl.GRPOConfig,
                   reward_funcs, order: list[int] | None = None, peft_config=None) -> tuple[Run, ReplayGRPOTrainer]:
    """TRL's ``GRPOTrainer`` (``ReplayGRPOTrainer``) on the prompt ``rows`` (TRL's format: a ``prompt`` column,
    plain or conversational, and the reward functions' columns), the model and tokenizer loaded from ``model_dir``,
    trained on the recorded ``generations`` in ``order``. Returns the run (``Run.steps``: its log records with a
    ``loss``) and the trainer."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reset_accelerate_state()
    trainer = ReplayGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward_funcs,
                                args=args, train_dataset=datasets.Dataset.from_list(rows),
                                processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=peft_config,
                                generations=generations, order=order)
    initial = trainable(trainer.model)
    trainer.train()
    steps = [r for r in trainer.state.log_history if "loss" in r]
    return Run(steps, [], initial, trainable(trainer.model)), trainer
