"""A plan as one self-contained HTML page: the node x GPU map coloured by role, the memory of one GPU of
each role as a stacked bar (weights, KV cache, activations, the rest, free) and the host memory of the
orchestrator's node, and the step-time estimate.

Pure: it reads the typed plan (primebuild/contracts/plan.py) and imports no torch. Nothing is fetched by
the page (inline CSS, no script, no font or image URL), so it opens anywhere, offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from primebuild.contracts.estimates import Estimates
from primebuild.contracts.memory import GroupMemory, InferenceGroupMemory
from primebuild.contracts.model_ref import ModelRef
from primebuild.contracts.plan import GpuSlot, Plan

TEMPLATES = Path(__file__).parent / "templates"
GIB = 1 << 30

ROLE_COLOURS = {  # roles of primebuild/builders/processes.py; colour-blind-safe (Okabe-Ito)
    "prefill": "#CC79A7", "decode": "#0072B2", "inference": "#56B4E9", "trainer": "#E69F00",
    "orchestrator": "#009E73", "idle": "#E5E7EB",
}
# memory breakdown keys of primebuild/builders/memory.py, grouped into what a reader asks about
MEMORY_PARTS = [
    ("weights", "weights", ("weights", "params", "master_weights"), "#0072B2"),
    ("grads_optimizer", "grads + optimizer", ("grads", "optimizer_state"), "#56B4E9"),
    ("fsdp_buffers", "gathered layers (FSDP)", ("fsdp_buffers",), "#F0E442"),
    ("kv_cache", "KV cache", ("kv_cache",), "#CC79A7"),
    ("weight_staging", "weight-sync staging", ("weight_staging",), "#D55E00"),
    ("activations", "activations + logits", ("activations", "logits", "sparse_index"), "#E69F00"),
    ("overhead", "overhead", ("overhead",), "#999999"),
    ("host_processes", "orchestrator + supervisor + P/D router", ("process", "supervisor", "router"), "#009E73"),
    ("episode_programs", "episodes' programs", ("episode_programs",), "#56B4E9"),
]
FREE_COLOUR = "#F3F4F6"


def render_plan_html(plan: Plan) -> str:
    import jinja2  # jinja2 is a core dependency; imported here so `plan -o json` does not pay for it

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             autoescape=True, trim_blocks=True, lstrip_blocks=True)
    return env.get_template("plan.html.j2").render(**view(plan))


def view(plan: Plan) -> dict[str, Any]:
    """What the template shows, computed from the plan."""
    hw = plan.hardware
    roles_used = sorted({g.role for n in plan.nodes for g in n.gpus} | {p.role for p in plan.processes},
                        key=_role_order)
    nodes = []
    for node in plan.nodes:
        by_index = {g.index: g for g in node.gpus}
        cells = [by_index.get(i, GpuSlot(index=i, process="", role="idle")) for i in range(hw.gpus_per_node)]
        cpu_only = [p for p in plan.processes if p.node == node.index and not p.gpus]
        nodes.append({"index": node.index, "cells": cells,
                      "cpu_processes": [{"name": p.name, "role": p.role} for p in cpu_only]})
    gpus = sum(len(n["cells"]) for n in nodes)
    model = plan.model
    return {
        "plan": plan, "name": plan.name, "nodes": nodes, "gpus": gpus, "colours": ROLE_COLOURS,
        "legend": [(r, ROLE_COLOURS.get(r, "#6B7280"), _count(plan, r)) for r in roles_used],
        "memory": [_memory_bar(role, m, _count(plan, role)) for role, m in
                   sorted(plan.memory.items(), key=lambda kv: _role_order(kv[0]))],
        "memory_parts": [(label, colour) for _, label, _, colour in MEMORY_PARTS] + [("free", FREE_COLOUR)],
        "step": _step(plan.estimates), "summary": plan.estimates.summary,
        "device": "CPU" if hw.gpu == "cpu" else hw.gpu.upper(),
        "params": _params(model), "model_name": model.repo or model.manifest or model.architecture,
    }


def _role_order(role: str | None) -> tuple[int, str]:
    order = list(ROLE_COLOURS)
    return (order.index(role) if role in order else len(order), role or "")


def _count(plan: Plan, role: str | None) -> int:
    """GPUs of a role, or its processes on a CPU plan."""
    gpus = sum(1 for n in plan.nodes for g in n.gpus if g.role == role)
    return gpus or sum(1 for p in plan.processes if p.role == role)


def _memory_bar(role: str, memory: GroupMemory, count: int) -> dict[str, Any]:
    capacity = memory.capacity_bytes
    breakdown = dict(memory.breakdown)
    parts = []
    for key, label, sources, colour in MEMORY_PARTS:
        size = sum(breakdown.get(s, 0) for s in sources)
        if size > 0:
            parts.append({"key": key, "label": label, "bytes": size, "text": _bytes(size), "colour": colour,
                          "percent": 100 * size / capacity})
    used = sum(p["bytes"] for p in parts)
    free = max(capacity - used, 0)
    parts.append({"key": "free", "label": "free", "bytes": free, "text": _bytes(free), "colour": FREE_COLOUR,
                  "percent": 100 * free / capacity})
    return {"role": role, "colour": ROLE_COLOURS.get(role, "#6B7280"), "count": count, "parts": parts,
            "capacity_gib": capacity / GIB, "used_gib": used / GIB, "fits": memory.fits,
            "kv_tokens": memory.kv_tokens_capacity if isinstance(memory, InferenceGroupMemory) else None}


def _step(estimates: Estimates) -> dict[str, Any] | None:
    step = estimates.step
    if step is None:
        return None
    sync = estimates.weight_sync.seconds if estimates.weight_sync else 0.0
    phases = [("rollout", step.rollout_seconds, ROLE_COLOURS["decode"]),
              ("train", step.train_seconds, ROLE_COLOURS["trainer"]),
              ("weight sync", sync, "#6B7280")]
    longest = max(s for _, s, _ in phases) or 1.0
    # The headline is the step people compare with runs: the expected asynchronous one where the manifest
    # gives a rollout profile; the worst case (every rollout full-length) is the line under it.
    profile = estimates.profile
    headline = profile.async_step_seconds if profile else step.step_seconds
    return {"seconds": headline, "expected": profile is not None, "worst_seconds": step.step_seconds,
            "sync_seconds": profile.sync_step_seconds if profile else None,
            "idle_side": step.idle_side, "idle_percent": 100 * step.idle_fraction,
            "tokens": step.tokens_per_step,
            "phases": [{"label": label, "seconds": s, "colour": c, "percent": 100 * s / longest}
                       for label, s, c in phases]}


def _params(model: ModelRef) -> str:
    total, active = model.total_params, model.active_params
    if not total:
        return ""
    text = _human(total)
    return text + (f" total, {_human(active)} active" if active and active != total else "")


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))
