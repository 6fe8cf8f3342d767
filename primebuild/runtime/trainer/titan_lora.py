"""LoRA on the torchtitan engine: low-rank adapters on torchtitan's linear modules, the base frozen.

The targets are Hugging Face module names (`q_proj`, `down_proj`, ...: trainer.lora.targets, the same set
the hf engine hands peft); torchtitan's Qwen3 state-dict adapter says which of its modules each one is
(`model.layers.{}.self_attn.q_proj.weight` -> `layers.{}.attention.qkv_linear.wq.weight`), so no name is
written twice. peft is not used here: it wraps a target as `base_layer` + adapters, which renames the
checkpoint's weight under torchtitan's sharding configs and state-dict adapter. A target instead switches
class to `LoraLinear` (the same `weight`, so loading, FSDP units and torchtitan's names do not change)
and gains `lora_A` / `lora_B`, computing as peft's Linear does: base(x) + B(A(x)) * alpha / r.

As on the hf engine (lora.py): adapters are added on the meta device before activation checkpointing and
FSDP wrap the blocks, initialised like peft's (A Kaiming-uniform, B zero), only they train, and each step
publishes them as a PEFT folder in Hugging Face naming, which vLLM loads and the embedded engine merges.
A MoE layer's routed experts are grouped 3-D weights, not linear modules, on both engines: there only the
attention projections are adapted (builders/lora.py says the same to the plan).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torchtitan.models.common import Linear

from primebuild.contracts.trainer import LoraConfig
from primebuild.errors import UserError

from .lora import PEFT_PREFIX

WRAPPED = "_checkpoint_wrapped_module."  # activation checkpointing's infix in module names


class LoraLinear(Linear):
    """torchtitan's Linear plus a low-rank update; a Linear becomes one by `add_adapter`."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    scale: float
    hf_module: str  # the Hugging Face module this adapts: the published adapter's name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_B(self.lora_A(x)) * self.scale


def add_adapter(linear: Linear, rank: int, alpha: float, hf_module: str) -> None:
    linear.__class__ = LoraLinear
    linear.lora_A = nn.Linear(linear.in_features, rank, bias=False, device=linear.weight.device)
    linear.lora_B = nn.Linear(rank, linear.out_features, bias=False, device=linear.weight.device)
    linear.scale = alpha / rank
    linear.hf_module = hf_module


def shard_adapters_as_their_base(titan: nn.Module) -> int:
    """Under TP (after torchtitan's plan made each target's weight a DTensor on the TP mesh) split the
    adapters so their product B·A is split as the weight is: a column-split weight (Shard(0), out rows)
    gets A whole and B's rows split, its update a column slice of the output like the base's; a row-split
    one (Shard(1), in columns) gets A's columns split and B whole, its update a partial sum like the
    base's. Each rank then adds its own part of the output. Returns how many modules were split."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    split = 0
    for module in titan.modules():
        if isinstance(module, LoraLinear) and isinstance(module.weight, DTensor):
            (placement,) = module.weight.placements
            a, b = (Replicate(), Shard(0)) if placement == Shard(0) else (Shard(1), Replicate())
            for adapter, where in ((module.lora_A, a), (module.lora_B, b)):
                adapter.weight = nn.Parameter(distribute_tensor(adapter.weight, module.weight.device_mesh, [where]),
                                              requires_grad=adapter.weight.requires_grad)
            split += 1
    return split


def titan_targets(from_hf_map: dict[str, str | None], targets: list[str]) -> dict[str, str]:
    """torchtitan module pattern (`layers.{}.attention.qkv_linear.wq`) -> Hugging Face module pattern
    (`model.layers.{}.self_attn.q_proj`) for each target, read off the state-dict adapter's map (a routed
    expert's weight, with a second `{}`, is no linear module)."""
    out = {}
    for hf, titan in from_hf_map.items():
        match = re.fullmatch(r"(model\.layers\.\{\}\.[^.{}]+\.([^.{}]+))\.weight", hf)
        if titan is not None and match and match.group(2) in targets:
            out[titan.removesuffix(".weight")] = match.group(1)
    missing = [t for t in targets if not any(hf.endswith("." + t) for hf in out.values())]
    if missing:
        raise UserError(f"trainer.lora.targets: the torchtitan engine's model has no module named {', '.join(missing)}",
                        hint="name the decoder layers' linear modules as in the Hugging Face checkpoint")
    return out


def apply_titan_lora(titan: nn.Module, from_hf_map: dict[str, str | None], lora: LoraConfig) -> set[str]:
    """Add adapters to every target module of `titan` (on the meta device, before checkpointing and FSDP)
    and freeze everything else; returns the names of the targets (each adapts at least one module)."""
    patterns = titan_targets(from_hf_map, list(lora.targets))
    adapted: set[str] = set()
    for name, module in list(titan.named_modules()):
        layer = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if layer is None:
            continue
        hf = patterns.get(f"layers.{{}}.{layer.group(2)}")
        if hf is not None:
            if type(module) is not Linear:
                raise UserError(f"trainer.lora.targets: {name} is a {type(module).__name__}, not a linear module")
            add_adapter(module, lora.rank, lora.alpha, hf.format(layer.group(1)))
            adapted.add(hf.rsplit(".", 1)[1])
    unused = [t for t in lora.targets if t not in adapted]
    if unused:  # a MoE's MLP names: its experts are grouped weights (as on the hf engine, lora.apply_lora)
        raise UserError(f"trainer.lora.targets: no linear module named {', '.join(unused)} in the model's layers")
    for name, param in titan.named_parameters():
        param.requires_grad_(is_titan_adapter(name))
    return adapted


def is_titan_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_parameters(titan: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(PEFT name, parameter) of every adapter tensor, sorted by name: the order init_adapters draws in,
    the same on both engines."""
    out = []
    for module in titan.modules():
        if isinstance(module, LoraLinear):
            for part in ("lora_A", "lora_B"):
                out.append((f"{PEFT_PREFIX}{module.hf_module}.{part}.weight", getattr(module, part).weight))
    return sorted(out, key=lambda item: item[0])


@torch.no_grad()
def merge_adapters(titan: nn.Module) -> int:
    """Fold every adapter into its base weight (W + B·A·alpha/r, computed in fp32) and make the module a
    plain Linear again, so the state dict is the base model's (an export of merged weights). Unsharded
    modules only (export.py loads the checkpoint into one process). Returns how many were merged."""
    merged = 0
    for module in titan.modules():
        if isinstance(module, LoraLinear):
            delta = module.lora_B.weight.float() @ module.lora_A.weight.float() * module.scale
            module.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))
            del module.lora_A, module.lora_B
            module.__class__ = Linear
            merged += 1
    return merged
