"""A Debian root filesystem as one normalised layer, from the .deb files the lock pins.

Each pinned .deb is downloaded (or taken from the download cache, where files are named by their
sha256), checked against the lock's sha256, and its file tree is read with `dpkg-deb --fsys-tarfile`.
The trees are merged the way Debian 12's debootstrap lays them out (merged /usr: `/bin`, `/sbin`,
`/lib`, `/lib64` are symlinks into `/usr`, so `lib/x` in a package lands at `usr/lib/x`). Two packages
shipping one path with different contents is an error, as it is for dpkg.

Maintainer scripts never run (they would need the target's own binaries, and what they generate —
ld.so.cache, byte-code, timestamps — is what makes debootstrap output differ between runs). The little
they contribute that Python needs is written directly: `/etc/passwd` and `/etc/group` from
base-passwd's master files (postinst copies them too), and `/var/lib/dpkg/status` from the packages'
control fields, so that tools reading it (e.g. image scanners) see what is installed. The glibc loader
finds `/usr/lib/x86_64-linux-gnu` without ld.so.cache: Debian builds it with the multiarch directories
in its default search path.

Documentation, manual pages and translations are left out, as Debian's slim images do (copyright
files stay). Modes come from the packages; owners, times and order are normalised by oci.py.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

from primebuild.builders.debian_index import fetch, mirror_for
from primebuild.builders.oci import TarEntry
from primebuild.errors import UserError

MERGED = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_DROPPED = ("usr/share/doc/", "usr/share/man/", "usr/share/info/", "usr/share/locale/", "usr/share/lintian/")


def download_cache() -> Path:
    """Downloads named by content: `$PRIMEBUILD_DOWNLOADS`, else `~/.cache/primebuild/downloads`."""
    env = os.environ.get("PRIMEBUILD_DOWNLOADS")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "primebuild" / "downloads"


def fetch_deb(name: str, pin: dict, cache: Path | None = None) -> Path:
    """The .deb of one lock pin, its sha256 checked; downloaded once per machine."""
    cache = cache or download_cache()
    path = cache / "sha256" / pin["sha256"]
    if path.is_file() and _sha256_file(path) == pin["sha256"]:
        return path
    url = f"{mirror_for(pin['archive'])}/{pin['path']}"
    data = fetch(url)
    if hashlib.sha256(data).hexdigest() != pin["sha256"]:
        raise UserError(f"{url} does not match the sha256 the lock pins for {name} {pin['version']}",
                        hint="the mirror serves other bytes than the lock names; re-lock with "
                             "`primebuild lock --update MANIFEST` if the archive changed")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def rootfs_entries(base: dict, cache: Path | None = None) -> list[TarEntry]:
    """Every node of the root filesystem the lock's `base_image` entry pins, merged and normalised."""
    tree: dict[str, TarEntry] = {}
    owner: dict[str, str] = {}
    controls = []
    for name, pin in sorted(base["packages"].items()):
        deb = fetch_deb(name, pin, cache)
        controls.append(_control(deb))
        for entry in _deb_entries(deb):
            old = tree.get(entry.path)
            if old is not None and old.kind != "dir" and (old.kind, old.data, old.target) != \
                    (entry.kind, entry.data, entry.target):
                raise UserError(f"Debian packages {owner[entry.path]} and {name} both ship /{entry.path} "
                                "with different contents")
            if old is None or old.kind != "dir" or entry.kind == "dir":
                tree[entry.path] = entry
                owner[entry.path] = name
    for top in MERGED:
        if any(p.startswith(f"usr/{top}/") for p in tree):
            tree[top] = TarEntry(top, "symlink", 0o777, target=f"usr/{top}")
    for table in ("passwd", "group"):
        master = tree.get(f"usr/share/base-passwd/{table}.master")
        if master is not None:
            tree[f"etc/{table}"] = TarEntry(f"etc/{table}", "file", 0o644, master.data)
    for folder, mode in (("tmp", 0o1777), ("root", 0o700), ("var/lib/dpkg", 0o755)):
        tree.setdefault(folder, TarEntry(folder, "dir", mode))
    status = "\n".join(c.rstrip("\n") + "\nStatus: install ok installed\n" for c in sorted(controls))
    tree["var/lib/dpkg/status"] = TarEntry("var/lib/dpkg/status", "file", 0o644, status.encode())
    return sorted(tree.values(), key=lambda e: e.path)


def _deb_entries(deb: Path) -> list[TarEntry]:
    data = _dpkg_deb("--fsys-tarfile", deb)
    entries: list[TarEntry] = []
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar:
            path = _canonical(member.name)
            if not path or _dropped(path):
                continue
            mode = member.mode & 0o7777
            if member.isdir():
                entries.append(TarEntry(path, "dir", mode))
            elif member.issym():
                entries.append(TarEntry(path, "symlink", 0o777, target=member.linkname))
            elif member.islnk():  # a hard link: the same bytes again (layers hold no links across files)
                entries.append(TarEntry(path, "file", mode, files[_canonical(member.linkname)]))
            elif member.isfile():
                files[path] = tar.extractfile(member).read()  # type: ignore[union-attr]
                entries.append(TarEntry(path, "file", mode, files[path]))
            else:
                raise UserError(f"{deb.name}: /{path} is a device or fifo, which an image layer cannot hold")
    return entries


def _canonical(name: str) -> str:
    path = os.path.normpath("/" + name).lstrip("/")
    if path == ".":
        return ""
    top, _, rest = path.partition("/")
    return f"usr/{top}" + (f"/{rest}" if rest else "") if top in MERGED else path


def _dropped(path: str) -> bool:
    return path.startswith(_DROPPED) and not path.endswith("/copyright") and path + "/" not in _DROPPED


def _control(deb: Path) -> str:
    return _dpkg_deb("--field", deb).decode("utf-8", "replace")


def _dpkg_deb(flag: str, deb: Path) -> bytes:
    try:
        done = subprocess.run(["dpkg-deb", flag, str(deb)], capture_output=True, timeout=300)
    except FileNotFoundError:
        raise UserError("dpkg-deb is not installed: it reads the .deb files of the image's Debian base",
                        hint="apt-get install dpkg (every Debian or Ubuntu machine has it)") from None
    if done.returncode != 0:
        raise UserError(f"dpkg-deb {flag} {deb} failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
