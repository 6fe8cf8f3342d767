"""The plan's ports (primebuild/builders/ports.py): a port derived past 65535, or two processes of one node
on one port, is a located error at the field that set it (exit 2), not an internal error or a run that
fails with "address already in use" after its restarts."""

from __future__ import annotations

import pytest
import yaml
from conftest import MANIFESTS, SHIPPED, call_cli


@pytest.mark.parametrize(("manifest", "port", "derived"), [
    ("reverse-text-pd.yaml", 64600, "kv port derived from it is 65601"),  # the decode server's KV inbox
    ("reverse-text-distill.yaml", 65535, "port derived from it is 65537"),  # the teacher after the servers
    ("reverse-text-vllm-pd.yaml", 65535, "port derived from it is 65537"),  # the P/D router
])
def test_a_derived_port_past_65535_is_refused_at_inference_port(capsys, manifest, port, derived):
    result = call_cli(capsys, "plan", MANIFESTS / manifest, "--set", f"inference.port={port}")
    assert result.code == 2, result.text
    assert "inference.port" in result.err and derived in result.err and "internal error" not in result.text
    assert "lower inference.port by at least" in result.err


@pytest.mark.parametrize(("manifest", "port", "other"), [
    ("reverse-text.yaml", 8000, "inference-0's http port"),
    ("reverse-text-pd.yaml", 9001, "decode-0's kv port"),
    ("reverse-text-distill.yaml", 8002, "teacher-0's http port"),
])
def test_the_weight_broadcast_on_another_processes_port_is_refused(capsys, manifest, port, other):
    result = call_cli(capsys, "plan", MANIFESTS / manifest, "--set", "weight_sync.mode=broadcast",
                      "--set", f"weight_sync.port={port}")
    assert result.code == 2, result.text
    assert "weight_sync.port" in result.err and other in result.err and "address already in use" in result.err


RL_MANIFESTS = [p for p in SHIPPED if not yaml.safe_load(p.read_text()).get("sft")]  # an SFT build starts none


@pytest.mark.parametrize("manifest", RL_MANIFESTS, ids=lambda p: p.name)
def test_no_shipped_plan_has_a_port_twice_on_a_node(manifest):
    from primebuild.builders.plan import compile_plan
    from primebuild.builders.ports import port_problems
    from primebuild.manifest.load import load_manifest

    loaded = load_manifest(manifest)
    plan = compile_plan(loaded, design=True)
    assert port_problems(loaded.manifest, plan.processes) == []
