"""Can the manifest's environments load? Checked at plan time, cheaply, without importing them.

An environment id is either built in (runtime/envs/, versions in primebuild/contracts/environments.py)
or `verifiers:<taskset-id>`, a verifiers (>= 0.4) taskset that verifiers' loader imports as the module
`verifiers.v1.tasksets.<name>` (those ship with verifiers) or `<name>` (an installed package), where
`<name>` is the id without an `owner/` prefix or `@version` suffix, `-` turned into `_`, lower-cased.
The check finds those modules with `importlib.util.find_spec` on top-level names and on verifiers'
own folder, so it imports neither verifiers (a large tree) nor torch: `plan` stays fast. What it cannot
see (a taskset's own optional dependencies) still fails when the orchestrator loads it.

An unknown id, or a taskset that is not installed, is a located problem of the plan; `plan --design`
still shows the plan, listing it among what this machine cannot run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

from primebuild.contracts.environments import BUILTIN_VERSIONS, VERIFIERS_PREFIX
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


# The adapter's own args (runtime/envs/verifiers_adapter.py); the rest are the taskset's config fields,
# which only verifiers itself can check (when the orchestrator loads the taskset).
ADAPTER_ARGS = {
    "num_eval": ("a positive integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
    "max_turns": ("a positive integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
    "prompt_format": ("a string holding {prompt}", lambda v: isinstance(v, str) and "{prompt}" in v),
    "reply_format": ("a string holding {message}", lambda v: isinstance(v, str) and "{message}" in v),
    "env": ("a mapping (the verifiers Env's config fields)", lambda v: isinstance(v, dict)),
}


def adapter_arg_problems(args: dict) -> Iterator[tuple[str, str]]:
    for name, (wanted, ok) in ADAPTER_ARGS.items():
        if name in args and not ok(args[name]):
            yield name, f"{name} must be {wanted}, got {args[name]!r}"


def environment_problems(m: Manifest) -> Iterator[tuple[str, str, str]]:
    """(field, message, hint) for every environment of `m` that cannot load here."""
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
            for name, message in adapter_arg_problems(env.args or {}):
                yield (f"environments[{i}].args.{name}", f"environment {env.id}: {message}",
                       "README.md, section Multi-turn environments and agents, lists the adapter's args")
        else:
            yield (f"environments[{i}].id", f"unknown environment id {env.id!r}",
                   f"use one of: {', '.join(known_ids())}")
