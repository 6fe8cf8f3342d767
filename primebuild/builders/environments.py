"""Can the manifest's environments load? Checked at plan time, cheaply, without importing them.

An environment id is either built in (primebuild/runtime/envs/, versions in primebuild/contracts/environments.py)
or `verifiers:<taskset-id>`, a verifiers (>= 0.4) taskset that verifiers' loader imports as the module
`verifiers.v1.tasksets.<name>` (those ship with verifiers) or `<name>` (an installed package), where
`<name>` is the id without an `owner/` prefix or `@version` suffix, `-` turned into `_`, lower-cased.
The check finds those modules with `importlib.util.find_spec` on top-level names and on verifiers'
own folder, so it imports neither verifiers (a large tree) nor torch: `plan` stays fast. What it cannot
see (a taskset's own optional dependencies) still fails when the orchestrator loads it.

An unknown id (a typo) is a located error of `validate` and `plan`, as is an arg the environment does not
take. A taskset that is not installed is a located problem of the plan; `plan --design` still shows the
plan, listing it among what this machine cannot run. So is a taskset that declares tools
(MCP toolsets, which primebuild's rollout loop does not drive): a child process reads its classes'
`toolsets` (primebuild/runtime/envs/verifiers_tools.py) when its package imports without torch.

Sandboxed environments (swe-tiny) need bubblewrap where the orchestrator runs: checked on this machine for
the local target, in the image's packages for a cluster target whose image this manifest builds, and
otherwise only named (a warning of the plan; the first rollout fails on a host without it).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from primebuild.contracts.environments import (
    BASH_SANDBOX_LIMITS,
    BUILTIN_ARGS,
    BUILTIN_VERSIONS,
    SANDBOXED,
    VERIFIERS_PREFIX,
)
from primebuild.manifest.schema import Manifest

VERIFIERS_REQUIREMENT = "verifiers==0.4.0"


def known_ids() -> list[str]:
    return sorted(BUILTIN_VERSIONS) + [f"{VERIFIERS_PREFIX}<taskset-id>"]


def taskset_module(taskset_id: str) -> str:
    """The module verifiers' loader imports for a taskset id (verifiers/v1/utils/loaders.py)."""
    return taskset_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def verifiers_problem(taskset_id: str) -> tuple[str, str] | None:
    """(message, hint) when taskset `taskset_id` cannot load here, else None."""
    spec = importlib.util.find_spec("verifiers")
    if spec is None or not spec.submodule_search_locations:
        return (f"verifiers taskset {taskset_id!r}: the verifiers package is not installed",
                f"install it into the run's environment: pip install '{VERIFIERS_REQUIREMENT}'")
    module = taskset_module(taskset_id)
    if not module.isidentifier():
        return (f"verifiers taskset {taskset_id!r}: {module!r} is not a module name",
                "a taskset id is a package name, optionally `owner/name@version`")
    shipped = Path(next(iter(spec.submodule_search_locations))) / "v1" / "tasksets" / module
    if (shipped / "__init__.py").is_file() or importlib.util.find_spec(module) is not None:
        return None
    return (f"verifiers taskset {taskset_id!r} is not installed here: no module {module!r} (nor "
            f"verifiers.v1.tasksets.{module})",
            f"install the package that provides the module {module!r} (a verifiers>=0.4 taskset exporting its "
            f"Taskset subclass in __all__) into the run's environment, then re-lock; built-in environments: "
            f"{', '.join(sorted(BUILTIN_VERSIONS))}")


# The adapter's own args (primebuild/runtime/envs/verifiers_adapter.py); the rest are the taskset's config fields,
# which only verifiers itself can check (when the orchestrator loads the taskset).
ADAPTER_ARGS = {
    "num_eval": ("a positive integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
    "max_turns": ("a positive integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
    "prompt_format": ("a string holding {prompt}", lambda v: isinstance(v, str) and "{prompt}" in v),
    "reply_format": ("a string holding {message}", lambda v: isinstance(v, str) and "{message}" in v),
    "env": ("a mapping (the verifiers Env's config fields)", lambda v: isinstance(v, dict)),
    "harness": ('"null" or "bash" (the verifiers harness that plays a taskset with tools; bash runs the model\'s '
                'shell commands in the bubblewrap sandbox)', lambda v: v in ("null", "bash")),
    # the bash harness's sandbox limits (primebuild/runtime/envs/sandbox_runtime.py)
    **{name: ("a positive integer (an arg of harness: bash)", lambda v: isinstance(v, int) and not isinstance(v, bool)
              and v > 0) for name in BASH_SANDBOX_LIMITS},
}


def adapter_arg_problems(args: dict) -> Iterator[tuple[str, str]]:
    for name, (wanted, ok) in ADAPTER_ARGS.items():
        if name in args and not ok(args[name]):
            yield name, f"{name} must be {wanted}, got {args[name]!r}"
        elif name in BASH_SANDBOX_LIMITS and name in args and args.get("harness") != "bash":
            yield name, f"{name} limits the bash harness's sandbox; this environment sets no harness: bash"


def unknown_id(env_id: str) -> tuple[str, str] | None:
    """(message, hint) when `env_id` is neither built in nor a verifiers taskset (a typo), else None."""
    if env_id in BUILTIN_VERSIONS or env_id.startswith(VERIFIERS_PREFIX):
        return None
    return f"unknown environment id {env_id!r}", f"use one of: {', '.join(known_ids())}"


def environment_mistakes(m: Manifest) -> Iterator[tuple[str, str, str]]:
    """(field, message, hint) for what no machine could load: an unknown id (a typo), a built-in
    environment's unknown arg, an adapter arg of the wrong kind. Errors even in a design study."""
    for i, env in enumerate(m.environments):
        if env.id in BUILTIN_VERSIONS:
            for name in sorted(set(env.args or {}) - set(BUILTIN_ARGS[env.id])):
                yield (f"environments[{i}].args.{name}", f"environment {env.id} has no arg {name!r}",
                       f"its args: {', '.join(BUILTIN_ARGS[env.id])}")
        elif env.id.startswith(VERIFIERS_PREFIX):
            for name, message in adapter_arg_problems(env.args or {}):
                yield (f"environments[{i}].args.{name}", f"environment {env.id}: {message}",
                       "docs/environments.md lists the adapter's args")
        else:
            yield (f"environments[{i}].id", *unknown_id(env.id))


def environment_problems(m: Manifest) -> Iterator[tuple[str, str, str]]:
    """(field, message, hint) for every known environment of `m` that cannot load here (a design study may
    name it: another machine's primebuild or packages may provide it)."""
    for i, env in enumerate(m.environments):
        if env.id in BUILTIN_VERSIONS:
            provided = BUILTIN_VERSIONS[env.id]
            if env.version not in ("latest", provided):
                yield (f"environments[{i}].version", f"environment {env.id}: version {env.version!r} requested, "
                       f"but this primebuild provides version {provided!r}", f"set version: {provided!r}")
        elif env.id.startswith(VERIFIERS_PREFIX):
            problem = verifiers_problem(env.id.removeprefix(VERIFIERS_PREFIX))
            if problem:
                yield (f"environments[{i}].id", *problem)
            else:
                yield from _tool_problems(i, env.id, env.args or {})


# --- tools a verifiers taskset declares -----------------------------------------------------------------

TOOLS_PROBE_SECONDS = 120  # importing verifiers and a taskset package takes a few seconds


def declared_tools(taskset_id: str, args: dict) -> dict:
    """primebuild/runtime/envs/verifiers_tools.py in a child process with this process's import path:
    {"tools": [...]} or {"unknown": reason}. Only the taskset's own args reach it (the adapter's are dropped
    there too), so manifests that differ in harness or limits share one probe."""
    taskset_args = {k: v for k, v in args.items() if k not in ADAPTER_ARGS}
    return _declared_tools(taskset_id, json.dumps(taskset_args, sort_keys=True, default=str), tuple(sys.path))


@functools.lru_cache(maxsize=64)  # refusals() runs once per suggested fix; the answer is the same each time
def _declared_tools(taskset_id: str, args_json: str, path: tuple[str, ...]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    try:
        done = subprocess.run([sys.executable, "-m", "primebuild.runtime.envs.verifiers_tools", taskset_id,
                               args_json], capture_output=True, text=True,
                              timeout=TOOLS_PROBE_SECONDS, env=env)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        return {"unknown": "the check did not finish"}


def _tool_problems(i: int, env_id: str, args: dict) -> Iterator[tuple[str, str, str]]:
    tools = declared_tools(env_id.removeprefix(VERIFIERS_PREFIX), args).get("tools")
    if tools and "harness" not in args:
        yield (f"environments[{i}].id", f"environment {env_id}: its tasks use tools ({', '.join(tools)}); verifiers "
               "runs MCP toolsets inside its harness programs, which primebuild's own turn loop does not drive",
               'play it with a verifiers harness: args.harness: "null" (its chat program calls the tools)')
    elif tools and args.get("harness") == "bash":
        yield (f"environments[{i}].args.harness", f"environment {env_id}: its tasks use MCP tools ({', '.join(tools)}), "
               "which verifiers serves as background processes of the harness's runtime; the bash harness's sandbox "
               "runs its one program and no tool servers", 'play it with args.harness: "null"')


# --- the sandbox of swe-tiny ---------------------------------------------------------------------------

def _image_has_bubblewrap(m: Manifest) -> bool | None:
    """Does the image this manifest builds contain bwrap? None: a registry base, which the plan cannot see into."""
    if not m.image.base.startswith("deb:"):
        return None
    return "bubblewrap" in m.image.packages


def _sandboxed(env) -> bool:
    """swe-tiny, and a verifiers taskset played by the bash harness (sandbox_runtime.py)."""
    return env.id in SANDBOXED or (env.id.startswith(VERIFIERS_PREFIX) and (env.args or {}).get("harness") == "bash")


def sandbox_problems(m: Manifest) -> Iterator[tuple[str, str, str]]:
    """(field, message, hint) for a sandboxed environment whose orchestrator host is known to lack bwrap."""
    for i, env in enumerate(m.environments):
        if not _sandboxed(env):
            continue
        field = f"environments[{i}].id"
        if m.target.kind == "local" and shutil.which("bwrap") is None:
            yield (field, f"environment {env.id} runs every program of a rollout in a bubblewrap sandbox on the "
                   "orchestrator's host, which for target local is this machine, and `bwrap` is not on PATH here",
                   "install bubblewrap (apt-get install bubblewrap)")
        elif m.target.kind in ("slurm", "kubernetes") and _image_has_bubblewrap(m) is False:
            yield (field, f"environment {env.id} runs every program of a rollout in a bubblewrap sandbox on the "
                   f"orchestrator's host; on target {m.target.kind} that is a node running the image this manifest "
                   f"builds ({m.image.base}), and image.packages has no bubblewrap",
                   "add bubblewrap to image.packages")


def sandbox_warnings(m: Manifest) -> list[str]:
    """What the plan cannot check: bwrap on hosts or in images it cannot see into."""
    sandboxed = sorted({env.id for env in m.environments if _sandboxed(env)})
    if not sandboxed or m.target.kind == "local" or _image_has_bubblewrap(m):
        return []
    where = ("the inventory hosts" if m.target.kind == "ssh" else
             f"the image {m.image.base} (or the nodes' own installation when no image is used)")
    return [f"{', '.join(sandboxed)} needs bubblewrap (`bwrap`, and unprivileged user namespaces) on the "
            f"orchestrator's host: {where}, which this plan cannot look into; without it the first rollout fails"]
