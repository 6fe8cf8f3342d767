"""The policy's full weights for publishing, gathered one group at a time: a decoder layer, or one
tensor outside the layers. Every rank holds its shards plus the group being gathered, never the whole
model (the all-gather is a collective: every rank iterates the groups; rank 0 writes or sends them).

Names are the checkpoint's own: transformers 5 fuses some tensors on load (MoE experts) and the fusion
is reverted per group, so a layer's experts are published as `experts.{e}.*` like the base checkpoint.
Tied weights (lm_head = embed_tokens) are published under both names, unlike save_pretrained: a server
that reloads in place (vLLM's reload_weights) updates the head only from its own key, and without it
served a head frozen at the first weights (measured: mismatch KL growing from 1e-12 to 3e-4 in 19
synchronous steps). HF loads either form; the bytes of the head are gathered and written twice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from primebuild.runtime.weight_sync.stream import TensorSpec

from .sharded_load import LAYER


def _group_names(names: list[str]) -> list[list[str]]:
    """State-dict names in groups: all of one decoder layer together, every other name alone."""
    groups: dict[str, list[str]] = {}
    for name in names:
        m = LAYER.match(name)
        groups.setdefault(m.group(1) if m else name, []).append(name)
    return list(groups.values())


def _checkpoint_naming(hf: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    try:  # transformers 5 fuses some weights on load (MoE experts); publish the checkpoint's own naming
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    return dict(revert_weight_conversion(hf, tensors))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather for a DTensor)."""
    if not isinstance(t, DTensor):
        return t.detach()
    if t.to_local().device.type != t.device_mesh.device_type:  # CPU-offloaded shards of a GPU mesh
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor().detach()


class PublishedWeights:
    """`StreamedWeights` (weight_sync/stream.py) of a model's state dict in ``dtype`` (integer tensors keep
    theirs), each group renamed by `naming` into the checkpoint's names (by default transformers' own
    reverted fusions, for an HF model; the torchtitan policy maps with its state-dict adapter)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype,
                 naming: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None):
        self.module, self.dtype = module, dtype
        self.naming = naming or functools.partial(_checkpoint_naming, module)
        sharded = module.state_dict()  # DTensors under FSDP: this rank's shards, nothing copied
        self._groups = _group_names(list(sharded))
        self.layout: list[TensorSpec] = []
        for names in self._groups:  # names and shapes after the renaming, from meta tensors
            meta = {n: torch.empty(sharded[n].shape, dtype=self._dtype(sharded[n]), device="meta") for n in names}
            self.layout += [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in self.naming(meta).items()]

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if t.is_floating_point() else t.dtype

    def groups(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        sharded = self.module.state_dict()
        for names in self._groups:
            full = {n: _full(sharded[n]).to("cpu", self._dtype(sharded[n])) for n in names}
            yield list(self.naming(full).items())
            del full

    def drain(self) -> None:
        """Take part in every gather without keeping anything (ranks other than the writer)."""
        for group in self.groups():
            del group  # dropped before the next gather, or two layers would be held at once
