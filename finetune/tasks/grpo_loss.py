"""GRPO's numbers as TRL 1.16 computes them (``trl/trainer/grpo_trainer.py``): the weighted reward and its
group-relative advantage (``_generate_and_score_completions``, the "sum_then_normalize" branch, lines 2756-2806),
the clipped per-token policy-gradient term with the k3 KL penalty (``_compute_loss``, lines 3085-3150), and each
aggregation's numerator and denominator (lines 3152-3175), written so that a window's loss is a sum over its
micro-batches divided by one count over the whole window and every process (``AGGREGATIONS``)."""

from __future__ import annotations

import math

import torch

from finetune.data.loading import IGNORE_INDEX

# loss type -> what its denominator counts, over the whole window on every process (the loop's ``items``)
AGGREGATIONS = {
    "dapo": "the window's active completion tokens",
    "dr_grpo": "the window's completions x --max_completion_length",
    "grpo": "the window's completions, each the mean over its own tokens",
    "bnpo": "micro-batches, each the mean over its own active tokens (TRL's: depends on the split)",
}


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (NaN for fewer than 2 values): TRL 1.16
    ``trainer/utils.py`` ``nanstd``."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


def weighted_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(completions,) rewards: each function's reward (``per_func``, (completions, functions), NaN where it gave
    None) times its weight, NaN-summed; NaN where every function gave None (TRL: unscorable)."""
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = float("nan")
    return rewards


def advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, std used) of the whole generation batch's ``rewards`` (completions,), groups of
    ``num_generations`` consecutive completions: reward - its group's NaN-mean, divided by (std + 1e-4) where
    ``scale_rewards`` is "group" (the group's std) or "batch" (the whole batch's), not for "none"; an unscorable
    completion's advantage is 0. Raises ``ValueError`` for another ``scale_rewards``."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards in ("group", "none"):
        std = (nanstd(grouped, dim=1).repeat_interleave(num_generations) if num_generations > 1
               else torch.zeros_like(rewards))
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"scale_rewards {scale_rewards!r}: group, batch or none")
    result = rewards - mean
    if scale_rewards != "none":
        result = result / (std + 1e-4)
    return torch.nan_to_num(result, nan=0.0), std


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(per-token log-probabilities (rows, seq-1), mask of trained positions (rows, seq-1), per-token entropies or
    None), fp32, of ``labels`` shifted by one under ``logits`` / ``temperature`` (TRL's fused LM head divides by the
    temperature); masked positions hold 0."""
    logits = logits[:, :-1].float() / temperature
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    log_probs = torch.log_softmax(logits, dim=-1)
    logps = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    ent = -(log_probs.exp() * log_probs).sum(-1) * mask if entropy else None
    return logps, mask, ent


def per_token_loss(logps, old_logps, ref_logps, advantages_, epsilon_low: float, epsilon_high: float, beta: float):
    """(loss (rows, T), ratio (rows, T), KL or None): TRL's clipped surrogate ``-min(r A, clip(r, 1-el, 1+eh) A)``
    with r = exp(logp - old logp), plus ``beta`` x the k3 estimate ``exp(ref - logp) - (ref - logp) - 1`` times r
    (GRPOConfig's ``use_bias_correction_kl``, default True, ``_compute_loss`` lines 3095-3105: r is 1 on-policy but
    differentiable, so it adds KL x grad logp to the gradient; the KL returned, and logged, is the corrected one)."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages_.unsqueeze(1)
    loss = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        kl = (torch.exp(ref_logps - logps) - (ref_logps - logps) - 1) * ratio
        loss = loss + beta * kl
    return loss, ratio, kl


def clip_extremes(low_clipped: torch.Tensor, high_clipped: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(the least share of a completion's active tokens clipped low, the largest share clipped high) over the rows
    of a micro-batch (masks (rows, T), bool); a row without an active token (an epoch's repeat, a truncated
    completion masked by --mask_truncated_completions) is skipped, as TRL's ``nanmin``/``nanmax`` skip its NaN
    (``_compute_loss``'s ``masked_seq_mean``, lines 3253-3256, then 3280-3283; ``trainer/utils.py`` 1124-1155).
    (inf, -inf) where no row has one."""
    active = mask.sum(-1)
    rows = active > 0
    if not rows.any():
        return float("inf"), float("-inf")
    low = low_clipped.sum(-1)[rows].double() / active[rows]
    high = high_clipped.sum(-1)[rows].double() / active[rows]
    return low.min().item(), high.max().item()


def window_extremes(parts: list) -> list[float]:
    """[clip_ratio/low_min, clip_ratio/high_max] of a window from every process's ``clip_extremes`` (None for a
    process that computed no loss): the least and the largest over them, NaN where no completion had an active
    token (TRL's ``nanmin`` of all NaNs)."""
    found = [p for p in parts if p is not None]
    low = min((p[0] for p in found), default=float("inf"))
    high = max((p[1] for p in found), default=float("-inf"))
    return [low if math.isfinite(low) else float("nan"), high if math.isfinite(high) else float("nan")]


def aggregate(loss: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The micro-batch's share of the window's loss numerator (0-d): the masked per-token ``loss`` summed
    (dapo, dr_grpo), each row's sum over its own tokens (at least 1) summed over rows (grpo), or the micro-batch's
    sum over its own active tokens (at least 1: bnpo, TRL's per-micro-batch mean). Divided by ``count``'s items."""
    masked = loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1)
    return masked.sum()


def items(mask: torch.Tensor, real_rows: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """The micro-batch's items (0-d int): active tokens (dapo), real completions x ``max_completion_length``
    (dr_grpo), real completions (grpo), 1 (bnpo: a micro-batch). ``real_rows``: (rows,) bool, the completions of
    prompts that are not an epoch's repeats (a truncated completion masked by --mask_truncated_completions is real,
    as TRL counts its row)."""
    if loss_type == "dapo":
        return mask.sum()
    if loss_type == "dr_grpo":
        return real_rows.sum() * max_completion_length
    if loss_type == "grpo":
        return real_rows.sum()
    return torch.tensor(1, device=mask.device)
