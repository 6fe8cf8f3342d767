"""Which code a run was made by (`run.json`'s code_version), and what changed since.

In a git checkout the version is the commit, plus, when tracked files have uncommitted changes, a digest
of those changes (`<sha>-dirty.<digest>`), so that two runs of the same edits compare equal and different
edits do not. Installed without git (a wheel, an image), it is the package version.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
SHA = re.compile(r"^[0-9a-f]{40}$")
MAX_FILES_SHOWN = 12


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None


def code_version() -> str:
    rev = _git("rev-parse", "HEAD")
    if rev is None or rev.returncode != 0:
        from primebuild import __version__

        return __version__
    sha = rev.stdout.decode().strip()
    diff = _git("diff", "HEAD", "--binary")
    if diff is not None and diff.stdout:
        return f"{sha}-dirty.{hashlib.sha256(diff.stdout).hexdigest()[:12]}"
    return sha


def code_changes(recorded: str, now: str) -> list[str]:
    """Lines that say how code `now` differs from code `recorded` (empty: the same code)."""
    if recorded == now:
        return []
    old_sha, old_dirty, old_digest = recorded.partition("-dirty")
    new_sha, new_dirty, _ = now.partition("-dirty")
    if not (SHA.match(old_sha) and SHA.match(new_sha)):
        return [f"code version {recorded} -> {now}"]
    lines = _commits_between(old_sha, new_sha) if old_sha != new_sha else []
    if old_dirty and new_dirty and old_sha == new_sha:
        lines.append("uncommitted changes differ from the run's" if old_digest
                     else "the run had uncommitted changes whose content was not recorded")
    else:
        if old_dirty:
            lines.append("the run had uncommitted changes, which this checkout does not have")
        if new_dirty:
            lines.append("this checkout has uncommitted changes (`git diff HEAD` shows them)")
    return lines


def _commits_between(old: str, new: str) -> list[str]:
    known = _git("cat-file", "-e", f"{old}^{{commit}}")
    if known is None or known.returncode != 0:
        return [f"commit {old[:12]} (the run's) is not in this checkout; today's is {new[:12]}"]
    count = _git("rev-list", "--count", f"{old}..{new}")
    back = _git("rev-list", "--count", f"{new}..{old}")
    files = _git("diff", "--name-only", old, new)
    ahead = int(count.stdout) if count and count.returncode == 0 else 0
    behind = int(back.stdout) if back and back.returncode == 0 else 0
    names = files.stdout.decode().split() if files and files.returncode == 0 else []
    lines = [f"commit {old[:12]} -> {new[:12]}: {ahead} commit(s) since the run"
             + (f", {behind} of the run's not here" if behind else "")
             + f", {len(names)} file(s) changed"]
    lines += [f"  {name}" for name in names[:MAX_FILES_SHOWN]]
    if len(names) > MAX_FILES_SHOWN:
        lines.append(f"  … and {len(names) - MAX_FILES_SHOWN} more (git diff --stat {old[:12]} {new[:12]})")
    return lines
