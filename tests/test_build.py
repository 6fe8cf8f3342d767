"""`primebuild build` refuses what it cannot build reproducibly. Building, cache hits and what the image
holds: tests/test_image_run.py (it needs the Debian archive and PyPI, and shares the ~1.1 GB of layers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import call_cli

pytestmark = pytest.mark.timeout(600)


def test_build_refuses_a_stale_lock(tmp_path: Path, capsys, locked: Path):
    manifest = locked / "reverse-text.yaml"
    result = call_cli(capsys, "build", manifest, "--set", "trainer.optimizer.lr=0.01", "--store", tmp_path / "s")
    assert result.code == 2 and "stale lock" in result.err
    bad = call_cli(capsys, "plan", "--locked", "--image-digest", "sha256:xyz", manifest)
    assert bad.code == 2 and "64 hex digits" in bad.err
