"""The routed experts of a weight bucket that a vLLM worker under expert parallelism keeps: its own.

vLLM's expert loader skips the experts another EP rank owns, but its layerwise reload (the set-up of
every weight update, broadcast_engine.py) first holds every incoming tensor of a module until the module
is complete; a MoE layer's experts are one module, so a worker would hold all of a layer's experts, as
sent, to keep 1/ep of them. Dropping the others before `load_weights` leaves it the slice it keeps.
Names that match no expert module of the model pass through unchanged (a mapping vLLM applies between
checkpoint and module names makes no filter, not a wrong one).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

# `model.layers.3.mlp.experts.17.down_proj.weight`: the experts module, then the global expert id
EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.")


def local_experts(model: nn.Module) -> dict[str, Callable[[int], int]]:
    """Expert modules sharded by EP, by name: global expert id -> this worker's slot, -1 when another's."""
    out: dict[str, Callable[[int], int]] = {}
    for name, module in model.named_modules():
        to_local = getattr(module, "_map_global_expert_id_to_local_expert_id", None)
        try:
            sharded = bool(getattr(module, "use_ep", False))
        except (AttributeError, RuntimeError):  # a layer not configured yet: nothing to filter by
            sharded = False
        if to_local is not None and sharded:
            # vLLM 0.32: `mlp.experts` is a MoERunner, the weights are its child `routed_experts`, and the
            # checkpoint names the runner (`mlp.experts.17.down_proj.weight`)
            out[name.removesuffix(".routed_experts")] = to_local
    return out


def keep_local(bucket: Sequence[tuple[str, torch.Tensor]],
               local: dict[str, Callable[[int], int]]) -> list[tuple[str, torch.Tensor]]:
    if not local:
        return list(bucket)
    kept = []
    for name, tensor in bucket:
        m = EXPERT.match(name)
        if m and m["module"] in local and local[m["module"]](int(m["expert"])) < 0:
            continue
        kept.append((name, tensor))
    return kept
