"""The content-addressed store: addressing, sealing, tamper detection, locking and garbage collection."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primebuild.builders.store import ENTRY_FILE, Store, default_store_root
from primebuild.errors import UserError


def write_tree(out: Path) -> None:
    (out / "weights.bin").write_bytes(bytes(range(256)) * 4)
    (out / "step").mkdir()
    (out / "step" / "config.json").write_text('{"hidden": 128}\n')
    (out / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(out / "run.sh", 0o700)
    os.symlink("weights.bin", out / "latest")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


def test_key_depends_on_name_and_inputs_only(store: Store, tmp_path: Path):
    a = store.key("sft", {"lr": 1e-3, "data": "sha256:ab", "builder": {"id": "sft", "version": 1}})
    b = Store(tmp_path / "elsewhere").key(
        "sft", {"builder": {"version": 1, "id": "sft"}, "data": "sha256:ab", "lr": 1e-3}
    )
    assert a == b  # key order and store location do not matter
    assert a.endswith("-sft") and len(a.split("-", 1)[0]) == 32
    assert store.key("sft", {"lr": 2e-3, "data": "sha256:ab", "builder": {"id": "sft", "version": 1}}) != a
    assert store.key("sft2", {"lr": 1e-3, "data": "sha256:ab", "builder": {"id": "sft", "version": 1}}) != a
    with pytest.raises(ValueError):
        store.key("../evil", {})
    with pytest.raises(TypeError):
        store.key("x", {"path": Path("/not/json")})


def test_default_root_comes_from_env(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PRIMEBUILD_STORE", str(tmp_path / "s"))
    assert default_store_root() == tmp_path / "s"
    assert Store().root == tmp_path / "s"
    monkeypatch.delenv("PRIMEBUILD_STORE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_store_root() == tmp_path / "cache" / "primebuild" / "store"


def test_build_then_cache_hit_without_running_builder(store: Store):
    calls = []

    def builder(out: Path) -> None:
        calls.append(out)
        write_tree(out)

    path = store.build("ckpt", {"step": 10}, builder)
    assert path == store.root / store.key("ckpt", {"step": 10})
    assert (path / "weights.bin").read_bytes() == bytes(range(256)) * 4
    assert os.readlink(path / "latest") == "weights.bin"
    assert store.lookup(path.name) == path

    start = time.perf_counter()
    again = store.build("ckpt", {"step": 10}, builder)
    elapsed = time.perf_counter() - start
    print(f"store cache hit in {elapsed * 1e3:.2f} ms")
    assert again == path and len(calls) == 1
    assert elapsed < 1.0
    assert store.lookup(store.key("ckpt", {"step": 11})) is None
    entry = store.verify(path, full=True)
    assert entry.inputs == {"step": 10} and entry.name == "ckpt" and entry.content_hash.startswith("sha256:")
    assert not any(p.name.startswith(".tmp-") for p in store.root.iterdir())


def test_entries_are_read_only(store: Store):
    path = store.build("ckpt", {}, write_tree)
    modes = {
        p.relative_to(path).as_posix(): stat.S_IMODE(p.lstat().st_mode)
        for p in [path, *path.rglob("*")]
        if not p.is_symlink()
    }
    assert modes == {
        ".": 0o555,
        "weights.bin": 0o444,
        "step": 0o555,
        "step/config.json": 0o444,
        "run.sh": 0o555,
        ENTRY_FILE: 0o444,
    }


def test_tampered_content_is_refused_with_a_clear_message(store: Store):
    path = store.build("ckpt", {}, write_tree)
    store.lookup(path.name)  # records the fast-path fingerprint
    target = path / "step" / "config.json"
    os.chmod(target, 0o644)
    data = bytearray(target.read_bytes())
    data[2] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(UserError) as err:
        store.lookup(path.name)
    message = str(err.value)
    assert f"store entry {path} was modified after it was built" in message
    assert "step/config.json (content changed, mode 444 -> 644)" in message
    assert "primebuild store gc --broken" in message
    with pytest.raises(UserError):  # building the same key must not silently reuse it either
        store.build("ckpt", {}, write_tree)


def test_same_size_edit_with_restored_mtime_is_still_caught_by_the_fast_path(store: Store):
    path = store.build("ckpt", {}, write_tree)
    store.verify(path)
    target = path / "weights.bin"
    before = target.stat()
    os.chmod(target, 0o644)
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    os.chmod(target, 0o444)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # mode, size, mtime as before; ctime is not
    with pytest.raises(UserError, match="weights.bin"):
        store.verify(path)


@pytest.mark.parametrize("tamper", ["chmod", "add", "remove", "record"])
def test_other_kinds_of_tampering(store: Store, tamper: str):
    path = store.build("ckpt", {"k": tamper}, write_tree)
    os.chmod(path, 0o755)
    if tamper == "chmod":
        os.chmod(path / "weights.bin", 0o644)
        expected = "weights.bin (mode 444 -> 644)"
    elif tamper == "add":
        (path / "extra.txt").write_text("x")
        expected = "extra.txt (added)"
    elif tamper == "remove":
        (path / "run.sh").unlink()
        expected = "run.sh (removed)"
    else:
        os.chmod(path / ENTRY_FILE, 0o644)
        (path / ENTRY_FILE).write_text((path / ENTRY_FILE).read_text().replace('"k":"record"', '"k":"other"'))
        expected = "does not match its inputs"
    os.chmod(path, 0o555)
    with pytest.raises(UserError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        store.verify(path)


def test_failed_build_leaves_nothing(store: Store):
    def broken_builder(out: Path) -> None:
        (out / "half.bin").write_bytes(b"x")
        os.chmod(out, 0o555)  # even a read-only leftover must be cleaned up
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        store.build("ckpt", {}, broken_builder)
    assert [p.name for p in store.root.iterdir() if not p.name.startswith((".locks", ".meta"))] == []
    assert store.build("ckpt", {}, write_tree).is_dir()


BUILD_SCRIPT = """
import sys, time
from pathlib import Path
from primebuild.builders.store import Store

def builder(out):
    with open(sys.argv[2], "a") as f:
        f.write("built\\n")
    time.sleep(0.5)  # long enough for the other processes to reach the lock
    (out / "weights.bin").write_bytes(b"w" * 1024)

print(Store(sys.argv[1]).build("shared", {"v": 1}, builder))
"""


def test_concurrent_builders_of_one_key_build_once(tmp_path: Path):
    root, counter = str(tmp_path / "store"), str(tmp_path / "counter")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD_SCRIPT, root, counter], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    paths = [proc.communicate(timeout=60)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0]
    assert len(set(paths)) == 1 and paths[0]
    assert Path(counter).read_text() == "built\n"
    Store(root).verify(Path(paths[0]), full=True)


def test_resolve_by_key_prefix_name_and_path(store: Store):
    a = store.build("alpha", {}, write_tree)
    b = store.build("beta", {}, write_tree)
    assert store.resolve(a.name) == a
    assert store.resolve(a.name[:8]) == a
    assert store.resolve("beta") == b
    assert store.resolve(b / "step" / "config.json") == b
    with pytest.raises(UserError, match="no store entry matches"):
        store.resolve("gamma")


def test_gc_keeps_roots_and_what_they_reference(store: Store):
    base = store.build("base", {}, write_tree)
    sft = store.build("sft", {"base": base.name}, write_tree)  # references base through its inputs
    other = store.build("other", {}, write_tree)
    broken = store.build("broken", {}, write_tree)
    os.chmod(broken / "weights.bin", 0o644)
    leftover = store.root / f".tmp-{store.key('crashed', {})}.abc123"
    leftover.mkdir()
    (leftover / "f").write_text("x")
    os.chmod(leftover, 0o555)

    dry = store.gc(broken_only=True, dry_run=True)
    assert (
        sorted(dry.removed) == sorted([broken.name, leftover.name]) and broken.exists() and leftover.exists()
    )

    report = store.gc(broken_only=True)
    assert report.broken == [broken.name] and not broken.exists() and not leftover.exists()
    assert base.exists() and sft.exists() and other.exists()

    report = store.gc(keep=[sft.name])
    assert report.removed == [other.name]
    assert sorted(report.kept) == sorted([base.name, sft.name])
    assert base.exists() and sft.exists() and not other.exists()
    assert not list(store.root.glob(".trash-*"))


def test_gc_skips_an_entry_whose_build_is_running(store: Store):
    path = store.build("busy", {}, write_tree)
    with store._locked(path.name):
        report = store.gc()
    assert report.removed == [] and path.exists()
    assert store.gc().removed == [path.name]


def test_gc_keeps_what_a_run_holds_and_skips_what_another_gc_removed(store: Store, tmp_path: Path):
    """A running run holds a shared lock on its model's entry (supervisor.py): gc removed it from under the
    run before. Two gcs at once: the loser found entries gone (internal error: FileNotFoundError)."""
    held = store.build("model", {}, write_tree)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from primebuild.builders.store import hold_entries\n"
                               f"hold_entries([{str(held)!r}]); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        report = store.gc(dry_run=True)
        assert report.in_use == [held.name] and report.removed == []
        assert store.gc().in_use == [held.name] and held.exists()
    finally:
        holder.kill()
        holder.wait()
    assert store.gc().removed == [held.name]  # the run ended: its lock went with its process

    for i in range(300):
        store.build(f"e{i}", {}, lambda out: (out / "f").write_text("x"))
    gcs = [subprocess.Popen([sys.executable, "-m", "primebuild.cli", "store", "--store", str(store.root), "gc",
                             "--all", "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for _ in range(2)]
    results = [(gc.wait(120), *gc.communicate()) for gc in gcs]
    assert all(code == 0 for code, _, _ in results), results
    removed = [name for _, out, _ in results for name in json.loads(out)["removed"]]
    assert len(removed) == len(set(removed)) == 300 and store.ls() == []


def test_an_unreadable_entry_is_broken_and_a_stray_leftover_is_left_alone(store: Store, monkeypatch):
    import primebuild.builders.store as store_module

    path = store.build("locked", {}, write_tree)
    stray = store.root / ".tmp-not-ours"  # no build writes this name: gc leaves it (it was an IndexError)
    stray.mkdir()

    def unreadable(file):
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr(store_module, "sha256_file", unreadable)
    with pytest.raises(UserError, match=r"-locked/\w+\.\w+: Permission denied"):
        store.verify(path, full=True)
    os.utime(path / "weights.bin")  # a change the fingerprint sees: gc re-reads the entry, and cannot
    report = store.gc(broken_only=True)
    assert report.broken == [path.name] and stray.exists()


def test_a_store_that_cannot_take_a_build_is_a_located_error_and_keeps_nothing(tmp_path: Path):
    """A full, read-only or misplaced store was `internal error: OSError`, exit 1."""
    import errno

    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError, match=r"a-file/store cannot take this build: Not a directory"):
        Store(tmp_path / "a-file" / "store").build("x", {}, write_tree)

    def fills_the_disk(out: Path) -> None:
        (out / "part").write_bytes(b"x" * 1024)
        raise OSError(errno.ENOSPC, "No space left on device")

    store = Store(tmp_path / "store")
    with pytest.raises(UserError, match=r"cannot take this build: No space left on device \(.* GiB free there\)"):
        store.build("big", {}, fills_the_disk)
    assert store.ls() == [] and not list(store.root.glob(".tmp-*"))

    def reads_a_missing_input(out: Path) -> None:
        (tmp_path / "no-such-input").read_text()

    with pytest.raises(FileNotFoundError):  # the builder's own error stays its own
        store.build("other", {}, reads_a_missing_input)
