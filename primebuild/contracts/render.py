"""RenderContext: what a target renderer needs beyond the plan (written by the CLI or a target, read by
primebuild/builders/render/). Only paths: everything about the processes is in the plan."""

from __future__ import annotations

from pydantic import Field

from primebuild.contracts.base import Contract


class RenderContext(Contract):
    run_dir: str = Field(min_length=1)  # absolute; on a filesystem every node sees, at the same path
    python: str = Field(min_length=1)  # an interpreter with primebuild installed, same path on every node
    image: str | None = None  # where the image was pushed (REGISTRY/NAME[:TAG]); pinned to the plan's image digest
    mounts: list[str] = Field(default_factory=list)  # slurm + image: host paths mounted at the same path (the store)
    model_path: str = "{model_path}"  # kubernetes: the model folder as the pods see it (on the shared volume)
    # slurm: nodes no component may be given (a restart after a lost host: slurmctld may not know it yet)
    exclude_nodes: list[str] = Field(default_factory=list)
