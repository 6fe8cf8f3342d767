"""Process specs: the exact command, environment, ports, health check and typed config of every process.

Each process kind gets its config object from the manifest here, once (primebuild/contracts/); the
worker writes it to `{config}` and the process parses it back into the same class. Only vLLM, an
external program, is configured by its command line.
"""

from __future__ import annotations

from dataclasses import replace

from primebuild.builders.placement import Placement, ReplicaPlacement, Slot
from primebuild.builders.trainer_restart import trainer_restarts
from primebuild.builders.vllm_command import KV_CACHE_DTYPES, VllmServer, server_argv, server_env
from primebuild.contracts.dtypes import PRECISION_DTYPES
from primebuild.contracts.inference import BroadcastJoin, DisaggregationRole, InferenceServerConfig
from primebuild.contracts.orchestrator import (
    CurriculumConfig,
    EnvironmentConfig,
    OrchestratorConfig,
    ServerJoin,
    TeacherEndpoint,
)
from primebuild.contracts.plan import HEALTH_TIMEOUT_S, START_ORDER, HealthCheck, ProcessSpec, RestartPolicy
from primebuild.contracts.router import DecodeServer, RouterConfig, VllmPool, VllmRouterConfig
from primebuild.contracts.run_dir import RunDir
from primebuild.contracts.trackers import TensorboardConfig, TrackersConfig, WandbConfig
from primebuild.contracts.trainer import (
    BroadcastSync,
    FilesystemSync,
    LoraConfig,
    ParallelDims,
    TrainerConfig,
)
from primebuild.manifest.schema import InferenceGroup, Manifest

VLLM_CPU_KV_CACHE_GIB = 1  # vLLM on CPU sizes its KV cache in GiB (its default, 4, is for big models)

KV_PORT_OFFSET = 1000  # an embedded decode server's KV inbox listens at its HTTP port + this
NIXL_PORT_OFFSET = 2000  # vLLM P/D over NIXL: side channels from the first HTTP port + this, one per DP rank
NIXL_CONNECTORS = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")
EXAMPLE_CONNECTOR_BLOCK = 32  # ExampleConnector moves whole blocks; CPU attention takes multiples of 32 only
ONEDNN_PRIMITIVE_CACHE = 16  # oneDNN primitives the embedded CPU engine keeps (why: where it is set)

NEVER = RestartPolicy(policy="never", max_restarts=0)
ON_FAILURE = RestartPolicy(policy="on-failure", max_restarts=3)
ALIVE = HealthCheck(kind="process")


def build_processes(m: Manifest, placement: Placement, moe_layers: tuple[int, ...] = (),
                    checkpoint_quantized: str = "", trainer_engine: str = "hf") -> list[ProcessSpec]:
    """Every process of the plan; `moe_layers` (the model's MoE decoder layers) tells the orchestrator
    which routed-expert columns to carry when the manifest asks for router replay; `checkpoint_quantized`
    (the checkpoint's own quant_method, "" for bf16/fp32 weights) picks vLLM's FP8 option; `trainer_engine`
    is builders/trainer_engine.py's choice."""
    heads = [rp for rp in placement.inference]  # one HTTP server per replica, on its first node
    broadcast = m.weight_sync.mode == "broadcast"
    init_method = f"tcp://{{host:{placement.trainer[0].node}}}:{m.weight_sync.port}"
    first_ranks = weight_group_ranks(m, placement.inference)
    world = first_ranks[-1]  # trainer rank 0 sends; every worker of every server receives
    processes = _inference_processes(m, placement.inference, init_method if broadcast else None, world,
                                     checkpoint_quantized)
    if m.inference.disaggregation and m.inference.engine == "embedded":
        processes.append(_router_process(m, placement.orchestrator_node, processes, len(heads)))
    elif m.inference.disaggregation:
        processes.append(_vllm_router_process(m, processes, len(heads)))
    sync = (BroadcastSync(init_method=init_method, world_size=world, bucket_mb=m.weight_sync.bucket_mb,
                          delta=m.weight_sync.delta, fp8_served_dtype=fp8_on_the_wire(m)) if broadcast
            else FilesystemSync())
    if m.distill is not None:
        processes.append(_teacher_process(m, placement.teacher, len(heads), checkpoint_quantized))
    processes += _trainer_processes(m, placement.trainer, sync, trainer_engine)
    processes.append(_orchestrator_process(m, placement.orchestrator_node, processes, moe_layers, sync, first_ranks))
    return processes


def fp8_on_the_wire(m: Manifest) -> str | None:
    """The dtype FP8 servers quantise from, when the weights can cross already in their FP8 format: the
    embedded engine's (runtime/inference/server.py: fp32 on a CPU, bf16 on a GPU). vLLM's FP8 on a bf16
    checkpoint (`fp8_per_block`) quantises online at every reload, from bf16 weights: it is sent bf16."""
    if m.inference.precision != "fp8" or m.inference.engine != "embedded":
        return None
    return "float32" if m.hardware.gpu == "cpu" else "bfloat16"


def receiving_workers(m: Manifest, rp: ReplicaPlacement) -> int:
    """The workers of one inference server that receive a weight broadcast: every vLLM worker (tp x dp
    of its replica, all engine cores) holds a full copy or a shard and joins with a rank of its own;
    an embedded server is one process."""
    group = m.inference.groups[rp.group]
    return group.tp * group.dp if m.inference.engine == "vllm" else 1


def weight_group_ranks(m: Manifest, replicas: tuple[ReplicaPlacement, ...]) -> list[int]:
    """The first rank of each server in the trainer's weight group, and (last) the group's size: rank 0
    is the trainer's sender, then the servers' workers in plan order (P/D: prefill, then decode)."""
    ranks = [1]
    for rp in replicas:
        ranks.append(ranks[-1] + receiving_workers(m, rp))
    return ranks


def _spec(*, name: str, role: str, node: int, gpus, argv, env, ports=None, health=ALIVE, restart=NEVER,
          config=None, secrets=(), group: str | None = None, environment: str = "primebuild") -> ProcessSpec:
    return ProcessSpec(name=name, role=role, group=group or role, node=node, gpus=list(gpus), argv=argv, env=env,
                       ports=ports or {}, health=health, restart=restart, start_order=START_ORDER[role],
                       config=config, secrets=list(secrets), environment=environment,
                       terminal="errors" if environment == "vllm" else "warnings")


def _base_env(m: Manifest, gpus) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1", "PRIMEBUILD_RUN_DIR": "{run_dir}"}
    env["CUDA_VISIBLE_DEVICES"] = "" if m.hardware.gpu == "cpu" else ",".join(str(g) for g in gpus)
    return {**env, **m.hardware.network_env}  # the site's NCCL/gloo interfaces, as the manifest names them


def bind_host(m: Manifest, node: int) -> str:
    """What a server on `node` listens on: the manifest's `inference.host` when written, else `{bind:N}`
    (loopback on a single-host run, the node's address when clients come from other nodes)."""
    return m.inference.host or f"{{bind:{node}}}"


def _threads(m: Manifest, share: int) -> int:
    """CPU threads per process when processes share a CPU-only node (never oversubscribe)."""
    return max(1, m.hardware.cpus_per_node // share)


# --- inference ---------------------------------------------------------------------------------------------


def _inference_processes(m: Manifest, replicas: tuple[ReplicaPlacement, ...], init_method: str | None,
                         world: int, checkpoint_quantized: str = "") -> list[ProcessSpec]:
    inf = m.inference
    groups = inf.groups
    out = []
    side_channel = inf.port + NIXL_PORT_OFFSET  # the next free NIXL side-channel port
    for index, rp in enumerate(replicas):
        group = groups[rp.group]
        port = inf.port + index
        for node_rank, slot in enumerate(rp.slots):
            head = node_rank == 0
            name = f"{rp.group}-{rp.replica}" + (f"-n{node_rank}" if len(rp.slots) > 1 else "")
            env = _base_env(m, slot.gpus)
            config = None
            if inf.engine == "embedded":
                threads = inf.threads or (_threads(m, 2) if m.hardware.gpu == "cpu" else None)
                if threads:
                    env["OMP_NUM_THREADS"] = str(threads)  # before torch loads: OpenMP reads it once
                if m.hardware.gpu == "cpu":
                    # Continuous batching gives the matmuls a new shape at nearly every decode step and
                    # oneDNN keeps a primitive per shape (1,024 by default): the tiny default's server grew
                    # ~480 MiB RSS where 16 keep it ~425, at no more CPU time per request (bench/RESULTS.md)
                    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(ONEDNN_PRIMITIVE_CACHE)
                join = BroadcastJoin(init_method=init_method, rank=1 + index, world_size=world) if init_method else None
                role = None
                if inf.disaggregation:
                    role = DisaggregationRole(role=rp.group, kv_port=port + KV_PORT_OFFSET if rp.group == "decode" else None)
                config = InferenceServerConfig(
                    model_path="{model_path}", served_model_name=m.name, host=bind_host(m, slot.node), port=port,
                    max_num_seqs=inf.max_num_seqs, max_model_len=m.orchestrator.seq_len,
                    precision=inf.precision, seed=m.seed + index, num_threads=threads, weight_broadcast=join,
                    disaggregation=role, tool_call_parser=inf.tool_call_parser, batch_invariant=inf.batch_invariant)
                argv = ["{python}", "-m", "primebuild.runtime.inference.server", "--config", "{config}"]
            else:
                argv = _vllm_argv(m, rp, group, node_rank, port, broadcast=init_method is not None,
                                  checkpoint_quantized=checkpoint_quantized)
                env.update(server_env(cpu_kv_cache_gib=VLLM_CPU_KV_CACHE_GIB if m.hardware.gpu == "cpu" else None,
                                      routed_experts=inf.router_replay, lora=m.trainer.lora is not None,
                                      batch_invariant=inf.batch_invariant))
                if m.hardware.gpu == "cpu":
                    workers = receiving_workers(m, rp)
                    env["OMP_NUM_THREADS"] = str(max(1, (inf.threads or _threads(m, 2)) // workers))
                    # vllm-cpu's automatic binding pins the server's worker (every engine core of a
                    # data-parallel server, every server of the node) to the NUMA node's first core, where
                    # it spins at 100% even idle, while a CPU node always shares its cores with the run's
                    # other processes. Measured: dp=2 and two replicas, core ids [0] twice (a restarting
                    # server's start took ~4 min on 2 cores); one server beside the trainer: a restarted
                    # trainer hung at `import torch` (MKL counts cores by pinning itself to each in turn and
                    # never got core 0) until the hang watchdog restarted it again.
                    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            ports = {"http": port} if head else {}
            if inf.engine == "vllm" and inf.disaggregation and inf.disaggregation.kv_connector in NIXL_CONNECTORS:
                # vLLM's NIXL handshake listens at this port + the DP rank; the prefill's answer names host
                # and port to the decode server, so the host is the node's address, not a loopback
                env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=f"{{host:{slot.node}}}",
                           VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_channel))
                first_rank = node_rank * (group.dp // len(rp.slots))
                ports["nixl"] = side_channel + first_rank  # this node's first DP rank's
            if inf.engine == "vllm" and inf.disaggregation and node_rank == len(rp.slots) - 1:
                side_channel += group.dp
            if config is not None and config.disaggregation and config.disaggregation.kv_port:
                ports["kv"] = config.disaggregation.kv_port  # the decode server's KV inbox (ZMQ)
            if len(rp.slots) > 1 and head:
                ports["dp_rpc"] = port + 1000  # the replica's data-parallel coordinator listens here
            health = (HealthCheck(kind="http", url=f"http://{{host:{slot.node}}}:{port}/health",
                                  timeout_s=HEALTH_TIMEOUT_S) if head else ALIVE)
            # Under broadcast too: a restarted server rejoins the weight group in a new generation
            # (primebuild/runtime/weight_sync/membership.py) and is brought to the current weights.
            out.append(_spec(name=name, role=rp.group, node=slot.node, gpus=slot.gpus, argv=argv, env=env,
                             ports=ports, health=health, restart=ON_FAILURE, config=config,
                             environment="primebuild" if inf.engine == "embedded" else "vllm"))
    return out


def vllm_fp8_option(checkpoint_quantized: str) -> str:
    """vLLM 0.32's FP8 for `inference.precision: fp8`. A bf16/fp32 checkpoint: `fp8_per_block`, online
    quantisation into primebuild/kernels/fp8.py's format (128x128 weight blocks, dynamic 1x128 activation tiles; the
    lm_head and the MoE router gate stay unquantised): the same function as the embedded engine and the
    FP8 trainer. Plain `fp8` would refuse such a checkpoint at load ("no longer supports online
    quantization"); it is for checkpoints stored in FP8, whose own block scales vLLM then uses."""
    return "fp8" if checkpoint_quantized == "fp8" else "fp8_per_block"


def _vllm_server(m: Manifest, *, model_path: str, served: str, port: int, node: int, tp: int,
                 checkpoint_quantized: str) -> VllmServer:
    """What every vLLM server of the plan shares (the students' and the teacher's)."""
    inf = m.inference
    cpu = m.hardware.gpu == "cpu"
    return VllmServer(
        python="{python}", model_path=model_path, served_model_name=served, port=port, host=bind_host(m, node),
        seed=m.seed, max_model_len=m.orchestrator.seq_len, max_num_seqs=inf.max_num_seqs,
        dtype=PRECISION_DTYPES.get(inf.precision, "bfloat16"), enforce_eager=cpu, cpu=cpu,  # CUDA graphs on GPUs
        gpu_memory_utilization=None if cpu else inf.gpu_memory_utilization, tensor_parallel=tp,
        quantization=vllm_fp8_option(checkpoint_quantized) if inf.precision == "fp8" else None,
        kv_cache_dtype=KV_CACHE_DTYPES[inf.kv_cache_dtype])


def _vllm_argv(m: Manifest, rp: ReplicaPlacement, group: InferenceGroup, node_rank: int, port: int,
               broadcast: bool, checkpoint_quantized: str = "") -> list[str]:
    inf = m.inference
    server = replace(
        _vllm_server(m, model_path="{model_path}", served=m.name, port=port, node=rp.slots[node_rank].node,
                     tp=group.tp, checkpoint_quantized=checkpoint_quantized),
        weight_broadcast=broadcast, return_routed_experts=inf.router_replay, expert_parallel=group.ep > 1,
        max_lora_rank=m.trainer.lora.rank if m.trainer.lora else None, tool_call_parser=inf.tool_call_parser)
    if group.dp > 1:
        local = group.dp // len(rp.slots)
        multi = len(rp.slots) > 1
        server = replace(server, data_parallel=group.dp, data_parallel_local=local,
                         data_parallel_address=f"{{host:{rp.slots[0].node}}}" if multi else None,
                         data_parallel_rpc_port=port + 1000 if multi else None,
                         data_parallel_start_rank=node_rank * local if node_rank > 0 else None)
    if inf.disaggregation:
        role = "kv_producer" if rp.group == "prefill" else "kv_consumer"
        transfer = {"kv_connector": inf.disaggregation.kv_connector, "kv_role": role}
        if inf.disaggregation.kv_connector == "ExampleConnector":
            transfer["kv_connector_extra_config"] = {"shared_storage_path": str(RunDir("{run_dir}").kv_transfer)}
            server = replace(server, block_size=EXAMPLE_CONNECTOR_BLOCK)
        server = replace(server, kv_transfer=transfer)
    return server_argv(server)


TEACHER_PORT_OFFSET = 1  # the teacher listens after the servers' ports and the router's


def teacher_served_name(m: Manifest) -> str:
    """The model name the teacher's server answers to (and the orchestrator's scorer asks for)."""
    return f"{m.name}-teacher"


def _teacher_process(m: Manifest, slot: Slot, replicas: int, checkpoint_quantized: str = "") -> ProcessSpec:
    """On-policy distillation: one server of `inference.engine` holding the teacher's weights
    (`{teacher_model_path}`, resolved at start like the student's) on its slot (builders/placement.py: on GPU
    hardware `distill.tp` GPUs of a node of its own, on a CPU the orchestrator's node); it never receives
    weights. Both engines answer the scorer's `prompt_logprobs` requests (orchestrator/teacher.py)."""
    port = m.inference.port + replicas + TEACHER_PORT_OFFSET
    cpu = m.hardware.gpu == "cpu"
    inf = m.inference
    env = _base_env(m, slot.gpus)
    threads = inf.threads or (_threads(m, 2) if cpu else None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    health = HealthCheck(kind="http", url=f"http://{{host:{slot.node}}}:{port}/health", timeout_s=HEALTH_TIMEOUT_S)
    served = teacher_served_name(m)
    if inf.engine == "vllm":
        server = _vllm_server(m, model_path="{teacher_model_path}", served=served, port=port, node=slot.node,
                              tp=m.distill.tp, checkpoint_quantized=checkpoint_quantized)
        env.update(server_env(cpu_kv_cache_gib=VLLM_CPU_KV_CACHE_GIB if cpu else None,
                              batch_invariant=inf.batch_invariant))
        if cpu:  # unpinned, as the students' (_inference_processes says why)
            env["OMP_NUM_THREADS"] = str(max(1, threads // m.distill.tp))
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        return _spec(name="teacher-0", role="teacher", node=slot.node, gpus=slot.gpus, argv=server_argv(server),
                     env=env, ports={"http": port}, restart=ON_FAILURE, health=health, environment="vllm")
    config = InferenceServerConfig(
        model_path="{teacher_model_path}", served_model_name=served, host=bind_host(m, slot.node),
        port=port, max_num_seqs=inf.max_num_seqs, max_model_len=m.orchestrator.seq_len,
        precision=inf.precision, seed=m.seed, num_threads=threads, batch_invariant=inf.batch_invariant)
    return _spec(name="teacher-0", role="teacher", node=slot.node, gpus=slot.gpus,
                 argv=["{python}", "-m", "primebuild.runtime.inference.server", "--config", "{config}"],
                 env=env, ports={"http": port}, restart=ON_FAILURE, config=config, health=health)


def _router_process(m: Manifest, node: int, servers: list[ProcessSpec], replicas: int) -> ProcessSpec:
    """The P/D router of the embedded engine: the orchestrator's one endpoint, in front of both pools."""
    def url(p: ProcessSpec) -> str:
        return f"http://{{host:{p.node}}}:{p.ports['http']}"

    port = m.inference.port + replicas  # the first port after the servers'
    config = RouterConfig(
        served_model_name=m.name, host=bind_host(m, node), port=port,
        prefill=[url(p) for p in servers if p.role == "prefill"],
        decode=[DecodeServer(url=url(p), kv_address=f"tcp://{{host:{p.node}}}:{p.ports['kv']}")
                for p in servers if p.role == "decode"])
    env = _base_env(m, [])
    if m.hardware.gpu == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return _spec(name="router", role="router", node=node, gpus=[], env=env, ports={"http": port},
                 argv=["{python}", "-m", "primebuild.runtime.inference.router", "--config", "{config}"],
                 health=HealthCheck(kind="http", url=f"http://{{host:{node}}}:{port}/health",
                                    timeout_s=HEALTH_TIMEOUT_S),
                 restart=ON_FAILURE, config=config)


def _vllm_router_process(m: Manifest, servers: list[ProcessSpec], replicas: int) -> ProcessSpec:
    """vLLM's P/D router (primebuild/runtime/inference/vllm/pd_router.py), the orchestrator's one endpoint. It runs in
    the prefill group, on the first prefill server's node: on a target that allocates every group on its
    own (a Slurm het-job component), a plan node's address is that of the one group that listens there,
    and the router then listens on an address its own allocation has."""
    inf = m.inference
    heads = [p for p in servers if "http" in p.ports]
    host = heads[0]  # the first prefill server
    port = inf.port + replicas  # the first port after the servers'

    def pool(role: str) -> list[VllmPool]:
        group = inf.groups[role]
        return [VllmPool(url=f"http://{{host:{p.node}}}:{p.ports['http']}", ranks=group.tp * group.dp)
                for p in heads if p.role == role]

    example = inf.disaggregation.kv_connector == "ExampleConnector"
    config = VllmRouterConfig(
        served_model_name=m.name, host=bind_host(m, host.node), port=port, prefill=pool("prefill"),
        decode=pool("decode"), kv_storage_path=str(RunDir("{run_dir}").kv_transfer) if example else None,
        kv_block_size=EXAMPLE_CONNECTOR_BLOCK)
    env = _base_env(m, [])
    if m.hardware.gpu == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return _spec(name="router", role="router", group=host.group, node=host.node, gpus=[], env=env,
                 ports={"http": port},
                 argv=["{python}", "-m", "primebuild.runtime.inference.vllm.pd_router", "--config", "{config}"],
                 health=HealthCheck(kind="http", url=f"http://{{host:{host.node}}}:{port}/health",
                                    timeout_s=HEALTH_TIMEOUT_S),
                 restart=ON_FAILURE, config=config)


# --- trainer -----------------------------------------------------------------------------------------------


def _trainer_processes(m: Manifest, slots: tuple[Slot, ...], sync, engine: str) -> list[ProcessSpec]:
    t = m.trainer
    cpu = m.hardware.gpu == "cpu"
    nproc = (t.ranks or t.world_size) // len(slots) if cpu else len(slots[0].gpus)  # per node
    config = trainer_config(m, sync, engine)
    # the supervisor restarts every trainer process together, from the newest checkpoint (trainer_restart.py)
    restarts = trainer_restarts(m)
    restart = RestartPolicy(policy="on-failure", max_restarts=restarts) if restarts else NEVER
    out = []
    for rank, slot in enumerate(slots):
        env = _base_env(m, slot.gpus)
        if cpu:
            env["OMP_NUM_THREADS"] = str(_threads(m, 2 * nproc))
        # torchrun through our launcher: its rendezvous listens on the node's own address (loopback on
        # one host, a free port there), never on every interface (primebuild/runtime/trainer/launch.py).
        port = t.rendezvous_port if len(slots) > 1 else 0
        argv = ["{python}", "-m", "primebuild.runtime.trainer.launch", "--nnodes", str(len(slots)),
                "--node-rank", str(rank), "--master-addr", f"{{host:{slots[0].node}}}", "--master-port", str(port),
                "--bind", f"{{bind:{slot.node}}}", "--", "--nproc-per-node", str(nproc),
                "-m", "primebuild.runtime.trainer.main", "--config", "{config}"]
        if nproc == 1 and len(slots) == 1:  # one rank needs no launcher (and no rendezvous port)
            argv = ["{python}", "-m", "primebuild.runtime.trainer.main", "--config", "{config}"]
        ports = {"rendezvous": t.rendezvous_port} if rank == 0 and len(slots) > 1 else {}
        if sync.mode == "broadcast" and rank == 0:
            ports["weight_broadcast"] = m.weight_sync.port
        out.append(_spec(name="trainer" if len(slots) == 1 else f"trainer-n{rank}", role="trainer", node=slot.node,
                         gpus=slot.gpus, argv=argv, env=env, ports=ports, config=config, secrets=m.secrets,
                         restart=restart))
    return out


def trainer_config(m: Manifest, sync=None, engine: str = "hf") -> TrainerConfig:
    t, o = m.trainer, m.orchestrator
    return TrainerConfig(engine=engine,
        model_path="{model_path}", run_dir="{run_dir}", seed=m.seed,
        loss=o.loss, max_completion_tokens=o.max_completion_tokens, temperature=o.temperature,
        distill_weight=m.distill.weight if m.distill is not None else 0.0,
        optimizer=t.optimizer.name, lr=t.optimizer.lr, betas=t.optimizer.betas, weight_decay=t.optimizer.weight_decay,
        max_grad_norm=t.optimizer.max_grad_norm, warmup_steps=t.optimizer.warmup_steps, max_steps=o.max_steps,
        micro_batch_tokens=t.micro_batch_tokens, logprob_chunk_tokens=t.logprob_chunk_tokens,
        precision=t.precision, activation_checkpointing=t.activation_checkpointing,
        router_replay=m.inference.router_replay,
        parallel=ParallelDims(dp_replicate=t.dp_replicate, dp_shard=t.dp_shard, cp=t.cp, tp=t.tp, ep=t.ep),
        optimizer_cpu_offload=t.optimizer.cpu_offload,
        lora=LoraConfig(rank=t.lora.rank, alpha=t.lora.alpha, targets=list(t.lora.targets)) if t.lora else None,
        weight_sync=sync or FilesystemSync(), weight_dtype=m.model.dtype, checkpoint_every=t.checkpoint_every,
        keep_checkpoints=m.retention.keep_checkpoints, trackers=trackers_config(m))


def trackers_config(m: Manifest) -> TrackersConfig:
    """The manifest's trackers: section, as the trainer and the orchestrator feed them."""
    wandb, tensorboard = m.trackers.wandb, m.trackers.tensorboard
    return TrackersConfig(
        wandb=WandbConfig(project=wandb.project, entity=wandb.entity, mode=wandb.mode, group=m.name,
                          tags=list(wandb.tags), api_key_env=wandb.api_key_secret) if wandb else None,
        tensorboard=TensorboardConfig(flush_secs=tensorboard.flush_secs) if tensorboard else None)


# --- orchestrator ------------------------------------------------------------------------------------------


def _vllm_joins(m: Manifest, processes: list[ProcessSpec], endpoints: list[ProcessSpec],
                sync: BroadcastSync | FilesystemSync, first_ranks: list[int]) -> list[ServerJoin]:
    """vLLM servers join the weight group when the orchestrator asks: every server (each pool of a P/D
    split too), its workers from its first rank on. A server reached through a router (P/D) serves the
    router's endpoint."""
    if sync.mode != "broadcast" or m.inference.engine != "vllm":
        return []
    heads = [p for p in processes if "http" in p.ports and p.role in ("inference", "prefill", "decode")]
    return [ServerJoin(init_method=sync.init_method, rank=first, world_size=sync.world_size,
                       workers=after - first, url=f"http://{{host:{p.node}}}:{p.ports['http']}",
                       endpoint=endpoints.index(p) if p in endpoints else 0)
            for p, first, after in zip(heads, first_ranks[:-1], first_ranks[1:], strict=True)]


def _orchestrator_process(m: Manifest, node: int, processes: list[ProcessSpec], moe_layers: tuple[int, ...],
                          sync: BroadcastSync | FilesystemSync, first_ranks: list[int]) -> ProcessSpec:
    o = m.orchestrator
    # P/D: requests go to the router, which sends each through a prefill and a decode server.
    samplers = [p for p in processes if "http" in p.ports and p.role in ("inference", "decode")]
    servers = [p for p in processes if p.role == "router"] or samplers
    joins = _vllm_joins(m, processes, servers, sync, first_ranks)
    config = OrchestratorConfig(
        run_dir="{run_dir}", model_path="{model_path}", served_model_name=m.name, seq_len=o.seq_len,
        endpoints=[f"http://{{host:{p.node}}}:{p.ports['http']}/v1" for p in servers],
        # vLLM's max_num_seqs holds per DP rank of a replica; the embedded engine has one
        max_requests_per_endpoint=m.inference.max_num_seqs * max(g.dp for g in m.inference.groups.values())
        * -(-len(samplers) // len(servers)),
        weight_broadcast=joins,
        environments=[EnvironmentConfig(id=e.id, version=None if e.version == "latest" else e.version,
                                        args=dict(e.args), weight=e.weight) for e in m.environments],
        seed=m.seed, rollouts_per_step=o.rollouts_per_step, group_size=o.group_size,
        max_off_policy_steps=o.max_off_policy_steps, max_completion_tokens=o.max_completion_tokens,
        max_steps=o.max_steps, temperature=o.temperature, top_p=o.top_p,
        normalize_advantage_std=o.normalize_advantage_std, eval_every=o.eval_every, eval_prompts=o.eval_prompts,
        max_failed_groups_in_a_row=o.max_failed_groups_in_a_row, filter_zero_advantage=o.filter_zero_advantage,
        curriculum=None if o.curriculum is None else CurriculumConfig(
            prompts=o.curriculum.prompts, window=o.curriculum.window, easy_at=o.curriculum.easy_at,
            hard_at=o.curriculum.hard_at, mix=o.curriculum.mix.model_dump()),
        engine=m.inference.engine, weight_sync=m.weight_sync.mode, keep_weights=m.retention.keep_weights,
        trackers=trackers_config(m),
        router_replay=m.inference.router_replay,
        moe_layers=list(moe_layers) if m.inference.router_replay else [],
        teacher=next((TeacherEndpoint(url=f"http://{{host:{p.node}}}:{p.ports['http']}/v1",
                                      served_model_name=teacher_served_name(m))
                      for p in processes if p.role == "teacher"), None),
        # a restarted server may take as long to come back as the supervisor waits for its health
        retry_seconds=HEALTH_TIMEOUT_S)
    env = _base_env(m, [])
    if m.hardware.gpu == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return _spec(name="orchestrator", role="orchestrator", node=node, gpus=[],
                 argv=["{python}", "-m", "primebuild.runtime.orchestrator.main", "--config", "{config}"],
                 env=env, config=config, secrets=m.secrets)
