"""Real OCI tools accept the layouts we write: skopeo (inspect, copy) and umoci (stat, unpack).

Install them with `apt-get install -y skopeo umoci` (Debian package names).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from cluster_helpers import missing

from primebuild.builders.image import ImageSpec, build_image, build_image_in_store
from primebuild.builders.store import Store

pytestmark = pytest.mark.cluster

REQUIREMENTS = "click==8.1.7 --hash=sha256:ae74fb96c20a0277a1d615f1e4d73c8414f5a98db8b799a7931d1582f3390c28\n"


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        missing(f"{tool} is not installed (apt-get install -y {tool}; scripts/bootstrap --test does it as root)")
    return path


def run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stderr}"
    return done.stdout


@pytest.fixture
def image(tmp_path: Path):
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "__init__.py").write_text("VERSION = 1\n")
    (project / "tool.sh").write_text("#!/bin/sh\necho ok\n")
    os.chmod(project / "tool.sh", 0o755)
    os.symlink("pkg/__init__.py", project / "link.py")
    plan = tmp_path / "plan.json"
    plan.write_text('{"processes":[]}')
    spec = ImageSpec(
        requirements=REQUIREMENTS,
        project_dir=project,
        files=("pkg/__init__.py", "tool.sh", "link.py"),
        plan=plan,
        plan_hash="sha256:" + "cd" * 32,
        tag="v1",
    )
    return build_image_in_store(spec, Store(tmp_path / "store"))


def test_skopeo_inspects_and_copies_the_layout(image, tmp_path: Path):
    skopeo = need("skopeo")
    info = json.loads(run(skopeo, "inspect", f"oci:{image.layout_path}:v1"))
    assert info["Digest"] == image.digest
    assert info["Layers"] == [layer.digest for layer in image.layers]
    assert info["Labels"]["dev.primebuild.plan.sha256"] == "sha256:" + "cd" * 32
    assert info["Created"] == "1970-01-01T00:00:00Z"
    raw = run(skopeo, "inspect", "--raw", f"oci:{image.layout_path}:v1")
    assert raw.encode() == (image.layout_path / "blobs/sha256" / image.digest[7:]).read_bytes()
    # A copy re-reads and checks every blob; between two layouts it keeps the manifest as is.
    run(
        skopeo,
        "--insecure-policy",
        "copy",
        "-q",
        f"oci:{image.layout_path}:v1",
        f"oci:{tmp_path / 'copy'}:v1",
    )
    assert json.loads(run(skopeo, "inspect", f"oci:{tmp_path / 'copy'}:v1"))["Digest"] == image.digest
    run(
        skopeo,
        "--insecure-policy",
        "copy",
        "-q",
        f"oci:{image.layout_path}:v1",
        f"docker-archive:{tmp_path / 'image.tar'}:primebuild:v1",
    )
    assert (tmp_path / "image.tar").stat().st_size > 0


def test_umoci_stats_and_unpacks_the_layout(image, tmp_path: Path):
    umoci = need("umoci")
    stat = json.loads(run(umoci, "stat", "--json", "--image", f"{image.layout_path}:v1"))
    assert [h["created_by"] for h in stat["history"]] == [
        "primebuild: locked Python requirements",
        "primebuild: project code",
        "primebuild: manifest, lock and plan",
    ]
    bundle = tmp_path / "bundle"
    run(umoci, "unpack", "--rootless", "--image", f"{image.layout_path}:v1", str(bundle))
    rootfs = bundle / "rootfs" / "opt" / "primebuild"
    assert (rootfs / "requirements.lock.txt").read_text() == REQUIREMENTS
    assert (rootfs / "src" / "pkg" / "__init__.py").read_text() == "VERSION = 1\n"
    assert (rootfs / "src" / "tool.sh").stat().st_mode & 0o777 == 0o755
    assert (rootfs / "src" / "pkg" / "__init__.py").stat().st_mode & 0o777 == 0o644
    assert os.readlink(rootfs / "src" / "link.py") == "pkg/__init__.py"
    assert (rootfs / "run" / "plan.json").read_text() == '{"processes":[]}'
    runtime_config = json.loads((bundle / "config.json").read_text())
    assert runtime_config["process"]["args"] == ["primebuild"]
    assert runtime_config["process"]["cwd"] == "/opt/primebuild/src"


def test_umoci_unpacks_an_image_built_on_a_local_base(image, tmp_path: Path):
    umoci = need("umoci")
    base = f"oci:{image.layout_path}:v1"  # any OCI layout can serve as a base
    child = build_image(ImageSpec(base=base, requirements=REQUIREMENTS, tag="child"), tmp_path / "child")
    assert len(child.layers) == len(image.layers) + 1
    bundle = tmp_path / "bundle"
    run(umoci, "unpack", "--rootless", "--image", f"{child.layout_path}:child", str(bundle))
    assert (bundle / "rootfs" / "opt" / "primebuild" / "src" / "tool.sh").exists()  # from the base
    if shutil.which("skopeo"):
        info = json.loads(run("skopeo", "inspect", f"oci:{child.layout_path}:child"))
        assert info["Digest"] == child.digest
