"""A `.safetensors` file written tensor by tensor: the header (names, dtypes, shapes, byte ranges) comes
from the layout announced up front, then each tensor's bytes are appended as it arrives, so the writer
holds one group of tensors, not the state dict `safetensors.torch.save_file` needs.

The format (safetensors' spec): an 8-byte little-endian header length, the JSON header (padded with
spaces to a multiple of 8), then the tensors' raw bytes back to back in header order.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from .stream import StreamedWeights, in_layout_order

DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(path: str | os.PathLike, weights: StreamedWeights, metadata: Mapping[str, str] | None = None) -> None:
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in weights.layout:
        if spec.dtype not in DTYPE_CODES:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} has no safetensors code")
        header[spec.name] = {"dtype": DTYPE_CODES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, tensor in in_layout_order(weights):
            raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(raw.numpy()))


def shard_layout(layout: list, max_shard_bytes: int) -> list[list]:
    """The layout cut into consecutive runs of at most `max_shard_bytes` (a tensor larger than that is a
    shard of its own), as save_pretrained cuts: never a tensor split across files."""
    shards: list[list] = [[]]
    size = 0
    for spec in layout:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


class _Slice:
    """One shard's part of a stream: its layout, and the stream's tensors until that layout is used up."""

    def __init__(self, layout: list, tensors):
        self.layout, self._tensors = layout, tensors

    def groups(self):
        for _ in self.layout:
            spec, tensor = next(self._tensors)
            yield [(spec.name, tensor)]


def write_sharded_safetensors(folder: str | os.PathLike, weights: StreamedWeights, max_shard_bytes: int,
                              metadata: Mapping[str, str] | None = None) -> list[str]:
    """`model.safetensors`, or above `max_shard_bytes` the files `model-0000k-of-0000n.safetensors` and
    their `model.safetensors.index.json` (Hugging Face's names: transformers and vLLM load either form).
    Streamed like `write_safetensors`: one group in memory at a time. Returns the files written."""
    folder = Path(folder)
    shards = shard_layout(weights.layout, max_shard_bytes)
    tensors = in_layout_order(weights)
    if len(shards) == 1:
        write_safetensors(folder / "model.safetensors", _Slice(shards[0], tensors), metadata)
        next(tensors, None)  # runs the stream's end-of-layout check
        return ["model.safetensors"]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for name, layout in zip(names, shards, strict=True):
        write_safetensors(folder / name, _Slice(layout, tensors), metadata)
        weight_map.update({spec.name: name for spec in layout})
    next(tensors, None)
    index = {"metadata": {"total_size": sum(spec.nbytes for spec in weights.layout)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, "model.safetensors.index.json"]
