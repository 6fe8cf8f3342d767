"""The interface every target implements, and the handle of one started process.

Like SkyPilot's backends (provision, setup, execute, teardown), a target has four verbs, and the CLI
(`run`, `status`, `stop`) calls only these, never asking which target it drives:

- `provision(plan)`  check that the cluster side is there (sbatch on PATH, hosts reachable, a kube
                     context) before anything is written; a missing piece is a UserError (exit 2);
- `launch(run, plan)`  start the run (render + submit, or start processes); returns the LaunchRecord
                     that `run.launch_record` keeps;
- `follow(run, record, …)`  until the run ends: stream progress and attention lines, return the Outcome;
- `active(run, record)`  whether anything of the run still runs (TargetUnanswered when the cluster did not say);
- `stop(run, record)`  end whatever of the run still runs (scancel, killing process groups);
- `state(run, record)`  one line for `status` (e.g. "slurm job 12: RUNNING");
- `release(run, record)`  what an ended run still holds on the cluster, once nobody followed it to its end.

Targets whose processes the supervisor (primebuild/runtime/supervisor.py) starts hand it a `Launcher`
(primebuild/runtime/launcher.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

from primebuild.contracts.plan import Plan
from primebuild.contracts.run_dir import LaunchRecord, RunDir
from primebuild.errors import UserError


class Outcome(Protocol):
    ok: bool
    message: str
    exit_code: int


Echo = Callable[[str], None]


class TargetUnanswered(UserError):
    """The cluster did not answer a query (slurmctld busy or restarting, an API server timing out): the run's
    state is unknown, not ended. Waits count it as still running (primebuild/runtime/targets/stopping.py)."""


class Target(ABC):
    kind: str
    # True where a supervisor inside the cluster job ends the run (summary.json, outcome.json) itself
    finishes_in_job: bool = False

    @abstractmethod
    def provision(self, plan: Plan) -> None: ...

    @abstractmethod
    def launch(self, run: RunDir, plan: Plan, *, echo: Echo, verbosity: int, live=None,
               avoid_hosts: tuple[str, ...] = ()) -> LaunchRecord: ...
    # avoid_hosts: addresses a restart should not be placed on (they lost contact); a target that places
    # processes itself (slurm) honours it, one whose hosts the manifest fixes cannot

    @abstractmethod
    def follow(self, run: RunDir, record: LaunchRecord, *, echo: Echo, verbosity: int) -> Outcome: ...

    @abstractmethod
    def active(self, run: RunDir, record: LaunchRecord) -> bool: ...

    @abstractmethod
    def stop(self, run: RunDir, record: LaunchRecord) -> str: ...

    @abstractmethod
    def state(self, run: RunDir, record: LaunchRecord) -> str: ...

    def release(self, run: RunDir, record: LaunchRecord) -> str | None:
        """What the cluster still keeps of a run that ended while nobody followed it (Kubernetes: a finished
        JobSet's pods and their logs), collected and deleted by `primebuild stop`; None: nothing."""
        return None
