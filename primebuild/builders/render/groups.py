"""The plan's groups as separately allocated components (a Slurm het-job component, a Kubernetes
replicated job), and which component gives each plan node its address.

A group (inference, or prefill and decode; trainer; orchestrator) is one component, in start order.
Its plan nodes map, in order, to the nodes the cluster allocates it. A plan node's address (`{host:N}`)
is that of the component whose processes listen there; capabilities.py refuses a plan in which two
groups would both listen on one plan node, since their allocations differ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from primebuild.contracts.plan import Plan, ProcessSpec
from primebuild.errors import UserError

# An OCI image reference as --image takes it: [registry[:port]/]name[:tag][@digest], nothing a shell or a
# comment line of a rendered script could read as more than one word.
IMAGE_REFERENCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*")


@dataclass(frozen=True)
class Component:
    index: int
    group: str
    processes: tuple[ProcessSpec, ...]
    nodes: tuple[int, ...]  # plan nodes, in order; the component's allocation has this many nodes

    @property
    def tasks_per_node(self) -> int:
        return max(sum(1 for p in self.processes if p.node == n) for n in self.nodes)

    @property
    def gpus_per_node(self) -> int:
        return max(sum(len(p.gpus) for p in self.processes if p.node == n) for n in self.nodes)

    def node_rank(self, plan_node: int) -> int:
        """Which node of this component's allocation holds `plan_node` (0-based)."""
        return self.nodes.index(plan_node)

    def shares_node(self, process: ProcessSpec) -> bool:
        return sum(1 for p in self.processes if p.node == process.node) > 1


def components(plan: Plan) -> list[Component]:
    order: list[str] = []
    for p in sorted(plan.processes, key=lambda p: p.start_order):  # stable: plan order inside an order
        if p.group not in order:
            order.append(p.group)
    out = []
    for index, group in enumerate(order):
        procs = tuple(p for p in plan.processes if p.group == group)
        nodes = tuple(sorted({p.node for p in procs}))
        out.append(Component(index, group, procs, nodes))
    return out


def node_owners(plan: Plan, comps: list[Component]) -> list[tuple[int, int] | None]:
    """For every plan node: (component index, node rank in it) of the component that gives its address,
    or None for a node no process uses."""
    owners: list[tuple[int, int] | None] = []
    for node in range(plan.hardware.nodes):
        present = [c for c in comps if node in c.nodes]
        listening = [c for c in present if any(p.ports for p in c.processes if p.node == node)]
        chosen = (listening or present or [None])[0]
        owners.append(None if chosen is None else (chosen.index, chosen.node_rank(node)))
    return owners


def env_literals(process: ProcessSpec) -> dict[str, str]:
    """The process's plan env with no placeholder ({run_dir} etc. are the worker's to fill)."""
    return {k: v for k, v in sorted(process.env.items()) if "{" not in v}


def not_runnable_notes(plan: Plan) -> list[str]:
    """A header for artifacts of a design study: what no built backend applies yet."""
    if plan.runnable:
        return []
    # each note is one comment line: a message quoting a model's config (its architecture) must not end it
    return ["DESIGN STUDY, NOT RUNNABLE: `primebuild run` refuses this plan; these fields need backends that "
            "are not built:"] + [" ".join(f"  {u.field}: {u.message}".splitlines()) for u in plan.unsupported]


def checked_image(image: str | None) -> str | None:
    """`--image` as given, refused (with how to fix it) unless it is an image reference."""
    if image is not None and not IMAGE_REFERENCE.fullmatch(image):
        raise UserError(f"--image {image!r}: not an image reference",
                        hint="give REGISTRY/NAME[:TAG] or NAME@sha256:DIGEST (letters, digits and ._/:@+-)")
    return image


def image_reference(image: str | None, plan: Plan) -> str | None:
    """The image the processes run: `--image NAME` (where the built image was pushed) pinned to the plan's
    image digest when the plan names one (`render --image-digest`, `plan --image-digest`); a tag is then
    dropped, since a digest says exactly which bytes. None: no image (the nodes' own installation)."""
    if plan.image is None:
        return image
    name = image or "primebuild"
    if "@" in name:
        return name
    if ":" in name.rsplit("/", 1)[-1]:
        name = name.rsplit(":", 1)[0]
    return f"{name}@{plan.image.digest}"
