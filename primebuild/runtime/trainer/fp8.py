"""FP8 training (`trainer.precision: fp8`): the decoder's matmuls run forward in primebuild/kernels/fp8.py's format.

What is FP8, and what is not:
- forward of every linear layer inside the decoder blocks (attention projections, dense MLPs, shared
  experts) and of the routed experts: the input quantised per 1 x 128 tile, the weight per 128 x 128
  block (fp32 scales), products accumulated in fp32 -- cuBLAS's block-scaled GEMM on a Hopper-class GPU,
  the reference function elsewhere (on a CPU: the fp32 product of the rounded operands);
- kept in the compute dtype (bf16 on GPUs, fp32 on CPUs): the embedding, the lm_head (its logits are
  the log-probs the loss compares), the routers (their top-k flips on tiny logit errors) and the norms;
- master weights and AdamW state: fp32, as in every precision of this trainer;
- backward: the exact gradient of the quantised product with respect to its dequantised operands
  (straight through the rounding), in the compute dtype: dX = dY @ deq(q(W)), dW = dY^T @ deq(q(X)). The
  operands are saved for it in FP8 (1 byte per element plus scales). FP8 backward GEMMs (DeepSeek-V3
  quantises dY too) are not built.

The weight is quantised again at every forward (a handful of elementwise kernels per weight); nothing
is cached across micro-batches. Modules are switched by class (`nn.Linear` -> `Fp8Linear`, same
parameters and names, so checkpoints, FSDP2 and published weights do not change) and the experts through
transformers' experts-implementation registry, so one flag switches FP8 on and nothing else changes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from primebuild.errors import UserError
from primebuild.kernels.fp8 import (
    dequantize_activation,
    dequantize_blockwise,
    fast_path_available,
    fp8_block_matmul,
    quantize_activation,
    quantize_blockwise,
)

EXPERTS_IMPLEMENTATION = "primebuild_fp8"


class _BlockFp8Matmul(torch.autograd.Function):
    """x [..., K] @ w [N, K].T with both operands block-quantised to e4m3, -> [..., N] in x's dtype; a
    weight fused from checkpoint weights (gate|up) quantises each of its `parts` on its own blocks."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, parts: tuple[int, ...] | None) -> Tensor:
        n, k = weight.shape
        w = weight.detach()
        quantised = [quantize_blockwise(piece) for piece in (w.split(list(parts)) if parts else [w])]
        x_q, x_s = quantize_activation(x.detach().reshape(-1, k))
        if len(quantised) == 1 and fast_path_available(x.device, n, k):
            y = fp8_block_matmul(x.detach(), *quantised[0], out_dtype=x.dtype)
        else:
            y = (dequantize_activation(x_q, x_s) @ _dequantized(quantised, torch.float32).T).to(x.dtype)
            y = y.view(*x.shape[:-1], n)
        ctx.save_for_backward(x_q, x_s, *[t for pair in quantised for t in pair])
        ctx.shapes = (x.shape, x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x_q, x_s, *flat = ctx.saved_tensors
        x_shape, x_dtype, w_dtype = ctx.shapes
        compute = grad_y.dtype
        g = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ _dequantized(list(zip(flat[::2], flat[1::2], strict=True)), compute)).to(x_dtype).view(x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g.T @ dequantize_activation(x_q, x_s, dtype=compute)).to(w_dtype)
        return grad_x, grad_w, None


def _dequantized(quantised: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> Tensor:
    return torch.cat([dequantize_blockwise(q, s, dtype=dtype) for q, s in quantised])


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, parts: tuple[int, ...] | None = None) -> Tensor:
    y = _BlockFp8Matmul.apply(x, weight, parts)
    return y if bias is None else y + bias


class Fp8Linear(nn.Linear):
    """An nn.Linear whose forward is block-scaled FP8 (a module becomes one by a class switch)."""

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias)


def fp8_experts_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' eager experts loop (gate_up_proj [E, 2I, H], down_proj [E, H, I]) with FP8 matmuls."""
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        hit = torch.bincount(top_k_index.flatten(), minlength=self.num_experts).nonzero().flatten().tolist()
    for expert in hit:
        token, slot = torch.where(top_k_index == expert)
        gate_up = self.gate_up_proj[expert]  # gate|up: two checkpoint weights, each its own blocks
        half = gate_up.shape[0] // 2
        gate, up = fp8_linear(hidden_states[token], gate_up, parts=(half, half)).chunk(2, dim=-1)
        y = fp8_linear(self.act_fn(gate) * up, self.down_proj[expert])
        out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out


def _register_experts_implementation() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if EXPERTS_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, fp8_experts_forward)


def apply_fp8_training(hf: nn.Module, layers: nn.ModuleList) -> dict[str, int]:
    """Switch the decoder blocks' linear layers and routed experts of `hf` to FP8 forwards (in place,
    before FSDP wraps the blocks); returns how many of each were switched."""
    linears = 0
    for layer in layers:
        for module in layer.modules():
            if type(module) is nn.Linear:
                module.__class__ = Fp8Linear
                linears += 1
    experts = [m for m in hf.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
    for m in experts:
        flags = (getattr(m, "has_gate", True), getattr(m, "has_bias", False), getattr(m, "is_transposed", False),
                 getattr(m, "is_concatenated", True))
        if flags != (True, False, False, True) or m.gate_up_proj.dim() != 3:
            raise UserError(f"trainer precision fp8: {type(m).__name__} stores its experts in a layout the FP8 "
                            "experts do not implement", hint="use trainer.precision: bf16")
    if experts:
        _register_experts_implementation()
        hf.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return {"linear": linears, "experts": len(experts)}
