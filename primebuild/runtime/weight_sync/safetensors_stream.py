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
