"""The run folder: the one place that names its paths.

    runs/<name>-<time>/
      plan.json  manifest.json  manifests/  lock.json    what ran (written by `primebuild run`)
      run.json  rendezvous.json                         code version; hosts and model folder at start
      config/<process>.json  logs/<process>.log         written by the worker and the supervisor
      rollouts/step_000001.pt …                         orchestrator -> trainer (runtime/trainer/batch.py)
      weights/step_000001/ …                            trainer -> inference (filesystem weight sync)
      checkpoints/step_000050/ …                        trainer (resume)
      orchestrator.json                                 orchestrator: held-out rewards before/after
      metrics.jsonl                                     trainer and orchestrator, one line per value
      summary.json  report.png                          written by `primebuild run` at the end
      STOP                                              present: finish the current step, checkpoint, stop

Every process gets the folder as `run_dir` in its config and wraps it in `RunDir`; nothing else
spells these names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import Field

from primebuild.contracts.base import Contract, parse_contract
from primebuild.errors import UserError


class Rendezvous(Contract):
    """What a run knows only at start: the address of every node and the resolved model folder."""

    hosts: list[str] = Field(min_length=1)
    model_path: str
    environments: dict[str, str] = Field(default_factory=dict)  # environment -> its python, beyond ours


class RunDir:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    # what ran
    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def manifests(self) -> Path:
        return self.root / "manifests"

    @property
    def lock(self) -> Path:
        return self.root / "lock.json"

    @property
    def run_record(self) -> Path:
        return self.root / "run.json"

    @property
    def rendezvous(self) -> Path:
        return self.root / "rendezvous.json"

    # processes
    def config(self, process: str) -> Path:
        return self.root / "config" / f"{process}.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    @property
    def stop_file(self) -> Path:
        return self.root / "STOP"

    def stop_requested(self) -> bool:
        return self.stop_file.exists()

    # data between processes
    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    def rollout(self, step: int) -> Path:
        return self.rollouts / f"step_{step:06d}.pt"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def orchestrator_state(self) -> Path:
        return self.root / "orchestrator.json"

    # results
    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def report(self) -> Path:
        return self.root / "report.png"

    # checks and small readers
    def is_run(self) -> bool:
        return self.plan.is_file()

    def require(self, *, resumable: bool = False) -> RunDir:
        """Raise a located error unless this is a run folder (with a rendezvous, for resuming)."""
        needed = [self.plan] + ([self.rendezvous] if resumable else [])
        missing = [p.name for p in needed if not p.is_file()]
        if missing:
            raise UserError(f"{self.root} is not a run folder (no {' / '.join(missing)})",
                            hint="give the folder `primebuild run` printed, e.g. runs/<name>-<time>")
        return self

    def read_rendezvous(self) -> Rendezvous:
        if not self.rendezvous.is_file():
            raise UserError(f"{self.rendezvous}: missing", hint="the target writes it before starting workers")
        return parse_contract(Rendezvous, json.loads(self.rendezvous.read_text()), where=str(self.rendezvous))

    def read_json(self, path: Path) -> dict:
        """A JSON file of this folder, or {} when it is not there (yet)."""
        return json.loads(path.read_text()) if path.is_file() else {}


def find_run(run_dir: Path | None, runs_dir: Path) -> RunDir:
    """RUN_DIR when given, else the newest run folder under `runs_dir` (as `git log` needs no argument)."""
    if run_dir is not None:
        return RunDir(run_dir).require()
    runs = [p for p in runs_dir.iterdir() if RunDir(p).is_run()] if runs_dir.is_dir() else []
    if not runs:
        raise UserError(f"no run folder under {runs_dir}", hint="give RUN_DIR, or --runs-dir where the runs are")
    return RunDir(max(runs, key=lambda p: (RunDir(p).plan.stat().st_mtime, p.name)).resolve())


def write_json_atomic(path: Path, data: object) -> None:
    """Readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)
