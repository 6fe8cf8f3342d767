"""The plan compiler on the shipped manifests: placement, processes, hash, and what a plan must not hold."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
from conftest import MANIFESTS, REPO, plan_json, run_cli

from primebuild.contracts.plan import PLAN_VERSION
from primebuild.hashing import canonical_json

PROCESS_KEYS = {"name", "role", "node", "gpus", "argv", "env", "ports"}


@pytest.fixture(scope="module")
def plans() -> dict[str, dict]:
    return {name: plan_json(MANIFESTS / f"{name}.yaml")
            for name in ("glm5", "qwen3-30b-a3b", "reverse-text", "reverse-text-sft")}


def render_json(plan: dict) -> str:
    return canonical_json(plan) + "\n"


def independent_hash(plan: dict) -> str:
    """sha256 of the canonical JSON of everything but the hash itself, written out here on purpose."""
    content = {k: v for k, v in plan.items() if k != "plan_hash"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def gpu_owners(plan: dict) -> Counter:
    return Counter((p["node"], g) for p in plan["processes"] for g in p["gpus"])


@pytest.mark.parametrize("name", ["glm5", "qwen3-30b-a3b", "reverse-text", "reverse-text-sft"])
def test_plan_shape_and_hash(plans, name):
    plan = plans[name]
    assert plan["plan_version"] == PLAN_VERSION
    assert plan["fits"] is True
    # glm5 plans as a run (P14); qwen3's environment (verifiers:math-python) is not installable here
    assert plan["runnable"] is (name != "qwen3-30b-a3b")
    assert bool(plan["unsupported"]) is not plan["runnable"]
    assert plan["plan_hash"] == independent_hash(plan)
    assert len(plan["plan_hash"]) == 64
    for p in plan["processes"]:
        assert PROCESS_KEYS <= set(p), p["name"]
        assert all(isinstance(a, str) for a in p["argv"]) and p["argv"]
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in p["env"].items())
        assert all(isinstance(v, int) for v in p["ports"].values())
        assert 0 <= p["node"] < plan["hardware"]["nodes"]
    names = [p["name"] for p in plan["processes"]]
    assert len(names) == len(set(names))
    assert [n["index"] for n in plan["nodes"]] == list(range(plan["hardware"]["nodes"]))
    # the node map and the processes tell the same story
    for node in plan["nodes"]:
        assert sorted(node["processes"]) == sorted(p["name"] for p in plan["processes"] if p["node"] == node["index"])
        for gpu in node["gpus"]:
            owner = next((p for p in plan["processes"] if p["node"] == node["index"] and gpu["index"] in p["gpus"]),
                         None)
            assert gpu["process"] == (owner["name"] if owner else None)
    # strict JSON: no NaN/Infinity that other languages cannot read
    json.loads(render_json(plan), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    # start order: inference, then trainer, then orchestrator
    if name == "reverse-text-sft":  # a build, not processes
        assert plan["processes"] == [] and plan["build"]["config"]["kind"] == "env-sft"
        return
    order = {p["role"]: p["start_order"] for p in plan["processes"]}
    assert max(v for k, v in order.items() if k in ("inference", "prefill", "decode")) < order["trainer"] \
        < order["orchestrator"]


def test_glm5_every_gpu_assigned_exactly_once(plans):
    plan = plans["glm5"]
    owners = gpu_owners(plan)
    assert len(owners) == 224 == 28 * 8
    assert set(owners.values()) == {1}
    assert set(owners) == {(n, g) for n in range(28) for g in range(8)}
    assert all(gpu["process"] is not None for node in plan["nodes"] for gpu in node["gpus"])
    roles = Counter(p["role"] for p in plan["processes"])
    assert {"prefill", "decode", "trainer", "orchestrator"} <= set(roles)
    assert roles["orchestrator"] == 1
    gpus_by_role = Counter()
    for p in plan["processes"]:
        gpus_by_role[p["role"]] += len(p["gpus"])
    assert gpus_by_role == Counter(prefill=32, decode=96, trainer=96)  # 4x8, 6x2x8, 12 nodes x8


def test_glm5_processes_wire_up(plans):
    procs = {p["name"]: p for p in plans["glm5"]["processes"]}
    prefill, head, follower = procs["prefill-0"], procs["decode-0-n0"], procs["decode-0-n1"]

    def arg(p, flag):
        return p["argv"][p["argv"].index(flag) + 1]

    assert prefill["argv"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and prefill["environment"] == "vllm"
    assert arg(prefill, "--tensor-parallel-size") == "8"
    assert json.loads(arg(prefill, "--kv-transfer-config"))["kv_role"] == "kv_producer"
    assert json.loads(arg(head, "--kv-transfer-config"))["kv_connector"] == "NixlConnector"
    assert json.loads(arg(head, "--kv-transfer-config"))["kv_role"] == "kv_consumer"
    # routes beside NIXL (our vLLM plugin lifts vLLM 0.32's refusal) on model runner v2, both halves;
    # expert parallelism over the decode replica's 16 ranks
    for server in (prefill, head, follower):
        assert "--enable-return-routed-experts" in server["argv"] and server["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "--enable-expert-parallel" in head["argv"]
    # a two-node decode replica: DP 16 over 8+8 GPUs, the second node headless and pointed at the first
    assert arg(head, "--data-parallel-size") == "16" and arg(head, "--data-parallel-size-local") == "8"
    assert arg(follower, "--data-parallel-address") == f"{{host:{head['node']}}}"
    assert "--headless" in follower["argv"] and arg(follower, "--data-parallel-start-rank") == "8"
    assert "http" in head["ports"] and set(follower["ports"]) == {"nixl"}  # a follower serves no HTTP
    # inference HTTP ports never collide on a node
    for node in plans["glm5"]["nodes"]:
        ports = [v for name in node["processes"] for v in procs[name]["ports"].values()]
        assert len(ports) == len(set(ports))
    # the trainer: 12 torchrun nodes that rendezvous at the first one
    trainers = [p for p in procs.values() if p["role"] == "trainer"]
    assert len(trainers) == 12
    assert {arg(t, "--nnodes") for t in trainers} == {"12"}
    assert sorted(int(arg(t, "--node-rank")) for t in trainers) == list(range(12))
    assert {(arg(t, "--master-addr"), arg(t, "--master-port")) for t in trainers} == {
        (f"{{host:{trainers[0]['node']}}}", "29500")}
    # each node's rendezvous and collectives listen on its own address, never on every interface
    assert [arg(t, "--bind") for t in trainers] == [f"{{bind:{t['node']}}}" for t in trainers]
    # the orchestrator samples through vLLM's P/D router, which prefills on the 4 prefill servers and decodes on
    # the 6 decode heads (one per replica); the router runs beside prefill-0, in its group
    orch, router = procs["orchestrator"], procs["router"]
    assert orch["gpus"] == [] and orch["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert orch["config"]["endpoints"] == [f"http://{{host:{router['node']}}}:{router['ports']['http']}/v1"]
    assert (router["node"], router["group"], router["gpus"]) == (prefill["node"], "prefill", [])
    heads = [p for p in procs.values() if p["role"] == "decode" and "http" in p["ports"]]
    assert [s["url"] for s in router["config"]["decode"]] == [f"http://{{host:{p['node']}}}:{p['ports']['http']}"
                                                              for p in heads]
    assert len(heads) == 6 and len(router["config"]["prefill"]) == 4
    assert [s["ranks"] for s in router["config"]["decode"]] == [16] * 6  # their joins' ranks (tp·dp)


def test_vllm_pd_over_nixl_gives_every_server_its_own_side_channel():
    """NIXL's handshake listens at VLLM_NIXL_SIDE_CHANNEL_PORT + the DP rank, and the prefill's answer sends
    decode servers there: every DP rank of every server gets a port of its own, on its node's address."""
    plan = plan_json(MANIFESTS / "glm5.yaml", ["inference.disaggregation.kv_connector=NixlConnector",
                                               "inference.router_replay=false"])
    servers = [p for p in plan["processes"] if p["role"] in ("prefill", "decode")]
    taken: list[int] = []
    for p in servers:
        assert p["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == f"{{host:{p['node']}}}"
        if p["name"].endswith("-n1"):  # a follower node: the same base, its ranks start at 8
            assert p["ports"]["nixl"] == int(p["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]) + 8
            continue
        dp = 16 if p["role"] == "decode" else 1
        taken += range(int(p["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]), int(p["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]) + dp)
    assert len(taken) == len(set(taken)) == 4 + 6 * 16
    (router,) = [p for p in plan["processes"] if p["role"] == "router"]
    assert router["config"]["kv_storage_path"] is None  # files are ExampleConnector's only


def test_vllm_pd_on_slurm_needs_an_address_per_listening_group():
    """A het-job gives every group its own allocation: the prefill and decode servers of a one-node CPU plan
    would both listen on plan node 0 (a located error); on three nodes each has its own, and the router
    listens beside prefill-0, inside the prefill group's allocation."""
    from primebuild.errors import UserError

    slurm = "target={kind: slurm}"
    with pytest.raises(UserError) as err:
        plan_json(MANIFESTS / "reverse-text-vllm-pd.yaml", [slurm], design=False)
    (problem,) = err.value.problems
    assert problem.field == "hardware.nodes" and "decode, prefill" in problem.message and problem.line
    plan = plan_json(MANIFESTS / "reverse-text-vllm-pd.yaml", [slurm, "hardware.nodes=3"], design=False)
    where = {p["name"]: (p["group"], p["node"]) for p in plan["processes"]}
    assert where["prefill-0"] == where["router"] == ("prefill", 0) and where["decode-0"] == ("decode", 1)


def test_glm5_memory_and_estimates(plans):
    plan = plans["glm5"]
    assert set(plan["memory"]) == {"prefill", "decode", "trainer", "orchestrator"}
    for group, mem in plan["memory"].items():
        assert mem["fits"] and 0 < mem["used_bytes"] <= mem["capacity_bytes"], group
    assert plan["estimates"]["summary"]
    assert plan["model"]["source"] == "hf" and plan["model"]["repo"] == "zai-org/GLM-5"


def test_qwen3_layout(plans):
    plan = plans["qwen3-30b-a3b"]
    owners = gpu_owners(plan)
    assert len(owners) == 16 and set(owners.values()) == {1}
    roles = Counter(p["role"] for p in plan["processes"])
    assert roles == {"inference": 4, "trainer": 1, "orchestrator": 1}
    inference = [p for p in plan["processes"] if p["role"] == "inference"]
    assert [p["gpus"] for p in inference] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert {p["node"] for p in inference} == {0}
    assert [p["ports"]["http"] for p in inference] == [8000, 8001, 8002, 8003]
    assert [p["env"]["CUDA_VISIBLE_DEVICES"] for p in inference] == ["0,1", "2,3", "4,5", "6,7"]
    trainer = next(p for p in plan["processes"] if p["role"] == "trainer")
    assert trainer["node"] == 1 and trainer["gpus"] == list(range(8))


def test_cpu_plans(plans):
    plan = plans["reverse-text"]
    assert plan["hardware"]["gpu"] == "cpu" and len(plan["nodes"]) == 1
    assert all(p["gpus"] == [] and p["node"] == 0 for p in plan["processes"])
    assert all(p["env"]["CUDA_VISIBLE_DEVICES"] == "" for p in plan["processes"])
    assert {p["role"] for p in plan["processes"]} == {"inference", "trainer", "orchestrator"}
    # CPU processes never oversubscribe the node's threads
    assert all(int(p["env"].get("OMP_NUM_THREADS", "1")) <= plan["hardware"]["cpus_per_node"]
               for p in plan["processes"])


def test_cpu_plans_model_fp32_eager_activations():
    """A CPU trainer's activations use the factor fitted on CPU fp32 eager layers (bench/trainer_memory.py),
    not the GPU one: the same manifest on H200s plans 1.85/1.45 as much per activation byte."""
    from primebuild.builders.memory import CPU_EAGER_ACTIVATION_FACTOR, HF_EAGER_ACTIVATION_FACTOR

    def activations(*overrides: str) -> int:
        done = run_cli("plan", MANIFESTS / "reverse-text.yaml", "--design", "-o", "json", *overrides)
        assert done.code == 0, done.text
        return json.loads(done.out)["memory"]["trainer"]["breakdown"]["activations"]

    cpu = activations()
    gpu = activations("--set", "hardware.gpu=h200", "--set", "hardware.gpus_per_node=8", "--set", "hardware.nodes=2")
    # reverse-text trains without activation checkpointing: every activation byte is scaled
    assert gpu / cpu == pytest.approx(
        HF_EAGER_ACTIVATION_FACTOR / CPU_EAGER_ACTIVATION_FACTOR, rel=1e-6)


def test_reverse_text_starts_from_the_sft_output(plans):
    model = plans["reverse-text"]["model"]
    assert model["source"] == "from_manifest" and model["manifest"] == "reverse-text-sft.yaml"
    assert model["architecture"] == plans["reverse-text-sft"]["model"]["architecture"]
    assert model["total_params"] == plans["reverse-text-sft"]["model"]["total_params"]


def test_plan_holds_no_secret_values_and_no_machine_paths(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_very_secret_value_123")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_secret_456")
    text = render_json(plan_json(MANIFESTS / "glm5.yaml"))
    assert "very_secret" not in text and "secret_456" not in text
    assert '"secrets":["HF_TOKEN","WANDB_API_KEY"]' in text  # names only
    assert str(REPO) not in text and "/home/" not in text and "/tmp/" not in text


def test_compile_is_pure_and_repeatable():
    from primebuild.builders.plan import compile_plan
    from primebuild.contracts.plan import render_json as render
    from primebuild.manifest.load import load_manifest

    loaded = load_manifest(MANIFESTS / "glm5.yaml")
    first = render(compile_plan(loaded, design=True))
    again = render(compile_plan(loaded, design=True))
    fresh = render(compile_plan(load_manifest(MANIFESTS / "glm5.yaml"), design=True))
    assert first == again == fresh


def test_formatting_and_comments_do_not_change_the_plan(tmp_path):
    import shutil

    shutil.copytree(MANIFESTS / "models", tmp_path / "models")
    text = (MANIFESTS / "qwen3-30b-a3b.yaml").read_text()
    reformatted = "# a new comment\n" + text.replace("hardware:\n", "\nhardware:   # the cluster\n")
    (tmp_path / "qwen3-30b-a3b.yaml").write_text(reformatted)
    a = plan_json(MANIFESTS / "qwen3-30b-a3b.yaml")
    b = plan_json(tmp_path / "qwen3-30b-a3b.yaml")
    assert a["plan_hash"] == b["plan_hash"]


def test_a_real_change_changes_the_hash():
    a = plan_json(MANIFESTS / "qwen3-30b-a3b.yaml")
    b = plan_json(MANIFESTS / "qwen3-30b-a3b.yaml", ["inference.port=9000"])
    assert a["plan_hash"] != b["plan_hash"] and a["manifest_hash"] != b["manifest_hash"]


def test_hsdp_reaches_the_trainer_and_the_memory_model_counts_no_saving():
    """dp_replicate multiplies the trainer's ranks (placement, torchrun) and reaches its config; per GPU it
    saves nothing: 2 replicas of 4 shards hold twice the parameters of 8 shards (primebuild/builders/memory.py)."""
    plan = plan_json(MANIFESTS / "reverse-text.yaml", ("hardware.cpus_per_node=4", "trainer.ranks=4",
                                                       "trainer.dp_replicate=2", "trainer.dp_shard=2"), design=False)
    (trainer,) = [p for p in plan["processes"] if p["role"] == "trainer"]
    assert trainer["config"]["parallel"] == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1}
    assert trainer["argv"][trainer["argv"].index("--nproc-per-node") + 1] == "4"

    def offloaded_shards(*sets: str) -> int:  # this manifest offloads params, grads and AdamW to the host
        return plan_json(MANIFESTS / "qwen3-30b-a3b.yaml", sets)["memory"]["trainer"]["host_offload_bytes_per_gpu"]

    fsdp = offloaded_shards("trainer.dp_shard=8")
    hsdp = offloaded_shards("trainer.dp_shard=4", "trainer.dp_replicate=2", "trainer.ep=4")
    assert fsdp > 0 and hsdp == pytest.approx(2 * fsdp, rel=1e-6)
    # a replicated trainer that does not fit is told to shard over its replicas' GPUs instead
    from primebuild.errors import UserError

    with pytest.raises(UserError) as err:
        plan_json(MANIFESTS / "qwen3-30b-a3b.yaml", ("trainer.dp_shard=4", "trainer.dp_replicate=2", "trainer.ep=4",
                                                     "trainer.optimizer.cpu_offload=false"))
    (problem,) = [p for p in err.value.problems if p.message.startswith("trainer:")]
    assert "dp_replicate: 1 with dp_shard: 8" in problem.hint
