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


@pytest.mark.parametrize("args", [("stop", "{d}"), ("status", "{d}"), ("logs", "-n", "-2", "{d}")])
def test_a_folder_whose_plan_does_not_read_is_no_run(args, tmp_path: Path):
    (tmp_path / "plan.json").write_text("{bad")
    result = run_cli(*(a.format(d=tmp_path) for a in args))
    assert result.code == 2 and "Traceback" not in result.text and result.err.strip(), result.text
    assert not (tmp_path / "STOP").exists()


def test_runs_of_one_manifest_started_in_the_same_second_get_folders_of_their_own(tmp_path: Path, monkeypatch):
    """A seed sweep starts `primebuild run` of one manifest several times at once: each run claims its own
    folder (it was `internal error: FileExistsError` for all but the first)."""
    import threading
    import time

    from primebuild.commands.run import new_run_folder

    monkeypatch.setattr(time, "strftime", lambda _format: "20261207-044937")
    barrier, claimed = threading.Barrier(8), []

    def claim() -> None:
        barrier.wait()
        claimed.append(new_run_folder(tmp_path / "runs", "bash-files"))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    names = sorted(folder.name for folder in claimed)
    assert names == sorted(["bash-files-20261207-044937"] + [f"bash-files-20261207-044937-{n}" for n in range(2, 9)])
    assert all(folder.is_dir() and not any(folder.iterdir()) for folder in claimed)
