"""The code base stays ruff-clean (pyproject.toml's [tool.ruff] rules): style drifts are caught in CI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (it comes with the test extra)")
    result = subprocess.run([ruff, "check", "--no-cache", str(REPO)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
