"""On-policy distillation: the teacher's log-probs of the student's own sampled tokens, as a per-token
penalty on the advantage.

Every sampled completion token t carries three log-probs: the trainer's (with gradient), the sampler's
μ_t (`inference_logprobs`) and the teacher's τ_t (`teacher_logprobs`, scored by the teacher's own
inference server: primebuild/runtime/orchestrator/teacher.py). The per-token estimator

    k_t = μ_t − τ_t        (E over tokens sampled from the student = KL(student ‖ teacher), reverse KL)

is folded into the advantage of that token, A_t = A − weight · (k_t − k̄), and every loss of losses.py
then trains on A_t unchanged: the reverse KL is a negative per-token reward, as in Thinking Machines'
on-policy distillation and prime-rl. Why an advantage penalty and not a separate loss term ∇(logπ − τ):
- the teacher signal goes through the same importance weighting and clipping as the reward, which async
  RL needs anyway (the tokens were sampled by a policy up to max_off_policy_steps old);
- it gives per-token credit (a token the teacher finds unlikely is pushed down, the rest of the
  completion is not), where a sequence-level reward would blur it over the sample;
- k_t uses the sampler's log-prob, a constant: the gradient is −A_t·∇logπ, the REINFORCE form of
  ∇KL(π ‖ teacher) at the sampled tokens, and the loss needs no second path.

k̄ is the mean of k_t over the step's trained tokens, a baseline: it leaves the expected gradient as it
is (E[∇logπ] = 0) and removes what made the uncentred penalty fail here. k_t is positive on most tokens
(the mean is the KL, ~1.7 nats at the reverse-text start), so uncentred nearly every sampled token got a
negative advantage and was pushed down: measured over 100 steps (bench/RESULTS.md), the policy's entropy
stayed at 2.0 nats where RL alone took it to 1.3, and the held-out reward fell. Tinker's KL-to-reference
penalty centres the same way.

Tokens the teacher did not score carry NaN in the micro-batch's teacher column (batch.py) and keep their
advantage as it is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from primebuild.contracts.rollout import Sample


def reverse_kl_per_token(inference_logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """k_t = μ_t − τ_t: positive where the student is surer of its token than the teacher is."""
    return inference_logprobs - teacher_logprobs


def teacher_baseline(samples: list[Sample]) -> float:
    """k̄: the mean of μ_t − τ_t over the trained tokens the teacher scored, over the whole step (every
    rank computes it from the whole batch, so all ranks use the same)."""
    total, count = 0.0, 0
    for s in samples:
        if s.teacher_logprobs is None:
            continue
        mask = s.completion_mask or [1] * len(s.completion_ids)
        for mu, tau, m in zip(s.inference_logprobs, s.teacher_logprobs, mask, strict=True):
            if m:
                total += mu - tau
                count += 1
    return total / count if count else 0.0


def distilled_advantages(advantages: Tensor, inference_logprobs: Tensor, teacher_logprobs: Tensor,
                         weight: float, baseline: float = 0.0) -> Tensor:
    """A_t = A − weight · (μ_t − τ_t − k̄) where the teacher scored the token, A elsewhere (no gradient)."""
    k = reverse_kl_per_token(inference_logprobs, teacher_logprobs).detach()
    return torch.where(torch.isnan(k), advantages, advantages - weight * (k - baseline))
