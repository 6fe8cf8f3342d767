"""How many times the trainer group alone may restart (primebuild/runtime/supervisor.py), and where it cannot.

A trainer-only restart keeps the inference servers' loaded model and the orchestrator's rollouts: the
trainer resumes from its newest checkpoint and retrains the steps after it from the rollout batches on
disk. That holds where primebuild's own supervisor restarts the group (local, ssh and Slurm targets), in
either weight-sync mode: with broadcast the restarted rank 0 hosts the weight group's store again on the
same port (weight_sync.port: no new port, no new process), the servers reconnect to it and register with
the step they hold, and the first step it sends after its restart goes to every server in full
(runtime/weight_sync/broadcast.py). Elsewhere the count is 0 and a written one is refused.
"""

from __future__ import annotations

from primebuild.manifest.schema import Manifest

DEFAULT_TRAINER_RESTARTS = 3


def trainer_restart_gap(m: Manifest) -> str | None:
    """Why a trainer-only restart cannot work in this configuration (None: it can)."""
    if m.target.kind == "kubernetes":
        return ("on Kubernetes the kubelet restarts one pod's container at a time, not the trainer group together, "
                "and a rank restarted alone cannot rejoin the others")
    return None


def trainer_restarts(m: Manifest) -> int:
    """`trainer.max_restarts` as written, else the default where a trainer-only restart works, else 0."""
    if m.trainer.max_restarts is not None:
        return m.trainer.max_restarts
    return DEFAULT_TRAINER_RESTARTS if trainer_restart_gap(m) is None else 0
