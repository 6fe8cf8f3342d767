"""Bit-reproducible OCI image layouts, written without a container engine.

Everything that could differ between two machines building the same content is pinned:
- tar layers: entries sorted by path, parent directories added explicitly, mtime fixed (the caller's
  SOURCE_DATE_EPOCH, else 0), uid/gid 0, empty user/group names, modes 0644/0755 decided by the
  caller, PAX format without atime/ctime records;
- gzip: Python's gzip with mtime 0, no file name, compression level 6 (deflate output also depends on
  the zlib implementation: stock zlib gives the same bytes everywhere; zlib-ng would not);
- JSON (config, manifest, index): canonical, i.e. sorted keys and no spaces.

Spec: https://github.com/opencontainers/image-spec (image-layout.md, manifest.md, config.md).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from primebuild.errors import UserError
from primebuild.hashing import canonical_bytes

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
REF_NAME = "org.opencontainers.image.ref.name"
GZIP_LEVEL = 6

# Docker media types name the same bytes; an OCI manifest must use the OCI names.
_DOCKER_TO_OCI = {
    "application/vnd.docker.distribution.manifest.v2+json": MEDIA_MANIFEST,
    "application/vnd.docker.distribution.manifest.list.v2+json": MEDIA_INDEX,
    "application/vnd.docker.container.image.v1+json": MEDIA_CONFIG,
    "application/vnd.docker.image.rootfs.diff.tar.gzip": MEDIA_LAYER_GZIP,
    "application/vnd.docker.image.rootfs.diff.tar": MEDIA_LAYER_TAR,
}
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def rfc3339(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str  # "sha256:<hex>"
    size: int
    annotations: dict[str, str] | None = None
    platform: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        if self.platform:
            out["platform"] = dict(self.platform)
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Descriptor:
        return cls(
            media_type=_DOCKER_TO_OCI.get(obj["mediaType"], obj["mediaType"]),
            digest=obj["digest"],
            size=int(obj["size"]),
            annotations=obj.get("annotations"),
            platform=obj.get("platform"),
        )


@dataclass(frozen=True)
class TarEntry:
    """One node of a layer. `path` is relative to the image root, posix, without a leading slash."""

    path: str
    kind: str = "file"  # "file" | "dir" | "symlink"
    mode: int = 0o644
    data: bytes = b""
    target: str = ""  # symlink target
    source: str | None = None  # a file to read `data` from when the layer is written (large trees)


@dataclass(frozen=True)
class Layer:
    descriptor: Descriptor  # the compressed blob
    diff_id: str  # sha256 of the uncompressed tar
    created_by: str  # what the layer holds, for the config history


@dataclass
class BaseImage:
    """An image read from a local OCI layout, ready to be extended."""

    layout: Path
    manifest_digest: str
    config: dict[str, Any]
    layers: list[Descriptor] = field(default_factory=list)


class _Counting:
    """A write-only file that hashes and counts what passes through it on the way to `sink`."""

    def __init__(self, sink: BinaryIO | None):
        self.sink = sink
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.sink is not None:
            self.sink.write(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


class OciLayout:
    """A directory in OCI image-layout format: `oci-layout`, `index.json`, `blobs/sha256/<hex>`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.blobs = self.root / "blobs" / "sha256"
        self.blobs.mkdir(parents=True, exist_ok=True)
        (self.root / "oci-layout").write_bytes(canonical_bytes({"imageLayoutVersion": "1.0.0"}))

    def blob_path(self, digest: str) -> Path:
        return self.blobs / digest.removeprefix("sha256:")

    def write_blob(self, data: bytes, media_type: str) -> Descriptor:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        path = self.blob_path(digest)
        if not path.exists():
            tmp = self.blobs / f".tmp-{os.getpid()}-{digest[7:19]}"
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return Descriptor(media_type, digest, len(data))

    def write_json(self, obj: dict[str, Any], media_type: str) -> Descriptor:
        return self.write_blob(canonical_bytes(obj), media_type)

    def write_layer(self, entries: list[TarEntry], *, mtime: int, created_by: str, compress: bool = True) -> Layer:
        """Write a tar layer of `entries` (parents added), gzip-compressed unless `compress` is False, and
        return its descriptors. Uncompressed suits the large layers (Debian base, Python packages): gzip -6
        of the 1 GB Python layer took 97 s here (-1: 27 s), and its bytes would depend on the zlib build;
        a tar's digest depends only on its files (`skopeo copy --dest-compress` compresses for a push)."""
        fd, tmp_name = tempfile.mkstemp(prefix=".tmp-layer-", dir=self.blobs)
        try:
            with os.fdopen(fd, "wb") as raw:
                written = _Counting(raw)
                if compress:
                    with gzip.GzipFile(
                        filename="", mode="wb", fileobj=written, compresslevel=GZIP_LEVEL, mtime=0
                    ) as gz:
                        uncompressed = _Counting(gz)
                        _write_tar(uncompressed, entries, mtime)
                else:
                    uncompressed = written
                    _write_tar(uncompressed, entries, mtime)
            os.replace(tmp_name, self.blob_path(written.digest))
        except BaseException:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
            raise
        media = MEDIA_LAYER_GZIP if compress else MEDIA_LAYER_TAR
        return Layer(Descriptor(media, written.digest, written.size), uncompressed.digest, created_by)

    def link_blob(self, source: Path, descriptor: Descriptor) -> None:
        """Put a blob built elsewhere (a layer's store entry) into this layout: a hard link where the
        filesystem allows (store entries are immutable), else a copy; its digest is checked by the store."""
        dst = self.blob_path(descriptor.digest)
        if dst.exists():
            return
        try:
            os.link(source, dst)
        except OSError:
            tmp = self.blobs / f".tmp-link-{os.getpid()}"
            shutil.copyfile(source, tmp)
            os.replace(tmp, dst)

    def copy_blob(self, source: Path, descriptor: Descriptor) -> None:
        """Copy a blob from another layout, checking that its bytes match its digest."""
        src = Path(source) / "blobs" / "sha256" / descriptor.digest.removeprefix("sha256:")
        dst = self.blob_path(descriptor.digest)
        if dst.exists():
            return
        tmp = self.blobs / f".tmp-copy-{os.getpid()}"
        sha = hashlib.sha256()
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(1 << 20):
                sha.update(chunk)
                fout.write(chunk)
        if "sha256:" + sha.hexdigest() != descriptor.digest:
            tmp.unlink()
            raise UserError(
                f"blob {src} does not match its digest {descriptor.digest}: the base layout is corrupt"
            )
        os.replace(tmp, dst)

    def write_index(self, manifests: list[Descriptor]) -> None:
        index = {"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [m.to_json() for m in manifests]}
        (self.root / "index.json").write_bytes(canonical_bytes(index))


def _write_tar(out: _Counting, entries: list[TarEntry], mtime: int) -> None:
    by_path: dict[str, TarEntry] = {}
    for entry in entries:
        path = entry.path.strip("/")
        if not path or ".." in path.split("/"):
            raise ValueError(f"bad path in layer: {entry.path!r}")
        by_path[path] = entry
        parts = path.split("/")
        for i in range(1, len(parts)):  # every parent directory gets an explicit, fixed entry
            by_path.setdefault("/".join(parts[:i]), TarEntry("/".join(parts[:i]), "dir", 0o755))
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[arg-type]
        for path in sorted(by_path):
            entry = by_path[path]
            info = tarfile.TarInfo(path)
            info.mtime = mtime
            info.mode = entry.mode
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if entry.kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif entry.kind == "symlink":
                info.type = tarfile.SYMTYPE
                info.linkname = entry.target
                info.mode = 0o777  # what every tool shows for a symlink; its mode is never used
                tar.addfile(info)
            elif entry.kind == "file" and entry.source is not None:
                with open(entry.source, "rb") as data:
                    info.size = os.fstat(data.fileno()).st_size
                    tar.addfile(info, data)
            elif entry.kind == "file":
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
            else:
                raise ValueError(f"unknown layer entry kind {entry.kind!r} for {path}")


# ---- reading a base image from a local layout ---------------------------------------------------------------


def parse_oci_reference(ref: str) -> tuple[Path, str | None, str | None] | None:
    """`oci:DIR`, `oci:DIR:TAG` or `oci:DIR@sha256:…` -> (dir, tag, digest); None for anything else."""
    if not ref.startswith("oci:"):
        return None
    rest = ref[4:]
    if "@" in rest:
        directory, _, digest = rest.rpartition("@")
        if not _DIGEST_RE.match(digest):
            raise UserError(f"base image {ref!r}: {digest!r} is not a sha256 digest")
        return Path(directory), None, digest
    directory, sep, tag = rest.rpartition(":")
    if sep and "/" not in tag and directory:
        return Path(directory), tag, None
    return Path(rest), None, None


def read_base_image(ref: str, *, architecture: str, os_name: str) -> BaseImage:
    parsed = parse_oci_reference(ref)
    if parsed is None:
        raise ValueError(f"not a local OCI layout reference: {ref!r}")
    layout, tag, digest = parsed
    index_file = layout / "index.json"
    if not index_file.is_file():
        raise UserError(
            f"base image {ref!r}: {index_file} does not exist; expected an OCI image layout directory"
        )
    index = json.loads(index_file.read_bytes())
    candidates = [Descriptor.from_json(m) for m in index.get("manifests", [])]
    if digest:
        chosen = [m for m in candidates if m.digest == digest]
    elif tag:
        chosen = [m for m in candidates if (m.annotations or {}).get(REF_NAME) == tag]
    else:
        chosen = candidates
    if len(chosen) != 1:
        tags = sorted((m.annotations or {}).get(REF_NAME, m.digest) for m in candidates)
        what = "no" if not chosen else "several"
        raise UserError(
            f"base image {ref!r}: {what} matching image in {layout} (it has: {', '.join(tags) or 'none'})",
            hint="name one with oci:DIR:TAG or oci:DIR@sha256:…",
        )
    descriptor = chosen[0]
    if descriptor.media_type == MEDIA_INDEX:  # a multi-platform image: pick ours
        nested = [Descriptor.from_json(m) for m in _read_blob_json(layout, descriptor)["manifests"]]
        matching = [
            m
            for m in nested
            if (m.platform or {}).get("architecture") == architecture
            and (m.platform or {}).get("os") == os_name
        ]
        if not matching:
            raise UserError(f"base image {ref!r} has no {os_name}/{architecture} variant")
        descriptor = matching[0]
    manifest = _read_blob_json(layout, descriptor)
    config = _read_blob_json(layout, Descriptor.from_json(manifest["config"]))
    layers = [Descriptor.from_json(d) for d in manifest.get("layers", [])]
    if len(layers) != len(config.get("rootfs", {}).get("diff_ids", [])):
        raise UserError(f"base image {ref!r}: manifest and config disagree on the number of layers")
    return BaseImage(layout=layout, manifest_digest=descriptor.digest, config=config, layers=layers)


def _read_blob_json(layout: Path, descriptor: Descriptor) -> dict[str, Any]:
    path = layout / "blobs" / "sha256" / descriptor.digest.removeprefix("sha256:")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UserError(f"OCI layout {layout}: missing blob {descriptor.digest}") from err
    if "sha256:" + hashlib.sha256(data).hexdigest() != descriptor.digest:
        raise UserError(f"OCI layout {layout}: blob {descriptor.digest} does not match its digest")
    return json.loads(data)
