"""Inside a Slurm job (called by job.sbatch): write the rendezvous, then supervise the plan's processes.

    python -m primebuild.runtime.targets.slurm_job rendezvous --run-dir DIR --plan-hash H --allocated … -- ADDR0 ADDR1 …
    python -m primebuild.runtime.targets.slurm_job supervise --run-dir DIR --script DIR/job.sbatch

`supervise` is primebuild/runtime/supervisor.py with a launcher whose processes are `bash job.sbatch launch NAME`
(that execs the process's `srun --het-group=N …` step), so restart policies, health gating, fail-fast
and the failure record are the local target's, and the job's exit status is the run's. SIGTERM (the
batch shell's `--signal=B:TERM@…` before the time limit, or `scancel --signal=TERM -b`) is a requested
stop: the trainer checkpoints, everything ends. A requeued job (SLURM_RESTART_COUNT > 0) first drops
weights newer than its checkpoint (primebuild/runtime/resume.py), as `run --resume` does.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from primebuild.contracts.plan import ProcessSpec, read_plan
from primebuild.contracts.run_dir import LOOPBACK, RunDir
from primebuild.runtime.targets.local import write_rendezvous
from primebuild.runtime.targets.processes import ProcessHandle


class SrunLauncher:
    def __init__(self, script: Path):
        self.script = script

    def start(self, spec: ProcessSpec, env: dict[str, str]) -> ProcessHandle:
        return ProcessHandle(["bash", str(self.script), "launch", spec.name], {**os.environ, **env})


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
    outcome = supervise(plan, run.root, SrunLauncher(script), echo=echo, verbosity=ATTENTION)
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
