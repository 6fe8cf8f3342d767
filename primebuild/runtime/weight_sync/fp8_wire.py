"""FP8 on the wire: with `inference.precision: fp8` the trainer sends the matmul weights already in the
serving format, so the bytes crossing are ~half of bf16 and the server loads them without quantising.

The serving format is primebuild/kernels/fp8.py's block format, the DeepSeek-V3 / GLM-5 FP8 checkpoint
convention: the weight as float8_e4m3fn plus `weight_scale_inv`, one fp32 scale per 128 x 128 block
(w ~= q * scale). Quantised are exactly the tensors the embedded engine quantises at load
(primebuild/runtime/inference/weights.py): the decoder layers' attention projections, dense MLPs and routed
experts; the embedding, router, norms and lm_head travel as published. Fused checkpoint weights are
quantised per part, as the engine does (an expert's gate and up halves each on their own blocks), and
the weight is first rounded to the dtype the server reads it in, so the blocks are bit for bit the ones
the server would have computed (tests/test_weight_sync_fp8.py).

Names on the wire: `x.weight` -> `x.weight` (fp8) + `x.weight_scale_inv`; a fused 3-D expert parameter
`...experts.gate_up_proj` -> itself (fp8) + `...experts.gate_up_proj_scale_inv`
[experts, blocks of its parts' rows, blocks of its columns].
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from primebuild.kernels.fp8 import BLOCK, FP8_DTYPE, quantize_blockwise

from .stream import StreamedWeights, TensorSpec

QUANTISED = re.compile(
    r"^model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj\.weight|mlp\.(?:gate|up|down)_proj\.weight"
    r"|mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight|mlp\.experts\.(?:gate_up|down)_proj)$")
FUSED_GATE_UP = "experts.gate_up_proj"  # [experts, 2 * inter, hidden]: gate rows, then up rows


def quantised(name: str) -> bool:
    return QUANTISED.match(name) is not None


def scale_name(name: str) -> str:
    return name + "_scale_inv"  # x.weight -> x.weight_scale_inv, as FP8 checkpoints name it


def parts(name: str, rows: int) -> tuple[int, ...]:
    """The row counts quantised on their own blocks (a fused gate|up: two halves)."""
    return (rows // 2, rows // 2) if name.endswith(FUSED_GATE_UP) else (rows,)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def scale_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    *lead, rows, cols = shape
    return (*lead, sum(_blocks(p) for p in parts(name, rows)), _blocks(cols))


def quantise(name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn of `weight`'s shape, fp32 scales of `scale_shape`): each matrix (each expert of a
    3-D parameter), each of its parts on its own blocks."""
    if weight.dim() == 2:
        pieces = [quantize_blockwise(w) for w in weight.split(list(parts(name, weight.shape[0])))]
        return torch.cat([q for q, _ in pieces]), torch.cat([s for _, s in pieces])
    per_matrix = [quantise(name, w) for w in weight]
    return torch.stack([q for q, _ in per_matrix]), torch.stack([s for _, s in per_matrix])


def split_scales(name: str, rows: int, scales: torch.Tensor) -> list[torch.Tensor]:
    """One matrix's scales, per part (the inverse of the concatenation in `quantise`)."""
    return list(scales.split([_blocks(p) for p in parts(name, rows)]))


class Fp8Wire:
    """A weight stream whose quantised tensors (see top) travel as FP8 blocks; the rest unchanged.
    `served_dtype`: what the server rounds the published weights to before it would quantise them."""

    def __init__(self, weights: StreamedWeights, served_dtype: torch.dtype):
        self.weights, self.served_dtype = weights, served_dtype
        self.layout: list[TensorSpec] = []
        for spec in weights.layout:
            if quantised(spec.name) and spec.dtype.is_floating_point:
                self.layout += [TensorSpec(spec.name, FP8_DTYPE, spec.shape),
                                TensorSpec(scale_name(spec.name), torch.float32, scale_shape(spec.name, spec.shape))]
            else:
                self.layout.append(spec)

    def groups(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for group in self.weights.groups():
            out = []
            for name, tensor in group:
                if quantised(name) and tensor.is_floating_point():
                    q, scales = quantise(name, tensor.detach().to(self.served_dtype))
                    out += [(name, q), (scale_name(name), scales)]
                else:
                    out.append((name, tensor))
            group = None
            yield out
            out = None
