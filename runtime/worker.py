"""`primebuild worker --plan plan.json --process NAME`: become one process of a plan.

Every target (local, ssh, Slurm, Kubernetes) starts processes this way, so the wiring lives in one
place: the worker reads the plan and the run's rendezvous file (node addresses and the model folder,
known only at start), fills the plan's placeholders, writes the process's config file, and replaces
itself (exec) with the process's command. The plan itself stays host-independent and secret-free.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from primebuild.errors import UserError

_PLACEHOLDER = re.compile(r"\{(run_dir|model_path|config|python|host:\d+)\}")


def find_process(plan: dict, name: str) -> dict:
    for p in plan["processes"]:
        if p["name"] == name:
            return p
    known = ", ".join(p["name"] for p in plan["processes"])
    raise UserError(f"process {name!r} is not in plan {plan.get('name')!r}", hint=f"known processes: {known}")


def resolver(run_dir: Path, rendezvous: dict, config_path: Path):
    hosts = rendezvous["hosts"]
    values = {"run_dir": str(run_dir), "model_path": rendezvous["model_path"], "config": str(config_path),
              "python": sys.executable}

    def resolve(value):
        if isinstance(value, str):
            def sub(match: re.Match) -> str:
                key = match.group(1)
                if key.startswith("host:"):
                    node = int(key.split(":")[1])
                    if node >= len(hosts):
                        raise UserError(f"the plan names node {node} but the rendezvous lists {len(hosts)} host(s)")
                    return hosts[node]
                return values[key]
            return _PLACEHOLDER.sub(sub, value)
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        return value

    return resolve


def prepare(plan: dict, name: str, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The resolved argv and environment of process `name`; writes its config file."""
    process = find_process(plan, name)
    rendezvous_path = run_dir / "rendezvous.json"
    if not rendezvous_path.is_file():
        raise UserError(f"{rendezvous_path}: missing", hint="the target writes it before starting workers")
    rendezvous = json.loads(rendezvous_path.read_text())
    config_path = run_dir / "config" / f"{name}.json"
    resolve = resolver(run_dir, rendezvous, config_path)
    config_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = config_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(resolve(process["config"]), indent=2, sort_keys=True))
    tmp.replace(config_path)
    env = dict(os.environ)
    env.update(resolve(process["env"]))
    missing = [s for s in process.get("secrets", []) if s not in os.environ]
    if missing:
        print(f"worker {name}: warning: secret env var(s) not set: {', '.join(missing)}", file=sys.stderr)
    return resolve(process["argv"]), env


def exec_process(plan_path: Path, name: str, run_dir: Path) -> None:
    plan = json.loads(plan_path.read_text())
    argv, env = prepare(plan, name, run_dir)
    sys.stdout.flush()
    os.execvpe(argv[0], argv, env)
