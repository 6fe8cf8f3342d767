"""What each rank sums over its own tokens during one step, by name, and one tensor to all-reduce it."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class StepSums:
    """Sums over this rank's micro-batches; summed over ranks they are the step's totals. Fields are
    floats or 0-d tensors (on any device); `to_tensor` packs them into one float64 vector in field
    order, so a single all-reduce carries them all, and `from_tensor` names them again."""

    loss: float | torch.Tensor = 0.0
    tokens: float | torch.Tensor = 0.0  # trained tokens
    kl: float | torch.Tensor = 0.0  # behaviour KL summed over trained tokens
    masked: float | torch.Tensor = 0.0  # trained tokens whose PG term was masked, clipped or truncated
    ratio: float | torch.Tensor = 0.0
    entropy: float | torch.Tensor = 0.0
    real: float | torch.Tensor = 0.0  # real (attended) positions this rank computed
    padded: float | torch.Tensor = 0.0  # all positions this rank computed, padding included
    # samples drawn with exactly the weights being trained (policy version step-1)
    fresh_tokens: float | torch.Tensor = 0.0
    fresh_kl: float | torch.Tensor = 0.0
    # router replay: the same tokens scored without replay, and routes the trainer's router chose itself
    kl_no_replay: float | torch.Tensor = 0.0
    fresh_kl_no_replay: float | torch.Tensor = 0.0
    agreed_routes: float | torch.Tensor = 0.0
    replayed_routes: float | torch.Tensor = 0.0
    # on-policy distillation: the reverse-KL estimate μ − τ summed over trained tokens the teacher scored
    teacher_kl: float | torch.Tensor = 0.0
    teacher_tokens: float | torch.Tensor = 0.0

    def to_tensor(self) -> torch.Tensor:
        values = (getattr(self, f.name) for f in fields(self))  # not astuple: it deep-copies the tensors
        return torch.stack([torch.as_tensor(v).detach().double().cpu() for v in values])

    @classmethod
    def from_tensor(cls, packed: torch.Tensor) -> StepSums:
        return cls(*packed.tolist())

    @classmethod
    def size(cls) -> int:
        return len(fields(cls))
