"""`primebuild worker --plan plan.json --process NAME`: become one process of a plan.

Every target (local, ssh, Slurm, Kubernetes) starts processes this way, so the wiring lives in one
place: the worker reads the plan and the run's rendezvous file (node addresses and the model folder,
known only at start), fills the plan's placeholders, writes the process's typed config file, records
where it runs (pids/NAME.json: host and process group, for teardown), and replaces itself (exec) with
the process's command. The plan itself stays host-independent and secret-free.

Two start-up duties depend on who started the worker:
- a local supervisor passes its pid in PRIMEBUILD_SUPERVISOR_PID: the worker asks the kernel to send
  it SIGTERM when that parent dies (PR_SET_PDEATHSIG survives exec), so even a SIGKILLed
  `primebuild run` leaves no process behind (primebuild/runtime/watchdog.py then ends the rest of the group);
- over ssh (`--session`) it starts its own process group, so `stop` ends everything it started,
  reads secret values from stdin (`NAME=value` lines up to an empty line), never from a command line,
  and gets SIGTERM when its parent, the sshd of its session, ends (the command execs the worker): a
  host whose link was cut, or whose supervisor vanished, ends the run's processes once sshd drops the
  session (ClientAliveInterval), instead of leaving them to hang in a collective.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

from primebuild.code_path import with_checkout
from primebuild.contracts.plan import PLACEHOLDER, Plan, ProcessSpec, per_process_devices, read_plan
from primebuild.contracts.run_dir import LOOPBACK, ProcessRecord, Rendezvous, RunDir, write_json_atomic
from primebuild.errors import UserError
from primebuild.runtime.stacks import PROCESS_ENV

SUPERVISOR_PID_ENV = "PRIMEBUILD_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1
BIND_RESOLVE_SECONDS = 120.0  # a Kubernetes pod's DNS record can appear a little after the pod starts


def bind_address(host: str, *, deadline_s: float = BIND_RESOLVE_SECONDS) -> str:
    """The address to listen on so that peers which reach this node as `host` get through."""
    if host in (LOOPBACK, "localhost", "::1"):
        return LOOPBACK
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return socket.gethostbyname(host)
        except OSError as err:
            if time.monotonic() > deadline:
                raise UserError(f"cannot resolve this node's address {host!r}: {err}") from None
            time.sleep(1.0)


def interpreter(environment: str, rendezvous: Rendezvous) -> str:
    """`{python}` of a process: this interpreter for primebuild's own environment, else the one the
    target prepared and named in the rendezvous."""
    if environment == "primebuild":
        return sys.executable
    if environment not in rendezvous.environments:
        raise UserError(f"the rendezvous names no python for the {environment!r} environment",
                        hint="the target prepares it before starting workers (for vLLM: scripts/vllm-env)")
    return rendezvous.environments[environment]


def resolver(run: RunDir, rendezvous: Rendezvous, config_path: Path, environment: str = "primebuild"):
    hosts = rendezvous.hosts
    values = {"run_dir": str(run.root), "model_path": rendezvous.model_path, "config": str(config_path),
              "teacher_model_path": rendezvous.teacher_model_path or "",
              "python": interpreter(environment, rendezvous)}
    binds: dict[int, str] = {}

    def node_host(node: int) -> str:
        if node >= len(hosts):
            raise UserError(f"the plan names node {node} but the rendezvous lists {len(hosts)} host(s)")
        return hosts[node]

    def sub(match: re.Match) -> str:
        key = match.group(1)
        if key.startswith("host:"):
            return node_host(int(key.split(":")[1]))
        if key.startswith("bind:"):
            node = int(key.split(":")[1])
            if node not in binds:
                binds[node] = bind_address(node_host(node))
            return binds[node]
        return values[key]

    def resolve(value):
        if isinstance(value, str):
            return PLACEHOLDER.sub(sub, value)
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        return value

    return resolve


def prepare(plan: Plan, name: str, run: RunDir, extra_env: dict[str, str] | None = None
            ) -> tuple[list[str], dict[str, str]]:
    """The resolved argv and environment of process `name`; writes its config file."""
    process: ProcessSpec = plan.process(name)
    config_path = run.config(name)
    rendezvous = run.read_rendezvous()
    resolve = resolver(run, rendezvous, config_path, process.environment)
    if process.config is not None:
        # Resolved, then parsed back into its class: what the process reads is what the plan typed.
        config = type(process.config).model_validate(resolve(process.config.model_dump(mode="json")))
        config_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True))
        tmp.replace(config_path)
    env = dict(os.environ)
    env.update(extra_env or {})
    env.update(resolve(process.env))
    if rendezvous.gpus_numbered_per_process and process.gpus:
        env["CUDA_VISIBLE_DEVICES"] = per_process_devices(process)
    if process.environment != "primebuild":  # vLLM's environment holds no primebuild: it gets this one's
        env = with_checkout(env)
    env[PROCESS_ENV] = name  # inherited by its children too: whose stacks a hang dump holds (primebuild/runtime/stacks.py)
    env.pop(SUPERVISOR_PID_ENV, None)
    missing = [s for s in process.secrets if s not in env]
    if missing:
        print(f"worker {name}: warning: secret env var(s) not set: {', '.join(missing)}", file=sys.stderr)
    return resolve(process.argv), env


def die_with_parent(expected_parent: int) -> None:
    """SIGTERM this process (and, after exec, what it becomes) when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != expected_parent:  # it died before prctl took effect
        sys.exit(143)


def die_with_supervisor() -> None:
    """SIGTERM this process when the local supervisor that started it dies."""
    expected = os.environ.get(SUPERVISOR_PID_ENV)
    if expected:
        die_with_parent(int(expected))


def env_from_stdin() -> dict[str, str]:
    """`NAME=value` lines up to an empty line or EOF (how the ssh target hands over secrets)."""
    env = {}
    for line in sys.stdin:
        line = line.rstrip("\n")
        if not line:
            break
        key, sep, value = line.partition("=")
        if sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            env[key] = value
    return env


def record_process(run: RunDir, name: str) -> None:
    write_json_atomic(run.process_record(name), ProcessRecord(
        process=name, host=socket.gethostname(), pid=os.getpid(), pgid=os.getpgid(0)).model_dump(mode="json"))


def exec_process(plan_path: Path, name: str, run_dir: Path, *, session: bool = False, stdin_env: bool = False
                 ) -> None:
    die_with_supervisor()
    if session:
        die_with_parent(os.getppid())  # the sshd of its session
        if os.getpgid(0) != os.getpid():
            os.setsid()
    extra = env_from_stdin() if stdin_env else {}
    run = RunDir(run_dir)
    argv, env = prepare(read_plan(plan_path), name, run, extra)
    record_process(run, name)
    sys.stdout.flush()
    os.execvpe(argv[0], argv, env)
