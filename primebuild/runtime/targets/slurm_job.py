"""Inside a Slurm job (called by job.sbatch): write the rendezvous, then supervise the plan's processes.

    python -m primebuild.runtime.targets.slurm_job rendezvous --run-dir DIR --plan-hash H --allocated … -- ADDR0 ADDR1 …
    python -m primebuild.runtime.targets.slurm_job supervise --run-dir DIR --script DIR/job.sbatch

`supervise` is primebuild/runtime/supervisor.py with a launcher whose processes are `bash job.sbatch launch NAME`
(that execs the process's `srun --het-group=N …` step), so restart policies, health gating, fail-fast
and the failure record are the local target's, and the job's exit status is the run's. A host that stops
answering (a cut link: its steps keep running, the shared filesystem still reads) is noticed by probing
each node's slurmd (slurm_hosts.py): its process fails as "lost contact with host ADDR", its srun is
killed at once (it could only wait on that slurmd), and the job's end cleans that node's steps once
slurmctld reaches it again. SIGTERM (the batch shell's `--signal=B:TERM@…` before the time limit, or
`scancel --signal=TERM -b`) is a requested stop: the trainer checkpoints, everything ends. A requeued job (SLURM_RESTART_COUNT > 0) first drops
weights newer than its checkpoint (primebuild/runtime/resume.py), as `run --resume` does.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from primebuild.contracts.plan import ProcessSpec, read_plan
from primebuild.contracts.run_dir import LOOPBACK, RunDir
from primebuild.runtime.targets.local import write_rendezvous
from primebuild.runtime.targets.processes import ProcessHandle
from primebuild.runtime.targets.slurm_hosts import HostWatch, slurmd_endpoints

LOST_EXIT = 255  # a step whose host no longer answers, as ssh(1) reports a lost connection


class SrunHandle(ProcessHandle):
    """An `srun` step's local client: its host is lost when that node's slurmd stops answering (slurm_hosts.py)."""

    def __init__(self, argv: list[str], env: dict[str, str], host: str, watch: HostWatch | None):
        super().__init__(argv, env)
        self.host, self.watch = host, watch

    def lost_contact(self) -> str | None:
        if self.watch is None or self.popen.poll() is not None:
            return None
        return self.watch.message(self.host)

    def lost_host(self) -> str | None:
        return self.host if self.lost_contact() else None

    def poll(self) -> int | None:
        code = self.popen.poll()
        return LOST_EXIT if code is None and self.lost_contact() else code

    def wait(self, timeout: float) -> int | None:
        if self.lost_contact():
            self.kill()  # srun would wait on a slurmd nothing reaches; the job's end cleans that node's step
            super().wait(timeout)
            return LOST_EXIT
        return super().wait(timeout)


class SrunLauncher:
    def __init__(self, script: Path, hosts: list[str], watch: HostWatch | None):
        self.script, self.hosts, self.watch = script, hosts, watch

    def start(self, spec: ProcessSpec, env: dict[str, str]) -> ProcessHandle:
        return SrunHandle(["bash", str(self.script), "launch", spec.name], {**os.environ, **env},
                          self.hosts[spec.node], self.watch)


def job_nodes() -> list[str]:
    """Every node of this job (all of a het job's components), by name."""
    lists = [v for k, v in os.environ.items() if k.startswith("SLURM_JOB_NODELIST_HET_GROUP_")]
    lists = lists or [os.environ["SLURM_JOB_NODELIST"]]
    names: list[str] = []
    for nodelist in lists:
        shown = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               timeout=30, check=True)
        names += [n for n in shown.stdout.split() if n not in names]
    return names


def watch_hosts(hosts: list[str]) -> HostWatch | None:
    """Probe the slurmd of every host the plan's processes run on; none when they all share this one."""
    if set(hosts) <= {LOOPBACK}:
        return None
    endpoints = slurmd_endpoints(job_nodes())
    unknown = sorted(set(hosts) - set(endpoints))
    if unknown:  # the rendezvous took these addresses from the same `scontrol show node`: never expected
        print(f"warning: no slurmd known at {', '.join(unknown)}: their link is not watched", flush=True)
    return HostWatch({a: p for a, p in endpoints.items() if a in hosts}).start()


def supervise(run: RunDir, script: Path) -> int:
    from primebuild.runtime.resume import reconcile
    from primebuild.runtime.session import finish
    from primebuild.runtime.supervisor import ATTENTION, supervise

    started = time.monotonic()
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)

    def echo(text: str) -> None:
        print(text, flush=True)

    if restart:
        # Slurm signalled the job before requeueing it (preemption, node failure, `scontrol requeue`): the
        # STOP that SIGTERM wrote asked for a clean stop of *that* session; this one continues.
        run.stop_file.unlink(missing_ok=True)
        run.failure.unlink(missing_ok=True)  # the signal that requeued it is no component's failure
        echo(f"job requeued (restart {restart}): resuming after step {reconcile(run, echo)}")
    signal.signal(signal.SIGTERM, lambda *_: run.stop_file.touch())  # a requested stop, not a crash
    plan = read_plan(run.plan)
    hosts = run.read_rendezvous().hosts
    watch = watch_hosts(hosts)
    try:
        outcome = supervise(plan, run.root, SrunLauncher(script, hosts, watch), echo=echo, verbosity=ATTENTION)
    finally:
        if watch is not None:
            watch.stop()
    summary, _ = finish(run, outcome, time.monotonic() - started)
    echo(f"outcome: {outcome.message}")
    return 0 if outcome.ok else max(1, outcome.exit_code)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m primebuild.runtime.targets.slurm_job")
    sub = parser.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("rendezvous")
    r.add_argument("--run-dir", required=True, type=Path)
    r.add_argument("--plan-hash", default=None, help="the plan the script was rendered from")
    r.add_argument("--allocated", nargs="+", required=True, help="the address of every node of the job")
    r.add_argument("addresses", nargs="+", help="plan node N's address, in order")
    s = sub.add_parser("supervise")
    s.add_argument("--run-dir", required=True, type=Path)
    s.add_argument("--script", required=True, type=Path)
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir)
    if args.verb == "rendezvous":
        found = read_plan(run.plan).plan_hash
        if args.plan_hash and found != args.plan_hash:
            print(f"job.sbatch: {run.plan} holds plan {found[:16]}, but this script was rendered from plan "
                  f"{args.plan_hash[:16]}: render and submit them together (primebuild run MANIFEST --detach)",
                  file=sys.stderr, flush=True)
            return 2
        one_host = len(set(args.allocated)) <= 1
        write_rendezvous(run, [LOOPBACK] * len(args.addresses) if one_host
                         else list(args.addresses))
        print(f"rendezvous: {', '.join(run.read_rendezvous().hosts)}", flush=True)
        return 0
    return supervise(run, args.script)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
