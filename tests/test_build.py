"""`primebuild build`: the image from the committed lock, reproducible digest, store cache hit."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import time
from pathlib import Path

from conftest import call_cli, run_cli

from primebuild.builders.image import LABEL_PLAN_HASH


def _blob(layout: Path, digest: str) -> bytes:
    return (layout / "blobs" / "sha256" / digest.split(":", 1)[1]).read_bytes()


def test_build_twice_same_digest_and_cache_hit(tmp_path: Path, capsys, locked: Path):
    MANIFEST = locked / "reverse-text.yaml"
    store = tmp_path / "store"
    first = call_cli(capsys, "build", MANIFEST, "--store", store, "-o", "json")
    assert first.code == 0, first.text
    a = json.loads(first.out)
    started = time.perf_counter()
    second = call_cli(capsys, "build", MANIFEST, "--store", store, "-o", "json")
    elapsed = time.perf_counter() - started
    assert second.code == 0, second.text
    b = json.loads(second.out)
    assert a["image_digest"] == b["image_digest"] and a["image_digest"].startswith("sha256:")
    assert not a["cached"] and b["cached"]
    assert b["seconds"] < 1.0 and elapsed < 3.0, (b["seconds"], elapsed)
    # a fresh store in another process rebuilds the same bytes
    other = run_cli("build", MANIFEST, "--store", tmp_path / "other", "-o", "json", cwd=tmp_path, timeout=120)
    assert other.code == 0, other.text
    assert json.loads(other.out)["image_digest"] == a["image_digest"]


def test_image_holds_locked_requirements_and_the_plan_without_image_field(tmp_path: Path, capsys, locked: Path):
    MANIFEST = locked / "reverse-text.yaml"
    result = call_cli(capsys, "build", MANIFEST, "--store", tmp_path / "store", "-o", "json")
    assert result.code == 0, result.text
    info = json.loads(result.out)
    layout = Path(info["layout"])
    assert Path(info["dockerfile"]).is_file() and "--require-hashes" in Path(info["dockerfile"]).read_text()
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads(_blob(layout, index["manifests"][0]["digest"]))
    assert index["manifests"][0]["digest"] == info["image_digest"]
    config = json.loads(_blob(layout, manifest["config"]["digest"]))
    assert config["config"]["Labels"][LABEL_PLAN_HASH] == f"sha256:{info['plan_hash']}"
    files = {}
    for layer in manifest["layers"]:
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(_blob(layout, layer["digest"])))) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    files[member.name] = tar.extractfile(member).read()
    requirements = files["opt/primebuild/requirements.lock.txt"].decode()
    assert "torch==2.13.0+cpu" in requirements and "--hash=sha256:" in requirements
    plan = json.loads(files["opt/primebuild/run/plan.json"])
    assert plan["plan_hash"] == info["plan_hash"] and plan["image"] is None and plan["lock_hash"]
    assert "opt/primebuild/run/lock.json" in files and "opt/primebuild/src/builders/lock.py" in files
    # the plan that names the image: same as `plan --locked --image-digest`
    named = call_cli(capsys, "plan", "--locked", "--image-digest", info["image_digest"], "-o", "json", MANIFEST)
    assert named.code == 0, named.text
    outer = json.loads(named.out)
    assert outer["image"] == {"digest": info["image_digest"], "plan_hash": info["plan_hash"]}
    assert outer["plan_hash"] == info["plan_hash_with_image"]


def test_build_refuses_a_stale_lock(tmp_path: Path, capsys, locked: Path):
    MANIFEST = locked / "reverse-text.yaml"
    result = call_cli(capsys, "build", MANIFEST, "--set", "orchestrator.lr=0.01", "--store", tmp_path / "s")
    assert result.code == 2 and "stale lock" in result.err
    bad = call_cli(capsys, "plan", "--locked", "--image-digest", "sha256:xyz", MANIFEST)
    assert bad.code == 2 and "64 hex digits" in bad.err
