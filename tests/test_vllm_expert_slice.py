"""A vLLM worker under expert parallelism hands its model only its own experts of a weight bucket
(primebuild/runtime/inference/vllm/expert_slice.py): vLLM's layerwise reload would otherwise hold every
expert of a MoE layer until the layer is complete. The modules here stand in for vLLM 0.32's MoERunner
(`mlp.experts`) and its RoutedExperts child: the two attributes the filter reads (its EP flag and its
global -> local expert map)."""

import torch
from torch import nn

from primebuild.runtime.inference.vllm.expert_slice import keep_local, local_experts


class RoutedExperts(nn.Module):
    def __init__(self, owned: range | None):
        super().__init__()
        self.owned = owned
        self.use_ep = owned is not None

    def _map_global_expert_id_to_local_expert_id(self, expert: int) -> int:
        return expert - self.owned.start if expert in self.owned else -1


def model(owned: range | None) -> nn.Module:
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList()
    for _ in range(2):
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.experts = nn.Module()  # vLLM 0.32's MoERunner, which holds the weights' module
        layer.mlp.experts.routed_experts = RoutedExperts(owned)
        root.model.layers.append(layer)
    return root


def bucket() -> list[tuple[str, torch.Tensor]]:
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight"]
    names += [f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight" for i in (0, 1) for e in range(4)
              for p in ("gate", "up", "down")]
    names += ["model.shared.experts.0.weight"]  # no such expert module: passes through
    return [(n, torch.zeros(1)) for n in names]


def test_an_ep_rank_keeps_its_experts_and_everything_that_is_not_an_expert():
    local = local_experts(model(range(2, 4)))
    assert set(local) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    kept = [n for n, _ in keep_local(bucket(), local)]
    assert kept[:2] == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight"]
    experts = [n for n in kept if ".mlp.experts." in n]
    assert len(experts) == 2 * 2 * 3 and all(".experts.2." in n or ".experts.3." in n for n in experts)
    assert kept[-1] == "model.shared.experts.0.weight"


def test_without_expert_parallelism_nothing_is_dropped():
    assert local_experts(model(None)) == {}
    assert [n for n, _ in keep_local(bucket(), {})] == [n for n, _ in bucket()]
