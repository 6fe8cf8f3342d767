"""The content-addressed store: immutable build outputs at `<store>/<hash>-<name>`.

Like Nix, an entry is *input-addressed*: its hash is the sha256 of the canonical JSON of what went into
it (name, builder id and version, hashes of input files, parameters), so a build whose inputs hash to an
existing entry is a cache hit without running anything. Unlike Nix we also record a *content hash* of
the output tree at build time and check it before every use, so a hand-edited checkpoint or image is
refused instead of silently reused.

Location: `$PRIMEBUILD_STORE`, else `$XDG_CACHE_HOME/primebuild/store` (`~/.cache/primebuild/store`).
A cache directory is the honest home: every entry can be rebuilt from its inputs, so deleting it costs
time, never correctness; it is per user, so no root and no shared permissions are needed. On a cluster,
point `PRIMEBUILD_STORE` at a shared filesystem so that every node sees the same entries (locks use
`flock`, which NFSv4 supports; Lustre needs the `flock` mount option).

Layout of the store directory:
    <hash>-<name>/              an entry: read-only (files 0444 or 0555 if executable, dirs 0555)
    <hash>-<name>/.primebuild-entry.json   its inputs and the content hash of the rest of the tree
    .locks/<hash>-<name>.lock   one flock per key: concurrent builders of a key wait for each other (an
                                exclusive lock); a running run holds a shared one on each entry it uses,
                                so `gc` keeps them
    .meta/<hash>-<name>.stat    stat fingerprint that makes re-verification cheap (see `verify`)
    .tmp-<hash>-<name>.*        a build in progress (or a leftover from a crash: `gc` removes it)

Verification choice: the first check of an entry (and `primebuild store verify`) re-reads every byte.
It then stores a fingerprint of every file's (path, mode, size, mtime, ctime, inode). Later uses only
`lstat` the tree and compare: the kernel updates ctime on every write and chmod and no user can set it,
so any modification changes the fingerprint and triggers a full re-hash. This keeps a cache hit on a
multi-GB checkpoint as cheap as on a small image. It guards against accidents, not against an attacker
who owns the store directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primebuild.errors import UserError
from primebuild.hashing import canonical_bytes, sha256_file

ENTRY_FILE = ".primebuild-entry.json"
ENTRY_FORMAT = 1
HASH_CHARS = 32  # 128 bits, as Nix truncates: plenty against accidental collisions, short paths
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")
_ENTRY_RE = re.compile(r"^([0-9a-f]{32})-([A-Za-z0-9][A-Za-z0-9._+-]*)$")
_REFERENCE_RE = re.compile(r"[0-9a-f]{32}-[A-Za-z0-9][A-Za-z0-9._+-]*")
_LEFTOVER_RE = re.compile(r"^\.(?:tmp|trash)-([0-9a-f]{32}-[A-Za-z0-9][A-Za-z0-9._+-]*)\.[^.]+$")


def store_key(name: str, inputs: dict[str, Any]) -> str:
    """An entry's directory name `<hash>-<name>`; the hash covers the name and all inputs. Pure: the
    lock computes the keys of entries that are not built yet with it."""
    _check_name(name)
    try:
        blob = canonical_bytes({"name": name, "inputs": inputs})
    except (TypeError, ValueError) as err:
        raise TypeError(f"store inputs for {name!r} must be plain JSON (str, int, list, dict …): {err}") from err
    return f"{hashlib.sha256(blob).hexdigest()[:HASH_CHARS]}-{name}"


def default_store_root() -> Path:
    env = os.environ.get("PRIMEBUILD_STORE")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "primebuild" / "store"


@dataclass(frozen=True)
class StoreEntry:
    """What `.primebuild-entry.json` says about one entry."""

    path: Path
    key: str  # "<hash>-<name>", the directory name
    name: str
    inputs: dict[str, Any]
    content_hash: str  # "sha256:<hex>" over the tree (without the entry file)
    files: list[list[Any]] = field(repr=False, default_factory=list)

    @property
    def hash(self) -> str:
        return self.key.split("-", 1)[0]


@dataclass
class GcReport:
    removed: list[str] = field(default_factory=list)  # entry keys and leftover directory names
    kept: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # subset of removed that failed verification
    in_use: list[str] = field(default_factory=list)  # subset of kept: a build or a run held its lock
    freed_bytes: int = 0


class Store:
    def __init__(self, root: Path | str | None = None):
        self.root = (
            Path(root).expanduser().absolute() if root is not None else default_store_root().absolute()
        )

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    # ---- addressing -------------------------------------------------------------------------------------

    def key(self, name: str, inputs: dict[str, Any]) -> str:
        return store_key(name, inputs)

    def path_of(self, key: str) -> Path:
        if not _ENTRY_RE.match(key):
            raise ValueError(f"not a store key: {key!r} (expected '<32 hex>-<name>')")
        return self.root / key

    def lookup(self, key: str) -> Path | None:
        """The entry's path if it exists and is intact; None when absent; UserError when tampered."""
        path = self.path_of(key)
        if not path.exists():
            return None
        self.verify(path)
        return path

    def resolve(self, ref: str | Path) -> Path:
        """Find an existing entry by key, store path (or a path inside it), hash prefix or name."""
        text = str(ref)
        candidate = Path(text).expanduser()
        if candidate.is_absolute() or "/" in text:
            candidate = candidate.absolute()
            for parent in (candidate, *candidate.parents):
                if parent.parent == self.root and _ENTRY_RE.match(parent.name):
                    return parent
            raise UserError(f"{text} is not inside the store {self.root}")
        if _ENTRY_RE.match(text) and (self.root / text).is_dir():
            return self.root / text
        keys = self._entry_keys()
        matches = [k for k in keys if k.startswith(text) or k.split("-", 1)[1] == text]
        if len(matches) == 1:
            return self.root / matches[0]
        if not matches:
            raise UserError(
                f"no store entry matches {text!r} in {self.root}",
                hint="list entries with `primebuild store ls`",
            )
        listing = ", ".join(matches[:5]) + (" …" if len(matches) > 5 else "")
        raise UserError(f"{text!r} matches several store entries: {listing}", hint="give more of the hash")

    # ---- building ---------------------------------------------------------------------------------------

    def build(self, name: str, inputs: dict[str, Any], builder: Callable[[Path], None]) -> Path:
        """Return the entry for (name, inputs), running `builder(out_dir)` only on a cache miss.

        `builder` fills the empty directory it is given. Its output is sealed (made read-only, content
        hashed) and renamed into place atomically, so readers never see a half-built entry. Concurrent
        builders of one key serialise on a per-key file lock; the second one gets the first one's entry.
        """
        key = self.key(name, inputs)
        hit = self.lookup(key)
        if hit is not None:
            return hit
        try:
            return self._build(key, name, inputs, builder)
        except OSError as err:
            if (problem := self._cannot_write(err)) is None:
                raise
            raise problem from None

    def _build(self, key: str, name: str, inputs: dict[str, Any], builder: Callable[[Path], None]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        with self._locked(key):
            hit = self.lookup(key)  # somebody may have built it while we waited for the lock
            if hit is not None:
                return hit
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}.", dir=self.root))
            try:
                builder(tmp)
                if (tmp / ENTRY_FILE).exists():
                    raise ValueError(f"builder for {name!r} wrote {ENTRY_FILE}, a name the store reserves")
                fingerprint = self._seal(tmp, key, name, inputs)
                os.rename(tmp, self.root / key)
            except BaseException:
                _remove_tree(tmp)
                raise
            self._write_fingerprint(key, fingerprint)
            return self.root / key

    def _cannot_write(self, err: OSError) -> UserError | None:
        """A located error when `err` says the store itself cannot take the build (full, read-only, not a
        folder); None for an error of the builder's own (its inputs), which is not the store's to explain."""
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        inside = err.filename is not None and str(err.filename).startswith(str(self.root))
        if not full and not (inside and err.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)):
            return None
        free = ""
        with contextlib.suppress(OSError):
            folder = next(p for p in (self.root, *self.root.parents) if p.is_dir())
            free = f" ({shutil.disk_usage(folder).free / 2**30:.1f} GiB free there)"
        return UserError(f"the store {self.root} cannot take this build: {err.strerror}{free}; nothing was "
                         "added to it", hint="free space there (`primebuild store gc`), or point --store / "
                         "PRIMEBUILD_STORE at a writable folder with room")

    def _seal(self, tmp: Path, key: str, name: str, inputs: dict[str, Any]) -> str:
        for path in _walk(tmp):
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            if stat.S_ISDIR(st.st_mode):
                if path != tmp:
                    os.chmod(path, 0o555)
            elif stat.S_ISREG(st.st_mode):
                wanted = 0o555 if st.st_mode & 0o111 else 0o444
                if stat.S_IMODE(st.st_mode) != wanted:  # a hard link into another entry: leave its ctime be
                    os.chmod(path, wanted)
            else:
                raise ValueError(f"store entries hold files, dirs and symlinks only; {path} is neither")
        os.chmod(tmp, 0o555)
        before = _stat_fingerprint(tmp)
        files = _content_listing(tmp)
        if _stat_fingerprint(tmp) != before:
            raise RuntimeError(f"the output of {name!r} changed while it was being hashed")
        record = {
            "format": ENTRY_FORMAT,
            "key": key,
            "name": name,
            "inputs": inputs,
            "content_hash": _listing_hash(files),
            "files": files,
        }
        os.chmod(tmp, 0o755)  # just long enough to add the entry file
        entry_file = tmp / ENTRY_FILE
        entry_file.write_bytes(canonical_bytes(record) + b"\n")
        os.chmod(entry_file, 0o444)
        os.chmod(tmp, 0o555)
        return _stat_fingerprint(tmp)

    # ---- verification -----------------------------------------------------------------------------------

    def entry(self, path_or_key: str | Path) -> StoreEntry:
        """Read an entry's record without verifying its content (UserError if the record is unreadable)."""
        path = self._entry_path(path_or_key)
        try:
            record = json.loads((path / ENTRY_FILE).read_bytes())
            return StoreEntry(
                path=path,
                key=record["key"],
                name=record["name"],
                inputs=record["inputs"],
                content_hash=record["content_hash"],
                files=record["files"],
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(
                _broken_message(path, f"its record {ENTRY_FILE} is missing or unreadable ({err})")
            ) from err

    def verify(self, path_or_key: str | Path, *, full: bool = False) -> StoreEntry:
        """Check that an entry is exactly what was built; raise UserError naming what changed if not.

        Cheap when the stat fingerprint recorded at the last full check still matches (see module doc);
        `full=True` always re-reads every byte.
        """
        entry = self.entry(path_or_key)
        path = entry.path
        if entry.key != path.name or self.key(entry.name, entry.inputs) != entry.key:
            raise UserError(_broken_message(path, f"its record {ENTRY_FILE} does not match its inputs"))
        if _listing_hash(entry.files) != entry.content_hash:
            raise UserError(_broken_message(path, f"its record {ENTRY_FILE} was edited"))
        try:
            fingerprint = _stat_fingerprint(path)
            if not full and fingerprint == self._read_fingerprint(entry.key):
                return entry
            actual = _content_listing(path)
        except OSError as err:  # a file made unreadable, or removed while we read
            raise UserError(_broken_message(path, f"{err.filename}: {err.strerror}")) from err
        if _listing_hash(actual) != entry.content_hash:
            raise UserError(_broken_message(path, _describe_changes(entry.files, actual)))
        self._write_fingerprint(entry.key, fingerprint)
        return entry

    def _read_fingerprint(self, key: str) -> str | None:
        with contextlib.suppress(OSError):
            return (self.root / ".meta" / f"{key}.stat").read_text()
        return None

    def _write_fingerprint(self, key: str, fingerprint: str) -> None:
        meta = self.root / ".meta"
        with contextlib.suppress(OSError):  # only a speed-up: a read-only store still works
            meta.mkdir(parents=True, exist_ok=True)
            tmp = meta / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(fingerprint)
            os.replace(tmp, meta / f"{key}.stat")

    # ---- listing and garbage collection -----------------------------------------------------------------

    def ls(self) -> list[StoreEntry | Path]:
        """All entries, sorted by key; a Path for an entry whose record cannot be read (a broken one)."""
        out: list[StoreEntry | Path] = []
        for key in self._entry_keys():
            try:
                out.append(self.entry(key))
            except UserError:
                out.append(self.root / key)
        return out

    def references(self, entry: StoreEntry) -> set[str]:
        """Keys of existing entries named anywhere in this entry's inputs (e.g. a base checkpoint)."""
        text = canonical_bytes(entry.inputs).decode()
        return {k for k in _REFERENCE_RE.findall(text) if k != entry.key and (self.root / k).is_dir()}

    def gc(
        self, keep: Iterable[str | Path] = (), *, broken_only: bool = False, dry_run: bool = False
    ) -> GcReport:
        """Remove broken entries and crash leftovers; unless `broken_only`, also every entry not reachable
        from `keep` (keys, paths or hash prefixes) through the references in entries' inputs.
        Entries whose key lock is held (a build in progress, a running run using it) are never touched;
        one that another gc removed first is skipped."""
        report = GcReport()
        if not self.root.is_dir():
            return report
        live: set[str] = set()
        pending = [self.resolve(ref).name for ref in keep]
        while pending:
            key = pending.pop()
            if key in live:
                continue
            live.add(key)
            with contextlib.suppress(UserError):
                pending.extend(self.references(self.entry(key)))
        for key in self._entry_keys():
            try:
                self.verify(key)
                broken = False
            except UserError:
                broken = True
            if not broken and (broken_only or key in live):
                report.kept.append(key)
                continue
            removed = self._remove(self.root / key, key, report, dry_run)
            if removed and broken:
                report.broken.append(key)
            elif removed is False:
                report.kept.append(key)
                report.in_use.append(key)
        for leftover in sorted(self.root.glob(".tmp-*")) + sorted(self.root.glob(".trash-*")):
            # ".tmp-<key>.<random>" / ".trash-<key>.<pid>": the suffix after the last dot has no dot
            key = _LEFTOVER_RE.match(leftover.name)
            if key:  # not ours otherwise (a name no build or gc writes): left alone
                self._remove(leftover, key.group(1), report, dry_run)
        return report

    def _remove(self, path: Path, key: str, report: GcReport, dry_run: bool) -> bool | None:
        """True: removed; False: its lock is held (a build, a run); None: already gone (another gc)."""
        with self._locked(key, blocking=False) as acquired:
            if not acquired:
                return False
            if not os.path.lexists(path):
                return None
            size = _tree_size(path)
            if not dry_run:
                trash = path
                if not path.name.startswith("."):
                    # Rename first: from here on no reader can find the half-deleted entry.
                    trash = self.root / f".trash-{key}.{os.getpid()}"
                    try:
                        os.rename(path, trash)
                    except FileNotFoundError:
                        return None
                _remove_tree(trash)
                with contextlib.suppress(OSError):
                    (self.root / ".meta" / f"{key}.stat").unlink()
            report.removed.append(path.name)
            report.freed_bytes += size
            return True

    # ---- helpers ----------------------------------------------------------------------------------------

    def _entry_keys(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if _ENTRY_RE.match(p.name) and p.is_dir())

    def _entry_path(self, path_or_key: str | Path) -> Path:
        if isinstance(path_or_key, Path):
            return path_or_key.absolute()
        return self.path_of(path_or_key)

    def hold(self, path: Path) -> int | None:
        """A shared lock on the entry at `path`, held while the returned descriptor is open (the process's
        life at most): `gc` keeps the entry. None when `path` is no entry of this store."""
        path = Path(path).resolve()
        if path.parent != self.root.resolve() or not _ENTRY_RE.match(path.name) or not path.is_dir():
            return None
        try:
            fd = self._lock_file(path.name)
        except OSError:  # a store this user cannot write: nobody here can gc it either
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for a build or a gc of this very key
        return fd

    @contextlib.contextmanager
    def _locked(self, key: str, *, blocking: bool = True) -> Iterator[bool]:
        fd = self._lock_file(key)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    yield False
                    return
                raise
            yield True
        finally:
            os.close(fd)  # closing the descriptor releases the lock


    def _lock_file(self, key: str) -> int:
        """A descriptor of key's lock file, made if missing."""
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        # Read-only is enough for flock, so users sharing a store can lock each other's lock files.
        return os.open(locks / f"{key}.lock", os.O_RDONLY | os.O_CREAT, 0o666)


def hold_entries(paths: Iterable[str | Path]) -> list[int]:
    """Shared locks on every store entry among `paths` (a run's model folders), in the store each lies in:
    `gc` keeps them while the descriptors are open. Paths outside a store are skipped."""
    fds = []
    for path in paths:
        fd = Store(Path(path).resolve().parent).hold(Path(path))
        if fd is not None:
            fds.append(fd)
    return fds


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"store entry name {name!r} must start with a letter or digit and use only letters, digits and ._+-"
        )


def _walk(root: Path) -> Iterator[Path]:
    """root, then everything below it, in sorted order, without following symlinks."""
    yield root
    stack = [root]
    while stack:
        directory = stack.pop()
        children = sorted(os.scandir(directory), key=lambda e: e.name)
        for child in children:
            yield Path(child.path)
        stack.extend(Path(c.path) for c in reversed(children) if c.is_dir(follow_symlinks=False))


def _relative(root: Path, path: Path) -> str:
    return "." if path == root else path.relative_to(root).as_posix()


def _content_listing(root: Path) -> list[list[Any]]:
    """[path, kind, mode, size, sha256 | symlink target] for every node except the entry record."""
    listing: list[list[Any]] = []
    for path in _walk(root):
        rel = _relative(root, path)
        if rel == ENTRY_FILE:
            continue
        st = path.lstat()
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            listing.append([rel, "symlink", 0, 0, os.readlink(path)])
        elif stat.S_ISDIR(st.st_mode):
            listing.append([rel, "dir", mode, 0, ""])
        elif stat.S_ISREG(st.st_mode):
            listing.append([rel, "file", mode, st.st_size, sha256_file(path)])
        else:
            listing.append([rel, "other", mode, 0, ""])
    listing.sort(key=lambda row: row[0])
    return listing


def _listing_hash(listing: list[list[Any]]) -> str:
    return "sha256:" + hashlib.sha256(canonical_bytes(listing)).hexdigest()


def _stat_fingerprint(root: Path) -> str:
    digest = hashlib.sha256()
    for path in _walk(root):
        st = path.lstat()
        rel = _relative(root, path)
        if path == root:  # the final rename changes the root's ctime: its mode is what matters
            row = [rel, st.st_mode]
        else:
            row = [rel, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        digest.update(canonical_bytes(row))
    return digest.hexdigest()


def _describe_changes(recorded: list[list[Any]], actual: list[list[Any]], limit: int = 5) -> str:
    before = {row[0]: row for row in recorded}
    after = {row[0]: row for row in actual}
    changes = []
    for rel in sorted(before.keys() | after.keys()):
        old, new = before.get(rel), after.get(rel)
        if old == new:
            continue
        if old is None:
            changes.append(f"{rel} (added)")
        elif new is None:
            changes.append(f"{rel} (removed)")
        else:
            what = []
            if old[1] != new[1] or old[3:] != new[3:]:
                what.append("content changed")
            if old[2] != new[2]:
                what.append(f"mode {old[2]:o} -> {new[2]:o}")
            changes.append(f"{rel} ({', '.join(what)})")
    shown = ", ".join(changes[:limit])
    if len(changes) > limit:
        shown += f" … and {len(changes) - limit} more"
    return shown or "its content hash does not match"


def _broken_message(path: Path, what: str) -> str:
    return (
        f"store entry {path} was modified after it was built: {what}; "
        "delete it with `primebuild store gc --broken` or rebuild"
    )


def _tree_size(root: Path) -> int:
    total = 0
    for path in _walk(root):
        with contextlib.suppress(OSError):
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def _remove_tree(root: Path) -> None:
    """rmtree for read-only trees: directories must be writable for their children to be unlinked."""
    if not root.exists() and not root.is_symlink():
        return
    for path in _walk(root):
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                os.chmod(path, 0o755)
    shutil.rmtree(root, ignore_errors=False)
