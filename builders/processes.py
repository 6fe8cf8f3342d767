"""Process specs: the exact command, environment, ports and health check of every process in a plan.

Values known only when a run starts are written as placeholders that `primebuild worker` fills in
from the run's rendezvous file, so that one plan (and one plan hash) serves every host:

  {run_dir}     the run folder            {model_path}  the model folder resolved at start
  {config}      this process's config file, written by the worker from the plan's `config` field
  {host:N}      the address of node N     {python}      the interpreter running primebuild
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from primebuild.builders.placement import Placement, ReplicaPlacement, Slot
from primebuild.manifest.schema import InferenceGroup, Manifest

# Roles start in this order; each waits for the health of everything before it.
START_ORDER = {"inference": 0, "prefill": 0, "decode": 0, "trainer": 1, "orchestrator": 2}
# vLLM refuses routed-experts return with these KV connectors (docs: "Routed Experts Return").
CONNECTORS_WITHOUT_ROUTER_REPLAY = {"NixlConnector", "NixlPullConnector", "NixlPushConnector",
                                    "MoRIIOConnector", "MooncakeConnector"}


@dataclass
class ProcessSpec:
    name: str
    role: str  # inference | prefill | decode | trainer | orchestrator
    group: str
    node: int
    gpus: list[int]
    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int]
    health: dict | None
    restart: dict
    config: dict = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "name": self.name, "role": self.role, "group": self.group, "node": self.node, "gpus": self.gpus,
            "argv": self.argv, "env": self.env, "ports": self.ports, "health": self.health,
            "restart": self.restart, "start_order": START_ORDER[self.role], "config": self.config,
            "secrets": self.secrets,
        }


def build_processes(m: Manifest, placement: Placement, *, model_dtype: str) -> list[ProcessSpec]:
    processes = _inference_processes(m, placement.inference, model_dtype)
    processes += _trainer_processes(m, placement.trainer)
    if m.weight_sync.mode == "broadcast":
        _wire_broadcast(m, processes, placement.trainer[0].node)
    processes.append(_orchestrator_process(m, placement.orchestrator_node, processes))
    return processes


def _wire_broadcast(m: Manifest, processes: list[ProcessSpec], trainer_node: int) -> None:
    """One torch.distributed group: trainer rank 0 (group rank 0, hosting its TCP store) and every
    inference server head (group ranks 1..N). A server that dies cannot rejoin a live group, so in this
    mode inference is not restarted: the run stops and resumes from its checkpoint instead."""
    init = f"tcp://{{host:{trainer_node}}}:{m.weight_sync.port}"
    heads = [p for p in processes if p.role != "trainer" and "http" in p.ports]
    world = 1 + len(heads)
    for rank, p in enumerate(heads, start=1):
        if m.inference.engine == "embedded":
            p.argv += ["--weight-broadcast-init", init, "--weight-broadcast-rank", str(rank),
                       "--weight-broadcast-world", str(world)]
        p.restart = {"policy": "never", "max_restarts": 0}
    for p in processes:
        if p.role == "trainer":
            p.config.update(weight_sync="broadcast", broadcast_init_method=init, broadcast_world_size=world)


def _base_env(m: Manifest, gpus: tuple[int, ...] | list[int]) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1", "PRIMEBUILD_RUN_DIR": "{run_dir}"}
    if m.hardware.gpu == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


def _threads(m: Manifest, share: int) -> str:
    """CPU threads per process when processes share a CPU-only node (never oversubscribe)."""
    return str(max(1, m.hardware.cpus_per_node // share))


def _inference_processes(m: Manifest, replicas: tuple[ReplicaPlacement, ...], model_dtype: str) -> list[ProcessSpec]:
    inf = m.inference
    out = []
    groups = inf.groups
    for index, rp in enumerate(replicas):
        group = groups[rp.group]
        port = inf.port + index
        for node_rank, slot in enumerate(rp.slots):
            name = f"{rp.group}-{rp.replica}" + (f"-n{node_rank}" if len(rp.slots) > 1 else "")
            env = _base_env(m, slot.gpus)
            if inf.engine == "embedded":
                argv, config = _embedded_argv(m, port, model_dtype, index), {}
                if m.hardware.gpu == "cpu":
                    env["OMP_NUM_THREADS"] = str(inf.threads or _threads(m, 2))
            else:
                argv = _vllm_argv(m, rp, group, slot, node_rank, port, replicas)
                config = {}
                if inf.router_replay:
                    env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # routed-experts return needs model runner v2
            head = node_rank == 0
            ports = {"http": port} if head else {}
            if len(rp.slots) > 1 and head:
                ports["dp_rpc"] = port + 1000  # the replica's data-parallel coordinator listens here
            health = ({"kind": "http", "url": f"http://{{host:{slot.node}}}:{port}/health", "timeout_s": 1800}
                      if head else {"kind": "process"})
            out.append(ProcessSpec(
                name=name, role=rp.group, group=rp.group, node=slot.node, gpus=list(slot.gpus), argv=argv,
                env=env, ports=ports, health=health,
                restart={"policy": "on-failure", "max_restarts": 3}, config=config))
    return out


def _embedded_argv(m: Manifest, port: int, model_dtype: str, index: int) -> list[str]:
    inf = m.inference
    return ["{python}", "-m", "primebuild.runtime.inference.server",
            "--model", "{model_path}", "--served-model-name", m.name,
            "--host", inf.host, "--port", str(port),
            "--max-num-seqs", str(inf.max_num_seqs), "--max-model-len", str(m.orchestrator.seq_len),
            "--dtype", model_dtype, "--seed", str(m.seed + index)]


def _vllm_argv(m: Manifest, rp: ReplicaPlacement, group: InferenceGroup, slot: Slot, node_rank: int, port: int,
               replicas: tuple[ReplicaPlacement, ...]) -> list[str]:
    inf = m.inference
    argv = ["vllm", "serve", "{model_path}", "--served-model-name", m.name,
            "--host", inf.host, "--port", str(port), "--seed", str(m.seed),
            "--tensor-parallel-size", str(group.tp),
            "--max-num-seqs", str(inf.max_num_seqs), "--max-model-len", str(m.orchestrator.seq_len),
            "--gpu-memory-utilization", str(inf.gpu_memory_utilization)]
    if group.dp > 1:
        local = group.dp // len(rp.slots)
        argv += ["--data-parallel-size", str(group.dp), "--data-parallel-size-local", str(local)]
        if len(rp.slots) > 1:
            argv += ["--data-parallel-address", f"{{host:{rp.slots[0].node}}}",
                     "--data-parallel-rpc-port", str(port + 1000)]
            if node_rank > 0:
                argv += ["--headless", "--data-parallel-start-rank", str(node_rank * local)]
    if group.ep > 1:
        argv += ["--enable-expert-parallel"]
    if inf.precision == "fp8":
        argv += ["--quantization", "fp8"]
    if inf.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", inf.kv_cache_dtype]
    if inf.router_replay:
        argv += ["--enable-return-routed-experts"]
    if inf.disaggregation:
        role = "kv_producer" if rp.group == "prefill" else "kv_consumer"
        transfer = {"kv_connector": inf.disaggregation.kv_connector, "kv_role": role}
        argv += ["--kv-transfer-config", json.dumps(transfer, sort_keys=True, separators=(",", ":"))]
    return argv


def _trainer_processes(m: Manifest, slots: tuple[Slot, ...]) -> list[ProcessSpec]:
    t = m.trainer
    cpu = m.hardware.gpu == "cpu"
    nproc = (t.ranks or t.world_size) if cpu else len(slots[0].gpus)
    out = []
    for rank, slot in enumerate(slots):
        name = "trainer" if len(slots) == 1 else f"trainer-n{rank}"
        env = _base_env(m, slot.gpus)
        if cpu:
            env["OMP_NUM_THREADS"] = str(_threads(m, 2 * nproc))
        if len(slots) == 1:
            launcher = ["--standalone", "--nnodes", "1"]
        else:
            launcher = ["--nnodes", str(len(slots)), "--node-rank", str(rank), "--rdzv-backend", "c10d",
                        "--rdzv-id", m.name, "--rdzv-endpoint", f"{{host:{slots[0].node}}}:{t.rendezvous_port}"]
        argv = ["{python}", "-m", "torch.distributed.run", *launcher, "--nproc-per-node", str(nproc),
                "-m", "primebuild.runtime.trainer.main", "--config", "{config}"]
        if nproc == 1 and len(slots) == 1:  # one rank needs no launcher (and no rendezvous port)
            argv = ["{python}", "-m", "primebuild.runtime.trainer.main", "--config", "{config}"]
        ports = {"rendezvous": t.rendezvous_port} if rank == 0 and len(slots) > 1 else {}
        if m.weight_sync.mode == "broadcast" and rank == 0:
            ports["weight_broadcast"] = m.weight_sync.port
        out.append(ProcessSpec(
            name=name, role="trainer", group="trainer", node=slot.node, gpus=list(slot.gpus), argv=argv, env=env,
            ports=ports, health={"kind": "process"}, restart={"policy": "never", "max_restarts": 0},
            config=_trainer_config(m), secrets=list(m.secrets)))
    return out


def _trainer_config(m: Manifest) -> dict:
    """The trainer's TrainerConfig (runtime/trainer/config.py); FSDP degree comes from torchrun's world."""
    t, o = m.trainer, m.orchestrator
    return {
        "model_path": "{model_path}", "run_dir": "{run_dir}", "seed": m.seed, "resume": True,
        "loss": o.loss.name, "loss_params": _loss_params(o.loss), "temperature": max(o.temperature, 1e-6),
        "max_completion_tokens": o.max_completion_tokens,
        "lr": o.lr, "warmup_steps": o.warmup_steps, "optimizer": t.optimizer.name, "betas": list(t.optimizer.betas),
        "weight_decay": t.optimizer.weight_decay, "max_grad_norm": t.optimizer.max_grad_norm,
        "micro_batch_tokens": t.micro_batch_tokens, "max_steps": o.max_steps,
        "dtype": {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}[t.precision],
        "activation_checkpointing": t.activation_checkpointing, "checkpoint_every": t.checkpoint_every,
        "weight_sync": "filesystem",
        "poll_interval_s": 0.01,  # a new batch is a file: noticing it late idles the trainer for nothing
    }


def _loss_params(loss) -> dict:
    """Manifest loss fields -> the keyword parameters of runtime/trainer/losses.py."""
    return {
        "dppo-kl": {"delta": loss.mask_bound, "kl_tau": loss.kl_tau},
        "aipo": {"rho": loss.is_cap},
        "grpo": {"eps_low": loss.clip_low, "eps_high": loss.clip_high},
        "cispo": {"eps_high": loss.is_cap},
    }[loss.name]


def _orchestrator_process(m: Manifest, node: int, processes: list[ProcessSpec]) -> ProcessSpec:
    o = m.orchestrator
    endpoints: dict[str, list[str]] = {}
    for p in processes:
        if "http" in p.ports:
            endpoints.setdefault(p.role, []).append(f"http://{{host:{p.node}}}:{p.ports['http']}/v1")
    config = {
        "run_dir": "{run_dir}", "model_path": "{model_path}", "seed": m.seed, "served_model_name": m.name,
        "endpoints": endpoints, "environments": [e.model_dump(mode="json") for e in m.environments],
        **o.model_dump(mode="json", exclude={"loss", "port"}),
        "loss": o.loss.name, "weight_sync": m.weight_sync.mode, "router_replay": m.inference.router_replay,
    }
    env = _base_env(m, [])
    if m.hardware.gpu == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return ProcessSpec(
        name="orchestrator", role="orchestrator", group="orchestrator", node=node, gpus=[],
        argv=["{python}", "-m", "primebuild.runtime.orchestrator.main", "--config", "{config}"],
        env=env, ports={}, health={"kind": "process"}, restart={"policy": "never", "max_restarts": 0},
        config=config, secrets=list(m.secrets))
