"""The plan counts the host memory of the orchestrator's node (primebuild/builders/orchestrator_memory.py):
the orchestrator, the supervisor where it runs there, and the programs of every episode that can be in
flight at once (the rollout pool's bound, plus a held-out eval); too much is refused, located."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import MANIFESTS, plan_json

from primebuild.builders.orchestrator_memory import (
    HARNESS_PROGRAM_BYTES,
    HARNESS_ZYGOTE_BYTES,
    ORCHESTRATOR_BYTES,
    ROUTER_BYTES,
    SANDBOXED_RUN_BYTES,
    SUPERVISOR_BYTES,
    orchestrator_memory,
)
from primebuild.errors import UserError
from primebuild.manifest.load import load_manifest

GIB = 1 << 30


def test_the_main_job_counts_the_orchestrator_and_the_supervisor_where_they_run():
    local = plan_json(MANIFESTS / "reverse-text.yaml")["memory"]["orchestrator"]
    assert local["breakdown"] == {"process": ORCHESTRATOR_BYTES, "supervisor": SUPERVISOR_BYTES, "episode_programs": 0,
                                  "router": 0}
    assert local["used_bytes"] == ORCHESTRATOR_BYTES + SUPERVISOR_BYTES and local["programs_in_flight"] == 0
    # over ssh, `primebuild run` supervises from the machine it was typed on, not from a plan node
    ssh = plan_json(MANIFESTS / "reverse-text-ssh.yaml")["memory"]["orchestrator"]
    assert ssh["breakdown"]["supervisor"] == 0


def test_a_p_d_router_on_the_orchestrators_node_is_counted_there():
    # the embedded engine's router runs on the orchestrator's node; vLLM's on the first prefill server's
    # node, the same one in a one-node plan
    for manifest in ("reverse-text-pd.yaml", "reverse-text-vllm-pd.yaml"):
        mem = plan_json(MANIFESTS / manifest)["memory"]["orchestrator"]
        assert mem["breakdown"]["router"] == ROUTER_BYTES, manifest
        assert mem["used_bytes"] == ORCHESTRATOR_BYTES + SUPERVISOR_BYTES + ROUTER_BYTES
    # a vLLM P/D plan over several nodes: the router is on a prefill node, not counted here
    glm5 = plan_json(MANIFESTS / "glm5.yaml")["memory"]["orchestrator"]
    assert glm5["breakdown"]["router"] == 0


def test_swe_tiny_counts_a_sandboxed_test_run_per_episode_in_flight():
    doc = yaml.safe_load((MANIFESTS / "swe-tiny.yaml").read_text())["orchestrator"]
    groups, size, off = doc["rollouts_per_step"] // doc["group_size"], doc["group_size"], doc["max_off_policy_steps"]
    episodes = (1 + off) * groups * size + doc["eval_prompts"]
    mem = plan_json(MANIFESTS / "swe-tiny.yaml")["memory"]["orchestrator"]
    assert mem["programs_in_flight"] == episodes
    assert mem["breakdown"]["episode_programs"] == episodes * SANDBOXED_RUN_BYTES


def test_more_episodes_in_flight_than_the_node_holds_are_refused_located():
    sets = ["orchestrator.rollouts_per_step=4096", "orchestrator.max_off_policy_steps=3", "hardware.host_memory_gb=8"]
    with pytest.raises(UserError) as err:
        plan_json(MANIFESTS / "swe-tiny.yaml", sets, design=False)
    (problem,) = [p for p in err.value.problems if p.field == "orchestrator.rollouts_per_step"]
    assert "episode programs at once" in problem.message and "host_memory_gb is 8" in problem.message


@pytest.mark.parametrize("harness", ["null", "bash"])
def test_a_harness_episode_counts_its_program(tmp_path: Path, harness: str):
    doc = yaml.safe_load((MANIFESTS / "reverse-text.yaml").read_text())
    doc["environments"] = [{"id": "verifiers:pb-any", "args": {"harness": harness}}, {"id": "reverse-text", "weight": 3}]
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(doc))
    (tmp_path / "models").symlink_to(MANIFESTS / "models")
    m = load_manifest(path).manifest
    mem = orchestrator_memory(m, 64 * GIB)
    o = m.orchestrator
    # the harness environment gets a quarter of the step's groups and of the eval prompts
    groups = o.rollouts_per_step // o.group_size // 4
    episodes = (1 + o.max_off_policy_steps) * groups * o.group_size + o.eval_prompts // 4
    assert mem.programs_in_flight == episodes
    zygote = HARNESS_ZYGOTE_BYTES.get(harness, 0)  # bash: the one sandboxed Python its programs are forked from
    assert mem.breakdown.episode_programs == episodes * HARNESS_PROGRAM_BYTES[harness] + zygote
    assert mem.fits and mem.used_bytes == ORCHESTRATOR_BYTES + SUPERVISOR_BYTES + mem.breakdown.episode_programs
