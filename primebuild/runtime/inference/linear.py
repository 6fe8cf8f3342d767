"""The engine's matmul: a weight with an optional oneDNN-packed copy for calls with many rows (`Linear`), and
its FP8 form (`Fp8Linear`: block-quantised weight, input quantised per 1 x 128 tile at every call)."""

from __future__ import annotations

import torch

from primebuild.kernels.fp8 import BlockFp8Weight, fake_quantize_activation

# oneDNN's fp32 GEMM on packed weights beats the MKL GEMM that F.linear calls by 1.5-2.5x once a
# matmul has a few rows (measured on an AVX-512 EPYC, where MKL takes its generic path); for a single
# row, or a small weight and few rows, its fixed ~10 us call cost loses. Measured inside the decode
# step, the crossover sat near 2^21 multiply-adds per call (tiny model: from 16-128 rows depending on
# the matrix; a 20M model: from 2-8 rows).
ONEDNN_MIN_MACS = 1 << 21
# Packed copies double the dense weights in memory: only small models (where call overheads matter
# most) get them, and only fp32 on CPU (bf16 matmuls already go through oneDNN).
ONEDNN_MAX_PACKED_BYTES = 1 << 30


def onednn_packing_available(device, dtype: torch.dtype) -> bool:
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear:
    """A weight [out, in] (+ bias) and, optionally, a oneDNN-packed copy used for calls with many rows."""

    __slots__ = ("weight", "weight_t", "bias", "packed", "packed_from_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.contiguous()
        self.weight_t = self.weight.t()  # a view, kept to save a call per matmul
        self.bias = bias
        self.packed = None
        self.packed_from_rows = 1 << 62

    def pack(self, batch_hint: int = 64) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, batch_hint)
        self.packed_from_rows = max(2, -(-ONEDNN_MIN_MACS // self.weight.numel()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out]."""
        if x.shape[0] >= self.packed_from_rows:
            return _onednn_linear(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ weight.T (+ bias), the add fused into the matmul; 2-D operands."""
        if x.shape[0] >= self.packed_from_rows:
            return _onednn_linear_add(x, residual, self.packed, self.bias, "add")
        if self.bias is None:
            return torch.addmm(residual, x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t).add_(residual)


class Fp8Linear(Linear):
    """A Linear whose weight is held in FP8 blocks and whose input is quantised per 1x128 tile at every
    call: on a GPU with the block-scaled GEMM through cuBLAS, elsewhere as the fp32 product of the
    rounded input and the dequantised weight (primebuild/kernels/fp8.py, `BlockFp8Weight`), which also takes the
    packed oneDNN path for many rows."""

    __slots__ = ("fp8",)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, parts: tuple[int, ...] | None = None):
        self.fp8 = BlockFp8Weight(weight, parts)  # parts: the checkpoint weights fused here, each its own blocks
        super().__init__(self.fp8.dequantised.to(weight.dtype), bias)

    @classmethod
    def from_blocks(cls, quantised: list[tuple[torch.Tensor, torch.Tensor]], bias: torch.Tensor | None,
                    dtype: torch.dtype) -> Fp8Linear:
        """From weights sent already in FP8 (weight_sync/fp8_wire.py): each part's (q, scales)."""
        linear = cls.__new__(cls)
        linear.fp8 = BlockFp8Weight.from_blocks(quantised, dtype)
        Linear.__init__(linear, linear.fp8.dequantised.to(dtype), bias)
        return linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8.fast:
            y = self.fp8.matmul(x)
            return y if self.bias is None else y + self.bias
        return super().__call__(fake_quantize_activation(x))

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.fp8.fast:
            return residual + self(x)
        return super().add_to(residual, fake_quantize_activation(x))


if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    _onednn_linear = torch.ops.mkldnn._linear_pointwise.default
    _onednn_linear_add = torch.ops.mkldnn._linear_pointwise.binary
