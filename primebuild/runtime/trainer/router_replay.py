"""Router replay (R3): the trainer's MoE forward routes each token to the experts inference routed it to.

Why: an MoE's top-k choice is discontinuous. Where the trainer's router logits differ from the engine's
by a rounding error (other kernels, other precision -- FP8 most of all), a token can land on other
experts, and its log-prob then differs by far more than the rounding error: the trainer would score a
policy that never sampled. Replaying the recorded routes makes both sides compute the same function.

How: a forward hook on every router module replaces its top-k *indices* by the recorded ones, and
recomputes the gate weights of those experts from the router's own logits (the architecture's gate:
softmax then top-k renormalisation for Qwen3-MoE; sigmoid, renormalisation and the routed scaling
factor for GLM-5), so the router keeps its gradient. The hook sits at the router's output, before the
experts module, so it is independent of how the experts execute (a loop, grouped GEMMs, expert
parallelism) and of FSDP2, which wraps whole decoder layers. With recorded and own routes equal, the
output is the unhooked router's, bit for bit.

Positions without a record (the last token of each row, padding: -1 in the micro-batch) keep the
router's own choice. Activation checkpointing recomputes blocks during backward: the routes stay set
until the micro-batch's backward has run (`RouterReplay.replaying` around forward *and* backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from primebuild.errors import UserError


def _qwen3_moe_gate(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen3MoeTopKRouter: softmax over all experts in fp32, the chosen ones, renormalised if asked."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _glm_moe_dsa_gate(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """GlmMoeDsaTopkRouter (GLM-5): sigmoid scores of the chosen experts (the score-correction bias only
    chooses, it does not weigh), renormalised if asked, times the routed scaling factor."""
    weights = logits.sigmoid().gather(-1, indices)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


@dataclass(frozen=True)
class RouterKind:
    """How to replay one library's router: its class name, where its output holds its own top-k choice
    ([tokens, top_k]), and its output rebuilt around given top-k indices (gate weights recomputed)."""

    class_name: str
    own_choice: Callable[[tuple], Tensor]
    replayed: Callable[[nn.Module, tuple, Tensor], tuple]


def _hf_router(class_name: str, gate: Callable[[nn.Module, Tensor, Tensor], Tensor]) -> RouterKind:
    """transformers' routers return (logits [T, E], top-k weights [T, K], top-k indices [T, K])."""
    return RouterKind(class_name, own_choice=lambda out: out[2],
                      replayed=lambda router, out, idx: (out[0], gate(router, out[0], idx), idx))


def _titan_replayed(router: nn.Module, out: tuple, idx: Tensor) -> tuple:
    """torchtitan's TokenChoiceTopKRouter returns (top-k scores [B, L, K], top-k ids [B, L, K], scores of
    every expert [B, L, E]): the chosen experts' scores, renormalised if it does, times its scale."""
    _, own, scores = out
    idx = idx.view_as(own)
    top = scores.gather(-1, idx)
    if router.route_norm:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * router.route_scale, idx, scores


# model_type -> how the hf engine replays its router. Keep the keys equal to
# primebuild/builders/capabilities.py's REPLAYABLE_ROUTERS: the plan accepts exactly these.
GATES: dict[str, RouterKind] = {
    "qwen3_moe": _hf_router("Qwen3MoeTopKRouter", _qwen3_moe_gate),
    "glm_moe_dsa": _hf_router("GlmMoeDsaTopkRouter", _glm_moe_dsa_gate),
}
# torchtitan's router, whatever the model (the torchtitan engine: titan_policy.py)
# (its ids [B, L, K] as they are: under TP a DTensor, which a flattening view would redistribute)
TITAN_ROUTER = RouterKind("TokenChoiceTopKRouter", own_choice=lambda out: out[1], replayed=_titan_replayed)


def _whole(x: Tensor) -> Tensor:
    """A count over this rank's DTensor part as the count over all of it (sequence-split: summed)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


class RouterReplay:
    """Hooks on every router of a MoE model, in decoder-layer order (the order of the routes' layer
    axis). Inert unless `replaying(routes)` is active; counts how often the own choice agreed.

    `kind` None: a transformers model, its router known by its config's model_type."""

    def __init__(self, model: nn.Module, kind: RouterKind | None = None):
        if kind is None:
            model_type = model.config.model_type
            if model_type not in GATES:
                raise UserError(f"router replay: model_type {model_type!r} has no replayable router here",
                                hint=f"router replay supports {', '.join(sorted(GATES))}")
            kind = GATES[model_type]
        self.kind = kind
        self.routers = [m for m in model.modules() if type(m).__name__ == kind.class_name]
        if not self.routers:
            raise UserError(f"router replay: no {kind.class_name} module in this {type(model).__name__}")
        self.routes: Tensor | None = None  # [rows, moe_layers, top_k] long, -1 = not recorded
        # (replayed positions x layers whose own top-k set was the record, all replayed), on the device:
        # no host sync per router call. Recomputation under activation checkpointing counts both twice.
        self.agree: Tensor | None = None
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @contextlib.contextmanager
    def replaying(self, routes: Tensor | None) -> Iterator[None]:
        """Replay `routes` ([B, T, moe_layers, top_k], -1 = none) in every forward inside the block."""
        if routes is not None and routes.shape[-2] != self.num_layers:
            raise UserError(f"routed_experts carry {routes.shape[-2]} MoE layers; the model has {self.num_layers}",
                            hint="the orchestrator's moe_layers must be the trained model's MoE layers")
        self.routes = None if routes is None else routes.reshape(-1, *routes.shape[-2:])
        try:
            yield
        finally:
            self.routes = None

    def _hook(self, layer: int):
        def replay(router: nn.Module, _inputs, output):
            if self.routes is None:
                return None
            own = self.kind.own_choice(output)
            recorded = self.routes[:, layer].to(own.device)  # [tokens, top_k]
            if recorded.numel() != own.numel() or recorded.shape[-1] != own.shape[-1]:
                raise UserError(f"router replay: {tuple(recorded.shape)} recorded routes for a router choosing "
                                f"{tuple(own.shape)} (tokens x top_k)")
            recorded = recorded.view(own.shape)
            if isinstance(own, DTensor):
                # under TP torchtitan's router outputs are DTensors: every rank holds the whole micro-batch's
                # routes; this rank takes its part of them as the router laid its own out (a local slice)
                recorded = DTensor.from_local(recorded, own.device_mesh, [Replicate()] * own.device_mesh.ndim,
                                              run_check=False).redistribute(placements=own.placements)
            known = (recorded >= 0).all(dim=-1, keepdim=True)
            indices = torch.where(known, recorded, own)
            with torch.no_grad():
                same = (indices.sort(-1).values == own.sort(-1).values).all(-1) & known[..., 0]
                counts = torch.stack([_whole(same.sum()), _whole(known.sum())]).double()
                self.agree = counts if self.agree is None else self.agree + counts
            return self.kind.replayed(router, output, indices)

        return replay

    def take_agreement(self) -> tuple[float, float]:
        """(replayed (position, layer) routes the trainer's router would have chosen itself, replayed
        routes) since the last call: their ratio is the routing agreement between trainer and engine."""
        counts = (0.0, 0.0) if self.agree is None else tuple(self.agree.tolist())
        self.agree = None
        return counts

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
