"""Render a plan for the ssh target: the exact command each inventory host runs, per process. Pure.

Plan node N runs on `target.hosts[N]`. Each process is one ssh session running
`cd RUN_DIR && exec PY -m primebuild.cli worker … --session --env-from-stdin`: the worker starts its
own process group (what `stop` ends), ends with its ssh session (a host cut off the network leaves
nothing running once its sshd drops the session), and reads the run's admin token and the manifest's secrets from
stdin, so no secret is ever part of a command line or of this artifact. PY is the interpreter of the
primebuild installation at `target.workdir` on the hosts (`<workdir>/.venv/bin/python`, what
scripts/bootstrap makes); the run folder must be on a filesystem every host sees, at the same path.
`ssh.sh` is that as a script a person can read or run by hand, supervising like `primebuild run`
(primebuild/runtime/supervisor.py): start order, health gates, restarts by the restart policy, fail fast.
"""

from __future__ import annotations

import re
import shlex

from primebuild import __version__
from primebuild.builders.render.groups import not_runnable_notes
from primebuild.contracts.plan import Plan, ProcessSpec
from primebuild.contracts.render import RenderContext
from primebuild.manifest.schema import SshTarget

SCRIPT_NAME = "ssh.sh"
_BASH_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # process names that are also bash function names


def shell_path(path: str) -> str:
    """A quoted path; a leading ~/ stays the remote user's home."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def remote_python(plan: Plan) -> str:
    return plan.target_settings(SshTarget).workdir.rstrip("/") + "/.venv/bin/python"


def host_of(plan: Plan, process: ProcessSpec) -> str:
    return plan.target.hosts[process.node]


def remote_command(plan: Plan, run_dir: str, process: ProcessSpec) -> str:
    run = shlex.quote(run_dir)
    worker = [shell_path(remote_python(plan)), "-m", "primebuild.cli", "worker", "--plan",
              shlex.quote(f"{run_dir}/plan.json"), "--process", shlex.quote(process.name), "--run-dir", run,
              "--session", "--env-from-stdin"]
    return f"cd {run} && exec {' '.join(worker)}"  # exec: the worker's parent is the session's sshd


def ssh_argv(plan: Plan, process: ProcessSpec) -> list[str]:
    target = plan.target_settings(SshTarget)
    host = host_of(plan, process)
    dest = f"{target.user}@{host}" if target.user else host
    # keepalives: a cut link ends the session in ~10 s, as `primebuild run`'s connections (runtime/targets/ssh.py),
    # instead of TCP's minutes of retries
    return ["ssh", "-p", str(target.port), "-o", "BatchMode=yes", "-o", "ServerAliveInterval=2",
            "-o", "ServerAliveCountMax=5", "--", dest]  # --: dest is never an option


def signal_command(run_dir: str, pgid: str, sig: str) -> str:
    """The remote command that sends `sig` to process group `pgid` (a number, or a shell expression that
    gives one), only if that group still belongs to this run: its leader's environment names the run
    folder (a recycled pid of another program is left alone)."""
    marker = shlex.quote(f"PRIMEBUILD_RUN_DIR={run_dir}")
    return (f"if tr '\\0' '\\n' < /proc/{pgid}/environ 2>/dev/null | grep -qxF -- {marker}; then "
            f"kill -{sig} -- -{pgid}; fi")


def _health_url(plan: Plan, process: ProcessSpec) -> str:
    """The process's HTTP health URL with every `{host:N}` replaced by its inventory host ('' for a
    process whose health is being alive)."""
    if process.health.kind != "http":
        return ""
    url = process.health.url or ""
    for node, host in enumerate(plan.target.hosts):
        url = url.replace("{host:" + str(node) + "}", host)
    return url


# What `primebuild run` does (primebuild/runtime/supervisor.py), in bash: start each start order, wait for its health
# checks, watch, restart what its restart policy allows, and on any other exit fail fast (STOP file, a
# short grace for the trainer's checkpoint, then TERM and KILL to every process group on its host).
_SUPERVISE = r"""
healthy() {  # NAME URL TIMEOUT_S: alive and, when URL is given, answering 200 before the timeout
  local name=$1 url=$2 deadline=$((SECONDS + $3))
  while (( SECONDS < deadline )); do
    kill -0 "${pid[$name]:-}" 2>/dev/null || return 1
    [[ -z $url ]] && return 0
    curl -fsS -o /dev/null --max-time 2 "$url" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}

signal_all() {  # SIGNAL: every process group the workers recorded, on its host
  local name pgid
  for name in "${names[@]}"; do
    pgid=$(sed -n 's/.*"pgid": *\([0-9][0-9]*\).*/\1/p' "$run_dir/pids/$name.json" 2>/dev/null || true)
    [[ -n $pgid ]] && "signal_$name" "$1" "$pgid"
  done
  return 0
}

stop_all() {
  signal_all TERM
  local deadline=$((SECONDS + term_seconds)) name
  while (( SECONDS < deadline )); do
    for name in "${names[@]}"; do kill -0 "${pid[$name]:-}" 2>/dev/null && { sleep 1; continue 2; }; done
    break
  done
  signal_all KILL
  wait
}

fail() {  # MESSAGE EXIT_CODE
  echo "error: $1; stopping every other process" >&2
  touch "$run_dir/STOP"  # the trainer saves the step it finished, the orchestrator stops
  local deadline=$((SECONDS + stop_grace_seconds)) name
  while (( SECONDS < deadline )); do
    for name in "${finishers[@]}"; do kill -0 "${pid[$name]:-}" 2>/dev/null && { sleep 1; continue 2; }; done
    break
  done
  stop_all
  exit "$2"
}

start_order() {  # NAME…: start them, then wait for each one's health
  local name
  for name in "$@"; do "start_$name"; done
  for name in "$@"; do
    healthy "$name" "${health_url[$name]}" "${health_timeout[$name]}" ||
      fail "$name did not become healthy; see $run_dir/logs/$name.log" 1
  done
}

watch() {  # until the orchestrator and the trainer exit 0
  local name code done
  while :; do
    for name in "${names[@]}"; do
      [[ -n ${exited[$name]:-} ]] && continue
      kill -0 "${pid[$name]}" 2>/dev/null && continue
      code=0; wait "${pid[$name]}" || code=$?
      if (( code == 0 )) && [[ " ${finishers[*]} " == *" $name "* ]]; then exited[$name]=0; continue; fi
      if (( code != 0 && restarts[$name] < max_restarts[$name] )); then
        restarts[$name]=$((restarts[$name] + 1))
        echo "$name exited with $code: restarting (${restarts[$name]}/${max_restarts[$name]})" >&2
        "start_$name"
        healthy "$name" "${health_url[$name]}" "${health_timeout[$name]}" ||
          fail "$name failed again after a restart; see $run_dir/logs/$name.log" 1
        continue
      fi
      exited[$name]=$code
      (( code == 0 )) && fail "$name exited before the run finished" 1
      fail "$name exited with $code; see $run_dir/logs/$name.log" "$(( code < 128 ? code : 1 ))"
    done
    done=1
    for name in "${finishers[@]}"; do [[ ${exited[$name]:-} == 0 ]] || done=0; done
    if (( done )); then stop_all; echo "run complete"; exit 0; fi
    sleep 1
  done
}
"""


def render_ssh(plan: Plan, ctx: RenderContext) -> dict[str, str]:
    ordered = sorted(plan.processes, key=lambda p: p.start_order)
    run = shlex.quote(ctx.run_dir)
    lines = ["#!/bin/bash", f"# primebuild {__version__}: {plan.name}, plan {plan.plan_hash}, target ssh "
             "(rendered; do not edit)"]
    lines += [f"# {n}" for n in not_runnable_notes(plan)]
    lines += ["# Each process: one ssh session, its own process group on the host. The admin token and the",
              "# secrets go to its stdin as NAME=value lines ending with an empty line, their values taken from",
              "# this shell's environment when it runs (never written here). Run it where the run folder is",
              "# (a filesystem every host sees): the processes start in the plan's start order, each order once",
              "# the previous one is healthy; a process that fails is restarted as its restart policy allows,",
              "# otherwise every process is stopped (fail fast). Logs go to RUN_DIR/logs/NAME.log. The workers read",
              "# RUN_DIR/plan.json and RUN_DIR/rendezvous.json (hosts, model folder, vLLM's python), as `run` writes them.",
              "set -uo pipefail",
              ': "${PRIMEBUILD_ADMIN_TOKEN:?set the run admin token}"',
              'command -v curl >/dev/null || { echo "ssh.sh: curl is needed for the health checks" >&2; exit 2; }',
              f"run_dir={run}",
              "stop_grace_seconds=8 term_seconds=10  # as primebuild/runtime/supervisor.py",
              'mkdir -p "$run_dir/logs"',
              "declare -A pid=() exited=() restarts=() max_restarts=() health_url=() health_timeout=()",
              "names=(" + " ".join(shlex.quote(p.name) for p in ordered) + ")",
              "finishers=(" + " ".join(shlex.quote(p.name) for p in ordered if p.role in ("trainer", "orchestrator"))
              + ")",
              "signal_template=" + shlex.quote(signal_command(ctx.run_dir, "@PGID@", "@SIG@")), ""]
    for p in ordered:
        name = shlex.quote(p.name)
        if not _BASH_NAME.match(p.name):
            raise ValueError(f"process name {p.name!r} cannot name a bash function")
        lines.append(f"# {p.name} ({p.role}) on plan node {p.node}: {host_of(plan, p)}")
        argv = " ".join(shlex.quote(a) for a in ssh_argv(plan, p))
        names = ["PRIMEBUILD_ADMIN_TOKEN", *p.secrets]
        values = " ".join(f'"{n}=${{{n}-}}"' for n in names)
        lines.append(f"start_{p.name}() {{")
        lines.append(f"  printf '%s\\n' {values} '' | {argv} {shlex.quote(remote_command(plan, ctx.run_dir, p))} "
                     f'>>"$run_dir/logs/"{name}.log 2>&1 &')
        lines.append(f"  pid[{name}]=$!")
        lines.append("}")
        lines.append(f"signal_{p.name}() {{  # SIGNAL PGID (digits): the remote command with both filled in")
        lines.append(f'  local command=${{signal_template//@PGID@/$2}}; {argv} "${{command//@SIG@/$1}}" </dev/null || true')
        lines.append("}")
        lines.append(f"restarts[{name}]=0 max_restarts[{name}]={p.restart.max_restarts if p.restart.policy == 'on-failure' else 0} "
                     f"health_url[{name}]={shlex.quote(_health_url(plan, p))} health_timeout[{name}]={int(p.health.timeout_s)}")
        lines.append("")
    lines.append(_SUPERVISE.strip("\n"))
    lines.append("")
    for order in sorted({p.start_order for p in ordered}):
        group = [p for p in ordered if p.start_order == order]
        lines.append(f"start_order {' '.join(p.name for p in group)}  # start order {order}")
    lines += ["watch", ""]
    return {SCRIPT_NAME: "\n".join(lines)}

