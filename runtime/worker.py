"""`primebuild worker --plan plan.json --process NAME`: become one process of a plan.

Every target (local, ssh, Slurm, Kubernetes) starts processes this way, so the wiring lives in one
place: the worker reads the plan and the run's rendezvous file (node addresses and the model folder,
known only at start), fills the plan's placeholders, writes the process's typed config file, and
replaces itself (exec) with the process's command. The plan itself stays host-independent and
secret-free.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from primebuild.contracts.plan import Plan, ProcessSpec, read_plan
from primebuild.contracts.run_dir import Rendezvous, RunDir
from primebuild.errors import UserError

_PLACEHOLDER = re.compile(r"\{(run_dir|model_path|config|python|host:\d+)\}")


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
              "python": interpreter(environment, rendezvous)}

    def sub(match: re.Match) -> str:
        key = match.group(1)
        if key.startswith("host:"):
            node = int(key.split(":")[1])
            if node >= len(hosts):
                raise UserError(f"the plan names node {node} but the rendezvous lists {len(hosts)} host(s)")
            return hosts[node]
        return values[key]

    def resolve(value):
        if isinstance(value, str):
            return _PLACEHOLDER.sub(sub, value)
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        return value

    return resolve


def prepare(plan: Plan, name: str, run: RunDir) -> tuple[list[str], dict[str, str]]:
    """The resolved argv and environment of process `name`; writes its config file."""
    process: ProcessSpec = plan.process(name)
    config_path = run.config(name)
    resolve = resolver(run, run.read_rendezvous(), config_path, process.environment)
    if process.config is not None:
        # Resolved, then parsed back into its class: what the process reads is what the plan typed.
        config = type(process.config).model_validate(resolve(process.config.model_dump(mode="json")))
        config_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True))
        tmp.replace(config_path)
    env = dict(os.environ)
    env.update(resolve(process.env))
    missing = [s for s in process.secrets if s not in os.environ]
    if missing:
        print(f"worker {name}: warning: secret env var(s) not set: {', '.join(missing)}", file=sys.stderr)
    return resolve(process.argv), env


def exec_process(plan_path: Path, name: str, run_dir: Path) -> None:
    argv, env = prepare(read_plan(plan_path), name, RunDir(run_dir))
    # `python -m` puts the working directory first on sys.path: started from a checkout, its top-level
    # kernels/ folder would shadow the PyPI package of that name. The run folder holds no packages.
    os.chdir(run_dir)
    sys.stdout.flush()
    os.execvpe(argv[0], argv, env)
