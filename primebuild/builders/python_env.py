"""Lock the project's Python packages per image variant with `uv pip compile --generate-hashes`.

A variant is what an image installs: `cpu` is the project's dependencies, `gpu` adds the `gpu` extra
(vLLM, torchtitan); other extras the manifest asks for (`test`) go into both. Resolution targets the
image, not this machine: `--python-version` from `image.python` and a fixed Linux x86_64 platform, so
the same request resolves the same way on a laptop or a cluster login node.

uv ignores pip's configuration, so the local wheel folder that pip's own config names (`find-links`,
e.g. /opt/wheels holding the CPU build of torch) is passed explicitly for the `cpu` variant; without it
uv would pick the multi-GB CUDA torch from PyPI. uv runs as a subprocess: locking never imports torch.

A failed resolution (no network, conflicting pins) is recorded with its reason instead of raising, so
a lock made offline still pins everything else and says what it could not pin.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[2]  # the repository root: primebuild/builders/python_env.py
PLATFORM = "x86_64-manylinux_2_28"
VARIANTS = ("cpu", "gpu")
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # where `+cpu` torch wheels live publicly
_TIMEOUT_S = 600


def variant_request(variant: str, python: str, extras: list[str], project_dir: Path = PROJECT_DIR,
                    gpu_packages: list[str] = ()) -> dict:
    """Everything a variant's resolution depends on that we can name; a change makes the lock stale.
    `gpu_packages`: distributions the gpu variant resolves beside the project (a KV connector's transport:
    kv_connector_packages.py); absent from the request when there are none, so other locks stay fresh."""
    wanted = sorted({e for e in extras if e != "gpu"} | ({"gpu"} if variant == "gpu" else set()))
    request = {
        "python": python,
        "platform": PLATFORM,
        "extras": wanted,
        "dependencies_sha256": dependencies_hash(project_dir / "pyproject.toml", wanted),
    }
    if variant == "gpu" and gpu_packages:
        request["packages"] = sorted(set(gpu_packages))
    return request


def dependencies_hash(pyproject: Path, extras: list[str]) -> str:
    """sha256 of what resolution reads from pyproject.toml: requires-python, the dependencies and the
    requested extras. Editing a comment, a tool's settings or another extra leaves locks fresh."""
    import tomllib

    project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    optional = project.get("optional-dependencies", {})
    relevant = {"requires-python": project.get("requires-python"), "dependencies": project.get("dependencies", []),
                "extras": {name: optional.get(name) for name in extras}}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def image_variant(hardware_gpus: int, extras: list[str]) -> str:
    """The variant an image installs: `gpu` (CUDA torch, the `vllm` wheel) for GPU hardware or when the
    manifest asks for the gpu extra, else `cpu`."""
    return "gpu" if hardware_gpus > 0 or "gpu" in extras else "cpu"


def environment_request(environment, python: str) -> dict:
    """The lock request of a Python environment of its own (a primebuild/builders/vllm_env.VllmEnvironment): its
    requirements alone, resolved for the image's Python and platform."""
    return {"python": python, "platform": PLATFORM, "requirements": list(environment.requirements),
            "prefix": environment.image_prefix, "device": environment.device}


def resolve_variant(request: dict, *, project_dir: Path = PROJECT_DIR, offline: bool = False) -> dict:
    """Run uv for one variant (the project with extras) or one environment of its own (`requirements`):
    {"pinned": True, "packages": {...}} or {"pinned": False, "reason": ...}."""
    uv = find_uv()
    if uv is None:
        return {"pinned": False, "reason": "uv is not installed (pip install uv)"}
    sources = [] if "requirements" in request else [project_dir / "pyproject.toml"]
    listed = request.get("requirements") or request.get("packages")  # the env's own, or beside the project
    if listed:  # written beside nothing: uv reads it and forgets it
        import tempfile

        handle = tempfile.NamedTemporaryFile("w", suffix=".in", prefix="primebuild-env-", delete=False)
        with handle:
            handle.write("\n".join(listed) + "\n")
        sources.append(Path(handle.name))
    try:
        return _compile(uv, sources, request, project_dir, offline)
    finally:
        for source in sources:
            if source.suffix == ".in":
                source.unlink(missing_ok=True)


def _compile(uv: str, sources: list[Path], request: dict, project_dir: Path, offline: bool) -> dict:
    argv = [uv, "pip", "compile", *map(str, sources), "--generate-hashes", "--no-header",
            "--no-annotate", "--quiet", "--python-version", request["python"], "--python-platform",
            request["platform"]]
    for extra in request.get("extras", []):
        argv += ["--extra", extra]
    links = pip_find_links()
    cpu = "gpu" not in request.get("extras", []) and request.get("device", "cpu") == "cpu"
    if cpu:
        for link in links:
            argv += ["--find-links", link]
    if offline:
        argv.append("--offline")
    env = {**os.environ, "UV_NO_PROGRESS": "1"}
    env.pop("UV_FIND_LINKS", None)  # only the cpu variant may see the local CPU wheels
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, env=env, cwd=project_dir)
    except subprocess.TimeoutExpired:
        return {"pinned": False, "reason": f"uv pip compile took more than {_TIMEOUT_S} s"}
    if done.returncode != 0:
        return {"pinned": False, "reason": "uv pip compile failed: " + _last_lines(done.stderr)}
    packages = parse_requirements(done.stdout)
    if not packages:
        return {"pinned": False, "reason": "uv pip compile printed no packages"}
    resolved = {"pinned": True, "packages": packages, "resolver": uv_version(uv)}
    if any("+cpu" in p["version"] for p in packages.values()):
        resolved["extra_index_url"] = PYTORCH_CPU_INDEX
    return resolved


def parse_requirements(text: str) -> dict[str, dict]:
    """uv's `name==version [; marker] \\ --hash=sha256:… …` blocks -> {name: {version, hashes, marker?}}."""
    packages: dict[str, dict] = {}
    logical, pending = [], ""
    for raw in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    for line in logical:
        body = line.strip()
        if not body or body.startswith("-"):
            continue
        requirement, _, rest = body.partition(" --hash=")
        hashes = sorted(re.findall(r"--hash=(\S+)", body))
        requirement, _, marker = requirement.partition(";")
        name, sep, version = requirement.strip().partition("==")
        if not sep:
            raise ValueError(f"unpinned line in uv output: {body!r}")
        entry = {"version": version.strip(), "hashes": hashes}
        if marker.strip():
            entry["marker"] = marker.strip()
        packages[_normalise(name)] = entry
    return dict(sorted(packages.items()))


def render_requirements(resolved: dict) -> str:
    """The pip requirements file (hash-checking mode) for a pinned variant, canonical line by line."""
    lines = ["# Locked by primebuild (uv pip compile --generate-hashes); install with --require-hashes."]
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
