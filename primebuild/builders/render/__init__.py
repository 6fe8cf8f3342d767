"""Renderers: a plan (+ where the run folder and the interpreter are) -> the exact artifacts a target
submits. Pure functions of their inputs, like the plan compiler: they import nothing from primebuild/runtime/."""

from __future__ import annotations

from primebuild.contracts.plan import Plan
from primebuild.contracts.render import RenderContext

TARGETS = ("slurm", "kubernetes", "ssh")


def render(plan: Plan, target: str, ctx: RenderContext) -> dict[str, str]:
    """{file name: text} of `plan` rendered for `target`."""
    if target == "slurm":
        from primebuild.builders.render.slurm import render_slurm

        return render_slurm(plan, ctx)
    if target == "kubernetes":
        from primebuild.builders.render.kubernetes import render_kubernetes

        return render_kubernetes(plan, ctx)
    if target == "ssh":
        from primebuild.builders.render.ssh import render_ssh

        return render_ssh(plan, ctx)
    raise ValueError(f"no renderer for target {target!r}")
