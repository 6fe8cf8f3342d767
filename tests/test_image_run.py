"""The runnable image: same lock -> same digest from two clones and two empty stores, a code change
rebuilds only the code layer, and podman (runc, vfs) runs `primebuild plan` and the main job in it.

Needs the Debian archive and PyPI (the first build downloads the pinned .deb files and wheels), `podman`
and `runc` (`apt-get install podman runc`; scripts/bootstrap --test installs them as root). Under CI=true
a missing podman fails. The Debian and Python layers (~1.1 GB) are built once per store: the module
builds two stores from scratch, everything else re-uses them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
from cluster_helpers import missing
from conftest import REPO, SHIPPED_NAMES, call_cli, run_cli, sft_workspace

from primebuild.builders import debian_index
from primebuild.builders.image import LABEL_DEBIAN_BASE, LABEL_PLAN_HASH, ImageSpec, build_image_in_store
from primebuild.builders.lock import read_lock, write_lock
from primebuild.builders.python_env import render_requirements
from primebuild.builders.store import Store

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
LOCK = read_lock(REPO / "lockfiles" / "reverse-text.lock")
# The Debian pins are made when the tests run: the archive keeps only the newest version of a package in
# its pool (a security update removes the one before), so a committed pin can leave it; PyPI keeps
# every release, so the committed Python pins stay.
DEBIAN: dict = {}


def debian_base() -> dict:
    if not DEBIAN:
        DEBIAN.update(debian_index.pin("deb:bookworm", []))
    return DEBIAN
# what test-infra.md found podman needs on these machines (no systemd, no overlay in the sandbox)
PODMAN_FLAGS = ["--storage-driver", "vfs", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
RUN_FLAGS = ["--network", "none", "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=1024:1024"]


def _blob(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.split(":", 1)[1]


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                          check=True).stdout


def spec_for(clone: Path) -> ImageSpec:
    """The image `primebuild build manifests/reverse-text.yaml` makes, minus the run layer."""
    return ImageSpec(name="reverse-text", tag="test", debian=debian_base(), install=True, python="3.11",
                     requirements=render_requirements(LOCK["python"]["cpu"]), project_dir=clone)


@pytest.fixture(scope="module")
def clones(tmp_path_factory) -> tuple[Path, Path]:
    if not (REPO / ".git").exists():
        pytest.skip("not running from a git checkout")
    root = tmp_path_factory.mktemp("clones")
    for name, umask in (("one", "0022"), ("two", "0077")):
        subprocess.run(f"umask {umask} && git clone -q --no-hardlinks {REPO} {root / name}", shell=True,
                       check=True, timeout=120)
    return root / "one", root / "two"


@pytest.fixture(scope="module")
def images(clones, tmp_path_factory):
    """Clone one into store A, clone two into store B: both empty, nothing shared but the download
    caches (the .deb files and uv's wheel cache, which hold bytes the lock names by sha256)."""
    stores = tmp_path_factory.mktemp("stores")
    built = []
    for clone, store in zip(clones, ("a", "b"), strict=True):
        started = time.perf_counter()
        built.append(build_image_in_store(spec_for(clone), Store(stores / store)))
        print(f"image from {clone.name} into empty store {store}: {time.perf_counter() - started:.1f} s")
    return built, stores


def test_two_clones_and_two_empty_stores_give_the_same_digest(images):
    (a, b), _ = images
    assert not a.cached and not b.cached
    assert a.digest == b.digest, [(x.created_by, x.digest == y.digest) for x, y in zip(a.layers, b.layers, strict=True)]
    assert [la.created_by for la in a.layers] == [
        f"primebuild: Debian bookworm base ({len(debian_base()['packages'])} packages pinned in the lock)",
        "primebuild: locked Python packages (uv pip install --require-hashes)",
        "primebuild: project code, installed"]
    blobs = sorted(p.name for p in (a.layout_path / "blobs" / "sha256").iterdir())
    assert blobs == sorted(p.name for p in (b.layout_path / "blobs" / "sha256").iterdir())
    assert (a.layout_path / "index.json").read_bytes() == (b.layout_path / "index.json").read_bytes()


def test_a_code_change_rebuilds_only_the_code_layer(clones, images):
    (_, before), stores = images
    clone = clones[1]
    (clone / "README.md").write_text((clone / "README.md").read_text() + "\nchanged\n")
    git(clone, "commit", "-qam", "a code change")
    store = Store(stores / "b")
    heavy = sorted(p.name for p in store.root.iterdir() if p.name.split("-", 1)[-1].startswith("layer-"))
    started = time.perf_counter()
    after = build_image_in_store(spec_for(clone), store)
    print(f"rebuild after a code change: {time.perf_counter() - started:.1f} s")
    assert not after.cached and after.digest != before.digest
    assert [la.digest for la in after.layers[:2]] == [la.digest for la in before.layers[:2]]
    assert after.layers[2].digest != before.layers[2].digest
    # the Debian and Python layers were store hits: no new layer entry was made
    assert heavy == sorted(p.name for p in store.root.iterdir() if p.name.split("-", 1)[-1].startswith("layer-"))
    assert len(heavy) == 2


@pytest.fixture(scope="module")
def locked_today(locked_module: Path) -> Path:
    """`locked_module` with today's Debian pins (the request is unchanged, so the lock stays fresh)."""
    for lock in (locked_module.parent / "lockfiles").glob("reverse-text*.lock"):
        entry = read_lock(lock)
        if entry["base_image"].get("kind") == "debian":
            entry["base_image"] = {"request": entry["base_image"]["request"], **debian_base()}
            write_lock(lock, entry)
    return locked_module


def test_build_command_reuses_the_layers_and_rebuilds_as_a_cache_hit(images, capsys, locked_today: Path):
    _, stores = images
    store = stores / "a"  # holds the Debian and Python layers of the same pins
    manifest = locked_today / "reverse-text.yaml"
    first = call_cli(capsys, "build", manifest, "--store", store, "-o", "json")
    assert first.code == 0, first.text
    a = json.loads(first.out)
    print(f"build with the layers in the store: {a['seconds']:.1f} s")
    started = time.perf_counter()
    second = call_cli(capsys, "build", manifest, "--store", store, "-o", "json")
    elapsed = time.perf_counter() - started
    assert second.code == 0, second.text
    b = json.loads(second.out)
    assert a["image_digest"] == b["image_digest"] and a["image_digest"].startswith("sha256:")
    assert not a["cached"] and b["cached"]
    assert b["seconds"] < 3.0 and elapsed < 6.0, (b["seconds"], elapsed)
    assert [la["created_by"].split(" (")[0] for la in a["layers"]] == [
        "primebuild: Debian bookworm base", "primebuild: locked Python packages",
        "primebuild: project code, installed", "primebuild: manifest, lock and plan"]


def test_the_image_holds_python_the_locked_packages_the_project_and_the_plan(images, capsys, locked_today: Path):
    _, stores = images
    store = stores / "a"
    manifest = locked_today / "reverse-text.yaml"
    result = call_cli(capsys, "build", manifest, "--store", store, "-o", "json")
    assert result.code == 0, result.text
    info = json.loads(result.out)
    layout = Path(info["layout"])
    dockerfile = Path(info["dockerfile"]).read_text()
    assert "--require-hashes" in dockerfile and "python3-minimal=" in dockerfile
    index = json.loads((layout / "index.json").read_text())
    manifest_blob = json.loads(_blob(layout, index["manifests"][0]["digest"]).read_bytes())
    assert index["manifests"][0]["digest"] == info["image_digest"]
    config = json.loads(_blob(layout, manifest_blob["config"]["digest"]).read_bytes())
    labels = config["config"]["Labels"]
    assert labels[LABEL_PLAN_HASH] == f"sha256:{info['plan_hash']}" and labels[LABEL_DEBIAN_BASE].startswith("deb:")
    assert config["config"]["Entrypoint"] == ["primebuild"]
    members: dict[str, tarfile.TarInfo] = {}
    small: dict[str, bytes] = {}
    for layer in manifest_blob["layers"]:
        with tarfile.open(_blob(layout, layer["digest"])) as tar:  # gzip or plain tar
            for member in tar:
                members[member.name] = member
                if member.isfile() and member.size < 1 << 20 and member.name.startswith(("opt/", "usr/local/bin/")):
                    small[member.name] = tar.extractfile(member).read()  # type: ignore[union-attr]
    assert members["usr/bin/python3"].issym() and members["usr/bin/python3.11"].isfile()
    assert members["bin"].issym() and members["bin"].linkname == "usr/bin"  # merged /usr, as debootstrap lays it
    assert "usr/local/lib/python3.11/dist-packages/torch/__init__.py" in members
    assert small["usr/local/bin/primebuild"].startswith(b"#!/usr/bin/python3\n")
    requirements = small["opt/primebuild/requirements.lock.txt"].decode()
    assert "torch==2.13.0+cpu" in requirements and "--hash=sha256:" in requirements
    plan = json.loads(small["opt/primebuild/run/plan.json"])
    assert plan["plan_hash"] == info["plan_hash"] and plan["image"] is None and plan["lock_hash"]
    assert "opt/primebuild/run/lock.json" in small and "opt/primebuild/src/primebuild/builders/lock.py" in small
    assert "usr/local/lib/python3.11/dist-packages/primebuild/builders/lock.py" in members  # installed too
    # the plan that names the image: same as `plan --locked --image-digest`
    named = call_cli(capsys, "plan", "--locked", "--image-digest", info["image_digest"], "-o", "json", manifest)
    assert named.code == 0, named.text
    outer = json.loads(named.out)
    assert outer["image"] == {"digest": info["image_digest"], "plan_hash": info["plan_hash"]}
    assert outer["plan_hash"] == info["plan_hash_with_image"]


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    """podman with a private storage root (removed afterwards) and the image of `images` pulled into it."""
    if shutil.which("podman") is None or shutil.which("runc") is None:
        missing("podman and runc are not installed (apt-get install podman runc)")
    root = tmp_path_factory.mktemp("podman")
    # podman refuses a runroot longer than 50 characters, which a pytest-xdist worker's tmp path exceeds
    runroot = tempfile.mkdtemp(prefix="pb-podman-run-", dir="/tmp")
    base = ["podman", "--root", str(root / "storage"), "--runroot", runroot, *PODMAN_FLAGS]
    yield base
    shutil.rmtree(runroot, ignore_errors=True)
    # its own storage only (nothing else of podman's is touched); vfs holds a full copy of the root
    # filesystem per layer (~4.5 GB, 60-130 s to delete here), so it is removed in the background
    subprocess.Popen(["rm", "-rf", str(root)], start_new_session=True, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


def test_podman_runs_the_plan_and_the_main_job(images, podman, tmp_path):
    (image, _), _ = images
    started = time.perf_counter()
    pulled = subprocess.run([*podman, "pull", "-q", image.reference], capture_output=True, text=True, timeout=600)
    assert pulled.returncode == 0, pulled.stderr
    image_id = pulled.stdout.strip().splitlines()[-1]
    print(f"podman pull: {time.perf_counter() - started:.1f} s")
    # a workspace for the main job: the default's manifests with a short SFT (as test_run_local does)
    work = tmp_path / "work"
    sft_workspace(work, SHIPPED_NAMES)  # an empty store: the container trains the SFT itself
    script = ("primebuild plan manifests/glm5.yaml --design -o json > /work/glm5.json && "
              "primebuild run /work/manifests/reverse-text.yaml --runs-dir /work/runs --quiet"
              " --set orchestrator.max_steps=3 --set orchestrator.rollouts_per_step=32"
              " --set orchestrator.eval_prompts=40")
    started = time.perf_counter()
    done = subprocess.run([*podman, "run", "--rm", *RUN_FLAGS, "-v", f"{work}:/work", "-e",
                           "PRIMEBUILD_STORE=/work/store", "--entrypoint", "/bin/sh", image_id, "-c", script],
                          capture_output=True, text=True, timeout=600)
    print(f"podman run (plan + main job, 3 steps): {time.perf_counter() - started:.1f} s")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the plan inside the image is the host's plan
    host = run_cli("plan", REPO / "manifests" / "glm5.yaml", "--design", "-o", "json")
    assert host.code == 0, host.text
    inside = json.loads((work / "glm5.json").read_text())
    assert inside["plan_hash"] == json.loads(host.out)["plan_hash"]
    # the main job ran to completion in the container
    (run_dir,) = (work / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_reward_after_step"] == 3 and 0 <= summary["eval_reward_after"] <= 1
    steps = {json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["role"] == "trainer"}
    assert steps == {1, 2, 3}
    assert (run_dir / "report.png").stat().st_size > 1000
    assert json.loads((run_dir / "run.json").read_text())["plan_hash"] == \
        json.loads((run_dir / "plan.json").read_text())["plan_hash"]


def test_lock_pins_the_debian_base_from_the_signed_index(tmp_path: Path):
    """`lock` reads the archive's index (gpg-checked InRelease, sha256-checked Packages.xz) and pins every
    package of the closure; image.packages adds to it; `--update` re-reads the index."""
    shutil.copytree(REPO / "manifests", tmp_path / "manifests", ignore=shutil.ignore_patterns("*.lock"))
    (tmp_path / "lockfiles").mkdir()
    for committed in (REPO / "lockfiles").glob("*.lock"):  # the Python variants come from these siblings
        shutil.copy(committed, tmp_path / "lockfiles" / f"committed-{committed.name}")
    manifest = tmp_path / "manifests" / "reverse-text-sft.yaml"
    text = manifest.read_text() + "image:\n  packages: [coreutils]\n"
    manifest.write_text(text)
    done = run_cli("lock", manifest, "-o", "json", timeout=300)
    assert done.code == 0, done.text
    base = read_lock(tmp_path / "lockfiles" / "reverse-text-sft.lock")["base_image"]
    assert base["pinned"] and base["request"] == {"ref": "deb:bookworm", "packages": ["coreutils"]}
    assert base["python"] == "3.11" and {"python3", "libc6", "coreutils"} <= base["packages"].keys()
    for name, pin in base["packages"].items():
        assert len(pin["sha256"]) == 64 and re.match(r"pool/(updates/)?main/.+\.deb$", pin["path"]), pin
        assert pin["archive"] in ("debian", "debian-security"), name
    if shutil.which("gpgv"):
        assert {s["signature"] for s in base["suites"].values()} == {"gpgv: Debian archive keyring"}
    update = run_cli("lock", "--update", manifest, "-o", "json", timeout=300)
    assert update.code == 0, update.text
    assert read_lock(tmp_path / "lockfiles" / "reverse-text-sft.lock")["base_image"]["pinned"]
