"""The non-finite guard: a step whose loss, gradient or new weights are not finite is never applied,
checkpointed or published; the run stops at that step, naming what went wrong first.

Skipping such a step quietly (what the trainer used to do) trains on, publishes the same weights and
reports a plausible reward at the end; a NaN is a bug or bad data, and the person wants to know where.
Every rank checks its own micro-batches and shards; one all-reduce makes them agree, so all ranks stop
together.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


class NonFiniteStep(RuntimeError):
    def __init__(self, step: int, what: str):
        self.step = step
        super().__init__(f"step {step}: {what} is not finite; nothing of step {step} was applied, checkpointed or "
                         "published (stopping: a NaN is bad data or a bug, not noise to train through)")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly FSDP-sharded, DTensor) tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def first_non_finite(named: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    for name, tensor in named:
        if tensor is not None and tensor.is_floating_point() and not torch.isfinite(local(tensor)).all():
            return name
    return None


def check(step: int, found: str | None, what: str, device: torch.device) -> None:
    """Raise on every rank when any rank `found` something (its own name, else 'on another rank')."""
    bad = found is not None
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = bool(flag.item())
    if bad:
        raise NonFiniteStep(step, f"{what} {found}" if found else f"{what} (on another rank)")


def grads(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor | None]]:
    return ((name, p.grad) for name, p in model.named_parameters())


def weights(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    return model.named_parameters()
