"""The GRPO section: the flags only a GRPO recipe (``TASK = "grpo"``, e.g. ``grpo`` on your prompts) reads, with
TRL 1.16 ``GRPOConfig``'s names and defaults (``grpo_config.py``): ``num_generations``, ``max_completion_length``,
``temperature``, ``top_p``, ``epsilon``, ``epsilon_high``, ``scale_rewards``, ``num_iterations``,
``mask_truncated_completions``, ``reward_funcs``, ``reward_weights``, ``use_vllm``, ``vllm_mode``,
``vllm_gpu_memory_utilization``, ``vllm_max_model_length``, ``vllm_tensor_parallel_size``; and ours,
``replay_completions``. ``--beta`` and
``--loss_type`` are the preference section's flags, read by each task with its own values (grpo|dr_grpo|dapo|bnpo
here: ``GRPO_LOSS_TYPES``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from finetune.config.flags import check_positive_int, flag
from finetune.errors import FinetuneError

# TRL 1.16's aggregations that this task trains; what each divides a window's summed per-token loss by
GRPO_LOSS_TYPES = ("dapo", "dr_grpo", "grpo", "bnpo")
VLLM_MODES = ("colocate", "server")  # GRPOConfig's vllm_mode values; colocate is the one built here


def reward_func_names(spec: str | None) -> list[str]:
    """``--reward_funcs``' ``module:function`` entries (comma-separated), stripped; [] for None."""
    return [part.strip() for part in (spec or "").split(",") if part.strip()]


def reward_weight_values(spec: str | None, count: int) -> list[float]:
    """``--reward_weights`` as floats (comma-separated), or ``count`` ones where unset (TRL's default). Raises
    ``FinetuneError`` for a number that is not one, or a count that differs from the reward functions'."""
    if spec is None:
        return [1.0] * count
    try:
        weights = [float(part) for part in spec.split(",")]
    except ValueError:
        raise FinetuneError(f"--reward_weights {spec!r}: comma-separated numbers, one per --reward_funcs entry."
                            ) from None
    if len(weights) != count:
        raise FinetuneError(f"--reward_weights has {len(weights)} value(s), --reward_funcs {count}: give one weight "
                            "per reward function.")
    return weights


@dataclass
class GRPOArguments:
    """Online RL with group-relative advantages (``finetune.tasks.grpo``)."""

    num_generations: int = flag(
        8, "GRPO (GRPOConfig's name and default): completions sampled per prompt, one group; a micro-batch of m "
        "prompts trains m x num_generations completions.",
        step=True, trainer=None,
    )
    max_completion_length: int = flag(
        256, "GRPO (GRPOConfig's name and default): the most tokens a completion is generated to; one cut there is "
        "truncated (completions/clipped_ratio).",
        step=True, trainer=None,
    )
    temperature: float = flag(
        1.0, "GRPO (GRPOConfig's name and default): the sampling temperature; the log-probabilities trained are of "
        "the logits divided by it, as TRL's.",
        step=True, trainer=None,
    )
    top_p: float = flag(
        1.0, "GRPO (GRPOConfig's name and default): nucleus sampling's probability mass (1.0: off).",
        step=True, trainer=None,
    )
    epsilon: float = flag(
        0.2, "GRPO (GRPOConfig's name and default): the clipped ratio's lower bound is 1 - epsilon (and its upper "
        "1 + epsilon unless --epsilon_high).",
        step=True, trainer=None,
    )
    epsilon_high: float | None = flag(
        None, "GRPO (GRPOConfig's name): the clipped ratio's upper bound is 1 + epsilon_high (DAPO's clip-higher). "
        "Default: --epsilon.",
        step=True, trainer=None,
    )
    scale_rewards: Literal["group", "batch", "none"] = flag(
        "group", "GRPO (GRPOConfig's names and default): advantages are reward - group mean, divided by the group's "
        "std (group), the whole generation batch's std (batch), or not (none).",
        step=True, trainer=None,
    )
    num_iterations: int = flag(
        1, "GRPO (GRPOConfig's name and default): optimizer steps per generation (mu): each window trains mu "
        "steps on one generation, against the old log-probabilities kept from it.",
        step=True, trainer=None,
    )
    mask_truncated_completions: bool = flag(
        False, "GRPO (GRPOConfig's name and default): completions cut at --max_completion_length add no loss.",
        step=True, trainer=None,
    )
    reward_funcs: str | None = flag(
        None, "GRPO (GRPOConfig's name): module:function[,module:function...], each called as TRL calls it: "
        "f(prompts, completions, completion_ids, **columns) -> list of float or None (None: no reward from it).",
        step=True, trainer=None,
    )
    reward_weights: str | None = flag(
        None, "GRPO (GRPOConfig's name): comma-separated weights, one per --reward_funcs entry. Default: 1 each.",
        step=True, trainer=None,
    )
    replay_completions: str | None = flag(
        None, "GRPO: take each step's completions from this completions.jsonl (a run's record) instead of "
        "generating them; rewards are computed again.",
        step=True, trainer=None,
    )

    use_vllm: bool = flag(
        False, "GRPO (GRPOConfig's name and default): generate the completions with vLLM (pip install vllm; a GPU) "
        "instead of model.generate, the policy's weights pushed into it before each generation.",
        step=True, trainer=None,
    )
    vllm_mode: Literal["colocate", "server"] = flag(
        "colocate", "GRPO (GRPOConfig's name and default): colocate runs vLLM inside each training process on its "
        "GPU; server (a separate vllm serve) is not built.",
        step=False, trainer=None,
    )
    vllm_gpu_memory_utilization: float = flag(
        0.3, "GRPO (GRPOConfig's name and default): with --use_vllm, the share of the GPU's memory vLLM reserves "
        "(weights and KV cache), in (0, 1].",
        step=False, trainer=None,
    )
    vllm_max_model_length: int | None = flag(
        None, "GRPO (GRPOConfig's name): with --use_vllm, vLLM's context window in tokens (the longest prompt plus "
        "--max_completion_length at least). Default: the model config's.",
        step=False, trainer=None,
    )
    vllm_tensor_parallel_size: int = flag(
        1, "GRPO (GRPOConfig's name and default): with --use_vllm, the processes one vLLM engine spans (tensor "
        "parallel); it must divide the number of processes.",
        step=False, trainer=None,
    )

    def _check_grpo(self) -> None:
        """Counts, bounds and the reward functions' weights (``reward_weight_values``)."""
        for name in ("num_generations", "max_completion_length", "num_iterations"):
            check_positive_int(name, getattr(self, name))
        if not self.temperature > 0:
            raise FinetuneError(f"--temperature must be positive, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise FinetuneError(f"--top_p must lie in (0, 1], got {self.top_p}.")
        for name in ("epsilon", "epsilon_high"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise FinetuneError(f"--{name} must be >= 0, got {value}.")
        reward_weight_values(self.reward_weights, len(reward_func_names(self.reward_funcs)))
        if self.use_vllm:
            self._check_vllm()

    def _check_vllm(self) -> None:
        """``--use_vllm``'s settings: colocate mode (server is refused), a memory share in (0, 1], positive sizes."""
        if self.vllm_mode != "colocate":
            raise FinetuneError(f"--vllm_mode {self.vllm_mode} is not built: only colocate (vLLM inside each training "
                                "process, on its GPU) is; drop --vllm_mode or pass --vllm_mode colocate.")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise FinetuneError("--vllm_gpu_memory_utilization must lie in (0, 1], got "
                                f"{self.vllm_gpu_memory_utilization}.")
        check_positive_int("vllm_tensor_parallel_size", self.vllm_tensor_parallel_size)
        if self.vllm_max_model_length is not None:
            check_positive_int("vllm_max_model_length", self.vllm_max_model_length)
