"""The trainer's device mesh, built once from the validated parallel degrees (torchtitan's parallel_dims
is the model for its shape, not its code).

Ranks are laid out dp-major, cp-minor: rank = dp_index * cp + cp_index. The sub-meshes, and who uses them:

| sub-mesh      | size               | what runs over it                                                  |
|---------------|--------------------|--------------------------------------------------------------------|
| `dp`          | dp_shard           | the batch: each dp rank packs its own micro-batches (batch.pack)   |
| `cp`          | cp                 | one micro-batch's sequence, split (context_parallel.py)            |
| `fsdp`        | dp_shard * cp      | FSDP of every non-expert parameter (CP ranks fold into FSDP)       |
| `ep`          | ep                 | experts: each rank owns num_experts / ep of them (expert_parallel.py) |
| `efsdp`       | dp_shard * cp / ep | FSDP of the experts a rank owns, over the ranks owning the same ones |

EP ranks are carved from the FSDP dimension: with ep a multiple of cp an EP group is ep/cp whole CP
groups (torchtitan's layout: dp_shard = efsdp * ep/cp); with cp a multiple of ep it lies inside one CP
group. Either way ep | dp_shard * cp (the plan checks it, and num_experts % ep).

HSDP (dp_replicate) and TP are not applied: the plan refuses them (builders/capabilities.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from primebuild.contracts.trainer import ParallelDims
from primebuild.errors import UserError


@dataclass(frozen=True)
class Meshes:
    dims: ParallelDims
    dp_rank: int
    cp_rank: int
    fsdp: DeviceMesh | None = None  # None on one rank
    cp_mesh: DeviceMesh | None = None
    ep_mesh: DeviceMesh | None = None
    efsdp: DeviceMesh | None = None

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return None if self.cp_mesh is None else self.cp_mesh.get_group()


def check_dims(dims: ParallelDims, world_size: int) -> None:
    """What the trainer applies; everything else is refused (the plan refuses it first)."""
    if dims.dp_replicate != 1 or dims.tp != 1:
        raise UserError(f"parallel {dims.model_dump()}: this trainer applies dp_shard, cp and ep "
                        "(dp_replicate and tp are not built)")
    if dims.world_size != world_size:
        raise UserError(f"parallel dp_shard*cp = {dims.world_size} but the launch has {world_size} rank(s)")
    shards = dims.dp_shard * dims.cp
    if shards % dims.ep:
        raise UserError(f"parallel.ep={dims.ep} must divide dp_shard*cp={shards}: EP ranks are carved from the "
                        "FSDP dimension")
    if dims.ep % dims.cp and dims.cp % dims.ep:
        raise UserError(f"parallel ep={dims.ep}, cp={dims.cp}: one must be a multiple of the other (an EP group "
                        "spans whole CP groups, or lies inside one)")


def build_meshes(dims: ParallelDims, world_size: int, rank: int, device_type: str) -> Meshes:
    """The one device mesh of the run and its named sub-meshes."""
    check_dims(dims, world_size)
    dp_rank, cp_rank = divmod(rank, dims.cp)
    if world_size == 1:
        return Meshes(dims, 0, 0)
    dp, cp, ep = dims.dp_shard, dims.cp, dims.ep
    if ep % cp == 0:  # (efsdp, ep/cp, cp): an EP group is ep/cp whole CP groups
        world = init_device_mesh(device_type, (dp * cp // ep, ep // cp, cp),
                                 mesh_dim_names=("efsdp", "ep_dp", "cp"))
        ep_mesh = _flat(world, ("ep_dp", "cp"), "ep")
        efsdp = world["efsdp"]
        cp_mesh = world["cp"]
    else:  # (dp, cp/ep, ep): an EP group inside one CP group
        world = init_device_mesh(device_type, (dp, cp // ep, ep), mesh_dim_names=("dp", "cp_outer", "ep"))
        ep_mesh = world["ep"]
        efsdp = _flat(world, ("dp", "cp_outer"), "efsdp")
        cp_mesh = _flat(world, ("cp_outer", "ep"), "cp")
    fsdp = _flat(world, world.mesh_dim_names, "fsdp")
    return Meshes(dims, dp_rank, cp_rank, fsdp=fsdp, cp_mesh=cp_mesh if cp > 1 else None,
                  ep_mesh=ep_mesh if ep > 1 else None, efsdp=efsdp if ep > 1 else None)


def _flat(mesh: DeviceMesh, names: tuple[str, ...], flat_name: str) -> DeviceMesh:
    return mesh[names]._flatten(flat_name)
