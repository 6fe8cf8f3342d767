"""On-policy distillation: the teacher's log-probs of the student's own sampled tokens, as a per-token
penalty on the advantage.

Every sampled completion token t carries three log-probs: the trainer's (with gradient), the sampler's
μ_t (`inference_logprobs`) and the teacher's τ_t (`teacher_logprobs`, scored by the teacher's own
inference server: primebuild/runtime/orchestrator/teacher.py). The per-token estimator

    k_t = μ_t − τ_t        (E over tokens sampled from the student = KL(student ‖ teacher), reverse KL)

is folded into the advantage of that token, A_t = A − weight · k_t, and every loss of losses.py then
trains on A_t unchanged. This is the choice of Thinking Machines' on-policy distillation and prime-rl:
the reverse KL is a negative per-token reward. Why not a separate loss term ∇(logπ − τ):
- the teacher signal goes through the same importance weighting and clipping as the reward, which async
  RL needs anyway (the tokens were sampled by a policy up to max_off_policy_steps old);
- it gives per-token credit (a token the teacher finds unlikely is pushed down, the rest of the
  completion is not), where a sequence-level reward would blur it over the sample;
- k_t uses the sampler's log-prob, a constant: the gradient is −A_t·∇logπ, the REINFORCE form of
  ∇KL(π ‖ teacher) at the sampled tokens, and the loss needs no second path.

Tokens without a teacher score (the environment's tokens of a multi-turn rollout, masked anyway) carry
τ_t = μ_t in the micro-batch (batch.py), so their penalty is exactly 0.
"""

from __future__ import annotations

from torch import Tensor


def reverse_kl_per_token(inference_logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """k_t = μ_t − τ_t: positive where the student is surer of its token than the teacher is."""
    return inference_logprobs - teacher_logprobs


def distilled_advantages(advantages: Tensor, inference_logprobs: Tensor, teacher_logprobs: Tensor,
                         weight: float) -> Tensor:
    """A_t = A − weight · (μ_t − τ_t), per token (no gradient flows through it)."""
    return advantages - weight * reverse_kl_per_token(inference_logprobs, teacher_logprobs).detach()
