"""Render a plan for the ssh target: the exact command each inventory host runs, per process. Pure.

Plan node N runs on `target.hosts[N]`. Each process is one ssh session running
`cd RUN_DIR && PY -m primebuild.cli worker … --session --env-from-stdin; exit $?`: the worker starts its
own process group (what `stop` ends) and reads the run's admin token and the manifest's secrets from
stdin, so no secret is ever part of a command line or of this artifact. PY is the interpreter of the
primebuild installation at `target.workdir` on the hosts (`<workdir>/.venv/bin/python`, what
scripts/bootstrap makes); the run folder must be on a filesystem every host sees, at the same path.
`ssh.sh` is that as a script a person can read or run by hand (it starts the processes in start order
and does not supervise them: `primebuild run` does).
"""

from __future__ import annotations

import shlex

from primebuild import __version__
from primebuild.builders.render.groups import not_runnable_notes
from primebuild.contracts.plan import Plan, ProcessSpec
from primebuild.contracts.render import RenderContext

SCRIPT_NAME = "ssh.sh"


def shell_path(path: str) -> str:
    """A quoted path; a leading ~/ stays the remote user's home."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def remote_python(plan: Plan) -> str:
    return plan.target.get("workdir", "~/primebuild").rstrip("/") + "/.venv/bin/python"


def host_of(plan: Plan, process: ProcessSpec) -> str:
    return plan.target["hosts"][process.node]


def remote_command(plan: Plan, run_dir: str, process: ProcessSpec) -> str:
    run = shlex.quote(run_dir)
    worker = [shell_path(remote_python(plan)), "-m", "primebuild.cli", "worker", "--plan",
              shlex.quote(f"{run_dir}/plan.json"), "--process", shlex.quote(process.name), "--run-dir", run,
              "--session", "--env-from-stdin"]
    return f"cd {run} && {' '.join(worker)}; exit $?"


def ssh_argv(plan: Plan, process: ProcessSpec) -> list[str]:
    target = plan.target
    host = host_of(plan, process)
    dest = f"{target['user']}@{host}" if target.get("user") else host
    return ["ssh", "-p", str(target.get("port", 22)), "-o", "BatchMode=yes", dest]


def render_ssh(plan: Plan, ctx: RenderContext) -> dict[str, str]:
    lines = ["#!/bin/bash", f"# primebuild {__version__}: {plan.name}, plan {plan.plan_hash}, target ssh "
             "(rendered; do not edit)"]
    lines += [f"# {n}" for n in not_runnable_notes(plan)]
    lines += ["# Each process: one ssh session, its own process group on the host. The admin token and the",
              "# secrets go to its stdin as NAME=value lines ending with an empty line, their values taken from",
              "# this shell's environment when it runs (never written here).", "set -euo pipefail",
              ': "${PRIMEBUILD_ADMIN_TOKEN:?set the run admin token}"', ""]
    for p in sorted(plan.processes, key=lambda p: p.start_order):
        lines.append(f"# {p.name} ({p.role}) on plan node {p.node}: {host_of(plan, p)}")
        argv = " ".join(shlex.quote(a) for a in ssh_argv(plan, p))
        names = ["PRIMEBUILD_ADMIN_TOKEN", *p.secrets]
        values = " ".join(f'"{n}=${{{n}-}}"' for n in names)
        lines.append(f"printf '%s\\n' {values} '' | {argv} {shlex.quote(remote_command(plan, ctx.run_dir, p))} &")
    lines += ["wait", ""]
    return {SCRIPT_NAME: "\n".join(lines)}
