"""Every parallelism and memory transform of the policy, applied in one place and in one fixed order
(torchtitan's parallelize is the model for the shape, for the dimensions this trainer builds):

1. FP8: the decoder blocks' linear layers and the routed experts switch to FP8 forwards (fp8.py); first,
   so that the later wrappers (EP's experts, FSDP's units) wrap the switched modules, which keep their
   parameters;
2. activation checkpointing: every decoder block recomputes its forward in backward;
3. CP: attention runs through the context-parallel attention function (context_parallel.py) and sparse
   attention indexers score all keys of the sequence (sparse_attention.py); the split itself happens
   per micro-batch (Policy.forward sets the model's ContextSplit);
4. EP: every MoE layer's experts become ExpertParallelExperts over meshes.ep_mesh (expert_parallel.py);
5. FSDP / HSDP: each decoder block and the root over meshes.fsdp (dp_shard * cp ranks); with EP, each
   block's experts first, over meshes.efsdp, sharded on dim 1 (dim 0 is already EP's); their gradient
   ends up divided by the whole FSDP degree like every other one (expert_parallel.py). With
   dp_replicate > 1 both meshes are 2-D (dp_replicate, shard), so the same fully_shard calls shard
   inside a replica and all-reduce the gradient shards across replicas.

Everything runs on the meta-device model, before any rank allocates its shards (model.load_model).
One rank (no meshes) stops after step 2. This is the hf engine's; the torchtitan engine's is
titan_parallelize.py. TP is the torchtitan engine's only: the plan refuses it here (builders/capabilities.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from . import context_parallel
from .expert_parallel import apply_expert_parallel
from .parallel_dims import Meshes
from .sparse_attention import apply_sparse_attention_cp

log = logging.getLogger("primebuild.trainer")


@dataclass(frozen=True)
class Parallelism:
    """What parallelize applies: the trainer config's switches, the compute dtype, and the meshes (None on
    one rank)."""

    compute_dtype: torch.dtype
    meshes: Meshes | None = None
    fp8: bool = False
    activation_checkpointing: bool = False
    cpu_offload: bool = False


def parallelize(model: nn.Module, layers: nn.ModuleList, how: Parallelism) -> None:
    """Apply every dimension `how` names to `model` (the Policy) and its HF module `model.hf`, whose
    decoder blocks are `layers`, in the order of the module docstring."""
    hf = model.hf
    if how.fp8:
        apply_fp8(hf, layers)
    if how.activation_checkpointing:
        apply_activation_checkpointing(hf)
    meshes = how.meshes
    if meshes is None:
        return
    if meshes.cp_mesh is not None:
        model.context_split = apply_context_parallel(hf, layers)
    expert_modules = apply_expert_parallel(hf, meshes.ep_mesh, fp8=how.fp8) if meshes.ep_mesh is not None else []
    apply_fsdp(model, layers, expert_modules, meshes, how.compute_dtype, how.cpu_offload)


def apply_fp8(hf: nn.Module, layers: nn.ModuleList) -> None:
    from .fp8 import apply_fp8_training

    apply_fp8_training(hf, layers)


def apply_activation_checkpointing(hf: nn.Module) -> None:
    # Non-reentrant checkpointing composes with FSDP2's hooks; blocks recompute in backward.
    kwargs = {"use_reentrant": False}
    if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.x name
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_context_parallel(hf: nn.Module, layers: nn.ModuleList) -> context_parallel.ContextSplit:
    """Route attention through the CP attention function, which reads the split from each block's
    attention module; returns the split the model's forward sets."""
    split = context_parallel.ContextSplit()
    hf.config._attn_implementation = context_parallel.register()
    for layer in layers:
        layer.self_attn.context_split = split
    apply_sparse_attention_cp(hf, split)
    return split


def apply_fsdp(model: nn.Module, layers: nn.ModuleList, expert_modules: list[nn.Module], meshes: Meshes,
               compute_dtype: torch.dtype, cpu_offload: bool) -> None:
    """FSDP2 units: the EP experts, then each block, then the root. Parameters are computed in
    `compute_dtype`, gradients reduced in fp32; with `cpu_offload` every unit keeps its shards in host
    memory (CPUOffloadPolicy)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import Shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # pinned host memory makes the copies to and from a GPU asynchronous; a CPU run has nothing to pin
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    if cpu_offload:
        log.info("FSDP2 CPUOffloadPolicy: parameter shards, gradients and optimizer state in host memory")
    for experts in expert_modules:
        fully_shard(experts, mesh=meshes.efsdp, mp_policy=mp, offload_policy=offload,
                    shard_placement_fn=lambda _: Shard(1))
    for layer in layers:
        fully_shard(layer, mesh=meshes.fsdp, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=meshes.fsdp, mp_policy=mp, offload_policy=offload)
