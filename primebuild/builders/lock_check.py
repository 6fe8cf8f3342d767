"""`plan --locked`: find a manifest's lock and refuse it when it is stale or incomplete.

Stale means the lock no longer describes what the manifest would use: the manifest changed (its hash),
an entry's request changed (another revision, environment, Python version, extra, pyproject.toml,
base image), or an input the lock hashed changed on disk (a byte of a local model folder, the facts
behind a random init or an SFT output's store key, the version of a built-in environment). Every
problem is named with the fix. Entries that are recorded but could not be pinned (offline) are not
stale: `unpinned()` lists them so that callers can warn.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from primebuild import __version__
from primebuild.builders import lock as lockmod
from primebuild.builders.diff import diff_values, render_changes
from primebuild.errors import Problem, UserError
from primebuild.manifest.load import LoadedManifest


def load_lock_for(loaded: LoadedManifest, lock_path: str | None, require_fresh: bool) -> dict:
    """The lock of `loaded` (default `lockfiles/<stem>.lock`); UserError when missing or, if
    `require_fresh`, when stale or missing entries."""
    path = Path(lock_path) if lock_path else lockmod.lock_path_for(loaded)
    if not path.is_file():
        raise UserError(f"no lock for {loaded.path} at {path}",
                        hint=f"create it with `primebuild lock {loaded.command_args}`")
    lock = lockmod.read_lock(path)
    if require_fresh:
        problems = check_lock(loaded, lock, shown=str(path))
        if problems:
            raise UserError(problems)
    return lock


def check_lock(loaded: LoadedManifest, lock: dict, *, shown: str = "lock",
               project_dir: Path = lockmod.python_env.PROJECT_DIR) -> list[Problem]:
    """Every way `lock` is stale for `loaded`, each with its fix; [] when fresh."""
    args = loaded.command_args
    if shown != "lock" and Path(shown).resolve() != lockmod.lock_path_for(loaded).resolve():  # a --lock of its own
        args += f" --lock {shlex.quote(shown)}"
    relock = f"`primebuild lock {args}` (re-pins only what changed)"
    update = f"`primebuild lock --update {args}`"
    problems: list[Problem] = []

    def stale(section: str, message: str, hint: str) -> None:
        problems.append(Problem(f"stale lock: {message}", file=shown, field=section, hint=hint))

    recorded = (lock.get("manifest") or {}).get("hash")
    if recorded != loaded.manifest_hash:
        stale("manifest.hash", f"the manifest changed since it was locked ({_short(recorded)} -> "
              f"{_short(loaded.manifest_hash)})", f"re-lock with {relock}")
    wanted = lockmod.requests(loaded, project_dir)

    # requests: a missing entry or one that asks for something else
    for section in ("model", "base_image"):
        entry = lock.get(section)
        if not isinstance(entry, dict):
            stale(section, f"the lock has no {section} entry", f"add it with {relock}")
        elif entry.get("request") != wanted[section]:
            stale(section, _request_change(entry.get("request"), wanted[section]), f"re-lock with {relock}")
    for group in ("environments", "python"):
        have = lock.get(group) if isinstance(lock.get(group), dict) else {}
        for key, request in sorted(wanted[group].items()):
            entry = have.get(key)
            if not isinstance(entry, dict):
                stale(f"{group}.{key}", f"the lock has no {group}.{key} entry", f"add it with {relock}")
            elif entry.get("request") != request:
                stale(f"{group}.{key}", _request_change(entry.get("request"), request), f"re-lock with {relock}")
        for key in sorted(set(have) - set(wanted[group])):
            stale(f"{group}.{key}", f"{group}.{key} is locked but the manifest no longer uses it",
                  f"re-lock with {relock}")

    # inputs hashed on disk: recompute what is cheap and local
    model = lock.get("model")
    if isinstance(model, dict) and model.get("request") == wanted["model"] and wanted["model"]["source"] != "hf":
        current = lockmod.resolve_model(loaded, offline=True)
        changes = diff_values(_comparable(model), _comparable(current), "model")
        if changes:
            stale("model", "the model's inputs changed on disk since locking:\n" + _indent(render_changes(changes)),
                  f"refresh with {update}")
    for env_id, entry in sorted((lock.get("environments") or {}).items()):
        if isinstance(entry, dict) and entry.get("kind") == "builtin" and env_id in wanted["environments"]:
            now = lockmod.resolve_environment(entry["request"])
            if (entry.get("version"), entry.get("primebuild_version")) != (now["version"], __version__):
                stale(f"environments.{env_id}",
                      f"built-in environment {env_id} was locked at version {entry.get('version')} of primebuild "
                      f"{entry.get('primebuild_version')}, this is version {now['version']} of primebuild "
                      f"{__version__}", f"refresh with {update}")
    return problems


def _comparable(entry: dict) -> dict:
    """A model entry without what may legitimately differ between a pinned and an offline resolution."""
    return {k: (_comparable(v) if isinstance(v, dict) and k == "base" else v)
            for k, v in entry.items() if k not in ("reason", "via")}


def _request_change(old: object, new: dict) -> str:
    changes = diff_values(old if isinstance(old, dict) else {}, new)
    return "the manifest now asks for something else:\n" + _indent(render_changes(changes))


def _indent(text: str) -> str:
    return "\n".join(f"      {line}" for line in text.splitlines())


def _short(digest: object) -> str:
    return str(digest)[:12] if digest else "none"
