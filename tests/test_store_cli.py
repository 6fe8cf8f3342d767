"""`primebuild store path|ls|verify|gc` through the real command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from primebuild.builders.store import Store
from primebuild.cli import main


def fill(out: Path) -> None:
    (out / "model.safetensors").write_bytes(b"\0" * 2048)
    (out / "config.json").write_text("{}\n")


@pytest.fixture
def store(tmp_path: Path, monkeypatch) -> Store:
    monkeypatch.setenv("PRIMEBUILD_STORE", str(tmp_path / "store"))
    return Store()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_path_ls_and_verify(store: Store, capsys):
    entry = store.build("sft-ckpt", {"step": 1}, fill)

    assert run(capsys, "store", "path") == (0, f"{store.root}\n", "")
    assert run(capsys, "store", "path", "sft-ckpt") == (0, f"{entry}\n", "")
    assert run(capsys, "store", "path", entry.name[:10]) == (0, f"{entry}\n", "")

    code, out, _ = run(capsys, "store", "ls")
    assert code == 0 and entry.name in out and "KiB" in out
    code, out, _ = run(capsys, "store", "ls", "-o", "json")
    listing = json.loads(out)
    assert code == 0 and listing["entries"] == [
        {"key": entry.name, "name": "sft-ckpt", "path": str(entry), "size": 2051, "record": "ok"}
    ]

    code, out, _ = run(capsys, "store", "verify")
    assert code == 0 and out == f"ok      {entry.name}\n"


def test_tampered_entry_fails_verify_and_path_and_is_collected(store: Store, capsys):
    good = store.build("good", {}, fill)
    bad = store.build("bad", {}, fill)
    os.chmod(bad / "config.json", 0o644)
    (bad / "config.json").write_text("{} \n")

    code, out, err = run(capsys, "store", "verify")
    assert code == 2
    assert f"BROKEN  {bad.name}" in out and f"ok      {good.name}" in out
    assert f"error: store entry {bad} was modified after it was built: config.json (content changed" in err
    assert "primebuild store gc --broken" in err and "Traceback" not in err

    code, _, err = run(capsys, "store", "path", "bad")
    assert code == 2 and "was modified after it was built" in err

    code, out, _ = run(capsys, "store", "gc")
    assert code == 2  # refuses to guess what to delete

    code, out, _ = run(capsys, "store", "gc", "--broken", "-o", "json")
    report = json.loads(out)
    assert code == 0 and report["removed"] == [bad.name] and report["broken"] == [bad.name]
    assert good.exists() and not bad.exists()


def test_gc_keep_and_all(store: Store, capsys):
    a = store.build("a", {}, fill)
    b = store.build("b", {}, fill)
    code, out, _ = run(capsys, "store", "gc", "--keep", "a", "--dry-run")
    assert code == 0 and f"would remove {b.name}" in out and b.exists()
    code, out, _ = run(capsys, "store", "gc", "--keep", "a")
    assert code == 0 and f"removed {b.name}" in out and a.exists() and not b.exists()
    code, out, _ = run(capsys, "store", "--store", str(store.root), "gc", "--all")
    assert code == 0 and not a.exists()
    code, out, _ = run(capsys, "store", "ls")
    assert out.startswith("(store ") and "is empty" in out


def test_installed_entrypoint_runs_store_ls(store: Store):
    store.build("x", {}, fill)
    exe = Path(sys.executable).parent / "primebuild"
    if not exe.exists():
        pytest.skip(f"console script {exe} is not installed")
    done = subprocess.run(
        [str(exe), "store", "ls", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PRIMEBUILD_STORE": str(store.root)},
    )
    assert done.returncode == 0, done.stderr
    assert [e["name"] for e in json.loads(done.stdout)["entries"]] == ["x"]
