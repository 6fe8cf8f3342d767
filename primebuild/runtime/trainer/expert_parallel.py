"""Expert parallelism for HF MoE blocks (Qwen3-MoE's `mlp.experts`): each EP rank owns num_experts / ep
experts; tokens travel to the rank owning their expert and back with two all-to-alls.

The hf engine's only (parallelize.py). Where torchtitan runs the model, its own EP does this job
(titan_parallelize.py); this stays for what runs on transformers' layers: GLM-5 (torchtitan 0.3.0 has no
GLM model, and its transformers backend fails with FSDP on torch 2.13: builders/trainer_engine.py), and
whatever a manifest runs with `trainer.engine: hf`.

The router is not touched: an expert module is called as `experts(hidden, top_k_index, top_k_weights)`
and executes exactly the top-k it is given, so whatever replaces the router's indices at the gate's
output (router replay) composes with EP.

Per MoE layer and micro-batch, on every rank of an EP group (each holds its own tokens):
  1. sort the (token, slot) pairs by expert; the owner of expert e is rank e // experts_per_rank;
  2. all-to-all the pair counts, then the hidden states (autograd: the backward is the reverse
     all-to-all, so the gradient of a token comes home to the rank that sent it);
  3. run the local experts over what arrived, grouped by expert;
  4. all-to-all the outputs back, weight them by the router's top-k weights (locally, so the router's
     gradient never leaves its rank) and add them up per token.

gloo implements all_to_all_single with uneven splits (checked), so this runs on CPUs as on GPUs.

Parameters: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] become DTensors sharded on dim 0 over the
EP mesh, under their HF names, so checkpoints (DCP) and the full state dict gather whole experts.
Their gradients sum over the EP group inside the all-to-all's backward (each rank's loss is scaled for
an average over all dp_replicate*dp_shard*cp ranks), and FSDP then averages them over the ranks that
own the same experts (meshes.efsdp: dp_shard*cp/ep of them in each of the dp_replicate replicas); the
missing 1/ep is applied to the expert weights' gradient here (`_ScaleGrad`), so they end up divided by
the whole FSDP degree like every other gradient. (FSDP's own `set_gradient_divide_factor` would do it with ReduceOp.PREMUL_SUM, which gloo
lacks: measured, it fails as soon as efsdp > 1.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` on its way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertParallelExperts(nn.Module):
    """Drop-in for an HF experts module holding 3-D `gate_up_proj` / `down_proj` weights."""

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh, fp8: bool = False):
        super().__init__()
        self.fp8 = fp8  # trainer precision fp8: the local experts' matmuls in FP8 as without EP (fp8.py)
        self.num_experts = experts.num_experts
        self.ep = ep_mesh.size()
        if self.num_experts % self.ep:
            raise ValueError(f"{self.num_experts} experts cannot be split over ep={self.ep} ranks")
        self.local_experts = self.num_experts // self.ep
        self.group = ep_mesh.get_group()
        self.act_fn = experts.act_fn
        self.gate_up_proj = nn.Parameter(distribute_tensor(experts.gate_up_proj.data, ep_mesh, [Shard(0)]))
        self.down_proj = nn.Parameter(distribute_tensor(experts.down_proj.data, ep_mesh, [Shard(0)]))

    def _local(self, param: torch.Tensor) -> torch.Tensor:
        return param.to_local() if isinstance(param, DTensor) else param

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        experts = top_k_index.flatten()
        order = torch.argsort(experts, stable=True)  # pairs grouped by expert, hence by owning rank
        sent_experts = experts[order]
        send = torch.bincount(sent_experts // self.local_experts, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        in_splits, out_splits = send.tolist(), recv.tolist()

        x = all_to_all(hidden[order // k], out_splits, in_splits, self.group)
        with torch.no_grad():
            local_ids = torch.empty(sum(out_splits), dtype=experts.dtype, device=experts.device)
            dist.all_to_all_single(local_ids, sent_experts.contiguous() % self.local_experts, out_splits,
                                   in_splits, group=self.group)
        y = self._run_local(x, local_ids)
        back = all_to_all(y, in_splits, out_splits, self.group)  # rows in `order` again

        weights = top_k_weights.flatten()[order].to(back.dtype)
        out = torch.zeros_like(hidden)
        return out.index_add(0, order // k, back * weights[:, None])

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, gate_up_parts: bool = False) -> torch.Tensor:
        if not self.fp8:
            return nn.functional.linear(x, weight)
        from .fp8 import fp8_linear

        half = weight.shape[0] // 2  # gate|up: two checkpoint weights, each quantised on its own blocks
        return fp8_linear(x, weight, parts=(half, half) if gate_up_parts else None)

    def _run_local(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        gate_up = _ScaleGrad.apply(self._local(self.gate_up_proj), 1.0 / self.ep)
        down = _ScaleGrad.apply(self._local(self.down_proj), 1.0 / self.ep)
        by_expert = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=self.local_experts).tolist()
        grouped = x[by_expert]
        outs, start = [], 0
        for expert, count in enumerate(counts):
            rows = grouped[start:start + count]
            gate, up = self._linear(rows, gate_up[expert], gate_up_parts=True).chunk(2, dim=-1)
            outs.append(self._linear(self.act_fn(gate) * up, down[expert]))
            start += count
        # back to arrival order by indexing with the inverse permutation: index_copy would keep its
        # source for backward, one more [pairs, hidden] tensor per layer (measured)
        return torch.cat(outs)[torch.argsort(by_expert)]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, fp8: bool = False) -> list[nn.Module]:
    """Replace every `mlp.experts` module holding 3-D expert weights; returns the new modules."""
    replaced = []
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is None or getattr(experts, "gate_up_proj", None) is None or experts.gate_up_proj.dim() != 3:
            continue
        mlp.experts = ExpertParallelExperts(experts, ep_mesh, fp8=fp8)
        replaced.append(mlp.experts)
    if not replaced:
        raise ValueError(f"{type(model).__name__}: ep > 1 but no MoE layer with 3-D expert weights was found")
    return replaced
