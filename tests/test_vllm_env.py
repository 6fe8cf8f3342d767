"""Which vLLM wheel a plan gets (primebuild/builders/vllm_env.py) and what scripts/vllm-env checks in its environment.

CI never installs the CUDA wheel: the script's check runs against stand-in environments made of this
venv's python (a CPU torch) and a stand-in `vllm` package with the distribution metadata of one wheel or
the other, so the check that a CUDA environment holds a CUDA torch is exercised for real, and fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MANIFESTS, REPO

from primebuild.builders import vllm_env
from primebuild.manifest.schema import Hardware

SCRIPT = REPO / "scripts" / "vllm-env"


def test_the_hardware_chooses_the_wheel():
    assert vllm_env.for_hardware(Hardware(gpu="cpu", gpus_per_node=0, cpus_per_node=2, host_memory_gb=16)) \
        == vllm_env.CPU
    assert vllm_env.for_hardware(Hardware(gpu="h200", gpus_per_node=8)) == vllm_env.CUDA
    assert vllm_env.CUDA.name == "vllm-0.32.0" and vllm_env.CPU.name == "vllm-cpu-0.32.0"
    assert vllm_env.CUDA.requirements == ["torch==2.13.0", "vllm==0.32.0"]
    assert vllm_env.CPU.image_python == "/opt/primebuild/envs/vllm-cpu-0.32.0/bin/python"


def test_the_script_pins_what_the_module_names():
    text = SCRIPT.read_text()
    assert re.search(r"^vllm_version=(\S+)$", text, re.M)[1] == vllm_env.VLLM_VERSION
    assert re.search(r"^torch_version=(\S+)$", text, re.M)[1] == vllm_env.TORCH_VERSION


def _stand_in_env(envs: Path, environment: vllm_env.VllmEnvironment) -> Path:
    """An environment folder whose python is this venv's, with a stand-in `vllm` of `environment`'s wheel."""
    folder = envs / environment.name
    (folder / "bin").mkdir(parents=True)
    python = folder / "bin" / "python"  # a wrapper, not a link: a linked venv python loses its venv
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    site = envs / f"site-{environment.name}"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    info = site / f"{environment.distribution.replace('-', '_')}-{vllm_env.VLLM_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {environment.distribution}\n"
                                   f"Version: {vllm_env.VLLM_VERSION}\n")
    # made from this checkout's lock of that env, as scripts/vllm-env marks it
    (folder / ".primebuild-ready").write_text(_lock_sha256(environment) + "\n")
    return site


def _lock_sha256(environment: vllm_env.VllmEnvironment) -> str:
    import hashlib

    return hashlib.sha256((REPO / "lockfiles" / "envs" / f"{environment.name}.txt").read_bytes()).hexdigest()


def _check(envs: Path, site: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *flags, "--check"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PRIMEBUILD_ENVS": str(envs), "PYTHONPATH": str(site)})


def test_the_check_asserts_the_torch_build_of_each_wheel(tmp_path):
    cpu_site = _stand_in_env(tmp_path, vllm_env.CPU)
    done = _check(tmp_path, cpu_site)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(tmp_path / "vllm-cpu-0.32.0" / "bin" / "python")

    gpu_site = _stand_in_env(tmp_path, vllm_env.CUDA)
    done = _check(tmp_path, gpu_site, "--gpu")
    assert done.returncode == 1 and "not a CUDA torch: 2.13.0+cpu" in done.stderr and "vllm-0.32.0" in done.stderr
    probe = subprocess.run([str(SCRIPT), "--gpu", "--check"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PRIMEBUILD_ENVS": str(tmp_path / "none")})
    assert probe.returncode == 1 and "missing" in probe.stderr and "vllm-0.32.0" in probe.stderr
    bad = subprocess.run([str(SCRIPT), "--cuda"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown argument" in bad.stderr


def _second_checkout(root: Path) -> Path:
    """Another checkout of the project on this machine: this one's package, scripts and pyproject.toml (the
    working tree, so uncommitted edits too) copied to `root`."""
    for name in ("primebuild", "scripts", "lockfiles/envs"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root.resolve()


def _started_from(checkout: Path, python: Path, module: str, env: dict[str, str]) -> Path:
    """The file `module` is imported from by a process of the environment at `python` that `checkout`
    starts: its environment is made by that checkout's own primebuild, as its worker makes it."""
    starter = ("import os, subprocess, sys; from primebuild.code_path import with_checkout; "
               "probe = f'import os, {sys.argv[2]} as m; print(os.path.realpath(m.__file__))'; "
               "sys.exit(subprocess.run([sys.argv[1], '-c', probe], env=with_checkout(os.environ)).returncode)")
    done = subprocess.run([sys.executable, "-c", starter, str(python), module], capture_output=True, text=True,
                          timeout=300, cwd="/", env={**env, "PYTHONPATH": os.pathsep.join(
                              [str(checkout), env.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-2000:]
    return Path(done.stdout.strip().splitlines()[-1])


def test_two_checkouts_share_the_environment_in_either_order(tmp_path):
    """Nothing of a checkout is installed into the shared environment: each passes the check and its
    processes there import its own primebuild, whichever came last (the environment's own python here
    even holds an editable install of a third checkout, which PYTHONPATH shadows)."""
    site = _stand_in_env(tmp_path / "envs", vllm_env.CPU)
    python = tmp_path / "envs" / vllm_env.CPU.name / "bin" / "python"
    second = _second_checkout(tmp_path / "second")
    env = {**os.environ, "PRIMEBUILD_ENVS": str(tmp_path / "envs"), "PYTHONPATH": str(site)}
    for checkout in (second, REPO):
        done = subprocess.run([str(checkout / "scripts" / "vllm-env"), "--check"], capture_output=True, text=True,
                              timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1] == str(python)
    for checkout in (REPO, second):
        module = "primebuild.runtime.inference.vllm.admin_auth"
        assert _started_from(checkout, python, module, env) == checkout / "primebuild/runtime/inference/vllm/admin_auth.py"


@pytest.mark.vllm
def test_a_second_checkout_runs_its_own_modules_in_the_real_environment(tmp_path):
    """The machine's real vllm-cpu environment: a second checkout passes the check (vllm imported) and
    the module vLLM's worker loads (`--worker-extension-cls`) comes from that checkout."""
    from vllm_helpers import vllm_python

    python = vllm_python()
    second = _second_checkout(tmp_path / "second")
    done = subprocess.run([str(second / "scripts" / "vllm-env"), "--check"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    module = "primebuild.runtime.inference.vllm.worker_extension"
    got = _started_from(second, python, module, dict(os.environ))
    assert got == second / "primebuild/runtime/inference/vllm/worker_extension.py"


def test_the_check_refuses_an_environment_made_from_another_lock(tmp_path):
    """The env holds exactly its committed lock: after a lock change `--check` says to sync it."""
    site = _stand_in_env(tmp_path, vllm_env.CPU)
    assert _check(tmp_path, site).returncode == 0
    (tmp_path / vllm_env.CPU.name / ".primebuild-ready").write_text("0" * 64 + "\n")
    done = _check(tmp_path, site)
    assert done.returncode == 1 and "was not made from" in done.stderr and "vllm-cpu-0.32.0.txt" in done.stderr
    assert "run scripts/vllm-env" in done.stderr


def test_the_check_refuses_the_other_wheel(tmp_path):
    """A vllm-cpu folder that holds the `vllm` distribution instead is broken, not silently used."""
    site = _stand_in_env(tmp_path, vllm_env.CPU)
    for info in site.glob("*.dist-info"):
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm_env.VLLM_VERSION}\n")
        info.rename(site / f"vllm-{vllm_env.VLLM_VERSION}.dist-info")
    done = _check(tmp_path, site)
    assert done.returncode == 1 and "PackageNotFoundError" in done.stderr and "broken" in done.stderr


@pytest.mark.parametrize(("manifest", "sets", "wheel"), [
    ("reverse-text-vllm.yaml", [], "vllm-cpu"),
    ("qwen3-30b-a3b.yaml", [], "vllm"),
])
def test_plans_select_the_wheel_of_their_hardware(manifest, sets, wheel):
    from primebuild.builders.plan import compile_plan
    from primebuild.manifest.load import load_manifest

    plan = compile_plan(load_manifest(MANIFESTS / manifest, sets), design=True)
    assert vllm_env.uses_vllm(plan.processes)
    assert vllm_env.for_hardware(plan.hardware).distribution == wheel


def test_run_makes_the_environment_of_the_plans_wheel():
    """What `run` calls (primebuild/runtime/inference/vllm/env.py): scripts/vllm-env with --gpu for the CUDA wheel."""
    from primebuild.runtime.inference.vllm.env import env_dir, script_argv

    assert script_argv(vllm_env.CUDA)[1:] == ["--gpu"] and script_argv(vllm_env.CPU, check=True)[1:] == ["--check"]
    assert env_dir(vllm_env.CUDA).name == "vllm-0.32.0" and env_dir().name == "vllm-cpu-0.32.0"
