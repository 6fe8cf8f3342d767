"""The Slurm target, on the submitting host: render the het-job script, `sbatch` it, follow it.

- provision: sbatch/squeue/scontrol/scancel on PATH and slurmctld answering (`scontrol ping`);
- launch: primebuild/builders/render/slurm.py -> RUN_DIR/job.sbatch, `sbatch --parsable --output …` -> job id;
- follow: poll `squeue`/`scontrol show job` (bounded by the job itself: it has a time limit), print the
  job's own output (the in-job supervisor's progress and attention lines) as it grows; a requeued job
  goes back to PENDING and is followed on; at the end read outcome.json (the in-job supervisor's), or
  the job's state when it never got that far (cancelled, out of time, node failure);
- stop: `scancel` (after `primebuild stop` has given the STOP file its grace);
- state: "slurm job N: RUNNING".

The run folder must be on a filesystem every node sees, at the same path, and the interpreter that runs
`primebuild` here must exist at the same path on the nodes (a shared install or the image): the job
resolves no packages at start.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from primebuild.builders.render.slurm import SCRIPT_NAME, render_slurm
from primebuild.contracts.plan import Plan
from primebuild.contracts.render import RenderContext
from primebuild.contracts.run_dir import LaunchRecord, RunDir
from primebuild.errors import UserError
from primebuild.runtime.supervisor import Outcome
from primebuild.runtime.targets.base import Echo, Target, TargetUnanswered
from primebuild.runtime.targets.slurm_avoid import nodes_to_exclude
from primebuild.runtime.targets.stopping import UNANSWERED_NOTICE_SECONDS, own_end_seconds, stop_gracefully

COMMANDS = ("sbatch", "squeue", "scontrol", "scancel")
POLL_SECONDS = 1.0
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
               "BOOT_FAIL", "DEADLINE"}


class SlurmUnanswered(TargetUnanswered):
    """slurmctld did not answer a query (busy, restarting, unreachable): the job's state is unknown, not gone."""


def _run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmUnanswered(f"`{' '.join(argv)}` did not answer within {timeout:g} s (slurmctld busy or "
                              "unreachable)") from None


def job_state(job_id: str) -> tuple[str | None, str | None]:
    """(state, exit code) of the job's first component, or (None, None) when Slurm no longer knows it;
    SlurmUnanswered when slurmctld did not say (one failed query is not a job that ended)."""
    shown = _run(["scontrol", "show", "job", "-o", job_id])
    if shown.returncode != 0:
        if "Invalid job id" in shown.stderr:
            return None, None
        raise SlurmUnanswered(f"`scontrol show job {job_id}` failed: "
                              f"{(shown.stderr or shown.stdout).strip() or f'exit code {shown.returncode}'}")
    first = shown.stdout.splitlines()[0] if shown.stdout else ""
    fields = dict(part.split("=", 1) for part in first.split() if "=" in part)
    return fields.get("JobState"), fields.get("ExitCode")


class SlurmTarget(Target):
    kind = "slurm"
    finishes_in_job = True

    def provision(self, plan: Plan) -> None:
        missing = [c for c in COMMANDS if shutil.which(c) is None]
        if missing:
            raise UserError(f"target slurm: {', '.join(missing)} not found on PATH",
                            hint="run on a Slurm login node, or `primebuild render --target slurm` and submit "
                                 "the script yourself")
        ping = _run(["scontrol", "ping"], timeout=20)
        if ping.returncode != 0 or "UP" not in ping.stdout:
            raise UserError(f"target slurm: slurmctld does not answer (`scontrol ping`: "
                            f"{(ping.stdout + ping.stderr).strip() or ping.returncode})")

    def launch(self, run: RunDir, plan: Plan, *, echo: Echo, verbosity: int, live=None,
               avoid_hosts: tuple[str, ...] = ()) -> LaunchRecord:
        excluded = nodes_to_exclude(plan, avoid_hosts, echo)
        ctx = RenderContext(run_dir=str(run.root), python=sys.executable, exclude_nodes=excluded)
        script = run.artifact(SCRIPT_NAME)
        script.write_text(render_slurm(plan, ctx)[SCRIPT_NAME])
        script.chmod(0o755)
        run.logs.mkdir(parents=True, exist_ok=True)
        submitted = _run(["sbatch", "--parsable", f"--output={run.logs}/job-%j.log", "--open-mode=append",
                          f"--chdir={run.root}", str(script)], timeout=60)
        if submitted.returncode != 0:
            raise UserError(f"sbatch refused {script}: {submitted.stderr.strip() or submitted.stdout.strip()}")
        job_id = submitted.stdout.strip().split(";")[0]
        echo(f"submitted slurm job {job_id} ({script})")
        return LaunchRecord(target=self.kind, job_id=job_id)

    def follow(self, run: RunDir, record: LaunchRecord, *, echo: Echo, verbosity: int) -> Outcome:
        """The job to its end; Ctrl-C stops it as `primebuild stop` does (STOP, its grace, then scancel)."""
        try:
            return self._follow(run, record, echo=echo, verbosity=verbosity)
        except KeyboardInterrupt:
            return self._interrupted(run, record, echo)

    def _interrupted(self, run: RunDir, record: LaunchRecord, echo: Echo) -> Outcome:
        ended = run.read_outcome()
        if ended is not None:  # the run had ended already (the job is cleaning up): that is its outcome
            return Outcome(ended.ok, ended.message, ended.exit_code)
        echo(f"stopping: slurm job {record.job_id} checkpoints and ends (Ctrl-C again to cancel it now)")
        stop_gracefully(self, run, record, grace=own_end_seconds(), echo=echo, interruptible=True)
        outcome = run.read_outcome()
        if outcome is not None and not outcome.ok and outcome.exit_code != 130:
            return Outcome(False, outcome.message, outcome.exit_code)  # it failed of itself meanwhile
        return Outcome(False, f"interrupted: slurm job {record.job_id} stopped; `primebuild run --resume "
                              f"{run.root}` continues after its newest checkpoint", 130)

    def _follow(self, run: RunDir, record: LaunchRecord, *, echo: Echo, verbosity: int) -> Outcome:
        job_id = record.job_id
        assert job_id
        log = run.job_log(job_id)
        offset, last_state, partial = 0, None, ""
        unanswered_since, told = None, 0.0
        while True:
            try:
                state, exit_code = job_state(job_id)
                unanswered_since = None
            except SlurmUnanswered as err:  # the job runs on without us: ask again, and say so
                now = time.monotonic()
                if unanswered_since is None:
                    unanswered_since = now
                if now - told >= UNANSWERED_NOTICE_SECONDS:
                    echo(f"warning: {err}; asking again (the job's state unknown for {now - unanswered_since:.0f} s)")
                    told = now
                state, exit_code = last_state or "unknown", None
            if state != last_state and state is not None and unanswered_since is None:
                echo(f"slurm job {job_id}: {state}")
                last_state = state
            if log.is_file():
                with open(log, errors="replace") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
                    offset = handle.tell()
                lines = (partial + chunk).split("\n")
                partial = lines.pop()
                for line in lines:
                    if verbosity or line.startswith(("step", "error", "outcome")):
                        echo(line)
            if state is None or state in DONE_STATES:
                break
            time.sleep(POLL_SECONDS)
        outcome = run.read_outcome()
        if outcome is not None and (state in (None, "COMPLETED", "FAILED")):
            return Outcome(outcome.ok, outcome.message, outcome.exit_code)
        return Outcome(False, f"slurm job {job_id} ended {state or 'unknown'} (exit code {exit_code}) before its "
                       f"supervisor finished; see {log}", 1)

    def active(self, run: RunDir, record: LaunchRecord) -> bool:
        state, _ = job_state(record.job_id) if record.job_id else (None, None)
        return state is not None and state not in DONE_STATES

    def stop(self, run: RunDir, record: LaunchRecord) -> str:
        if not record.job_id:
            return "no slurm job recorded"
        try:
            if not self.active(run, record):
                return f"slurm job {record.job_id} is not running"
        except SlurmUnanswered:
            pass  # cancel it anyway: scancel says what it finds
        done = _run(["scancel", record.job_id])
        if done.returncode != 0:
            raise UserError(f"scancel {record.job_id}: {done.stderr.strip()}")
        return f"cancelled slurm job {record.job_id}"

    def state(self, run: RunDir, record: LaunchRecord) -> str:
        try:
            state, exit_code = job_state(record.job_id) if record.job_id else (None, None)
        except SlurmUnanswered as err:
            return f"slurm job {record.job_id}: state unknown ({err})"
        return f"slurm job {record.job_id}: {state or 'gone'}" + (f" (exit {exit_code})" if exit_code else "")
