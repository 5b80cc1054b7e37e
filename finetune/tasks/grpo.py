"""GRPO (online RL with group-relative advantages, TRL 1.16 ``GRPOTrainer``'s losses) as a task. The data is
prompts (``data.prompts``); a micro-batch of m prompts becomes, at each optimizer step, m x ``--num_generations``
completions sampled by the policy itself (``rollout``: the task's ``rollout`` hook, called by the loop once per
window before it counts the window), with ``model.generate`` or, with ``--use_vllm``, a vLLM engine in the process
that the policy's weights are pushed into before each generation (``vllm_generation``). Rewards come from ``--reward_funcs``; advantages are normalised over the whole
generation batch (the window on every process, gathered), never per micro-batch; each loss type's denominator is
counted over the whole window and every process (``grpo_loss.AGGREGATIONS``), so any split of a step's completions
trains what the large batch does (``bnpo``, TRL's per-micro-batch mean, excepted and said so).

The reference, where ``--beta`` > 0: a frozen copy of the starting model, or the policy with its LoRA adapter
disabled. The old policy's log-probabilities: with ``--num_iterations`` 1 the current ones, detached (TRL's); with mu > 1
computed once at generation (no gradients, the model as it trains) and kept for the generation's mu optimizer steps,
also in ``<output_dir>/grpo_generation`` (``rollout.keep_generation``) for a resume inside them."""

from __future__ import annotations

import contextlib

import datasets
import torch

import finetune.tasks.grpo_loss as grpo_loss
import finetune.tasks.rollout as rollout
import finetune.tasks.vllm_generation as vllm_generation
from finetune.config.grpo import GRPO_LOSS_TYPES, reward_func_names, reward_weight_values
from finetune.data.chat import end_of_turn_ids
from finetune.data.loading import IGNORE_INDEX
from finetune.data.prompts import check_prompt_rows, is_conversation, load_prompt_files, prompts_to_features
from finetune.distributed import is_main_process
from finetune.errors import FinetuneError
from finetune.tasks.base import unwrapped
from finetune.tasks.causal_lm import CausalLM
from finetune.tasks.preference import frozen_copy

_CAUSAL_LM = CausalLM()
ROLLOUT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                   "completions/clipped_ratio")
PROMPT_BATCH = ("input_ids", "attention_mask", "prompt_index", "labels")  # PromptCollator's keys
TOKEN_METRICS = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
# over the window's completions on every process: the least share of a completion's tokens clipped low, the largest
# clipped high (TRL's, per micro-batch: grpo_loss.clip_extremes)
EXTREME_METRICS = ("clip_ratio/low_min", "clip_ratio/high_max")


class PromptCollator:
    """Prompt rows -> ``input_ids`` (right-padded with ``pad_id``), ``attention_mask``, ``prompt_index`` (the row's
    position in its split) and ``labels`` (rows, 1) of 0: the loop marks an epoch's repeated rows there."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, features: list[dict]) -> dict:
        width = max(len(f["prompt_ids"]) for f in features)
        ids = [f["prompt_ids"] + [self.pad_id] * (width - len(f["prompt_ids"])) for f in features]
        mask = [[1] * len(f["prompt_ids"]) + [0] * (width - len(f["prompt_ids"])) for f in features]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask),
                "prompt_index": torch.tensor([f["prompt_index"] for f in features]),
                "labels": torch.zeros(len(features), 1, dtype=torch.long)}


def none_for_nan(value: float) -> float | None:
    """``value``, or None for NaN (JSON has no NaN: a reward function that gave none)."""
    return None if value != value else value


def completion_batch(prompts: list[list[int]], completions: list[list[int]], trained: list[bool], pad_id: int) -> dict:
    """One row per completion: its prompt then its completion, right-padded with ``pad_id``; ``labels`` the
    completion's tokens where ``trained``, else ``IGNORE_INDEX``."""
    rows = [p + c for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX)
    for i, (p, row, train) in enumerate(zip(prompts, rows, trained)):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
        if train:
            labels[i, len(p):len(row)] = torch.tensor(row[len(p):])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class GRPOTask:
    """GRPO over prompts: ``for_run(config)`` gives the run's own instance (loss type, beta, clipping, rewards);
    ``attach`` gives it the training rows, the tokenizer's stop tokens and, where ``beta`` > 0 without LoRA, a
    frozen reference; ``rollout`` turns a window of prompt micro-batches into completion micro-batches."""

    name = "grpo"
    packs = False
    no_packing_reason = "a window's completions are generated at each step; packing them is not built"
    chunked_loss = False
    chat = True
    class_labels = False
    peft_task_type = "CAUSAL_LM"
    pipeline_tag = "text-generation"
    probe_label_names = None
    generates = True  # the completions trained are sampled at each step, none is in the data

    def __init__(self, config=None):
        self.config = config
        self.loss_type = config.loss_type if config is not None else "dapo"
        self.functions = []  # [(name, reward function)]
        self.weights = torch.ones(0)
        self.reference_model = None
        self.rows = {}  # split -> the tokenized split (its raw columns feed the reward functions)
        self.tokenizer = None
        self.stop_ids, self.pad_id = [], 0
        self.replay = None
        self._metric_sums = None
        self._extremes = None  # this process's (least low-clipped share, largest high-clipped share) of the window
        self._window = {}  # the current window's global figures (rollout)
        self._first_step = True
        self._policy = None  # the unwrapped policy of the current window (the disabled adapter's reference)
        self._generation = None  # --num_iterations > 1: (step, completion micro-batches, window figures)
        self.vllm = None  # --use_vllm: the process's colocated engine (vllm_generation.ColocatedVLLM)
        self._shown = []  # this process's (prompt index, sample) of the evaluation under way (eval_samples)

    # ---- facts that depend on the run
    @property
    def loss_name(self) -> str:
        """What the loss is a mean of (the model card)."""
        return f"{self.loss_type} GRPO loss per {'token' if self.loss_type == 'dapo' else 'completion'}"

    @property
    def counts_tokens(self) -> bool:
        """Items are tokens under dapo."""
        return self.loss_type == "dapo"

    @property
    def split_dependence(self) -> str | None:
        """Why ``bnpo`` depends on the split (its definition, TRL 1.16's own words); None for the other types."""
        if self.loss_type != "bnpo":
            return None
        return ("--loss_type bnpo is split-dependent by definition: TRL 1.16 divides each micro-batch's loss by its "
                "own active tokens and averages the micro-batches (\"results may slightly vary depending on the local "
                "batch size, despite a constant effective batch size\", GRPOConfig's loss_type help), so another "
                "split trains other weights. This is bnpo, not a fault of the engine: dapo, dr_grpo and grpo are exact "
                "under any split")

    @property
    def mean_of_means(self) -> tuple[str, dict] | None:
        """verify's positive control for GRPO: the mean of micro-batch means over their own completion tokens (TRL's
        ``bnpo`` aggregation trained on the split), the wrong normalisation a GRPO loop falls into; None under
        bnpo itself (the generic control)."""
        if self.loss_type == "bnpo":
            return None
        return ("the mean of micro-batch means: each micro-batch's loss the mean over its own completion tokens, then "
                "the mean over the window's micro-batches (bnpo's aggregation)", {"loss_type": "bnpo"})

    @property
    def step_metrics(self) -> tuple[str, ...]:
        """TRL's names of the per-step metrics (``take_metric_sums``' order)."""
        rewards = tuple(f"rewards/{name}/mean" for name, _ in self.functions)
        return (ROLLOUT_METRICS + rewards + TOKEN_METRICS + (("kl",) if self.config and self.config.beta else ())
                + EXTREME_METRICS)

    # ---- a run's own task
    def for_run(self, config) -> "GRPOTask":
        """The run's task. Raises ``FinetuneError`` under ``--backend trainer``, for a loss type that is not GRPO's,
        reward functions that cannot be loaded, or ``--use_vllm`` where it cannot run (``require_vllm``)."""
        if config.backend == "trainer":
            raise FinetuneError("the grpo task runs on --backend accelerate only (each step generates its completions "
                                "inside the loop): drop --backend trainer.")
        if config.loss_type not in GRPO_LOSS_TYPES:
            raise FinetuneError(f"--loss_type {config.loss_type} is not a GRPO aggregation: use one of "
                                f"{', '.join(GRPO_LOSS_TYPES)} (TRL 1.16's names; dapo is its default).")
        task = GRPOTask(config)
        names = reward_func_names(config.reward_funcs)
        task.functions = rollout.reward_functions(names)
        task.weights = torch.tensor(reward_weight_values(config.reward_weights, len(names)), dtype=torch.float32)
        if config.replay_completions:
            task.replay = rollout.read_replay(config.replay_completions)
        elif config.use_vllm:
            vllm_generation.require_vllm(config)
        return task

    def attach(self, model, tokenized, collator, config, main_process_first, device, precision="no"):
        """Keep the tokenized splits (their raw columns feed the rewards), where ``beta`` > 0 without LoRA a frozen
        copy of ``model`` as the reference, and with ``--use_vllm`` (generating, not replaying) the process's vLLM
        engine; ``tokenized`` unchanged."""
        self.rows = dict(tokenized)
        if config.beta and not config.use_peft:
            self.reference_model = frozen_copy(model)
        if config.use_vllm and self.replay is None and self.vllm is None:
            self.vllm = vllm_generation.ColocatedVLLM(config)
        return tokenized

    def note(self) -> str | None:
        """The banner's line on vLLM's generation (``ColocatedVLLM.note``), or None without it."""
        return self.vllm.note() if self.vllm is not None else None

    def keep(self, output_dir) -> None:
        """Nothing derived to write (the completions are recorded as they are generated)."""
        return

    # ---- data
    def load_model(self, config, label_names=None):
        """The causal LM of ``--model_name_or_path`` (``CausalLM.load_model``)."""
        return _CAUSAL_LM.load_model(config, label_names)

    def load_files(self, train_file, validation_file, text_columns=None, cache_dir=None):
        """JSON-lines prompt-only rows (``prompts.load_prompt_files``)."""
        return load_prompt_files(train_file, validation_file, cache_dir)

    def check_rows(self, split) -> None:
        """Raise ``FinetuneError`` naming the first row whose prompt is neither a text nor a conversation."""
        check_prompt_rows(split)

    def tokenize(self, raw, tokenizer, config, text_columns=None):
        """Each split's prompts tokenized (``prompts.prompts_to_features``); the tokenizer's stop tokens kept for
        generation."""
        self.tokenizer = tokenizer
        self.stop_ids = end_of_turn_ids(tokenizer) if getattr(tokenizer, "chat_template", None) else [
            tokenizer.eos_token_id]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        return datasets.DatasetDict({split: prompts_to_features(ds, tokenizer, config.max_length)
                                     for split, ds in raw.items()})

    def collator(self, tokenizer, pad_to_multiple_of):
        """``PromptCollator``."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return PromptCollator(pad)

    def item_lengths(self, dataset) -> list[int]:
        """Prompt tokens per row."""
        return [len(ids) for ids in dataset["prompt_ids"]]

    # ---- the step
    def rollout(self, model, window: list[dict], step: int) -> list[dict]:
        """The completion micro-batches of a window of prompt micro-batches at optimizer ``step`` (1-based): each
        prompt's group generated (seeded by seed, step and prompt) or replayed, rewarded, its advantages
        normalised over the whole window on every process, the completions recorded; one completion micro-batch
        per prompt micro-batch, each with ``advantages``, the ``ref_logps`` where ``beta`` > 0, and the prompt
        micro-batch's sample ids. Collective (one all_gather_object). Raises ``FinetuneError`` for a replay
        without a prompt's completions, or a reward function that returns another number of rewards."""
        config, G = self.config, self.config.num_generations
        policy = self._policy = unwrapped(model)
        mu, generation_step = config.num_iterations, step - (step - 1) % config.num_iterations
        if mu > 1 and step != generation_step:  # a later step of the same generation (--num_iterations)
            return self._reused(generation_step)
        step = generation_step
        prompts = [[(batch["input_ids"][r][batch["attention_mask"][r].bool()].tolist(), int(batch["prompt_index"][r]),
                     bool(batch["labels"][r, 0] != IGNORE_INDEX)) for r in range(batch["input_ids"].shape[0])]
                   for batch in window]
        completions = iter(self._completions(policy, [row for rows in prompts for row in rows], step))
        # per micro-batch: [(prompt ids, prompt index, real, [completion ids] x G)]
        groups = [[(prompt, index, ok, next(completions)) for prompt, index, ok in rows] for rows in prompts]
        real = [(index, c) for rows in groups for _, index, ok, cs in rows if ok for c in cs]
        rewards = self._rewards(real)
        truncated = [not self.ended(c) for _, c in real]
        gathered = rollout.all_processes((rewards.tolist(), [len(c) for _, c in real], truncated))
        everything = torch.tensor([r for rw, _, _ in gathered for r in rw], dtype=torch.float32).view(
            -1, len(self.functions))
        summed = grpo_loss.weighted_rewards(everything, self.weights)
        adv, std = grpo_loss.advantages(summed, G, config.scale_rewards)
        me = torch.distributed.get_rank() if len(gathered) > 1 else 0
        offset = sum(len(g[1]) for g in gathered[:me])
        local_adv = adv[offset:offset + len(real)].tolist()
        self._record(step, real, rewards)
        micro_batches = self._batches(window, groups, local_adv)
        self._window_figures(gathered, everything, summed, std, micro_batches)
        if mu > 1:  # the old policy's log-probabilities, kept with the generation for its mu steps
            with torch.no_grad():
                for batch in micro_batches:
                    logits = model(**self.model_inputs(batch)).logits
                    batch["old_logps"] = grpo_loss.token_logps(logits, batch["labels"], config.temperature)[0]
            self._generation = (step, [dict(b) for b in micro_batches], dict(self._window))
            rollout.keep_generation(config.output_dir, *self._generation)
        return micro_batches

    def _completions(self, policy, rows: list[tuple], step: int) -> list[list[list[int]]]:
        """Each (prompt ids, prompt index, real) row's ``num_generations`` completions at ``step``: replayed, or
        sampled under ``rollout.group_seed(seed, step, prompt)`` by vLLM (the policy's weights pushed first) or by
        ``model.generate``."""
        config, G = self.config, self.config.num_generations
        if self.replay is not None:  # an epoch's repeated row (masked) is in no record: replayed_repeat
            return [rollout.replayed_group(self.replay, config.replay_completions, step, index, G) if kept
                    else rollout.replayed_repeat(self.replay, step, index, G, self.stop_ids[0])
                    for _, index, kept in rows]
        seeds = [rollout.group_seed(config.seed, step, index) for _, index, _ in rows]
        settings = dict(max_new_tokens=config.max_completion_length, temperature=config.temperature,
                        top_p=config.top_p)
        if self.vllm is None:
            return [rollout.generate_group(policy, prompt, G, settings, self.stop_ids, self.pad_id, seed)
                    for (prompt, _, _), seed in zip(rows, seeds)]
        self.vllm.push(policy)
        groups = self.vllm.generate([prompt for prompt, _, _ in rows], [vllm_generation.request_seed(s) for s in seeds],
                                    G, settings, self.stop_ids)
        return [[rollout.cut_at_stop(c, self.stop_ids) for c in group] for group in groups]

    def _reused(self, step: int) -> list[dict]:
        """The completion micro-batches generated at ``step`` (this run's, or those a stopped run kept: a resume
        inside a generation's ``--num_iterations`` steps). Raises ``FinetuneError`` where none is kept."""
        if self._generation is None or self._generation[0] != step:
            self._generation = rollout.read_generation(self.config.output_dir, step)
        self._window = dict(self._generation[2])
        return [dict(b) for b in self._generation[1]]

    def ended(self, completion: list[int]) -> bool:
        """Whether a completion ends in a stop or padding token, not cut at --max_completion_length (TRL 1.16's
        ``is_truncated`` is its negation: ``ids[-1] not in eos_and_pad``)."""
        return bool(completion) and (completion[-1] in self.stop_ids or completion[-1] == self.pad_id)

    def _rewards(self, real: list[tuple[int, list[int]]]) -> torch.Tensor:
        """(completions, functions) rewards of this process's real completions (``rollout.call_rewards``), each
        with its training row's prompt and other columns, as TRL passes them."""
        if not real:
            return torch.zeros(0, len(self.functions))
        split = self.rows["train"]
        rows = [split[index] for index, _ in real]
        skip = {"prompt", "prompt_ids", "prompt_index", "__row__"}
        columns = {k: [row[k] for row in rows] for k in rows[0] if k not in skip}
        prompts = [row["prompt"] for row in rows]
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for _, c in real]
        completions = [[{"role": "assistant", "content": t}] if is_conversation(p) else t
                       for p, t in zip(prompts, texts)]
        return rollout.call_rewards(self.functions, prompts, completions, [c for _, c in real], columns)

    def _record(self, step: int, real: list, rewards: torch.Tensor) -> None:
        """This window's completions into ``completions.jsonl`` (main process; every process's, in process order)."""
        G, names = self.config.num_generations, [n for n, _ in self.functions]
        records = [{"step": step, "prompt": index, "generation": k % G, "completion_ids": c,
                    "rewards": {n: none_for_nan(v) for n, v in zip(names, rewards[k].tolist())}}
                   for k, (index, c) in enumerate(real)]
        every = rollout.all_processes(records)
        if is_main_process():
            rollout.keep_records(self.config.output_dir, [r for part in every for r in part], self._first_step, step)
        self._first_step = False

    def _batches(self, window: list[dict], groups: list, local_adv: list[float]) -> list[dict]:
        """One completion micro-batch per prompt micro-batch (``completion_batch``), with its advantages, whether
        each row is real (not an epoch's repeat), the reference's log-probabilities where ``beta`` > 0 and the
        prompt micro-batch's sample ids."""
        config, out, k = self.config, [], 0
        for batch, rows in zip(window, groups):
            prompts, completions, trained, real, adv = [], [], [], [], []
            for prompt, _, ok, cs in rows:
                for c in cs:
                    cut = self.ended(c)
                    prompts.append(prompt)
                    completions.append(c)
                    trained.append(ok and (cut or not config.mask_truncated_completions))
                    real.append(ok)
                    adv.append(local_adv[k] if ok else 0.0)
                    k += 1 if ok else 0
            built = completion_batch(prompts, completions, trained, self.pad_id)
            device = batch["input_ids"].device
            built = {key: v.to(device) for key, v in built.items()}
            built["advantages"] = torch.tensor(adv, dtype=torch.float32, device=device)
            built["real"] = torch.tensor(real, device=device)
            if config.beta:
                built["ref_logps"] = self._reference_logps(batch["input_ids"].device, built)
            built.update({key: value for key, value in batch.items() if key not in PROMPT_BATCH})  # sample ids
            out.append(built)
        return out

    def _reference_logps(self, device, batch: dict) -> torch.Tensor:
        """(rows, seq-1) per-token log-probabilities of the reference (no gradients): the frozen copy, or the policy
        with its adapter disabled. Raises ``FinetuneError`` where there is none."""
        policy = self._policy
        if self.reference_model is not None:
            reference, context = self.reference_model, contextlib.nullcontext()
            reference.to(device)
        elif hasattr(policy, "disable_adapter"):
            reference, context = policy, policy.disable_adapter()
        else:
            raise FinetuneError("--beta > 0 needs a reference: a frozen copy (without --use_peft) or the disabled "
                                "adapter (--use_peft).")
        with torch.no_grad(), context:
            logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return grpo_loss.token_logps(logits, batch["labels"], self.config.temperature)[0]

    def _window_figures(self, gathered, per_func, summed, std, micro_batches) -> None:
        """The window's global figures: its items and active tokens over every process, and the rollout metrics
        (TRL's: NaN-means over every completion of the window)."""
        local = torch.tensor([float(sum(self.count(b) for b in micro_batches)),
                              float(sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches))])
        totals = torch.tensor(rollout.all_processes(local.tolist())).sum(0).tolist()
        lengths = [n for g in gathered for n in g[1]]
        cut = [t for g in gathered for t in g[2]]
        values = [torch.nanmean(summed).item(), grpo_loss.nanstd(summed).item(),
                  torch.isclose(std, torch.zeros_like(std)).float().mean().item() if len(std) else float("nan"),
                  sum(lengths) / max(len(lengths), 1), sum(cut) / max(len(cut), 1),
                  *[torch.nanmean(per_func[:, j]).item() for j in range(len(self.functions))]]
        self._window = {"items": totals[0], "tokens": totals[1], "values": values}

    def count(self, batch: dict) -> torch.Tensor:
        """The micro-batch's items for its loss type (``grpo_loss.items``): a 0-d int tensor."""
        mask = batch["labels"][:, 1:] != IGNORE_INDEX
        return grpo_loss.items(mask, batch["real"], self.loss_type, self.config.max_completion_length)

    def samples(self, batch: dict) -> int:
        """Prompts in the micro-batch (its rows / ``num_generations``)."""
        return batch["labels"].shape[0] // self.config.num_generations

    def model_inputs(self, batch: dict) -> dict:
        """The forward's arguments: ``input_ids`` and ``attention_mask``."""
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def loss_sum(self, model, batch: dict, forward=None) -> torch.Tensor:
        """The micro-batch's loss numerator (``grpo_loss.aggregate``): the clipped surrogate against the old
        log-probabilities (the current ones, detached) plus ``beta`` x KL to ``ref_logps``; its token metrics'
        sums added up for ``take_metric_sums``."""
        config = self.config
        logits = (forward or model)(**self.model_inputs(batch)).logits
        logps, mask, entropy = grpo_loss.token_logps(logits, batch["labels"], config.temperature, entropy=True)
        high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        loss, ratio, kl = grpo_loss.per_token_loss(logps, old, batch.get("ref_logps"),
                                                   batch["advantages"], config.epsilon, high, config.beta)
        with torch.no_grad():
            adv = batch["advantages"].unsqueeze(1)
            low_clip = (ratio < 1 - config.epsilon) & (adv < 0) & mask
            high_clip = (ratio > 1 + high) & (adv > 0) & mask
            sums = [entropy.double().sum(), low_clip.double().sum(), high_clip.double().sum(),
                    (low_clip | high_clip).double().sum()]
            if config.beta:
                sums.append((kl * mask).double().sum())
            sums = torch.stack(sums).cpu()
            extremes = grpo_loss.clip_extremes(low_clip, high_clip, mask)
        self._metric_sums = sums if self._metric_sums is None else self._metric_sums + sums
        self._extremes = extremes if self._extremes is None else (min(self._extremes[0], extremes[0]),
                                                                  max(self._extremes[1], extremes[1]))
        return grpo_loss.aggregate(loss, mask, self.loss_type)

    def take_metric_sums(self) -> torch.Tensor:
        """The step's metrics as sums the loop divides by the window's items (all processes): the rollout's
        (global already: given by the main process, times the items), the token metrics (this process's sums
        times items / the window's active tokens) and the clip extremes (the window's over every process,
        ``grpo_loss.window_extremes``: given by the main process, times the items). (metrics,) float64. Collective
        on several processes (one ``all_gather_object``)."""
        items, tokens = self._window.get("items", 0.0), self._window.get("tokens", 0.0)
        main = is_main_process()
        head = torch.tensor(self._window.get("values", [0.0] * (len(ROLLOUT_METRICS) + len(self.functions))),
                            dtype=torch.float64)
        head = head * items if main else torch.zeros_like(head)
        tail = self._metric_sums if self._metric_sums is not None else torch.zeros(
            len(self.step_metrics) - len(head) - len(EXTREME_METRICS), dtype=torch.float64)
        tail = tail * (items / tokens) if tokens else torch.full_like(tail, float("nan"))
        extremes = torch.tensor(grpo_loss.window_extremes(rollout.all_processes(self._extremes)), dtype=torch.float64)
        extremes = extremes * items if main else torch.zeros_like(extremes)
        self._metric_sums, self._extremes = None, None
        return torch.cat([head, tail, extremes])

    # ---- evaluation: the held-out prompts' mean reward of one greedy completion each
    def eval_outputs(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        """Per prompt: the weighted reward of its greedy completion (``max_completion_length`` tokens); each prompt,
        completion and rewards kept for ``eval_samples``."""
        policy, split = unwrapped(model), self.rows.get("validation")
        real = []
        for r in range(batch["input_ids"].shape[0]):
            prompt = batch["input_ids"][r][batch["attention_mask"][r].bool()].tolist()
            ids = torch.tensor([prompt], device=batch["input_ids"].device)
            with torch.no_grad():
                out = policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=self.config.max_completion_length, eos_token_id=self.stop_ids,
                                      pad_token_id=self.pad_id)
            real.append((int(batch["prompt_index"][r]), rollout.cut_at_stop(out[0, len(prompt):].tolist(),
                                                                              self.stop_ids)))
        saved, self.rows = self.rows, {"train": split}
        try:
            per_func = self._rewards(real)
        finally:
            self.rows = saved
        rewards = grpo_loss.weighted_rewards(per_func, self.weights)
        names = [name for name, _ in self.functions]
        self._shown += [(index, {"prompt": split[index]["prompt"],
                                 "completion": self.tokenizer.decode(ids, skip_special_tokens=True),
                                 "reward": none_for_nan(reward),
                                 "rewards": {n: none_for_nan(v) for n, v in zip(names, row)}})
                        for (index, ids), reward, row in zip(real, rewards.tolist(), per_func.tolist())]
        return (rewards.to(batch["input_ids"].device),)

    def eval_samples(self) -> list[dict]:
        """The latest evaluation's held-out prompts (as the rows hold them), greedy completions (decoded as the
        reward functions read them), weighted reward and each function's (None where it gave none), gathered
        over the processes in row order, each row once (Accelerate repeats rows to even out the processes'
        shares). Collective on several processes (one ``all_gather_object``)."""
        shown, self._shown = self._shown, []
        every = dict(pair for part in rollout.all_processes(shown) for pair in part)
        return [every[index] for index in sorted(every)]

    def eval_metrics(self, gathered: list[torch.Tensor], metric_specs: dict | None = None) -> dict:
        """``eval_reward`` (the NaN-mean over held-out prompts) and ``eval_samples``."""
        rewards = gathered[0].double() if gathered else torch.zeros(0)
        return {"eval_reward": torch.nanmean(rewards).item() if len(rewards) else float("nan"),
                "eval_samples": len(rewards)}

    def prompt_and_reference(self, row: dict, row_name: str = "row") -> tuple[list[dict], str]:
        """(the prompt as messages, "" : a prompt has no reference text)."""
        prompt = row.get("prompt")
        return (prompt if is_conversation(prompt) else [{"role": "user", "content": str(prompt)}]), ""

    # ---- the tools' hooks
    def data_findings(self, raw, tokenizer, config) -> tuple:
        """No findings of its own (prompts are checked as they load)."""
        return raw, []

    def sequences(self, row: dict) -> dict:
        """The prompt's ids; none of them is trained."""
        return {"": (row["prompt_ids"], [False] * len(row["prompt_ids"]))}

    def probe_batch(self, micro_batch: int, length: int, vocab: int, device) -> dict:
        """``micro_batch`` x ``num_generations`` random rows of a ``length``-token prompt (``--max_length``, a prompt's
        most) and its completion (``--max_completion_length`` tokens, the most generated), all trained."""
        rows = micro_batch * (self.config.num_generations if self.config else 8)
        completion = self.config.max_completion_length if self.config else 0
        ids = torch.randint(0, vocab, (rows, length + completion), device=device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
                 "advantages": torch.ones(rows, device=device), "real": torch.ones(rows, dtype=torch.bool,
                                                                                  device=device)}
        # what ``rollout`` adds beside (``_batches``): the reference's per-token log-probabilities where beta > 0,
        # the old policy's with --num_iterations > 1
        logps = torch.zeros(rows, ids.shape[1] - 1, device=device)
        if self.config is not None and self.config.beta:
            batch["ref_logps"] = logps
        if self.config is not None and self.config.num_iterations > 1:
            batch["old_logps"] = logps.clone()
        return batch

    def resident_bytes(self) -> int:
        """The frozen reference's bytes, if any."""
        if self.reference_model is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.reference_model.parameters())

    def plain_loss_sum(self, model, forward, batch: dict) -> torch.Tensor:
        """``loss_sum`` from ``forward``."""
        return self.loss_sum(model, batch, forward=forward)

    def card_settings(self, config) -> list[tuple[str, object]]:
        """The model card's GRPO rows."""
        return [("GRPO loss (loss_type, beta, epsilon)", f"{config.loss_type}, beta {config.beta}, epsilon "
                 f"{config.epsilon}"), ("generations per prompt", config.num_generations),
                ("reward functions", config.reward_funcs)]
