"""The run folder: the one place that names its paths.

    runs/<name>-<time>/
      plan.json  manifest.json  manifests/  lock.json    what ran (written by `primebuild run`)
      run.json  rendezvous.json                         code version; hosts and model folder at start
      config/<process>.json  logs/<process>.log         written by the worker and the supervisor
      rollouts/step_000001.safetensors                  orchestrator -> trainer (primebuild/runtime/rollout_file.py)
      weights/step_000001/ …                            trainer -> inference (filesystem weight sync)
      kv_transfer/<md5>/ …                              vLLM prefill -> decode servers (P/D, ExampleConnector)
      checkpoints/step_000050/ …                        trainer (resume)
      orchestrator.json                                 orchestrator: held-out rewards before/after
      metrics.jsonl                                     trainer and orchestrator, one line per value
      wandb/  tensorboard/<role>/                       the same values, for the trackers the manifest names
      summary.json  report.png  outcome.json            written by whoever supervised the run, at the end
      failure.json                                      the component that ended the run: exit status, log tail
      trainer_restarts.jsonl                            the supervisor: each trainer-only restart, when and from which step
      stacks/<process>.<pid>.txt                        each Python process's thread stacks, dumped on a hang
      supervision.json                                  `primebuild run`'s hang bound and restart count
      launch.json                                       the target's record: Slurm job id, supervisor pid …
      supervisor.lock                                   flock-held by the `primebuild run` supervising it (claim)
      inference_pool.json                               supervisor -> orchestrator: the replicas to use / drain
      inference_pool_state.json                         orchestrator -> supervisor: each replica's state, requests
      scale/request-<id>.json  scale/answer-<id>.json   `primebuild scale` -> the supervisor, and its answer
      scale/plan.json                                   the plan plus the replicas `scale` added (their workers read it)
      pids/<process>.json                               each worker: its host and process group (teardown)
      job.sbatch  kubernetes.yaml  ssh.sh               the rendered artifact the target submitted
      logs/job-<id>.log                                 the Slurm job's own output (in-job supervisor)
      STOP                                              present: finish the current step, checkpoint, stop

Every process gets the folder as `run_dir` in its config and wraps it in `RunDir`; nothing else
spells these names.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field

from primebuild.contracts.base import Contract, parse_contract
from primebuild.errors import UserError


class Rendezvous(Contract):
    """What a run knows only at start: the address of every node and the resolved model folder.

    `hosts[N]` is how other nodes reach plan node N (Slurm: the node's NodeAddr; ssh: the inventory
    entry; Kubernetes: the pod's DNS name). When the whole run is on one host, every entry is
    127.0.0.1, so every server binds loopback (`{bind:N}` resolves to it).
    """

    hosts: list[str] = Field(min_length=1)
    model_path: str
    teacher_model_path: str | None = None  # on-policy distillation: the teacher's folder (its server's {teacher_model_path})
    environments: dict[str, str] = Field(default_factory=dict)  # environment -> its python, beyond ours
    # the container runtime shows each process only its own GPUs, numbered from 0 (Kubernetes' device plugin):
    # CUDA_VISIBLE_DEVICES then counts 0..k-1, not the plan's node-wide indices
    gpus_numbered_per_process: bool = False


LOOPBACK = "127.0.0.1"

# Per-step files and folders (rollouts, published weights, checkpoints): zero-padded so they sort.
STEP_NAME = re.compile(r"^step_(\d+)$")


def step_folder(root: str | os.PathLike, step: int) -> Path:
    """``root/step_000042``: the folder (or, with a suffix, the file) of one step under ``root``."""
    return Path(root) / f"step_{step:06d}"


def single_host_or(hosts: list[str]) -> list[str]:
    """The rendezvous hosts for a run whose nodes resolved to `hosts`: loopback when there is only one."""
    return [LOOPBACK] * len(hosts) if len(set(hosts)) <= 1 else list(hosts)


class ProcessRecord(Contract):
    """Written by each worker before it becomes its process: where it runs, so teardown can end it."""

    process: str
    host: str  # socket.gethostname() of the machine it runs on
    pid: int
    pgid: int  # its process group: the process and everything it started


class FailureRecord(Contract):
    """The component that ended a run: what a person reads first after a failed run."""

    process: str
    role: str
    exit_code: int | None  # None: it did not exit (timed out becoming healthy)
    signal: str | None = None  # e.g. SIGKILL, when the exit code says it was killed by one
    message: str
    log: str  # the log file, in this run folder
    log_tail: list[str]
    lost_host: str | None = None  # the address of the host nothing reached any more, when that ended it


class OutcomeRecord(Contract):
    """How a run ended, written by its supervisor (local, ssh, or the in-job one on Slurm)."""

    ok: bool
    message: str
    exit_code: int


class SupervisionRecord(Contract):
    """How `primebuild run` asked this run to be supervised (every target's supervisor reads it)."""

    hang_floor_s: float = Field(600.0, ge=0)  # the least time without a step before a hang; 0: no hang watchdog
    max_restarts: int = Field(0, ge=0)  # `--max-restarts`: failed sessions resumed from the newest checkpoint


class LaunchRecord(Contract):
    """What a target started for this run, so that `status`, `stop` and teardown find it again."""

    target: str  # local, ssh, slurm, kubernetes
    supervisor_host: str | None = None  # local/ssh: where `primebuild run` supervises
    supervisor_pid: int | None = None
    # boot id and start time of that pid (processes.process_identity): a pid the kernel gave to another
    # process since is not the supervisor
    supervisor_identity: str | None = None
    job_id: str | None = None  # slurm
    namespace: str | None = None  # kubernetes
    objects: list[str] = Field(default_factory=list)  # kubernetes: kind/name of what was applied
    launches: int = Field(1, ge=1)  # 1 + how many times the run was resumed


class PoolServer(Contract):
    """One inference server the orchestrator may sample from."""

    name: str  # its process name (inference-2)
    url: str  # its OpenAI base URL (…/v1), as the orchestrator's endpoints spell it


class InferencePool(Contract):
    """The supervisor's word on the replicas (written at start and on every `scale`): the orchestrator
    adds a server it does not know yet and stops sending to one that is draining."""

    servers: list[PoolServer]
    draining: list[str] = Field(default_factory=list)  # names: finish or re-route in-flight requests, take no new


class ServerState(Contract):
    """The orchestrator's view of one server (inference_pool_state.json)."""

    state: Literal["joining", "active", "down", "draining", "drained"]
    requests: int = 0  # answers received from it
    joined_version: int | None = None  # the policy version it was brought to before it got work
    answered_versions: list[int] = Field(default_factory=list)  # [lowest, highest] policy version since it (re)joined


class PoolState(Contract):
    servers: dict[str, ServerState]  # by URL


class ScaleRequest(Contract):
    id: str
    inference: int  # +1 adds a replica, -1 retires one


class ScaleAnswer(Contract):
    ok: bool
    message: str


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

    def job_log(self, job_id: str) -> Path:
        return self.logs / f"job-{job_id}.log"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    def process_record(self, process: str) -> Path:
        return self.pids / f"{process}.json"

    def process_records(self) -> list[ProcessRecord]:
        out = []
        for path in sorted(self.pids.glob("*.json")) if self.pids.is_dir() else []:
            try:
                out.append(ProcessRecord.model_validate_json(path.read_text()))
            except (ValueError, OSError):  # half-written by a worker that was killed, unreadable: nothing to end
                continue
        return out

    @property
    def launch_record(self) -> Path:
        return self.root / "launch.json"

    def read_launch(self) -> LaunchRecord | None:
        if not self.launch_record.is_file():
            return None
        return parse_contract(LaunchRecord, self.read_json(self.launch_record), where=str(self.launch_record))

    def artifact(self, name: str) -> Path:
        """A rendered artifact the target submitted (job.sbatch, kubernetes.yaml, ssh.sh)."""
        return self.root / name

    @property
    def failure(self) -> Path:
        return self.root / "failure.json"

    @property
    def outcome(self) -> Path:
        return self.root / "outcome.json"

    def read_outcome(self) -> OutcomeRecord | None:
        if not self.outcome.is_file():
            return None
        return parse_contract(OutcomeRecord, self.read_json(self.outcome), where=str(self.outcome))

    @property
    def supervision(self) -> Path:
        return self.root / "supervision.json"

    def read_supervision(self) -> SupervisionRecord:
        if not self.supervision.is_file():
            return SupervisionRecord()
        return parse_contract(SupervisionRecord, self.read_json(self.supervision), where=str(self.supervision))

    @property
    def inference_pool(self) -> Path:
        return self.root / "inference_pool.json"

    @property
    def inference_pool_state(self) -> Path:
        return self.root / "inference_pool_state.json"

    @property
    def scale(self) -> Path:
        return self.root / "scale"

    def scale_request(self, request_id: str) -> Path:
        return self.scale / f"request-{request_id}.json"

    def scale_answer(self, request_id: str) -> Path:
        return self.scale / f"answer-{request_id}.json"

    @property
    def scaled_plan(self) -> Path:
        return self.scale / "plan.json"

    @property
    def stacks(self) -> Path:
        return self.root / "stacks"

    def stack_file(self, process: str, pid: int) -> Path:
        """Where process `process` (pid `pid`) writes its thread stacks when asked (primebuild/runtime/stacks.py)."""
        return self.stacks / f"{process}.{pid}.txt"

    @property
    def trainer_restarts(self) -> Path:
        return self.root / "trainer_restarts.jsonl"

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
        legacy = step_folder(self.rollouts, step).with_suffix(".pt")  # written by code before format 2
        return legacy if legacy.is_file() else step_folder(self.rollouts, step).with_suffix(".safetensors")

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def kv_transfer(self) -> Path:
        """vLLM P/D with ExampleConnector: the prompts' KV files (prefill -> decode servers), which the P/D
        router deletes once no request needs them."""
        return self.root / "kv_transfer"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def wandb(self) -> Path:
        """Where wandb keeps its runs (offline-run-<time>-<id>/); it is always `wandb/` in the `dir` it is given."""
        return self.root / "wandb"

    def tensorboard(self, role: str) -> Path:
        return self.root / "tensorboard" / role

    @property
    def orchestrator_state(self) -> Path:
        return self.root / "orchestrator.json"

    @property
    def curriculum(self) -> Path:
        """orchestrator.curriculum: each prompt's recent rewards, as of the last batch written (resume reads it)."""
        return self.root / "curriculum.json"

    # results
    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def report(self) -> Path:
        return self.root / "report.png"

    # checks and small readers
    def is_run(self) -> bool:
        try:
            return self.plan.is_file()
        except OSError:  # a folder this user may not enter: not one of the runs to choose from
            return False

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
        return parse_contract(Rendezvous, self.read_json(self.rendezvous), where=str(self.rendezvous))

    def require_models(self) -> None:
        """Raise a located error when a model folder the run records (its model, its teacher) is gone: a
        resume or an export would otherwise fail deep inside a process with "no such folder"."""
        record = self.read_json(self.run_record)
        for key in ("model_path", "teacher_model_path"):
            folder = record.get(key)
            if isinstance(folder, str) and folder and not Path(folder).is_dir():
                raise UserError(f"{self.run_record}: {key} {folder} is gone (a `primebuild store gc` while the "
                                "run was not running removes it)",
                                hint="rebuild it: the manifest that made it (an sft: manifest, or the run's own "
                                     "with `primebuild run`) gives the same store path from the same inputs")

    @property
    def supervisor_lock(self) -> Path:
        return self.root / "supervisor.lock"

    def claim(self) -> None:
        """Hold this run folder for as long as this process (its supervisor, `primebuild run`) lives: a
        second `primebuild run --resume` of it is refused even before the launch record exists."""
        if self.root in _CLAIMED:
            return
        fd = os.open(self.supervisor_lock, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"{self.root} is being run by another `primebuild run` (it holds "
                            f"{self.supervisor_lock.name})", hint="stop it first with `primebuild stop`") from None
        _CLAIMED[self.root] = fd  # closed by the kernel when this process ends, which releases the lock

    def claimed(self) -> bool:
        """Does a live `primebuild run` hold this folder (claim)?"""
        if self.root in _CLAIMED:
            return True
        try:
            fd = os.open(self.supervisor_lock, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def unfinished_json_writes(self) -> list[Path]:
        """Temporary files of `write_json_atomic` calls that a kill cut short (the folders it writes in)."""
        return sorted(p for folder in (self.root, self.pids, self.scale) if folder.is_dir()
                      for p in folder.glob(".*.json.*.tmp") if p.is_file())

    def read_json(self, path: Path) -> dict:
        """A JSON object of this folder, or {} when it is not there (yet); a located error (UserError) when
        it does not read as one (a file cut short by a full disk, edited by hand, unreadable)."""
        from primebuild.json_file import read_json

        if not path.is_file():
            return {}
        return read_json(path, what=f"the run record {path.name}", want_object=True)


_CLAIMED: dict[Path, int] = {}  # run folders this process supervises -> the descriptor holding the lock


def find_run(run_dir: Path | None, runs_dir: Path) -> RunDir:
    """RUN_DIR when given, else the newest run folder under `runs_dir` (as `git log` needs no argument)."""
    if run_dir is not None:
        return RunDir(run_dir).require()
    newest: tuple[tuple[float, str], Path] | None = None
    try:
        folders = list(runs_dir.iterdir()) if runs_dir.is_dir() else []
    except OSError as err:
        raise UserError(f"cannot list the runs under {runs_dir}: {err.strerror}",
                        hint="give RUN_DIR, or --runs-dir where the runs are") from None
    for folder in folders:
        try:  # a plan.json that is a file, by its time
            key = (RunDir(folder).plan.stat().st_mtime, folder.name) if RunDir(folder).is_run() else None
        except OSError:  # gone meanwhile
            key = None
        if key is not None and (newest is None or key > newest[0]):
            newest = (key, folder)
    if newest is None:
        raise UserError(f"no run folder under {runs_dir}", hint="give RUN_DIR, or --runs-dir where the runs are")
    return RunDir(newest[1].resolve())


def write_json_atomic(path: Path, data: object) -> None:
    """Readers see the old file or the new one, never half of one."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True))


def write_text_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file renamed into place: readers see the old file or the new
    one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

