"""FP8 training (`trainer.precision: fp8`) on the torchtitan engine: the same block-scaled FP8 matmuls as
on the hf engine (fp8.py: the input per 1 x 128 tile, the weight per 128 x 128 block, e4m3, fp32
accumulation; straight-through backward), applied to torchtitan's modules.

What is FP8, as fp8.py says for transformers' layers: every linear layer inside the blocks (attention
projections, dense feed-forward) and the routed experts (w1, w3 and w2 each on its own blocks, as the
checkpoint's gate, up and down weights). Not FP8: the routers' gates, the embedding, the head and the norms.
Modules switch class in place (same parameters and names), before activation checkpointing and FSDP.

Why not torchtitan's Float8 converter (torchao's Float8Linear, tensorwise or rowwise scales): the trainer
must quantise as the FP8 inference engine does (128-blocks, e4m3), so that it scores what the server
samples; torchao's recipes scale per tensor or per row, and torchao is not installed here. On a Hopper-class
GPU the 128-block product is cuBLAS's block-scaled GEMM (kernels/fp8.py's fast path); elsewhere the
reference function (on a CPU: the fp32 product of the rounded operands).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard
from torchtitan.models.common import Linear
from torchtitan.models.common.moe import GroupedExperts

from primebuild.errors import UserError
from primebuild.kernels.fp8 import BLOCK  # the recipe's block edge

from .fp8 import fp8_linear
from .titan_model import ExactGroupedExperts


class Fp8TitanLinear(Linear):
    """torchtitan's Linear whose forward is block-scaled FP8. Under TP each rank multiplies its own shards
    (a column-split weight gives its columns of the output, a row-split one a partial sum): the blocks are
    the whole weight's where every split dimension is a multiple of 128 x tp, which the plan requires."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.weight, DTensor):
            return fp8_linear(x, self.weight, self.bias)
        (split,) = self.weight.placements  # the TP mesh's: Shard(0) column-wise, Shard(1) row-wise
        columns = split == Shard(0)
        # column-wise, x is whole on every rank and each rank's gradient of it only its columns' share: Partial
        local_x = x.to_local(grad_placements=[Partial()] if columns else None)
        y = fp8_linear(local_x, self.weight.to_local())
        y = DTensor.from_local(y, self.weight.device_mesh, [Shard(-1) if columns else Partial()], run_check=False)
        return y if self.bias is None else y + self.bias


class Fp8GroupedExperts(ExactGroupedExperts):
    """torchtitan's grouped experts (same parameters, names and sharding), each expert's rows through FP8
    matmuls: SwiGLU(x @ w1^T, x @ w3^T) @ w2^T, in the compute dtype around them."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    @staticmethod
    def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, w)


def apply_titan_fp8(titan: nn.Module) -> dict[str, int]:
    """Switch the blocks' linear layers (routers' gates excepted) and routed experts of `titan` to FP8
    forwards; returns how many of each were switched."""
    counts = {"linear": 0, "experts": 0}
    for name, module in titan.layers.named_modules():
        if isinstance(module, GroupedExperts):
            module.__class__ = Fp8GroupedExperts
            counts["experts"] += 1
        elif type(module) is Linear and ".router." not in f".{name}.":
            module.__class__ = Fp8TitanLinear
            counts["linear"] += 1
    return counts


def check_tp_blocks_whole(titan: nn.Module) -> None:
    """After torchtitan's TP plan: every FP8 weight's TP-split dimension must be a multiple of 128 x tp, so
    that each rank's blocks are the whole weight's (the plan refuses the rest: capabilities._fp8_tensor_parallel;
    a hand-written config meets the same rule here)."""
    for name, module in titan.named_modules():
        if not isinstance(module, (Fp8TitanLinear, Fp8GroupedExperts)):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if not isinstance(param, DTensor):
                continue
            mesh = param.device_mesh
            for axis, size, placement in zip(mesh.mesh_dim_names, mesh.shape, param.placements, strict=True):
                # EP splits whole experts (dim 0), which FP8 never blocks across: the TP axis only
                if axis == "tp" and placement.is_shard() and param.shape[placement.dim] % (BLOCK * size):
                    raise UserError(f"precision fp8 under tp={size}: {name}.{param_name} splits a dimension of "
                                    f"{param.shape[placement.dim]}, no multiple of 128 x {size}: a rank's FP8 blocks "
                                    "would straddle the shards", hint="use a tp that keeps 128-blocks whole, or "
                                    "precision: bf16")
