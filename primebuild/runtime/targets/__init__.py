"""Targets: where a plan's processes run. `target_for(kind)` gives the one a plan names."""

from __future__ import annotations

from primebuild.contracts.run_dir import LaunchRecord, OutcomeRecord, RunDir
from primebuild.runtime.targets.base import Target


def target_for(kind: str) -> Target:
    if kind == "local":
        from primebuild.runtime.targets.local import LocalTarget

        return LocalTarget()
    if kind == "slurm":
        from primebuild.runtime.targets.slurm import SlurmTarget

        return SlurmTarget()
    if kind == "ssh":
        from primebuild.runtime.targets.ssh import SshTarget

        return SshTarget()
    if kind == "kubernetes":
        from primebuild.runtime.targets.kubernetes import KubernetesTarget

        return KubernetesTarget()
    raise ValueError(f"unknown target {kind!r}")


def ended_outcome(run: RunDir, record: LaunchRecord | None) -> OutcomeRecord | None:
    """The recorded outcome of a session that is over (its target runs nothing of it any more), else None."""
    outcome = run.read_outcome()
    if outcome is None or (record is not None and target_for(record.target).active(run, record)):
        return None
    return outcome
