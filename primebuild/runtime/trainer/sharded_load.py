"""Each rank's shards of an HF checkpoint, read straight from its safetensors files.

The model is built on the meta device and parallelised there (EP, FSDP: parameters become DTensors that
know which block of the full tensor each rank owns); then the empty shards are allocated and every rank
reads only its blocks with safetensors' `get_slice` (memory-mapped: bytes of other ranks' blocks are
never touched; the files are unmapped after each decoder layer). A rank's peak is its shards plus one
layer's blocks, so a model that fits sharded loads sharded: nothing ever holds the whole model (torchtitan's meta-init + load, without a DCP copy of
the HF checkpoint).

Checkpoint names are the model's own, except where transformers fuses checkpoint tensors on load (MoE
experts: `experts.{e}.gate_proj.weight` and `.up_proj.weight` become one `experts.gate_up_proj`
[E, 2I, H]); those fusions, read from transformers' conversion mapping, are read block by block too.
A conversion of any other shape is refused by name rather than loaded wrong.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from primebuild.errors import UserError

from .lora import checkpoint_name

Ranges = list[tuple[int, int]]  # one [start, stop) per dimension
LAYER = re.compile(r"^((?:.*\.)?layers\.\d+)\.")  # a decoder layer's names: loaded, published, as one group


class SafetensorsCheckpoint:
    """The tensors of an HF folder (`model.safetensors`, or the shards its index names), by name."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise UserError(f"{folder}: no *.safetensors file", hint="the trainer loads HF safetensors checkpoints")
            weight_map = {}
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), file.name))
        self.folder = folder
        self.weight_map = weight_map
        self._open: dict[str, object] = {}

    def _slice(self, name: str):
        from safetensors import safe_open

        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), framework="pt")
        return self._open[file].get_slice(name)

    def release(self) -> None:
        """Unmap the files: the pages read so far stop counting in this process's memory (a reader holds
        one layer's pages, not the checkpoint's)."""
        self._open.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def read(self, name: str, ranges: Ranges) -> torch.Tensor:
        """The block [start:stop) of every dimension of tensor `name`; only its bytes are read."""
        part = self._slice(name)
        return part[tuple(slice(a, b) for a, b in ranges)] if ranges else part[:]


def _local_block(param: torch.Tensor) -> tuple[torch.Tensor, Ranges]:
    """The tensor this rank fills for `param`, and where it lies in the full tensor."""
    if not isinstance(param, DTensor):
        return param.data, [(0, n) for n in param.shape]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"DTensor local shape {tuple(local.shape)} is not the block {tuple(shape)} it should own")
    return local, [(o, o + n) for o, n in zip(offset, shape, strict=True)]


class _FusedExperts:
    """A parameter transformers fuses from per-expert checkpoint tensors: expert e's `sources` (patterns
    with `*` for e) stacked along a new dim 0, then concatenated along `cat_dim` if there are several."""

    def __init__(self, prefix: str, sources: list[str], cat_dim: int | None, ckpt: SafetensorsCheckpoint):
        self.keys = [lambda e, s=s: prefix + s.replace("*", str(e)) for s in sources]
        self.cat_dim = cat_dim
        self.ckpt = ckpt
        first = [k(0) for k in self.keys]
        missing = [k for k in first if k not in ckpt]
        if missing:
            raise UserError(f"{ckpt.folder}: no tensor {missing[0]}")
        # each source's extent along the concatenated dim (in the stacked tensor's numbering)
        self.widths = [ckpt.shape(k)[cat_dim - 1] if cat_dim else 0 for k in first]

    def read(self, ranges: Ranges) -> torch.Tensor:
        (e0, e1), inner = ranges[0], ranges[1:]
        if self.cat_dim is None:
            return torch.stack([self.ckpt.read(self.keys[0](e), inner) for e in range(e0, e1)])
        parts, start = [], 0
        lo, hi = ranges[self.cat_dim]
        for key, width in zip(self.keys, self.widths, strict=True):
            a, b = max(lo, start), min(hi, start + width)
            if a < b:
                block = list(inner)
                block[self.cat_dim - 1] = (a - start, b - start)
                parts.append(torch.stack([self.ckpt.read(key(e), block) for e in range(e0, e1)]))
            start += width
        return torch.cat(parts, dim=self.cat_dim)


def _fusions(hf: nn.Module) -> list[tuple[str, list[str], int | None]]:
    """(target suffix, source patterns, concatenation dim) of every fusion transformers applies on load."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    except ImportError:  # transformers 4: checkpoint names are parameter names
        return []
    out = []
    for conversion in get_model_conversion_mapping(hf, add_legacy=False) or []:
        if not isinstance(conversion, WeightConverter):
            continue
        ops = list(conversion.operations)
        shape_ok = (len(conversion.target_patterns) == 1 and ops and isinstance(ops[0], MergeModulelist)
                    and ops[0].dim == 0 and (len(ops) == 1 and len(conversion.source_patterns) == 1
                                             or len(ops) == 2 and isinstance(ops[1], Concatenate)))
        if not shape_ok:
            raise UserError(f"{type(hf).__name__}: transformers converts {conversion.source_patterns} -> "
                            f"{conversion.target_patterns} with {ops} on load; the sharded loader reads "
                            "stacked experts (MergeModulelist(dim=0), then Concatenate) only")
        out.append((conversion.target_patterns[0], list(conversion.source_patterns),
                    ops[1].dim if len(ops) == 2 else None))
    return out


def _reader(name: str, ckpt: SafetensorsCheckpoint, fusions):
    if name in ckpt:
        return lambda ranges: ckpt.read(name, ranges)
    for target, sources, cat_dim in fusions:
        if name.endswith(target):
            return _FusedExperts(name.removesuffix(target), sources, cat_dim, ckpt).read
    raise UserError(f"{ckpt.folder}: no tensor for parameter {name}",
                    hint="the checkpoint does not match the model's config.json")


@torch.no_grad()
def load_shards(hf: nn.Module, folder: str | Path) -> None:
    """Fill every parameter and persistent buffer of `hf` (allocated, possibly sharded) from `folder`."""
    ckpt = SafetensorsCheckpoint(folder)
    fusions = _fusions(hf)
    persistent = [(n, b) for n, b in hf.named_buffers()
                  if n.rpartition(".")[2] not in hf.get_submodule(n.rpartition(".")[0])._non_persistent_buffers_set]
    layer = None
    for name, tensor in [*hf.named_parameters(), *persistent]:
        if (m := LAYER.match(name)) is None or m.group(1) != layer:
            ckpt.release()
            layer = m and m.group(1)
        source = checkpoint_name(name)  # an adapted module's base weight; None: a LoRA adapter (lora.py)
        local, ranges = _local_block(tensor)
        if source is None or local.numel() == 0:
            continue
        block = _reader(source, ckpt, fusions)(ranges)
        if tuple(block.shape) != tuple(local.shape):
            raise UserError(f"{ckpt.folder}: {source} has shape {tuple(block.shape)} where the model needs "
                            f"{tuple(local.shape)} (block {ranges})")
        local.copy_(block)
    ckpt.release()


@torch.no_grad()
def init_computed_buffers(hf: nn.Module) -> None:
    """Non-persistent buffers (rotary inverse frequencies) are computed, not loaded: compute them again
    after the meta model was allocated, with transformers' own initialisation of their modules."""
    owners = {name.rpartition(".")[0] for name, _ in hf.named_buffers()}
    for name in sorted(owners):
        module = hf.get_submodule(name)
        computed = [b for b in module._buffers if b in module._non_persistent_buffers_set]
        if not computed:
            continue
        if next(module.parameters(recurse=False), None) is not None:  # never re-initialise a loaded weight
            raise UserError(f"{type(hf).__name__}: {name} holds computed buffers {computed} next to weights; "
                            "the sharded loader cannot recompute them")
        hf._init_weights(module)
