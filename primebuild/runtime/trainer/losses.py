"""Policy-gradient losses for asynchronous RL, one registry: ``LOSSES[name](...) -> (loss_sum, metrics)``.

Every loss takes per-token tensors of one shape (any shape):
  ``logprobs``            trainer log-prob of each sampled token (carries the gradient),
  ``inference_logprobs``  log-prob of the same token under the policy that sampled it,
  ``advantages``          the sample's advantage, repeated on each of its tokens,
  ``loss_mask``           bool, True on tokens that are trained,
plus keyword params of its own. It returns

  ``loss_sum``  sum of the per-token loss over ``loss_mask`` tokens — *not* averaged: the trainer
                divides it by one constant of the whole step (batch.loss_normalizer), so how tokens are
                split over micro-batches and ranks never changes the gradient;
  ``metrics``   sums over ``loss_mask`` tokens, detached: ``tokens`` (count), ``mismatch_kl``, ``masked``
                (tokens whose PG term was masked, clipped or truncated), ``ratio``. Divide by the total
                ``tokens`` of the step to get means.

Notation: Δ = logprobs − inference_logprobs (trainer minus inference), r = exp(Δ), A = advantage.
The inference policy μ is the behaviour policy: in async RL it is up to a few steps stale, and even at
the same weights it differs numerically from the trainer (other kernels, other precision).

Mismatch KL: mean over tokens of exp(Δ) − Δ − 1 (the "k3" estimator). Tokens are sampled from μ, and
E_μ[r − 1 − log r] = KL(μ ‖ π_trainer), so this estimates KL(inference ‖ trainer); it is ≥ 0 per token
and 0 exactly when the two log-probs agree.

Where the gradient must be an importance-*weighted* policy gradient (weight w without gradient), the
loss is written −A·w·exp(logπ − sg(logπ)): its value is the surrogate −A·w and its gradient is
−A·w·∇logπ, so logged loss values stay comparable across losses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from primebuild.contracts.base import parse_contract
from primebuild.contracts.loss import LOSS_CLASSES, LossConfig, loss_params
from primebuild.errors import UserError

LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]


def kl_per_token(delta: Tensor) -> Tensor:
    """exp(Δ) − Δ − 1 per token (detached, at least fp32: bf16 metrics would round to nothing).

    Written expm1(Δ) − Δ: for the tiny Δ of matched numerics, exp(Δ) − Δ − 1 cancels to rounding noise
    of either sign (a mean of −1e-9 was reported), while expm1 keeps Δ²/2; the clamp takes what is left
    of rounding, as the estimator is ≥ 0 by construction."""
    d = delta.detach()
    d = d.to(torch.promote_types(d.dtype, torch.float32))
    return (torch.expm1(d) - d).clamp_min(0)


def _common_metrics(delta: Tensor, loss_mask: Tensor, masked: Tensor) -> dict[str, Tensor]:
    with torch.no_grad():
        d = delta.detach().to(torch.promote_types(delta.dtype, torch.float32))
        m = loss_mask
        return {
            "tokens": m.sum().float(),
            "mismatch_kl": torch.where(m, kl_per_token(delta), 0.0).sum(),
            "masked": (masked & m).sum().float(),
            "ratio": torch.where(m, torch.exp(d), 0.0).sum(),
        }


def _weighted_pg(logprobs: Tensor, weight: Tensor, advantages: Tensor) -> Tensor:
    """Per-token −A·w·∇logπ with value −A·w (w carries no gradient)."""
    return -advantages * weight.detach() * torch.exp(logprobs - logprobs.detach())


def dppo_kl(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    mask_bound: float,
    kl_tau: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Divergence-masked PPO with a KL penalty.

    A token's PG term −r·A is dropped when the trainer's probability already moved more than ``mask_bound``
    (in probability, not ratio) from the inference probability *in the direction the advantage pushes*:
    p − q > mask_bound for A > 0, q − p > mask_bound for A < 0. Pushing further there would leave the trust region;
    moving back is still allowed. Unlike a ratio clip, a rare token (q tiny) may still move a lot in
    ratio terms while its probability mass moves little. Every trained token also pays
    kl_tau·Δ², which pulls the trainer towards the sampling policy.
    """
    delta_lp = logprobs - inference_logprobs
    ratio = torch.exp(delta_lp)
    with torch.no_grad():
        gap = torch.exp(logprobs.detach()) - torch.exp(inference_logprobs)
        masked = ((advantages > 0) & (gap > mask_bound)) | ((advantages < 0) & (-gap > mask_bound))
    keep = loss_mask & ~masked
    pg = torch.where(keep, -ratio * advantages, 0.0)
    kl = torch.where(loss_mask, kl_tau * delta_lp.pow(2), 0.0)
    return (pg + kl).sum(), _common_metrics(delta_lp, loss_mask, masked)


def aipo(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    is_cap: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Asynchronous importance-weighted policy optimisation (LlamaRL): the policy gradient of every token
    is weighted by the truncated IS ratio min(r, is_cap), with no clipping of the gradient itself — a token
    far off-policy still learns, its weight is only capped to bound the variance."""
    delta_lp = logprobs - inference_logprobs
    ratio = torch.exp(delta_lp)
    weight = torch.clamp(ratio, max=is_cap)
    per_token = torch.where(loss_mask, _weighted_pg(logprobs, weight, advantages), 0.0)
    return per_token.sum(), _common_metrics(delta_lp, loss_mask, ratio.detach() > is_cap)


def grpo(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate −min(r·A, clip(r, 1−clip_low, 1+clip_high)·A) with the inference policy as
    the old policy. Advantages are expected group-normalised (advantages.group_relative_advantages with
    ``normalize_std=True``). ``masked`` counts tokens whose gradient the clip zeroes."""
    delta_lp = logprobs - inference_logprobs
    ratio = torch.exp(delta_lp)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        r = ratio.detach()
        masked = ((advantages > 0) & (r > 1 + clip_high)) | ((advantages < 0) & (r < 1 - clip_low))
    return torch.where(loss_mask, per_token, 0.0).sum(), _common_metrics(delta_lp, loss_mask, masked)


def cispo(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): clip the IS *weight* above at 1+clip_high, stop its gradient, and let the
    gradient flow through logπ of every token — unlike PPO, clipped tokens keep a gradient. No lower
    clip, as in MiniMax-M1. ``masked`` counts clipped weights."""
    delta_lp = logprobs - inference_logprobs
    ratio = torch.exp(delta_lp)
    weight = torch.clamp(ratio, max=1 + clip_high)
    per_token = torch.where(loss_mask, _weighted_pg(logprobs, weight, advantages), 0.0)
    r = ratio.detach()
    masked = r > 1 + clip_high
    return per_token.sum(), _common_metrics(delta_lp, loss_mask, masked)


LOSSES: dict[str, LossFn] = {
    "dppo-kl": dppo_kl,
    "aipo": aipo,
    "grpo": grpo,
    "cispo": cispo,
}


def resolve_loss(loss: str | LossConfig, params: dict[str, Any] | None = None) -> Callable[..., tuple[Tensor, dict]]:
    """The loss with its parameters bound: a loss config, or a name and parameters checked by its config
    class (contracts/loss.py), which also supplies the defaults."""
    if isinstance(loss, str):
        if loss not in LOSS_CLASSES:
            raise UserError(f"unknown loss {loss!r}", hint=f"choose one of: {', '.join(sorted(LOSSES))}")
        cls = LOSS_CLASSES[loss]
        unknown = sorted(set(params or {}) - set(cls.model_fields))
        if unknown:
            raise UserError(f"loss {loss!r} has no parameter(s) {', '.join(unknown)}",
                            hint=f"its parameters are: {', '.join(f for f in cls.model_fields if f != 'name')}")
        loss = parse_contract(cls, {"name": loss, **(params or {})}, where=f"loss {loss!r}")
    fn, bound_params = LOSSES[loss.name], loss_params(loss)

    def bound(logprobs, inference_logprobs, advantages, loss_mask):
        return fn(logprobs, inference_logprobs, advantages, loss_mask, **bound_params)

    bound.__name__ = f"{fn.__name__}_bound"
    return bound
