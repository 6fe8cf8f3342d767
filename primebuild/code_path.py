"""How a process in another Python environment imports this checkout's primebuild.

vLLM runs in an environment of its own (its pins differ from ours: primebuild/builders/vllm_env.py), one per
machine, and its processes load modules of ours (the worker extension, the admin middleware). The
environment holds only vLLM and its pins; our code reaches its processes through PYTHONPATH, set per
process to the root of the checkout that starts them, so every checkout on a machine uses the one
environment, at the same time and in any order. (Installed into the environment, editable, only the last
checkout to install itself there worked.)

A checkout's root is safe on another interpreter's path: `primebuild` is its only importable top-level
package (docs/architecture.md; tests/test_code_path.py keeps it so), so nothing there shadows one of vLLM's
packages. An installed primebuild (a wheel, as in an image) lies in site-packages beside our own pins,
which must never reach vLLM's processes: it hands nothing over, and the image installs primebuild into each
of its environments instead (primebuild/builders/image.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def checkout_root() -> Path | None:
    """The checkout this primebuild is imported from; None when it is installed (no pyproject.toml beside it)."""
    root = PACKAGE.parent
    return root if (root / "pyproject.toml").is_file() else None


def with_checkout(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with this checkout's root first on PYTHONPATH; unchanged for an installed primebuild."""
    out = dict(env)
    root = checkout_root()
    if root is not None:
        rest = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(root)]
        out["PYTHONPATH"] = os.pathsep.join([str(root), *rest])
    return out
