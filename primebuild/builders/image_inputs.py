"""What an image takes from the checkout (primebuild/builders/image.py): the locked requirements, checked to pin every
package with a hash, and the project's files with git's modes (never the checkout's umask or mtimes)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from primebuild.builders.oci import TarEntry
from primebuild.errors import Problem, UserError


def read_file(path: Path, role: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise UserError(f"cannot read the {role} file {path}: {err.strerror}") from err


def read_requirements(source: Path | str) -> bytes:
    if isinstance(source, Path):
        data, origin = read_file(source, "requirements"), str(source)
    elif "\n" not in source.strip() and source.strip().endswith(".txt") and Path(source.strip()).exists():
        raise UserError(f"requirements {source!r} looks like a file name: pass Path({source!r}) to read it")
    else:
        data, origin = source.encode(), "<requirements text>"
    check_requirements(data.decode(), origin)
    return data


def check_requirements(text: str, origin: str = "<requirements>") -> None:
    """Every requirement must be pinned (`==`) or a direct URL, and carry `--hash=`: pip's hash-checking
    mode then installs exactly the locked artifacts or nothing."""
    problems = []
    logical: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append((start, pending + line))
        pending = ""
    if pending:
        logical.append((start, pending))
    for number, line in logical:
        body = line.strip()
        if not body or (
            body.startswith("-")
            and not body.startswith(("-e", "--editable", "-r", "--requirement", "-c", "--constraint"))
        ):
            continue  # blank, or an option such as --index-url
        requirement = body.split()[0]
        if requirement in ("-r", "--requirement", "-c", "--constraint") or body.startswith(("-r", "-c")):
            problems.append(
                Problem(
                    f"{body!r} refers to another file, which the image would not hold: inline it",
                    file=origin,
                    line=number,
                )
            )
        elif body.startswith(("-e", "--editable")):
            problems.append(
                Problem(f"editable requirement {body!r} cannot be locked", file=origin, line=number)
            )
        elif "--hash=" not in body:
            problems.append(Problem(f"requirement {requirement!r} has no --hash", file=origin, line=number))
        elif "==" not in requirement and " @ " not in body and "@" not in requirement:
            problems.append(
                Problem(f"requirement {requirement!r} is not pinned with ==", file=origin, line=number)
            )
    if problems:
        hint = "generate locked requirements with `uv pip compile --generate-hashes`"
        problems[-1] = Problem(problems[-1].message, file=origin, line=problems[-1].line, hint=hint)
        raise UserError(problems)


def project_entries(project_dir: str | Path, files: tuple[str, ...] | None, warnings: list[str]
                    ) -> list[TarEntry]:
    """The project's files as image entries: git-tracked ones with git's modes, or the `files` listed;
    submodules and tracked files missing from the checkout are left out with a warning."""
    root = Path(project_dir).resolve()
    if not root.is_dir():
        raise UserError(f"project directory {root} does not exist")
    listed = git_files(root) if files is None else [(f, None) for f in files]
    entries = []
    for rel, git_mode in listed:
        path = root / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise UserError(f"project file {rel!r} must be a relative path inside {root}")
        if git_mode == "160000":
            warnings.append(f"git submodule {rel} is not included in the image")
            continue
        if path.is_symlink():
            entries.append(TarEntry(Path(rel).as_posix(), "symlink", 0o777, target=os.readlink(path)))
        elif path.is_file():
            executable = git_mode == "100755" if git_mode else bool(path.stat().st_mode & 0o111)
            entries.append(
                TarEntry(Path(rel).as_posix(), "file", 0o755 if executable else 0o644, path.read_bytes())
            )
        elif not path.exists() and git_mode:
            warnings.append(f"tracked file {rel} is missing from the working tree and was left out")
        else:
            raise UserError(f"project file {path} is not a regular file or symlink")
    return sorted(entries, key=lambda e: e.path)


def git_files(root: Path) -> list[tuple[str, str]]:
    """(path, git mode) of every tracked file: modes come from git, so the checkout's umask is irrelevant."""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-s", "-z"], capture_output=True, timeout=60
        )
    except FileNotFoundError as err:
        raise UserError("git is not installed: pass ImageSpec.files to list the project files") from err
    if done.returncode != 0:
        raise UserError(
            f"{root} is not a git checkout ({done.stderr.decode().strip()}); pass ImageSpec.files instead"
        )
    files = []
    for record in done.stdout.decode().split("\0"):
        if record:
            meta, _, path = record.partition("\t")
            files.append((path, meta.split()[0]))
    return sorted(set(files))
