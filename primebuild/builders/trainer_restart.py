"""How many times the trainer group alone may restart (primebuild/runtime/supervisor.py), and where it cannot.

A trainer-only restart keeps the inference servers' loaded model and the orchestrator's rollouts: the
trainer resumes from its newest checkpoint and retrains the steps after it from the rollout batches on
disk. That holds where primebuild's own supervisor restarts the group (local, ssh and Slurm targets) and
the servers read weights from the run folder. Elsewhere the count is 0 and a written one is refused.
"""

from __future__ import annotations

from primebuild.manifest.schema import Manifest

DEFAULT_TRAINER_RESTARTS = 3


def trainer_restart_gap(m: Manifest) -> str | None:
    """Why a trainer-only restart cannot work in this configuration (None: it can)."""
    if m.weight_sync.mode == "broadcast":
        return ("with broadcast weight sync the trainer's rank 0 is the sender of a torch.distributed group the "
                "servers joined at start; a restarted trainer cannot join it again, so the servers would never "
                "receive another step")
    if m.target.kind == "kubernetes":
        return ("on Kubernetes the kubelet restarts one pod's container at a time, not the trainer group together, "
                "and a rank restarted alone cannot rejoin the others")
    return None


def trainer_restarts(m: Manifest) -> int:
    """`trainer.max_restarts` as written, else the default where a trainer-only restart works, else 0."""
    if m.trainer.max_restarts is not None:
        return m.trainer.max_restarts
    return DEFAULT_TRAINER_RESTARTS if trainer_restart_gap(m) is None else 0
