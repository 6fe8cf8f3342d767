"""Locked Python packages (and the project itself) installed for the image's interpreter, as layer entries.

`uv pip install --target` installs for the image, not for this machine: `--python-version` and
`--python-platform` name the image's Python and platform, `--require-hashes` with `--no-deps` installs
exactly the lock's files (wheels only: `--no-build`, since a build from source is not reproducible),
and the local wheel folder pip is configured with is passed as `--find-links` (uv ignores pip's
configuration; that folder holds the CPU build of torch the cpu variant locks). Files land in
`/usr/local/lib/pythonX.Y/dist-packages`, which Debian's Python puts on `sys.path`, and console
scripts in `/usr/local/bin`. Byte-code is not compiled: a .pyc records its source's mtime, which the
layer does not keep (the container compiles on first import, into its own writable layer).

Two things an installer writes depend on the build machine and are normalised: console scripts'
`#!` line (uv names the interpreter it ran with: it becomes the image's `/usr/bin/python3`, and the
script's line in RECORD gets the new sha256 and size) and the
project's `direct_url.json` (the path of the temporary copy it was installed from) and uv's cache
records beside it (a build time): dropped, as for any package installed from an index.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
from pathlib import Path

from primebuild.builders import python_env
from primebuild.builders.oci import TarEntry
from primebuild.errors import UserError

IMAGE_PYTHON = "/usr/bin/python3"
_TIMEOUT_S = 1200
# what uv writes beside a project installed from a folder: the folder's URL, and its cache bookkeeping
# (uv_cache.json holds the time of the build)
_BUILD_MACHINE_RECORDS = ("direct_url.json", "uv_cache.json", "uv_build.json")


def site_packages(python: str) -> str:
    return f"usr/local/lib/python{python}/dist-packages"


def install_requirements(requirements: str, python: str, work: Path) -> list[TarEntry]:
    """Install a locked requirements text (`name==version --hash=…` lines) into `work`; its entries."""
    return tree_entries(_install_locked(requirements, python, work), python)


def install_environment(requirements: str, python: str, prefix: str, work: Path) -> list[TarEntry]:
    """A Python environment of its own at `prefix` (a venv over the image's Python, as `python -m venv`
    lays it out) holding a locked requirements text: what a process group whose pins differ from ours
    runs in (the vLLM one on CPUs: primebuild/builders/vllm_env.py)."""
    root = prefix.strip("/")
    config = f"home = {os.path.dirname(IMAGE_PYTHON)}\ninclude-system-site-packages = false\nversion = {python}\n"
    return [TarEntry(f"{root}/pyvenv.cfg", "file", 0o644, config.encode()),
            TarEntry(f"{root}/bin/python", "symlink", 0o777, target=IMAGE_PYTHON),
            TarEntry(f"{root}/bin/python3", "symlink", 0o777, target="python"),
            *tree_entries(_install_locked(requirements, python, work), python, root=root)]


def _install_locked(requirements: str, python: str, work: Path) -> Path:
    extra_index = re.search(r"^--extra-index-url\s+(\S+)", requirements, re.M)
    packages_only = "\n".join(line for line in _logical_lines(requirements)
                              if line.strip() and not line.lstrip().startswith(("-", "#")))
    work.mkdir(parents=True, exist_ok=True)
    req = work / "requirements.txt"
    req.write_text(packages_only + "\n")
    links = python_env.pip_find_links()
    argv = ["--require-hashes", "--no-build", "-r", str(req)]
    for link in links:
        argv += ["--find-links", link]
    if extra_index and not links:  # the local wheel folder, where there is one, holds the +cpu wheels
        argv += ["--extra-index-url", extra_index.group(1)]
    return _uv_install(argv, python, work / "target")


def install_project(files: list[TarEntry], python: str, work: Path, root: str | None = None) -> list[TarEntry]:
    """Install the project (its git-tracked files, as read for the code layer) like `pip install .`: into
    the image's Python, or into the environment at `root` (install_environment's)."""
    source = work / "source"
    for entry in files:
        path = source / entry.path
        path.parent.mkdir(parents=True, exist_ok=True)
        if entry.kind == "symlink":
            os.symlink(entry.target, path)
        else:
            path.write_bytes(entry.data)
    target = _uv_install([str(source)], python, work / "target")
    for name in _BUILD_MACHINE_RECORDS:
        for path in target.glob(f"*.dist-info/{name}"):
            path.unlink()
    return tree_entries(target, python, root=root)


def _uv_install(args: list[str], python: str, target: Path) -> Path:
    uv = python_env.find_uv()
    if uv is None:
        raise UserError("uv is not installed: it installs the image's Python packages", hint="pip install uv")
    argv = [uv, "pip", "install", "--target", str(target), "--python-version", python, "--python-platform",
            python_env.PLATFORM, "--no-deps", "--quiet", *args]
    env = {**os.environ, "UV_NO_PROGRESS": "1"}
    for name in ("UV_FIND_LINKS", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_COMPILE_BYTECODE"):
        env.pop(name, None)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise UserError(f"uv pip install took more than {_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise UserError("uv pip install of the image's Python packages failed: "
                        + python_env._last_lines(done.stderr, 6),
                        hint="the lock names the exact files; `primebuild lock --update MANIFEST` re-pins them")
    return target


def tree_entries(target: Path, python: str, root: str | None = None) -> list[TarEntry]:
    """The files uv wrote, placed where the image's Python finds them (or, with `root`, the environment
    there: its site-packages and bin/); read lazily at layer write."""
    site = site_packages(python) if root is None else f"{root}/lib/python{python}/site-packages"
    bin_dir = "usr/local" if root is None else root
    interpreter = IMAGE_PYTHON if root is None else f"/{root}/bin/python"
    scripts = {}  # rel path -> bytes with the image's #! line
    entries = []
    for dirpath, dirnames, filenames in os.walk(target):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(target).as_posix()
        for name in sorted(filenames) + [d for d in dirnames if Path(dirpath, d).is_symlink()]:
            path = Path(dirpath) / name
            rel = f"{rel_dir}/{name}" if rel_dir != "." else name
            where = f"{bin_dir}/{rel}" if rel.startswith("bin/") else f"{site}/{rel}"
            if path.is_symlink():
                entries.append(TarEntry(where, "symlink", 0o777, target=os.readlink(path)))
            elif rel.startswith("bin/"):
                scripts[rel] = _image_shebang(path.read_bytes(), interpreter)
                entries.append(TarEntry(where, "file", 0o755, scripts[rel]))
            elif rel.endswith(".dist-info/RECORD"):
                entries.append(TarEntry(where, "file", 0o644, b""))  # rewritten below, once scripts are known
            else:
                mode = 0o755 if path.stat().st_mode & 0o111 else 0o644
                entries.append(TarEntry(where, "file", mode, source=str(path)))
    out = []
    for entry in entries:
        if entry.path.endswith(".dist-info/RECORD"):
            rel = entry.path[len(site) + 1:]
            entry = TarEntry(entry.path, "file", 0o644, _record_with(Path(target, rel).read_bytes(), scripts, target))
        out.append(entry)
    return out


def _record_with(record: bytes, scripts: dict[str, bytes], target: Path) -> bytes:
    """A RECORD whose lines for rewritten scripts carry their new sha256 and size (PEP 376/627 form),
    without the files removed after installing (direct_url.json)."""
    lines = []
    for line in record.decode().splitlines():
        path = line.rsplit(",", 2)[0]
        if not path.endswith("RECORD") and not (target / path).is_file() and not (target / path).is_symlink():
            continue
        if path in scripts:
            digest = base64.urlsafe_b64encode(hashlib.sha256(scripts[path]).digest()).rstrip(b"=").decode()
            line = f"{path},sha256={digest},{len(scripts[path])}"
        lines.append(line)
    return ("\n".join(lines) + "\n").encode()


def _image_shebang(script: bytes, interpreter: str = IMAGE_PYTHON) -> bytes:
    first, sep, rest = script.partition(b"\n")
    if first.startswith(b"#!") and b"python" in first:
        return f"#!{interpreter}".encode() + sep + rest
    return script


def _logical_lines(text: str) -> list[str]:
    return re.sub(r"\\\n", " ", text).splitlines()

