"""primebuild: declarative, reproducible async RL for LLMs."""

import os
import sys
from pathlib import Path

__version__ = "0.1.0"


def _keep_the_checkout_off_sys_path() -> None:
    """A checkout's top-level kernels/ (mapped to primebuild.kernels by setup.py) must not shadow PyPI's
    `kernels`, which transformers imports. `python -m primebuild...` started in a checkout puts its root
    first on sys.path; primebuild's own modules come from the install (editable or not), so drop it."""
    root = Path(__file__).resolve().parent.parent
    if not ((root / "setup.py").is_file() and (root / "kernels" / "fp8.py").is_file()):
        return  # installed from a wheel: no folder of ours beside the package
    sys.path[:] = [entry for entry in sys.path if Path(entry or os.getcwd()).resolve() != root]


_keep_the_checkout_off_sys_path()
