"""The worker: a plan's process, resolved on its host — typed config file, argv and env, no placeholder left."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import MANIFESTS

from primebuild.builders.plan import compile_plan
from primebuild.contracts.base import load_contract
from primebuild.contracts.plan import render_json
from primebuild.contracts.run_dir import Rendezvous, RunDir
from primebuild.errors import UserError
from primebuild.manifest.load import load_manifest
from primebuild.runtime import worker

PLACEHOLDER = re.compile(r"\{(run_dir|model_path|config|python|host:\d+|bind:\d+)\}")


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    plan = compile_plan(load_manifest(MANIFESTS / "reverse-text.yaml", ["weight_sync.mode=broadcast"]))
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.plan.write_text(render_json(plan))
    run.rendezvous.write_text(Rendezvous(hosts=["10.0.0.7"], model_path="/models/tiny").model_dump_json())
    return run


def test_every_process_gets_its_typed_config_with_nothing_left_to_resolve(run: RunDir):
    plan = worker.read_plan(run.plan)
    for spec in plan.processes:
        argv, env = worker.prepare(plan, spec.name, run)
        assert not any(PLACEHOLDER.search(a) for a in argv), argv
        assert not any(PLACEHOLDER.search(v) for v in env.values())
        config = load_contract(type(spec.config), run.config(spec.name))  # what the process itself does
        text = run.config(spec.name).read_text()
        assert not PLACEHOLDER.search(text), text
        resolved = {"run_dir", "model_path", "weight_sync", "weight_broadcast", "endpoints", "host"}
        assert config.model_dump(exclude=resolved) == spec.config.model_dump(exclude=resolved)
        if hasattr(config, "host"):  # {bind:0}: the node's own address, as it resolves on the node
            assert spec.config.host == "{bind:0}" and config.host == "10.0.0.7"
        if hasattr(config, "run_dir"):
            assert config.run_dir == str(run.root)
        if hasattr(config, "model_path"):
            assert config.model_path == "/models/tiny"
    trainer = load_contract(type(plan.process("trainer").config), run.config("trainer"))
    assert trainer.weight_sync.init_method == "tcp://10.0.0.7:29600"  # {host:0} from the rendezvous
    orchestrator = json.loads(run.config("orchestrator").read_text())
    assert orchestrator["endpoints"] == ["http://10.0.0.7:8000/v1"]


def test_a_plan_that_does_not_type_check_is_a_located_error(run: RunDir):
    data = json.loads(run.plan.read_text())
    next(p for p in data["processes"] if p["role"] == "trainer")["config"]["learning_rate"] = 0.1
    run.plan.write_text(json.dumps(data))
    with pytest.raises(UserError) as err:
        worker.read_plan(run.plan)
    assert str(run.plan) in err.value.render() and "learning_rate" in err.value.render()


def test_an_unknown_process_names_the_known_ones(run: RunDir):
    with pytest.raises(UserError, match="known processes: inference-0, trainer, orchestrator"):
        worker.prepare(worker.read_plan(run.plan), "decode-7", run)


def test_vllm_weight_group_joins_resolve_to_each_servers_address(tmp_path: Path):
    """vLLM + broadcast, two dp=2 servers: each join names its server at the node's address, and the
    workers' rank blocks follow the sender's rank 0 (1-2, 3-4 of a group of 5)."""
    sets = ["weight_sync.mode=broadcast", "inference.engine=vllm", "inference.dp=2", "inference.replicas=2"]
    plan = compile_plan(load_manifest(MANIFESTS / "reverse-text.yaml", sets))
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.plan.write_text(render_json(plan))
    run.rendezvous.write_text(Rendezvous(hosts=["10.0.0.7"], model_path="/models/tiny").model_dump_json())
    worker.prepare(worker.read_plan(run.plan), "orchestrator", run)
    joins = json.loads(run.config("orchestrator").read_text())["weight_broadcast"]
    assert [(j["url"], j["rank"], j["workers"], j["world_size"], j["endpoint"]) for j in joins] == [
        ("http://10.0.0.7:8000", 1, 2, 5, 0), ("http://10.0.0.7:8001", 3, 2, 5, 1)]
    worker.prepare(worker.read_plan(run.plan), "trainer", run)
    assert json.loads(run.config("trainer").read_text())["weight_sync"]["world_size"] == 5


def test_glm5_weight_group_lists_every_prefill_and_decode_worker():
    """P/D + broadcast: every server of both pools joins, prefill servers first (4 x tp8), then decode
    (6 x dp16, each over 2 nodes); the trainer's group holds rank 0 and all 128 workers."""
    plan = compile_plan(load_manifest(MANIFESTS / "glm5.yaml"), design=True)
    joins = plan.process("orchestrator").config.weight_broadcast
    assert [(j.rank, j.workers) for j in joins] == [(1 + 8 * i, 8) for i in range(4)] + [
        (33 + 16 * i, 16) for i in range(6)]
    assert {j.world_size for j in joins} == {129} == {plan.process("trainer-n0").config.weight_sync.world_size}
    # behind a P/D router every server serves its one endpoint; without one, a decode server is its own
    endpoints = plan.process("orchestrator").config.endpoints
    assert all(len(endpoints) == 1 or endpoints[j.endpoint] == j.url + "/v1" for j in joins[4:])
