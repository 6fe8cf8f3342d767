"""Placement: which node and GPUs each replica and rank gets.

Order is fixed and documented because it decides what a person sees in `plan`: inference groups first
(prefill, decode, or the single inference group), in declaration order; then the trainer on whole
nodes; the orchestrator on a CPU slot of the first node (CPU-only hardware: see `_place_cpu`). Replicas that fit inside one node are packed
into nodes; a replica spanning several nodes takes whole nodes. Nothing is shared between groups, so
one group's failure or memory use never lands on another group's GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from primebuild.errors import Problem
from primebuild.manifest.schema import InferenceGroup, Manifest


@dataclass(frozen=True)
class Slot:
    """The GPUs of one node given to one process."""

    node: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class ReplicaPlacement:
    group: str
    replica: int
    slots: tuple[Slot, ...]  # one per node of the replica


@dataclass(frozen=True)
class Placement:
    inference: tuple[ReplicaPlacement, ...]
    trainer: tuple[Slot, ...]  # one per trainer node (a torchrun per node)
    orchestrator_node: int
    idle_gpus: tuple[tuple[int, int], ...]  # (node, gpu) nobody uses
    teacher: Slot | None = None  # on-policy distillation: the teacher's server (CPU: the orchestrator's node)


class _Cursor:
    """Hands out GPUs node by node."""

    def __init__(self, nodes: int, gpus_per_node: int):
        self.nodes, self.per_node = nodes, gpus_per_node
        self.node, self.gpu = 0, 0

    def fresh_node(self) -> None:
        if self.gpu:
            self.node, self.gpu = self.node + 1, 0

    def take(self, count: int) -> Slot | None:
        if self.gpu + count > self.per_node:
            self.fresh_node()
        if self.node >= self.nodes:
            return None
        slot = Slot(self.node, tuple(range(self.gpu, self.gpu + count)))
        self.gpu += count
        if self.gpu == self.per_node:
            self.node, self.gpu = self.node + 1, 0
        return slot


def check_group_shape(name: str, group: InferenceGroup, gpus_per_node: int, path: str) -> list[Problem]:
    """Shape rules that need only the hardware: TP inside a node, whole nodes for multi-node replicas."""
    problems = []
    per_replica = group.gpus_per_replica
    if group.tp > gpus_per_node:
        problems.append(Problem(f"{name}: tp={group.tp} exceeds the {gpus_per_node} GPUs of a node; tensor "
                                "parallelism must stay inside a node (NVLink)", field=f"{path}.tp",
                                hint=f"use tp <= {gpus_per_node} and raise dp or nodes_per_replica instead"))
    if (group.tp * group.dp) % group.ep:
        problems.append(Problem(f"{name}: ep={group.ep} must divide tp*dp={group.tp * group.dp}",
                                field=f"{path}.ep", hint="expert parallelism reuses the tp*dp ranks of a replica"))
    if group.nodes_per_replica == 1:
        if per_replica > gpus_per_node:
            problems.append(Problem(
                f"{name}: a replica needs tp*dp={per_replica} GPUs but a node has {gpus_per_node}",
                field=f"{path}.nodes_per_replica",
                hint=f"set nodes_per_replica: {-(-per_replica // gpus_per_node)} or lower tp/dp"))
        elif gpus_per_node % per_replica:
            problems.append(Problem(
                f"{name}: replicas of {per_replica} GPUs do not tile a node of {gpus_per_node}",
                field=f"{path}.tp", hint="choose tp*dp dividing the GPUs per node"))
    elif per_replica != group.nodes_per_replica * gpus_per_node:
        problems.append(Problem(
            f"{name}: tp*dp={per_replica} must equal nodes_per_replica*gpus_per_node="
            f"{group.nodes_per_replica * gpus_per_node} for a multi-node replica",
            field=f"{path}.dp", hint=f"set dp: {group.nodes_per_replica * gpus_per_node // group.tp}"))
    return problems


def place(m: Manifest) -> tuple[Placement | None, list[Problem]]:
    hw = m.hardware
    if hw.gpu == "cpu":
        replicas = sum(g.replicas for g in m.inference.groups.values())
        if replicas > hw.cpus_per_node:  # also keeps a typo like 1000000 from building a million processes
            return None, [Problem(f"{replicas} inference replicas on one CPU node with {hw.cpus_per_node} CPUs",
                                  field="inference.replicas",
                                  hint=f"use at most {hw.cpus_per_node} replicas, or raise hardware.cpus_per_node")]
        return _place_cpu(m)
    problems: list[Problem] = []
    section = "inference.disaggregation" if m.inference.disaggregation else "inference"
    for name, group in m.inference.groups.items():
        path = f"{section}.{name}" if m.inference.disaggregation else section
        problems += check_group_shape(name, group, hw.gpus_per_node, path)
    if problems:
        return None, problems

    cursor = _Cursor(hw.nodes, hw.gpus_per_node)
    replicas: list[ReplicaPlacement] = []
    for name, group in m.inference.groups.items():
        path = f"{section}.{name}" if m.inference.disaggregation else section
        cursor.fresh_node()  # groups never share a node: different roles, different failure domains
        for r in range(group.replicas):
            if group.nodes_per_replica > 1:
                cursor.fresh_node()
                slots = [cursor.take(hw.gpus_per_node) for _ in range(group.nodes_per_replica)]
            else:
                slots = [cursor.take(group.gpus_per_replica)]
            if any(s is None for s in slots):
                need = _inference_nodes(m)
                return None, [Problem(
                    f"inference needs {need} nodes but the cluster has {hw.nodes} ({name} replica {r} is the "
                    "first that does not fit)", field=f"{path}.replicas",
                    hint="lower replicas, or add nodes under hardware.nodes")]
            replicas.append(ReplicaPlacement(name, r, tuple(slots)))  # type: ignore[arg-type]
    cursor.fresh_node()
    teacher = None
    if m.distill is not None:  # its own node: another model, another failure domain (its other GPUs idle)
        teacher = cursor.take(m.distill.tp) if m.distill.tp <= hw.gpus_per_node else None
        if teacher is None:
            return None, [Problem(
                f"the teacher's server needs {m.distill.tp} GPUs (distill.tp) of one node of its own: inference "
                f"takes {cursor.node} of the {hw.nodes} nodes of {hw.gpus_per_node} GPUs", field="distill.tp",
                hint=f"add a node under hardware.nodes, or use at most {hw.gpus_per_node} GPUs (one node)")]
        cursor.fresh_node()
    last_port = m.inference.port + len(replicas) - 1 + (1000 if any(len(r.slots) > 1 for r in replicas) else 0)
    if last_port > 65535:  # one HTTP port per replica (and a DP coordinator port for multi-node ones)
        return None, [Problem(f"{len(replicas)} inference replicas from port {m.inference.port} need ports up to "
                              f"{last_port}, beyond 65535", field="inference.port",
                              hint="lower inference.port or the number of replicas")]

    free_nodes = hw.nodes - cursor.node
    trainer_nodes = m.trainer.nodes or free_nodes
    world = m.trainer.world_size
    if trainer_nodes > free_nodes or free_nodes == 0:
        return None, [Problem(
            f"trainer wants {trainer_nodes} node(s) but only {free_nodes} remain after inference"
            f"{' and the teacher' if teacher else ''} ({cursor.node} of {hw.nodes} nodes)", field="trainer.nodes",
            hint="add nodes, shrink inference (replicas), or set trainer.nodes lower")]
    capacity = trainer_nodes * hw.gpus_per_node
    if world != capacity and not (trainer_nodes == 1 and world < hw.gpus_per_node):
        return None, [Problem(
            f"trainer world size dp_replicate*dp_shard*cp*tp = {world} but its {trainer_nodes} node(s) hold "
            f"{capacity} GPUs", field="trainer.dp_shard",
            hint=f"set dp_shard: {capacity // max(1, m.trainer.dp_replicate * m.trainer.cp * m.trainer.tp)} "
                 f"or trainer.nodes: {-(-world // hw.gpus_per_node)}")]
    per_node = min(world, hw.gpus_per_node)
    trainer = tuple(Slot(cursor.node + i, tuple(range(per_node))) for i in range(trainer_nodes))

    used = {(s.node, g) for rp in replicas for s in rp.slots for g in s.gpus}
    used |= {(s.node, g) for s in trainer for g in s.gpus}
    used |= {(teacher.node, g) for g in teacher.gpus} if teacher else set()
    idle = tuple((n, g) for n in range(hw.nodes) for g in range(hw.gpus_per_node) if (n, g) not in used)
    return Placement(tuple(replicas), trainer, orchestrator_node=0, idle_gpus=idle, teacher=teacher), []


def _inference_nodes(m: Manifest) -> int:
    per_node = m.hardware.gpus_per_node
    total = 0
    for group in m.inference.groups.values():
        if group.nodes_per_replica > 1:
            total += group.replicas * group.nodes_per_replica
        else:
            total += -(-group.replicas * group.gpus_per_replica // per_node)
    return total


def _place_cpu(m: Manifest) -> tuple[Placement | None, list[Problem]]:
    """CPU-only hardware, no GPUs to hand out. One node: every process on it. Several (a cluster target):
    the trainer takes the last `trainer.nodes` nodes (default 1; one torchrun per node, its ranks split
    evenly over them), the orchestrator shares the last one — its rollouts go to the trainer through
    the run folder — and the inference replicas take the others in turn, so that sampling and training
    never compete for the same cores."""
    nodes = m.hardware.nodes
    trainer_nodes = m.trainer.nodes or 1
    ranks = m.trainer.ranks or m.trainer.world_size
    if trainer_nodes > 1 and trainer_nodes >= nodes:
        return None, [Problem(f"trainer wants {trainer_nodes} nodes but the cluster has {nodes}, and inference "
                              "needs one of its own", field="trainer.nodes",
                              hint=f"set hardware.nodes: {trainer_nodes + 1}, or trainer.nodes lower")]
    if ranks % trainer_nodes:
        return None, [Problem(f"trainer: {ranks} ranks do not split evenly over {trainer_nodes} nodes",
                              field="trainer.nodes", hint=f"use a multiple of {trainer_nodes} ranks (dp_shard)")]
    first_trainer = nodes - trainer_nodes
    inference_nodes = max(1, first_trainer)
    flat = [(name, r) for name, group in m.inference.groups.items() for r in range(group.replicas)]
    replicas = tuple(ReplicaPlacement(name, r, (Slot(i % inference_nodes, ()),)) for i, (name, r) in enumerate(flat))
    trainer = tuple(Slot(max(0, first_trainer) + i, ()) for i in range(trainer_nodes))
    teacher = Slot(nodes - 1, ()) if m.distill is not None else None  # beside the orchestrator
    return Placement(replicas, trainer, orchestrator_node=nodes - 1, idle_gpus=(), teacher=teacher), []
