"""Property tests of the manifest loader and plan compiler.

1. Random *valid* manifests (GPU clusters with consistent parallel layouts, and CPU machines) compile,
   and compile deterministically: the same canonical JSON twice, every GPU owned by at most one
   process, unique process names, the hash matching the content.
2. Random *mutations* of the shipped manifests (keys deleted, renamed, values replaced by random
   scalars/lists/mappings, junk inserted into the text) end in a plan or a clean `UserError`, never
   in another exception (which the CLI would report as an internal error, exit 1).
"""

from __future__ import annotations

import shutil
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from conftest import MANIFESTS, SHIPPED
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from primebuild.builders.plan import compile_plan
from primebuild.contracts.plan import plan_hash
from primebuild.errors import UserError
from primebuild.hashing import canonical_json
from primebuild.manifest.load import load_manifest
from primebuild.manifest.schema import Manifest

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TINY = str(MANIFESTS / "models" / "reverse-text-tiny.json")  # 4 heads, 2 KV heads, dense
QWEN3 = str(MANIFESTS / "models" / "qwen3-30b-a3b.json")  # 32 heads, 4 KV heads, 128 experts


@pytest.fixture(scope="module")
def scratch() -> Path:
    """One folder for the whole module (hypothesis reruns a test body many times)."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        shutil.copytree(MANIFESTS / "models", root / "models")
        shutil.copytree(MANIFESTS / "data", root / "data")
        for path in SHIPPED:
            shutil.copy(path, root / path.name)
        yield root


def pow2_divisors(n: int, cap: int | None = None) -> list[int]:
    out = [d for d in (1, 2, 4, 8, 16, 32, 64) if n % d == 0]
    return [d for d in out if cap is None or d <= cap]


# --- valid manifests ---------------------------------------------------------------------------------------


@st.composite
def inference_group(draw, gpus_per_node: int, heads: int, moe: bool) -> tuple[dict, int]:
    """One group of replicas with a consistent layout, and the nodes it occupies."""
    nodes_per_replica = draw(st.sampled_from([1, 1, 2]))
    tp = draw(st.sampled_from(pow2_divisors(heads, cap=gpus_per_node)))
    if nodes_per_replica == 1:
        dp = draw(st.sampled_from(pow2_divisors(gpus_per_node // tp)))
    else:
        dp = nodes_per_replica * gpus_per_node // tp
    ep = draw(st.sampled_from(pow2_divisors(tp * dp))) if moe else 1
    replicas = draw(st.integers(1, 3))
    if nodes_per_replica == 1:
        nodes = -(-replicas * tp * dp // gpus_per_node)
    else:
        nodes = replicas * nodes_per_replica
    return {"replicas": replicas, "nodes_per_replica": nodes_per_replica, "tp": tp, "dp": dp, "ep": ep}, nodes


@st.composite
def gpu_manifest(draw) -> dict:
    moe = draw(st.booleans())
    facts, heads = (QWEN3, 32) if moe else (TINY, 4)
    gpus_per_node = draw(st.sampled_from([2, 4, 8]))
    disaggregated = draw(st.booleans())
    inference: dict = {"engine": "vllm" if disaggregated else draw(st.sampled_from(["vllm", "embedded"])),
                       "router_replay": moe and draw(st.booleans()),
                       "max_num_seqs": draw(st.sampled_from([8, 64, 256]))}
    if disaggregated:
        prefill, prefill_nodes = draw(inference_group(gpus_per_node, heads, moe))
        decode, decode_nodes = draw(inference_group(gpus_per_node, heads, moe))
        inference["disaggregation"] = {"prefill": prefill, "decode": decode}
        if inference["router_replay"]:  # vLLM 0.32 returns routed experts with none of the NIXL connectors
            inference["disaggregation"]["kv_connector"] = "LMCacheConnectorV1"
        inference_nodes = prefill_nodes + decode_nodes
    else:
        group, inference_nodes = draw(inference_group(gpus_per_node, heads, moe))
        inference.update(group)

    trainer_nodes = draw(st.integers(1, 2))
    idle_nodes = draw(st.sampled_from([0, 0, 1]))
    world = trainer_nodes * gpus_per_node
    if trainer_nodes == 1:
        world = draw(st.sampled_from(pow2_divisors(gpus_per_node)))
    tp = draw(st.sampled_from(pow2_divisors(min(heads, world), cap=gpus_per_node)))
    cp = draw(st.sampled_from(pow2_divisors(world // tp, cap=2)))
    dp_replicate = draw(st.sampled_from(pow2_divisors(world // tp // cp, cap=2)))
    dp_shard = world // (tp * cp * dp_replicate)
    ep = draw(st.sampled_from(pow2_divisors(dp_shard * cp))) if moe else 1
    seq_len = draw(st.sampled_from([1024, 4096] if moe else [64, 128]))  # the tiny model has 128 positions
    group_size = draw(st.sampled_from([2, 4, 8]))  # 1 trains on nothing (refused)
    two_envs = draw(st.booleans())  # a second environment needs a group of every step (builders/mixture.py)
    return {
        "apiVersion": "primebuild/v1",
        "name": draw(st.from_regex(r"[a-z][a-z0-9_.-]{0,20}", fullmatch=True)),
        "seed": draw(st.integers(0, 2**32 - 1)),
        "model": {"hf": "Qwen/Qwen3-30B-A3B", "facts": facts} if moe else {"init": "random", "facts": facts},
        "hardware": {"nodes": inference_nodes + trainer_nodes + idle_nodes, "gpus_per_node": gpus_per_node,
                     "gpu": draw(st.sampled_from(["h100", "h200", "b200"])), "gpu_memory_gb": 1024,
                     "host_memory_gb": 4096},
        "inference": inference,
        "trainer": {"nodes": trainer_nodes, "dp_shard": dp_shard, "dp_replicate": dp_replicate, "cp": cp, "tp": tp,
                    "ep": ep, "micro_batch_tokens": seq_len},
        "orchestrator": {"seq_len": seq_len, "max_completion_tokens": seq_len // 2, "group_size": group_size,
                         "rollouts_per_step": group_size * draw(st.integers(2 if two_envs else 1, 64)),
                         "max_off_policy_steps": draw(st.integers(0, 3))},
        "environments": [{"id": "reverse-text"}, *([{"id": "wordle", "weight": 0.5}] if two_envs else [])],
        "weight_sync": {"mode": draw(st.sampled_from(["filesystem", "broadcast"]))},
        "target": draw(st.sampled_from([{"kind": "local"}, {"kind": "slurm", "partition": "gpu"},
                                        {"kind": "ssh", "hosts": ["a", "b"]}, {"kind": "kubernetes"}])),
        "secrets": draw(st.lists(st.sampled_from(["HF_TOKEN", "WANDB_API_KEY"]), unique=True)),
    }


@st.composite
def cpu_manifest(draw) -> dict:
    ranks = draw(st.integers(1, 4))
    replicas = draw(st.integers(1, 3))
    return {
        "apiVersion": "primebuild/v1",
        "name": draw(st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True)),
        "model": {"init": "random", "facts": TINY, "tokenizer": "char", "dtype": "float32"},
        "hardware": {"gpu": "cpu", "gpus_per_node": 0, "cpus_per_node": draw(st.integers(max(replicas, ranks), 64)),
                     "host_memory_gb": 16},
        "inference": {"engine": "embedded", "precision": "fp32", "replicas": replicas,
                      "max_num_seqs": draw(st.sampled_from([1, 16, 128]))},
        "trainer": {"ranks": ranks, "dp_shard": ranks, "precision": "fp32", "micro_batch_tokens": 4096},
        "orchestrator": {"seq_len": 64, "max_completion_tokens": draw(st.integers(1, 64)),
                         "rollouts_per_step": 64, "group_size": draw(st.sampled_from([2, 8, 64]))},
        "environments": [{"id": "reverse-text"}],
    }


def compile_file(path: Path) -> dict:
    """The plan's JSON; design studies included (random GPU manifests ask for vLLM, TP, EP …)."""
    return compile_plan(load_manifest(path), design=True).to_json()


def check_plan(plan: dict, doc: dict) -> None:
    hw = doc["hardware"]
    assert plan["plan_hash"] == plan_hash(plan)
    names = [p["name"] for p in plan["processes"]]
    assert len(names) == len(set(names))
    owners = [(p["node"], g) for p in plan["processes"] for g in p["gpus"]]
    assert len(owners) == len(set(owners)), "a GPU is assigned twice"
    assert all(0 <= n < hw.get("nodes", 1) and 0 <= g < hw["gpus_per_node"] for n, g in owners)
    for p in plan["processes"]:
        assert p["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, p["gpus"]))
    roles = {p["role"] for p in plan["processes"]}
    assert {"trainer", "orchestrator"} <= roles and roles & {"inference", "prefill", "decode"}
    for node in plan["nodes"]:
        ports = [v for p in plan["processes"] if p["node"] == node["index"] for v in p["ports"].values()]
        assert len(ports) == len(set(ports)), f"port clash on node {node['index']}"
    joins = next(p for p in plan["processes"] if p["role"] == "orchestrator")["config"]["weight_broadcast"]
    if joins:  # vLLM + broadcast: every server joins, each worker with a rank of its own after the sender's 0
        heads = [p for p in plan["processes"] if "http" in p["ports"] and p["role"] in ("inference", "prefill", "decode")]
        assert [j["url"].rsplit(":", 1)[1] for j in joins] == [str(p["ports"]["http"]) for p in heads]
        sync = next(p for p in plan["processes"] if p["role"] == "trainer")["config"]["weight_sync"]
        assert sync["world_size"] == 1 + sum(j["workers"] for j in joins) == joins[0]["world_size"]


@SETTINGS
@given(doc=st.one_of(gpu_manifest(), cpu_manifest()))
def test_random_valid_manifests_plan_deterministically(doc, scratch):
    path = scratch / "valid.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    first = compile_file(path)
    second = compile_file(path)
    assert canonical_json(first) == canonical_json(second)
    check_plan(first, doc)
    if doc["hardware"]["gpu"] != "cpu":
        used = len([g for p in first["processes"] for g in p["gpus"]])
        idle = sum(1 for node in first["nodes"] for gpu in node["gpus"] if gpu["process"] is None)
        assert used + idle == doc["hardware"]["nodes"] * doc["hardware"]["gpus_per_node"]


# --- mutations of the shipped manifests --------------------------------------------------------------------

SHIPPED_DOCS = {p.name: yaml.safe_load(p.read_text()) for p in SHIPPED}


def field_names(model: type[BaseModel] = Manifest, seen: set | None = None) -> set[str]:
    """Every field name of the schema: inserted keys are real fields often enough to get past `extra`."""
    seen = seen if seen is not None else set()
    names: set[str] = set()
    for name, info in model.model_fields.items():
        names.add(name)
        for arg in [info.annotation, *typing.get_args(info.annotation)]:
            for inner in [arg, *typing.get_args(arg)]:
                if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in seen:
                    seen.add(inner)
                    names |= field_names(inner, seen)
    return names


FIELD_NAMES = sorted(field_names())
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(0, 70000),
                    st.floats(allow_nan=True, allow_infinity=True), TEXT,
                    st.sampled_from(["", "0", "-1", "1e400", "~", "yes", "../../x", "/etc/passwd", "a/b", "models"]))
KEYS = st.one_of(TEXT, st.sampled_from(FIELD_NAMES))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(TEXT, inner, max_size=3)), max_leaves=6)


def tweak(value: object) -> st.SearchStrategy:
    if isinstance(value, bool):
        return st.just(not value)
    if isinstance(value, int):
        return st.one_of(st.sampled_from([0, 1, 2, 3, 7, 16, 100, 4096, 65535, 2**31, value * 2, value // 2, value + 1]),
                         st.integers(-1, 10 * abs(value) + 10))
    if isinstance(value, float):
        return st.sampled_from([0.0, 0.5, 1.0, 1e-9, 1e9, value * 10, -value])
    if isinstance(value, str):
        return st.sampled_from([value.upper(), value + "x", "", "models/glm-5.json", "glm5.yaml", "reverse-text.yaml",
                                "a/b", "h100", "cpu", "vllm", "embedded", "fp8", "broadcast", "slurm", "NixlConnector"])
    return VALUES


def paths_of(value: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths_of(v, (*prefix, i))
    return out


def parent_of(doc: object, path: tuple) -> object:
    for part in path[:-1]:
        doc = doc[part]  # type: ignore[index]
    return doc


@st.composite
def mutated(draw) -> tuple[str, str]:
    name = draw(st.sampled_from(sorted(SHIPPED_DOCS)))
    doc = yaml.safe_load(yaml.safe_dump(SHIPPED_DOCS[name]))  # a deep copy
    for _ in range(draw(st.integers(1, 3))):
        # apiVersion has its own tests; hypothesis favours the first choice, so that is no top-level key
        paths = sorted((p for p in paths_of(doc) if p and p != ("apiVersion",)), key=lambda p: (-len(p), str(p)))
        path = draw(st.sampled_from(paths))
        parent, key = parent_of(doc, path), path[-1]
        action = draw(st.sampled_from(["tweak", "delete", "replace", "rename", "insert"]))
        if action == "tweak":  # a plausible value of the same kind: gets past the schema, reaches the compiler
            parent[key] = draw(tweak(parent[key]))
        elif action == "delete":
            del parent[key]
        elif action == "replace":
            parent[key] = draw(VALUES)
        elif action == "rename" and isinstance(parent, dict):
            parent[draw(KEYS)] = parent.pop(key)
        elif isinstance(parent, dict):
            parent[draw(KEYS)] = draw(VALUES)
        else:
            parent.insert(key, draw(VALUES))
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
    if draw(st.integers(0, 3)) == 0:  # junk in the text itself: YAML syntax, tabs, tags, anchors
        junk = draw(st.sampled_from([" # note", "\t", ":", "- ", "{", "]", "&a", "*a", "!!python/none", "!x ", "<<: ", "\n  ",
                                     "---\n", "%YAML 1.1\n", "\x00", "\ufeff", "#", '"', "? "]))
        at = draw(st.integers(0, len(text)))
        text = text[:at] + junk + text[at:]
    return name, text


@SETTINGS
@given(case=mutated())
def test_mutated_shipped_manifests_plan_or_fail_cleanly(case, scratch):
    name, text = case
    path = scratch / "mutant.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        plan = compile_file(path)
    except UserError as err:
        assert err.problems and all(p.message for p in err.problems)
        assert err.render()
        return
    assert plan["plan_hash"] == plan_hash(plan)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_manifests_survive_a_yaml_round_trip(path, scratch):
    """The property tests mutate YAML re-dumped from the shipped files: that alone must not change the plan."""
    copy = scratch / f"roundtrip-{path.name}"
    copy.write_text(yaml.safe_dump(yaml.safe_load(path.read_text()), sort_keys=False))
    assert compile_file(copy)["plan_hash"] == compile_file(scratch / path.name)["plan_hash"]
