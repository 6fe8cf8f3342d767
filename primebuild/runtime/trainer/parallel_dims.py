"""The trainer's device mesh, built once from the validated parallel degrees (torchtitan's parallel_dims
is the model for its shape, not its code).

Ranks are laid out replica-major, then dp, cp-minor: rank = (replica * dp_shard + dp_index) * cp + cp_index.
The sub-meshes, and who uses them:

| sub-mesh       | size                    | what runs over it                                                                                       |
|----------------|-------------------------|---------------------------------------------------------------------------------------------------------|
| `dp`           | dp_replicate * dp_shard | the batch: each dp rank packs its own micro-batches (batch.pack)                                        |
| `cp`           | cp                      | one micro-batch's sequence, split (context_parallel.py)                                                 |
| `shard`        | dp_shard * cp           | FSDP's shard dimension for every non-expert parameter (CP ranks fold into it): the ranks of one replica |
| `ep`           | ep                      | experts: each rank owns num_experts / ep of them (expert_parallel.py)                                   |
| `efsdp`        | dp_shard * cp / ep      | FSDP's shard dimension for the experts a rank owns, over the ranks of its replica owning the same ones  |
| `dp_replicate` | dp_replicate            | HSDP: every replica holds the whole sharded model; gradients are all-reduced across replicas            |

With dp_replicate > 1 the meshes FSDP is applied over are 2-D, (dp_replicate, shard) and (dp_replicate,
efsdp): FSDP2 reduce-scatters a gradient inside the replica, then all-reduces the shard across replicas
(torchtitan's HSDP). Replication costs no memory saving: a replica holds all parameters, split only
dp_shard * cp ways. The EP and CP groups lie inside one replica, so their traffic stays there.

EP ranks are carved from the FSDP dimension: with ep a multiple of cp an EP group is ep/cp whole CP
groups (torchtitan's layout: dp_shard = efsdp * ep/cp); with cp a multiple of ep it lies inside one CP
group. Either way ep | dp_shard * cp when tp = 1 (the plan checks it, and num_experts % ep).

TP (the torchtitan engine only: torchtitan's Qwen3 plan, titan_parallelize.py) is the innermost
dimension, as in torchtitan's meshes: the tp ranks of a group are consecutive and compute the same
micro-batches, so the batch is dealt over rank // (cp * tp). torchtitan builds the meshes it shards
over itself; from these it needs only the data layout, the CP group and the replica. Its expert mesh
(efsdp, ep) is cut from dp_shard * cp * tp with ep innermost, so EP borrows the TP ranks first (tp 2 x
ep 2 on 2 ranks: the EP group is the TP group) and ep | dp_shard * cp * tp.
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
    fsdp: DeviceMesh | None = None  # what fully_shard gets: `shard`, or (dp_replicate, shard); None on one rank
    cp_mesh: DeviceMesh | None = None
    ep_mesh: DeviceMesh | None = None
    efsdp: DeviceMesh | None = None  # the experts' fully_shard mesh: `efsdp`, or (dp_replicate, efsdp)
    replica: DeviceMesh | None = None  # the ranks of this rank's replica; None without HSDP (all ranks)
    world: DeviceMesh | None = None  # the root every mesh above is cut from; it holds their groups (teardown.py)

    @property
    def dp_degree(self) -> int:
        """The ranks the batch is dealt over: every replica trains on its own part of it."""
        return self.dims.dp_replicate * self.dims.dp_shard

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return None if self.cp_mesh is None else self.cp_mesh.get_group()

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks that together hold every gradient element once (None: the whole world does)."""
        return None if self.replica is None else self.replica.get_group()


def check_dims(dims: ParallelDims, world_size: int) -> None:
    """What the trainer applies; everything else is refused (the plan refuses it first). tp > 1 is
    the torchtitan engine's alone (main.check_launch)."""
    if dims.world_size != world_size:
        raise UserError(f"parallel dp_replicate*dp_shard*cp*tp = {dims.world_size} but the launch has {world_size} "
                        "rank(s)")
    shards = dims.dp_shard * dims.cp * dims.tp
    if shards % dims.ep:
        raise UserError(f"parallel.ep={dims.ep} must divide dp_shard*cp*tp={shards}: EP ranks are carved from the "
                        "FSDP, CP and TP ranks")
    if dims.ep > 1 and dims.tp > dims.ep and dims.dp_replicate * dims.dp_shard * dims.cp == 1:
        raise UserError(f"parallel ep={dims.ep} < tp={dims.tp} with no FSDP rank: the ranks owning the same experts "
                        "would not sum their gradients", hint=f"set ep: {dims.tp}, or dp_shard >= 2")
    if dims.ep % dims.cp and dims.cp % dims.ep:
        raise UserError(f"parallel ep={dims.ep}, cp={dims.cp}: one must be a multiple of the other (an EP group "
                        "spans whole CP groups, or lies inside one)")


def build_meshes(dims: ParallelDims, world_size: int, rank: int, device_type: str) -> Meshes:
    """The one device mesh of the run and its named sub-meshes."""
    check_dims(dims, world_size)
    dp_rank, inner = divmod(rank, dims.cp * dims.tp)  # dp_rank = replica * dp_shard + dp_index
    cp_rank = inner // dims.tp
    if world_size == 1:
        return Meshes(dims, 0, 0)
    replicas, dp, cp, ep = dims.dp_replicate, dims.dp_shard, dims.cp, dims.ep
    if dims.tp > 1:  # torchtitan's meshes shard the model (titan_parallelize.py): here the data layout only
        world = init_device_mesh(device_type, (replicas, dp, cp, dims.tp),
                                 mesh_dim_names=("dp_replicate", "dp", "cp", "tp"))
        replica = _flat(world, ("dp", "cp", "tp"), "replica") if replicas > 1 else None
        return Meshes(dims, dp_rank, cp_rank, cp_mesh=world["cp"] if cp > 1 else None, replica=replica, world=world)
    if ep % cp == 0:  # (efsdp, ep/cp, cp): an EP group is ep/cp whole CP groups
        world = init_device_mesh(device_type, (replicas, dp * cp // ep, ep // cp, cp),
                                 mesh_dim_names=("dp_replicate", "efsdp", "ep_dp", "cp"))
        ep_mesh = _flat(world, ("ep_dp", "cp"), "ep")
        efsdp = world["efsdp"]
        cp_mesh = world["cp"]
    else:  # (dp, cp/ep, ep): an EP group inside one CP group
        world = init_device_mesh(device_type, (replicas, dp, cp // ep, ep),
                                 mesh_dim_names=("dp_replicate", "dp", "cp_outer", "ep"))
        ep_mesh = world["ep"]
        efsdp = _flat(world, ("dp", "cp_outer"), "efsdp")
        cp_mesh = _flat(world, ("cp_outer", "ep"), "cp")
    shard = _flat(world, world.mesh_dim_names[1:], "shard")
    fsdp = shard
    if replicas > 1:  # HSDP: FSDP's meshes get the replicate dimension in front (built from the meshes
        # kept here: slicing flattened names from the root mesh is deprecated)
        replicate = world["dp_replicate"]
        fsdp, efsdp = DeviceMesh._concatenate([replicate, shard]), DeviceMesh._concatenate([replicate, efsdp])
    return Meshes(dims, dp_rank, cp_rank, fsdp=fsdp, cp_mesh=cp_mesh if cp > 1 else None,
                  ep_mesh=ep_mesh if ep > 1 else None, efsdp=efsdp if ep > 1 else None,
                  replica=shard if replicas > 1 else None, world=world)


def _flat(mesh: DeviceMesh, names: tuple[str, ...], flat_name: str) -> DeviceMesh:
    return mesh[names]._flatten(flat_name)
