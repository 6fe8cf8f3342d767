"""Weights that travel one group at a time: the layout (every tensor's name, dtype and shape) is known
before any byte, the tensors come in groups (a decoder layer, say) in layout order. A writer or sender
then holds one group, never the whole model: publishing a model that only fits sharded stays possible.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class StreamedWeights(Protocol):
    layout: list[TensorSpec]

    def groups(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The tensors in layout order, a group at a time; a group may be dropped once the next is asked for."""
        ...


class InMemoryWeights:
    """A state dict already in memory, as one group."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.state_dict = dict(state_dict)
        self.layout = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in self.state_dict.items()]

    def groups(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        yield list(self.state_dict.items())


def as_stream(weights: Mapping[str, torch.Tensor] | StreamedWeights) -> StreamedWeights:
    return InMemoryWeights(weights) if isinstance(weights, Mapping) else weights


def in_layout_order(weights: StreamedWeights) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Every tensor with its spec, checked against the layout announced before (a stream that differs
    from its own layout would write a file whose header lies)."""
    specs = iter(weights.layout)
    for group in weights.groups():
        for name, tensor in group:
            spec = next(specs, None)
            if spec is None or spec.name != name or spec.dtype != tensor.dtype or spec.shape != tuple(tensor.shape):
                raise RuntimeError(f"weight stream: got {name} {tensor.dtype} {tuple(tensor.shape)}, layout says {spec}")
            yield spec, tensor
        group = tensor = None  # this group is dropped before the next one is gathered: one group held, not two
    if (left := next(specs, None)) is not None:
        raise RuntimeError(f"weight stream ended before {left.name}")
