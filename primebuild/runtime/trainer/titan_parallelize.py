"""The torchtitan engine's parallel dimensions: torchtitan's own meshes and module sharding (expert
parallelism: its token dispatcher's all-to-all and grouped experts), then FSDP2 / HSDP units, on the
meta-device model before any rank allocates its shards (titan_policy.load_titan_model).

Order, as torchtitan's parallelize_qwen3 applies them: the model's sharding configs (set on its config
before it is built: `configure`), `Module.parallelize` (TP: torchtitan's Qwen3 plan, sequence parallel
between blocks; EP), activation checkpointing per block, then
FSDP: each block's routed experts over the EP-FSDP mesh (efsdp: dp_shard / ep ranks own the same
experts), each block and the root over the FSDP mesh (2-D with dp_replicate > 1: HSDP).

Gradients are summed, not averaged, across ranks (every FSDP unit's divide factor is 1, as torchtitan's
own trainer does): the loss is already divided by a constant of the whole step (batch.loss_normalizer),
so the sum over ranks is the one-rank gradient whatever the layout; an expert's gradient gathers its
tokens from every EP rank through the all-to-all's backward and needs no correction of its own.

Two settings torchtitan reads from its module globals are set here: the SPMD backend `partial_dtensor`
(its default, `spmd_types`, needs every parameter on one full mesh, which torch 2.13's FSDP refuses for
sharded layouts) and, without a GPU, the device type of its meshes (it assumes CUDA).
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.tensor import Shard
from torchtitan.config import ParallelismConfig
from torchtitan.distributed import ParallelDims as TitanDims

from primebuild.contracts.trainer import ParallelDims

SPMD_BACKEND = "partial_dtensor"


@dataclass
class _RuntimeConfig:
    """What torchtitan's model configs read in `update_from_config`: the parallelism section."""

    parallelism: ParallelismConfig


def _parallelism(dims: ParallelDims) -> ParallelismConfig:
    # CP ranks are FSDP ranks to torchtitan (its own `fsdp` folds dp_shard and cp the same way); the
    # sequence split is ours (titan_model.DocumentAttention with a ContextShard), so torchtitan is told
    # cp = 1 and never wraps the attention for its ring CP.
    return ParallelismConfig(data_parallel_replicate_degree=dims.dp_replicate,
                             data_parallel_shard_degree=dims.dp_shard * dims.cp, context_parallel_degree=1,
                             tensor_parallel_degree=dims.tp, expert_parallel_degree=dims.ep,
                             spmd_backend=SPMD_BACKEND)


def configure(model_config, dims: ParallelDims) -> None:
    """Give the model config the sharding of `dims` (before the model is built from it)."""
    with _trainer_class_unimported():
        model_config.update_from_config(config=_RuntimeConfig(_parallelism(dims)))


@contextmanager
def _trainer_class_unimported():
    """`update_from_config` imports `torchtitan.trainer` for one check, `isinstance(config, Trainer.Config)`
    (is this torchtitan's own trainer?), and that module imports torchtitan's data loaders, validator and
    Hugging Face `datasets`: +1,050 modules, +111 MiB of RSS and ~0.7 s of CPU in every trainer process
    (measured). Ours never is torchtitan's trainer, so while the call runs the name resolves to a module
    whose `Trainer.Config` nothing is an instance of; torchtitan's own checks and settings run unchanged,
    and a later torchtitan that reads more of that module fails loudly (AttributeError) instead of silently.
    Where the real module is already imported (a test process), it is used."""
    name = "torchtitan.trainer"
    if name in sys.modules:
        yield
        return
    placeholder = types.ModuleType(name, "torchtitan.trainer, not imported: see titan_parallelize.configure")
    placeholder.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})
    sys.modules[name] = placeholder
    try:
        yield
    finally:
        if sys.modules.get(name) is placeholder:
            del sys.modules[name]


def build_titan_dims(dims: ParallelDims, world_size: int, device_type: str) -> TitanDims:
    """torchtitan's ParallelDims over the running process group, its meshes built."""
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend(SPMD_BACKEND)
    titan_parallel_dims.device_type = device_type  # torchtitan assumes CUDA; its meshes must match the ranks'
    titan = TitanDims.from_config(_parallelism(dims), world_size)
    titan.build_mesh()
    return titan


def parallelize_titan(root: nn.Module, titan: nn.Module, dims: TitanDims, compute_dtype: torch.dtype,
                      activation_checkpointing: bool, cpu_offload: bool) -> None:
    """Apply `dims` to the torchtitan model `titan` inside the trained module `root` (the FSDP root)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if dims.ep_enabled or dims.tp_enabled:
        titan.parallelize(dims)
        if dims.tp_enabled:
            from .titan_lora import shard_adapters_as_their_base

            shard_adapters_as_their_base(titan)  # LoRA's adapters follow their TP-split weights
            from .titan_fp8 import check_tp_blocks_whole

            check_tp_blocks_whole(titan)
        if dims.tp_enabled and not dims.ep_enabled:
            keep_expert_input_gradients(titan)
        if dims.tp_enabled and titan.enable_weight_tying:
            # TP gave the embedding and the head a DTensor parameter each (both split along the vocabulary,
            # Shard(0)): tie them again, or each would train on half of the tied weight's gradient
            titan.tok_embeddings.weight = titan.lm_head.weight
    if activation_checkpointing:
        apply_block_checkpointing(titan)
    if not dims.dp_enabled:
        return
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    replicate = ["dp_replicate"] if dims.dp_replicate_enabled else []
    dense_mesh = dims.get_mesh([*replicate, "fsdp"])
    for block in titan.layers.values():
        moe = getattr(_unwrapped(block), "moe", None)
        if moe is not None and dims.ep_enabled:
            experts = moe.routed_experts
            # dim 0 (experts) is EP's already; with fewer experts than ranks sharing them, shard dim 1
            placement = Shard(1) if dims.get_mesh("efsdp").size() * dims.ep > experts.inner_experts.num_experts \
                else Shard(0)
            fully_shard(experts, mesh=dims.get_mesh([*replicate, "efsdp"]), mp_policy=mp, offload_policy=offload,
                        shard_placement_fn=lambda _, placement=placement: placement)
        fully_shard(block, mesh=dense_mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(root, mesh=dense_mesh, mp_policy=mp, offload_policy=offload)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # summed: see the module docstring
            # a plain SUM on the wire: FSDP would otherwise pre-multiply (PREMUL_SUM), which gloo lacks
            module.set_force_sum_reduction_for_comms(True)


def keep_expert_input_gradients(titan: nn.Module) -> None:
    """Under TP without EP the routed experts' input is the MoE's input all-gathered along the sequence,
    which torchtitan redistributes asynchronously (a DTensor over an AsyncCollectiveTensor). torch's
    `local_map` (torchtitan's wrapper of the experts) then takes `.wait()` of that tensor, which returns its
    buffer outside autograd: the experts' share of the gradient of the MoE's input was dropped and only
    the router's reached the block below (measured: the MoE input's gradient was the router's alone, so
    `ffn_norm` and every layer under the last MoE were off; grad norm 0.2%). A clone before the experts
    waits for the gather inside autograd; its backward passes the gradient through."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    def materialize(_module, args):
        return tuple(a.clone() if isinstance(a, DTensor) and isinstance(a._local_tensor, AsyncCollectiveTensor)
                     else a for a in args)

    for block in titan.layers.values():
        moe = getattr(_unwrapped(block), "moe", None)
        if moe is not None:
            moe.routed_experts.register_forward_pre_hook(materialize)


def apply_block_checkpointing(titan: nn.Module) -> None:
    """Every block recomputes its forward in backward (non-reentrant: composes with FSDP2's hooks)."""
    for name, block in list(titan.layers.items()):
        titan.layers[name] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def _unwrapped(block: nn.Module) -> nn.Module:
    return getattr(block, "_checkpoint_wrapped_module", block)
