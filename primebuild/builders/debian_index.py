"""Pin a Debian root filesystem: a package set resolved from the archive's signed index, for the lock.

`image.base: deb:bookworm` asks for a base assembled from Debian packages (the seeds below plus
`image.packages`, with everything they depend on). Locking reads the archive's `InRelease` (checked
with `gpgv` against the Debian archive keyring when both are installed), the `Packages.xz` index it
names (checked against the sha256 InRelease gives), and records for every package of the dependency
closure its version, the sha256 and size of its .deb and its path in the pool. Building
(debian_rootfs.py) then downloads exactly those files and refuses any other bytes.

The suites are the release plus its `-updates` and `-security` suites, the newest version winning, as
apt sees them. Where to download from is not part of the lock (a .deb is identified by its sha256):
the mirrors come from apt's own configuration on this machine, or from $PRIMEBUILD_DEBIAN_MIRROR and
$PRIMEBUILD_DEBIAN_SECURITY_MIRROR.

Dependency resolution follows Depends and Pre-Depends, taking the first alternative that exists (or
is already chosen), else a virtual package's provider of highest Priority (then by name); Recommends are left out, as
with `apt-get --no-install-recommends`. Essential packages are not pulled in implicitly: maintainer
scripts never run in this base (see debian_rootfs.py), and only the seeds' closure is needed to run
Python.
"""

from __future__ import annotations

import glob
import hashlib
import lzma
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from primebuild.errors import UserError

SCHEME = "deb:"
ARCHITECTURE = "amd64"
# What Python needs to start and to load manylinux wheels (libstdc++ and libgcc_s are on the
# manylinux allow-list: wheels expect the system's), a /bin/sh, /etc/os-release, and the users and
# groups base-passwd's master files define.
SEEDS = ("python3", "libstdc++6", "libgcc-s1", "dash", "base-files", "base-passwd")
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
_TIMEOUT_S = 120
_RELEASE_RE = re.compile(r"^[a-z]+$")


def is_debian_base(ref: str) -> bool:
    return ref.startswith(SCHEME)


def release_of(ref: str) -> str:
    release = ref[len(SCHEME):]
    if not _RELEASE_RE.match(release):
        raise UserError(f"image.base {ref!r}: expected deb:<release>, e.g. deb:bookworm")
    return release


def suites(release: str) -> list[tuple[str, str]]:
    """(archive, suite) pairs that make up a release as apt sees it."""
    return [("debian", release), ("debian", f"{release}-updates"), ("debian-security", f"{release}-security")]


# ---- where the archive is -------------------------------------------------------------------------------


def mirrors() -> dict[str, str]:
    """{archive: base URL} from $PRIMEBUILD_DEBIAN_MIRROR / $PRIMEBUILD_DEBIAN_SECURITY_MIRROR, else from
    the URIs apt's sources name (deb822 `.sources` files and one-line `sources.list` entries)."""
    found: dict[str, str] = {}
    for uri in _apt_uris():
        archive = "debian-security" if uri.rstrip("/").endswith("debian-security") else \
            "debian" if uri.rstrip("/").endswith("/debian") else None
        if archive:
            found.setdefault(archive, uri.rstrip("/"))
    for archive, var in (("debian", "PRIMEBUILD_DEBIAN_MIRROR"),
                         ("debian-security", "PRIMEBUILD_DEBIAN_SECURITY_MIRROR")):
        if os.environ.get(var):
            found[archive] = os.environ[var].rstrip("/")
    return found


def mirror_for(archive: str) -> str:
    url = mirrors().get(archive)
    if url is None:
        var = "PRIMEBUILD_DEBIAN_SECURITY_MIRROR" if archive == "debian-security" else "PRIMEBUILD_DEBIAN_MIRROR"
        raise ArchiveUnreachable(f"no mirror of the Debian archive {archive!r} is configured here",
                        hint=f"set {var} to its URL (apt's sources on a Debian machine name one)")
    return url


def _apt_uris() -> list[str]:
    uris: list[str] = []
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        text = Path(path).read_text(errors="replace")
        for stanza in re.split(r"\n\s*\n", text):
            fields = dict(re.findall(r"^([A-Za-z-]+):[ \t]*(.*)$", stanza, re.M))
            if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no":
                uris += fields.get("URIs", "").split()
    for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
        if os.path.isfile(path):
            for line in Path(path).read_text(errors="replace").splitlines():
                words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
                if len(words) >= 3 and words[0] == "deb":
                    uris.append(words[1])
    return uris


class ArchiveUnreachable(UserError):
    """The archive could not be read (network): a lock records it as not pinned, a build stops."""


def fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
            return response.read()
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", None) or err
        raise ArchiveUnreachable(f"cannot download {shown_url(url)}: {reason}") from None


def shown_url(url: str) -> str:
    """`url` without its user and password (a mirror may carry them): what messages and locks may say."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


# ---- the signed index ------------------------------------------------------------------------------------


def read_index(archive: str, suite: str, base_url: str) -> tuple[str, dict]:
    """(the Packages text, facts about it) for one suite's main component, every byte checked."""
    in_release = fetch(f"{base_url}/dists/{suite}/InRelease")
    body, verified = _verify_release(in_release, suite)
    name = f"main/binary-{ARCHITECTURE}/Packages.xz"
    match = re.search(rf"^ ([0-9a-f]{{64}})\s+(\d+)\s+{re.escape(name)}$",
                      body.split("\nSHA256:", 1)[-1], re.M)
    if not match:
        raise UserError(f"{shown_url(base_url)}/dists/{suite}/InRelease lists no sha256 for {name}")
    packages_xz = fetch(f"{base_url}/dists/{suite}/{name}")
    if hashlib.sha256(packages_xz).hexdigest() != match.group(1):
        raise UserError(f"{shown_url(base_url)}/dists/{suite}/{name} does not match the sha256 its InRelease gives")
    date = re.search(r"^Date: (.*)$", body, re.M)
    facts = {"archive": archive, "date": date.group(1) if date else None,
             "packages_xz_sha256": match.group(1), "signature": verified}
    return lzma.decompress(packages_xz).decode("utf-8", "replace"), facts


def _verify_release(data: bytes, suite: str) -> tuple[str, str]:
    """The signed text of an InRelease file and how it was checked."""
    gpgv = shutil.which("gpgv")
    if gpgv and KEYRING.is_file():
        done = subprocess.run([gpgv, "--keyring", str(KEYRING), "--output", "-", "-"], input=data,
                              capture_output=True, timeout=60)
        if done.returncode != 0:
            raise UserError(f"the InRelease file of {suite} does not carry a valid Debian archive signature: "
                            f"{done.stderr.decode(errors='replace').strip()[-300:]}")
        return done.stdout.decode("utf-8", "replace"), "gpgv: Debian archive keyring"
    text = data.decode("utf-8", "replace")
    body = text.split("\n\n", 1)[-1].split("-----BEGIN PGP SIGNATURE-----", 1)[0]
    return body, "not checked (gpgv or debian-archive-keyring missing)"


# ---- resolution ------------------------------------------------------------------------------------------


class PackageIndex:
    """The newest stanza of every package over a release's suites, parsed lazily (63,000 stanzas: a
    full deb822 parse takes ~30 s in pure Python, a split and two regexes well under a second)."""

    def __init__(self) -> None:
        self.stanzas: dict[str, tuple[str, str]] = {}  # name -> (archive, stanza text)
        self.providers: dict[str, list[str]] = {}

    def add(self, archive: str, text: str) -> None:
        from debian.debian_support import Version

        for stanza in text.split("\n\n"):
            name = re.match(r"Package: (\S+)", stanza)
            if not name:
                continue
            old = self.stanzas.get(name.group(1))
            if old is not None and Version(_field(old[1], "Version")) >= Version(_field(stanza, "Version")):
                continue
            self.stanzas[name.group(1)] = (archive, stanza)
            provides = re.search(r"^Provides: (.*)$", stanza, re.M)
            for item in (provides.group(1).split(",") if provides else []):
                self.providers.setdefault(item.split("(")[0].strip(), []).append(name.group(1))

    def closure(self, seeds: list[str]) -> dict[str, dict]:
        """{name: pin} of `seeds` and everything they depend on (see the module docstring)."""
        from debian.deb822 import PkgRelation
        from debian.debian_support import Version

        chosen: dict[str, dict] = {}
        todo = list(seeds)
        while todo:
            name = todo.pop(0)
            if name in chosen:
                continue
            if name not in self.stanzas:
                raise UserError(f"Debian package {name!r} is not in the archive's index",
                                hint="check the name in image.packages (`apt-cache show NAME`)")
            archive, stanza = self.stanzas[name]
            chosen[name] = {"version": _field(stanza, "Version"), "sha256": _field(stanza, "SHA256"),
                            "size": int(_field(stanza, "Size")), "path": _field(stanza, "Filename"),
                            "archive": archive}
            relations = " , ".join(v for v in (_field(stanza, "Pre-Depends", ""), _field(stanza, "Depends", ""))
                                   if v)
            for alternatives in PkgRelation.parse_relations(relations) if relations else []:
                names = [a["name"] for a in alternatives]
                if any(n in chosen for n in names):
                    continue
                pick = next((a for a in alternatives if a["name"] in self.stanzas), None)
                if pick is None:
                    providers = sorted((p for n in names for p in self.providers.get(n, [])), key=self._rank)
                    if not providers:
                        raise UserError(f"Debian package {name} depends on {' | '.join(names)}, which nothing "
                                        "in the index provides")
                    todo.append(providers[0])
                    continue
                if pick.get("version"):
                    op, wanted = pick["version"]
                    have = Version(_field(self.stanzas[pick["name"]][1], "Version"))
                    if not _satisfies(have, op, Version(wanted)):
                        raise UserError(f"Debian package {name} needs {pick['name']} ({op} {wanted}); the "
                                        f"index has {have}")
                todo.append(pick["name"])
        return dict(sorted(chosen.items()))


    def _rank(self, name: str) -> tuple[int, str]:
        """Providers of a virtual package, as apt prefers them: higher priority first, then by name."""
        priority = _field(self.stanzas[name][1], "Priority", "optional")
        return (_PRIORITIES.get(priority, len(_PRIORITIES)), name)


_PRIORITIES = {"required": 0, "important": 1, "standard": 2, "optional": 3, "extra": 4}


def _satisfies(have, op: str, wanted) -> bool:
    return {"<<": have < wanted, "<=": have <= wanted, "=": have == wanted, ">=": have >= wanted,
            ">>": have > wanted}[op]


def _field(stanza: str, name: str, default: str | None = None) -> str:
    match = re.search(rf"^{name}: (.*)$", stanza, re.M)
    if match:
        return match.group(1).strip()
    if default is None:
        raise UserError(f"a stanza of the Debian index has no {name} field: {stanza[:80]!r}")
    return default


def python_version(pins: dict[str, dict]) -> str | None:
    """'3.11' from the pinned `python3` package's version (3.11.2-1+b1)."""
    version = pins.get("python3", {}).get("version", "")
    match = re.match(r"(\d+\.\d+)", version)
    return match.group(1) if match else None


def pin(ref: str, packages: list[str]) -> dict:
    """The lock entry of a `deb:<release>` base: every package's version, sha256, size and pool path."""
    release = release_of(ref)
    index = PackageIndex()
    facts = {}
    for archive, suite in suites(release):
        text, facts[suite] = read_index(archive, suite, mirror_for(archive))
        index.add(archive, text)
    pins = index.closure([*SEEDS, *packages])
    return {"pinned": True, "kind": "debian", "release": release, "architecture": ARCHITECTURE,
            "suites": facts, "python": python_version(pins), "packages": pins}
