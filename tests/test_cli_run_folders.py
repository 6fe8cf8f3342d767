"""status | logs | stop | run --resume on folders that are not run folders: clean errors, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli


@pytest.mark.parametrize("args", [
    ("status", "{d}"), ("stop", "{d}"), ("logs", "{d}"), ("run", "--resume", "{d}"),
    ("run", "--resume", "{d}/missing"), ("run",), ("worker", "--plan", "{d}/plan.json", "--process", "x"),
    ("status", "--runs-dir", "{d}"), ("logs", "--runs-dir", "{d}"), ("stop", "--runs-dir", "{d}"),
])
def test_not_a_run_folder_is_a_clean_error(args, tmp_path: Path):
    result = run_cli(*(a.format(d=tmp_path) for a in args))
    assert result.code == 2, result.text
    assert "Traceback" not in result.text and result.err.strip()
    assert not (tmp_path / "STOP").exists()
