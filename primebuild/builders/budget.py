"""Memory budget and time estimates of a placed manifest, in the plan's JSON shape.

This file only adapts the manifest to the formulas in memory.py and timing.py (docs/planning.md) and
turns "does not fit" into problems that name the group, the shortfall and concrete fixes.
"""

from __future__ import annotations

import dataclasses
import math

from primebuild.builders.capabilities import applies
from primebuild.builders.hardware import GIB, gpu_spec
from primebuild.builders.lora import adapter_params
from primebuild.builders.memory import (
    CPU_EAGER_ACTIVATION_FACTOR,
    HF_EAGER_ACTIVATION_FACTOR,
    broadcast_staging_bytes,
    delta_copy_bytes,
    dtype_bytes,
    inference_memory_per_gpu,
    trainer_memory_per_gpu,
    weight_bytes,
)
from primebuild.builders.model_facts import ModelFacts
from primebuild.builders.orchestrator_memory import orchestrator_memory
from primebuild.builders.placement import Placement
from primebuild.builders.rollout_time import Costs, Profile, profile_times
from primebuild.builders.timing import (
    cpu_costs,
    cpu_weight_sync_estimate,
    gpu_costs,
    step_time_estimate,
    suggest_split,
    teacher_scoring_seconds,
    weight_sync_estimate,
)
from primebuild.builders.vllm_cpu_memory import vllm_cpu_server
from primebuild.contracts.estimates import Estimates, ProfileTimes, SuggestedSplit, WeightSyncEstimate
from primebuild.contracts.memory import (
    GroupMemory,
    InferenceBreakdown,
    InferenceGroupMemory,
    TrainerBreakdown,
    TrainerGroupMemory,
)
from primebuild.errors import Problem, UserError
from primebuild.manifest.schema import Manifest

# A CPU process has no CUDA context or NCCL buffers: the interpreter, torch and allocator slack.
CPU_PROCESS_OVERHEAD = 512 * 1024**2
# The embedded engine's server on a CPU, beside its weights and KV slots: its RSS grows through a run as glibc
# keeps what continuous batching frees (tensors of ever new shapes). Peak RSS of 700-step runs: 580 MiB
# (reverse-text), 676 MiB (reverse-text-pd's decode server), the model and KV ~40 MiB of it
# (bench/RESULTS.md, "The embedded server's memory over a run").
EMBEDDED_SERVER_OVERHEAD = 640 * 1024**2
_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp8": "bf16"}  # fp8 training keeps bf16 params, fp8 matmuls


def compute(m: Manifest, f: ModelFacts, placement: Placement, *, design: bool = False,
            teacher: ModelFacts | None = None) -> tuple[dict[str, GroupMemory], Estimates, list[Problem], list[str]]:
    """Return (memory by group, estimates, problems, warnings). Suggested fixes are only ones the plan's
    backends apply (in a design study: any). `teacher`: the distillation teacher's facts (its server is
    counted as a group of its own)."""
    def can(field: str, value: object) -> bool:
        return design or applies(m, field, value, f)

    hw = m.hardware
    host_bytes = int(hw.host_memory_gb * GIB)
    spec = gpu_spec(hw.gpu, host_memory_bytes=host_bytes)
    capacity = int(hw.gpu_memory_gb * GIB) if hw.gpu_memory_gb else spec.memory_bytes
    cpu = hw.gpu == "cpu"
    per = "per process" if cpu else "per GPU"  # a CPU plan's budgets are each process's share of host memory
    memory: dict[str, GroupMemory] = {}
    problems: list[Problem] = []
    warnings: list[str] = []
    inference_section = "inference.disaggregation" if m.inference.disaggregation else "inference"

    # The embedded engine's FP8 on a CPU multiplies in fp32 by a dequantised copy of each FP8 weight
    # (primebuild/runtime/inference/weights.py): fp32 weights plus the 1-byte ones, not less memory.
    cpu_fp8 = cpu and m.inference.precision == "fp8"
    # Broadcast: every receiving worker stages up to two buckets while it loads an update; with delta each
    # end also keeps the last synced weights in host memory (on a CPU node: the process's own memory).
    sync = m.weight_sync
    broadcast = sync.mode == "broadcast"
    staging = broadcast_staging_bytes(f, m.model.dtype, int(sync.bucket_mb * 2**20)) if broadcast else 0
    delta_copy = delta_copy_bytes(f, m.model.dtype) if broadcast and sync.delta else 0
    for name, g in m.inference.groups.items():
        mem = inference_memory_per_gpu(
            f, precision="fp32" if cpu_fp8 else m.inference.precision, kv_cache_dtype=m.inference.kv_cache_dtype,
            tp=g.tp, ep=g.ep,
            dp=g.dp, gpu_memory_bytes=capacity, gpu_memory_utilization=m.inference.gpu_memory_utilization,
            max_num_seqs=m.inference.max_num_seqs, seq_len=m.orchestrator.seq_len,
            overhead_bytes=EMBEDDED_SERVER_OVERHEAD if cpu else None)  # vLLM's: its processes', below
        kv_cache = max(mem.kv_cache_bytes, 0)
        if cpu_fp8:
            mem = dataclasses.replace(mem, weights=mem.weights + f.param_counts().matmul_weights)
        kv_tokens = kv_cache // mem.kv_bytes_per_token
        seqs, staging_workers = m.inference.max_num_seqs, 1
        if cpu and m.inference.engine == "vllm":
            # one server's processes (builders/vllm_cpu_memory.py): a KV cache of fixed size per worker,
            # the weights once per worker (sharded by tp), the staging once per receiving worker
            server = vllm_cpu_server(g.tp, g.dp)
            mem = dataclasses.replace(mem, weights=mem.weights * server.workers,
                                      activations=mem.activations * server.workers, overhead=server.overhead)
            kv_cache, staging_workers = server.kv_cache, server.workers
            kv_tokens, seqs = server.kv_cache_per_worker // mem.kv_bytes_per_token * g.dp, seqs * g.dp
        elif cpu:  # the embedded engine preallocates exactly max_num_seqs full-length slots
            kv_cache = seqs * m.orchestrator.seq_len * mem.kv_bytes_per_token
            kv_tokens = kv_cache // mem.kv_bytes_per_token
        worker_staging = (staging + (delta_copy if cpu else 0)) * staging_workers
        used = mem.weights + mem.activations + mem.overhead + kv_cache + worker_staging
        memory[name] = InferenceGroupMemory(
            role=name, capacity_bytes=capacity, budget_bytes=mem.budget, used_bytes=used,
            free_bytes=capacity - used, fits=used <= capacity if cpu else mem.fits and used <= capacity,
            breakdown=InferenceBreakdown(weights=mem.weights, activations=mem.activations, overhead=mem.overhead,
                                         kv_cache=kv_cache, weight_staging=worker_staging),
            kv_bytes_per_token=mem.kv_bytes_per_token,
            kv_tokens_capacity=kv_tokens if cpu else mem.kv_tokens_capacity,
            max_concurrent_seqs=seqs if cpu else mem.max_concurrent_seqs_total,
        )
        if not mem.fits:
            path = f"{inference_section}.{name}" if m.inference.disaggregation else inference_section
            short = mem.weights + mem.activations + mem.overhead - mem.budget
            problems.append(Problem(
                f"{name}: weights {_g(mem.weights)} + activations {_g(mem.activations)} + overhead "
                f"{_g(mem.overhead)} GiB leave no room for one {m.orchestrator.seq_len}-token sequence in "
                f"{_g(mem.budget)} GiB {per}" + (f" (short by {_g(short)} GiB)" if short > 0 else ""),
                field=f"{path}.tp",
                hint=_inference_fixes(m, g.tp * g.dp, hw.gpus_per_node, can)))
        elif not cpu and used > capacity:  # vLLM fills its budget with KV cache: staging lives outside it
            problems.append(Problem(
                f"{name}: weight-sync staging {_g(staging)} GiB (two buckets) does not fit beside vLLM's budget "
                f"({_g(mem.budget)} of {_g(capacity)} GiB per GPU)", field="weight_sync.bucket_mb",
                hint="lower weight_sync.bucket_mb or inference.gpu_memory_utilization"))

    if teacher is not None:
        memory["teacher"] = _teacher_memory(m, teacher, capacity)
        if not memory["teacher"].fits:
            t = memory["teacher"]
            problems.append(Problem(
                f"teacher: weights {_g(t.breakdown.weights)} + activations {_g(t.breakdown.activations)} + overhead "
                f"{_g(t.breakdown.overhead)} GiB leave no room for one {m.orchestrator.seq_len}-token sequence in "
                f"{_g(t.budget_bytes)} GiB {per}", field="distill.tp",
                hint="more GPUs for the teacher (distill.tp), fp8 (inference.precision), or a smaller teacher"))

    t = m.trainer
    tmem = _trainer_memory(m, f, capacity, t.dp_shard)
    breakdown = TrainerBreakdown(**{k: getattr(tmem, k) for k in TrainerBreakdown.model_fields})
    # on CPU hardware what FSDP offloads stays in the same process's host memory: it counts there
    used = tmem.total + (tmem.host_bytes if cpu else 0)
    memory["trainer"] = TrainerGroupMemory(
        role="trainer", capacity_bytes=capacity, budget_bytes=capacity, used_bytes=used, free_bytes=capacity - used,
        fits=used <= capacity, breakdown=breakdown, host_offload_bytes_per_gpu=tmem.host_bytes,
        tokens_per_gpu=tmem.tokens_per_gpu)
    if used > capacity:
        offloaded = f", offloaded to host {_g(tmem.host_bytes)}" if cpu and tmem.host_bytes else ""
        problems.append(Problem(
            f"trainer: {_g(used)} GiB {per} needed, {_g(capacity)} GiB available (short by "
            f"{_g(used - capacity)} GiB): " + ", ".join(f"{k} {_g(v)}" for k, v in breakdown if v) + offloaded,
            field="trainer.dp_shard", hint=_trainer_fixes(m, tmem, can)))
    orchestrator = memory["orchestrator"] = orchestrator_memory(m, host_bytes)
    if not orchestrator.fits:
        problems.append(Problem(
            f"orchestrator: its node's processes need {_g(orchestrator.used_bytes)} GiB of host memory ("
            + ", ".join(f"{k} {_g(v)}" for k, v in orchestrator.breakdown if v)
            + f"; {orchestrator.programs_in_flight} episode programs at once), hardware.host_memory_gb is "
            f"{hw.host_memory_gb:g}", field="orchestrator.rollouts_per_step",
            hint="fewer episodes in flight: lower rollouts_per_step, max_off_policy_steps or eval_prompts"))
    need = _host_bytes_per_node(tmem, t.world_size, hw)
    if hw.gpu != "cpu" and need > host_bytes:
        problems.append(Problem(
            f"trainer: CPU-offloaded shards need {_g(need)} GiB of host memory per node, "
            f"hardware.host_memory_gb is {hw.host_memory_gb:g}", field="trainer.optimizer.cpu_offload",
            hint="shard over more GPUs (dp_shard) or keep the optimizer on the GPU"))

    if delta_copy and not cpu:
        workers = hw.gpus_per_node * delta_copy  # one copy per receiving worker on an inference node
        sender = delta_copy + need  # trainer rank 0's node: its copy beside what the ranks offload
        for where, held in (("an inference node", workers), ("trainer rank 0's node", sender)):
            if held > host_bytes:
                problems.append(Problem(
                    f"weight_sync.delta keeps the last synced weights ({_g(delta_copy)} GiB) per receiving worker "
                    f"and on the sender: {_g(held)} GiB of host memory on {where}, hardware.host_memory_gb is "
                    f"{hw.host_memory_gb:g}", field="weight_sync.delta", hint="turn delta off"))
    if hw.gpu == "cpu":
        total = sum(v.used_bytes * _process_count(m, k) for k, v in memory.items()) + delta_copy  # the sender's
        if total > host_bytes:
            problems.append(Problem(
                f"all processes together need {_g(total)} GiB but the node has {hw.host_memory_gb:g} GiB",
                field="hardware.host_memory_gb", hint="lower inference.max_num_seqs or use a smaller model"))

    estimates = _estimates(m, f, placement, spec, memory, capacity, teacher)
    return memory, estimates, problems, warnings


def _trainer_memory(m: Manifest, f: ModelFacts, capacity: int, dp_shard: int):
    t = m.trainer
    param = _DTYPE[t.precision]
    adapters = adapter_params(f, t.lora.rank, t.lora.targets) if t.lora else None
    return trainer_memory_per_gpu(
        f, adapter_params=adapters, param_dtype=param, master_dtype=None if param == "fp32" else "fp32", grad_dtype="fp32",
        optimizer=t.optimizer.name, optimizer_cpu_offload=t.optimizer.cpu_offload, dp_shard=dp_shard,
        dp_replicate=t.dp_replicate, cp=t.cp, ep=t.ep, tp=t.tp,
        activation_checkpointing=t.activation_checkpointing, micro_batch_tokens=t.micro_batch_tokens,
        seq_len=m.orchestrator.seq_len, gpu_memory_bytes=capacity,
        activation_dtype="fp32" if param == "fp32" else "bf16", logits_chunk_tokens=t.logprob_chunk_tokens,
        overhead_bytes=CPU_PROCESS_OVERHEAD if m.hardware.gpu == "cpu" else None,
        activation_factor=CPU_EAGER_ACTIVATION_FACTOR if m.hardware.gpu == "cpu" else HF_EAGER_ACTIVATION_FACTOR)


def sft_trainer_memory(m: Manifest, f: ModelFacts, config) -> tuple[dict[str, GroupMemory], list[Problem]]:
    """The SFT build's ranks (primebuild/runtime/trainer/sft.py): the RL trainer's memory model for what
    they run: fp32 weights, gradients and AdamW state sharded over `ranks` (FSDP2), no activation
    checkpointing, one packed row of `micro_batch_tokens` at a time, log-probs in chunks; for an
    environment's SFT, rank 0's greedy-validation copy of the weights (host memory)."""
    hw = m.hardware
    cpu = hw.gpu == "cpu"
    capacity = int(hw.host_memory_gb * GIB) if cpu else (
        int(hw.gpu_memory_gb * GIB) if hw.gpu_memory_gb else gpu_spec(hw.gpu).memory_bytes)
    tmem = trainer_memory_per_gpu(
        f, param_dtype="fp32", master_dtype=None, grad_dtype="fp32", optimizer="adamw", dp_shard=config.ranks,
        activation_checkpointing=False, micro_batch_tokens=config.micro_batch_tokens,
        seq_len=config.micro_batch_tokens, gpu_memory_bytes=capacity, activation_dtype="fp32",
        logits_chunk_tokens=config.logprob_chunk_tokens, overhead_bytes=CPU_PROCESS_OVERHEAD if cpu else None,
        activation_factor=CPU_EAGER_ACTIVATION_FACTOR if cpu else HF_EAGER_ACTIVATION_FACTOR)
    # An environment's SFT (EnvSFTConfig): rank 0 keeps a transformers copy of the full fp32 weights for
    # the greedy validation and gathers a second one to refresh it (runtime/trainer/env_sft.py GreedyJudge);
    # it lives in host memory on either device.
    judge = 2 * sum(weight_bytes(f, "fp32")) if getattr(config, "kind", "") == "env-sft" else 0
    parts = {k: getattr(tmem, k) for k in TrainerBreakdown.model_fields}
    parts["overhead"] += judge if cpu else 0
    breakdown = TrainerBreakdown(**parts)
    rank0 = tmem.total + (judge if cpu else 0)
    used = tmem.total * (config.ranks if cpu else 1) + (judge if cpu else 0)  # CPU ranks share the host
    memory = {"sft-trainer": TrainerGroupMemory(  # rank 0, as the plan shows every group
        role="sft-trainer", capacity_bytes=capacity, budget_bytes=capacity, used_bytes=rank0,
        free_bytes=capacity - used, fits=used <= capacity, breakdown=breakdown, host_offload_bytes_per_gpu=0,
        tokens_per_gpu=tmem.tokens_per_gpu)}
    problems = []
    if used > capacity:
        where = f"{config.ranks} CPU rank(s) need" if cpu else "each GPU rank needs"
        problems.append(Problem(
            f"sft: {where} {_g(used)} GiB, {_g(capacity)} GiB available: " +
            ", ".join(f"{k} {_g(v)}" for k, v in breakdown if v), field="sft.micro_batch_tokens",
            hint="lower sft.micro_batch_tokens, or shard over more ranks (sft.ranks)"))
    return memory, problems


def _host_bytes_per_node(tmem, trainer_gpus: int, hw) -> int:
    """What a node's trainer ranks offload to its host memory (optimizer.cpu_offload)."""
    return tmem.host_bytes * min(trainer_gpus, hw.gpus_per_node)


def cpu_sync_estimate(m: Manifest, f: ModelFacts) -> WeightSyncEstimate:
    """The plan's seconds per weight sync on a CPU node: the weights in the trainer's precision, to every
    inference server (timing.cpu_weight_sync_estimate)."""
    receivers = sum(g.replicas for g in m.inference.groups.values())
    dtype = _DTYPE[m.trainer.precision]
    lora = m.trainer.lora
    size = (math.ceil(adapter_params(f, lora.rank, lora.targets) * dtype_bytes(dtype)) if lora  # the adapter only
            else sum(weight_bytes(f, dtype)))
    return cpu_weight_sync_estimate(size, mode=m.weight_sync.mode, receivers=receivers)


def _estimates(m: Manifest, f: ModelFacts, placement: Placement, spec, memory: dict[str, GroupMemory],
               capacity: int, teacher: ModelFacts | None = None) -> Estimates:
    hw, o = m.hardware, m.orchestrator
    inference_gpus = sum(len(s.gpus) for rp in placement.inference for s in rp.slots)
    trainer_gpus = sum(len(s.gpus) for s in placement.trainer)
    groups = m.inference.groups
    decode_name = "decode" if "decode" in groups else "inference"
    decode_replicas = groups[decode_name].replicas
    decode_memory = memory[decode_name]
    assert isinstance(decode_memory, InferenceGroupMemory)
    decode_seqs = max(1, decode_memory.max_concurrent_seqs)  # full-length sequences one decode replica runs
    prefill_gpus = (groups["prefill"].replicas * groups["prefill"].gpus_per_replica) if "prefill" in groups else 0
    if hw.gpu == "cpu":
        sync = cpu_sync_estimate(m, f)
        servers = sum(g.replicas for g in m.inference.groups.values())
        sync_line = (f"weight sync ({sync.mode}): {sync.bytes / 1e6:,.1f} MB per step to {servers} server"
                     f"{'s' if servers > 1 else ''}, ~{sync.seconds:,.3f} s")
        if o.rollout_profile is None:
            return Estimates(weight_sync=sync, summary=[
                "CPU run: step times are measured by `primebuild run`, not predicted", sync_line])
        costs = cpu_costs(f, m.hardware.cpus_per_node, sync.seconds, batch_invariant=m.inference.batch_invariant,
                          inference_threads=m.inference.threads)
        profile = _profile_times(m, costs, replicas=decode_replicas,
                                 max_concurrent=m.inference.max_num_seqs)
        return Estimates(weight_sync=sync, profile=profile,
                         summary=["CPU run (embedded engine; per-token and per-request costs calibrated on the 2-core "
                                  "CI machine, primebuild/builders/timing.py)", sync_line, *_profile_summary(profile)])

    sync = weight_sync_estimate(
        f, dtype=_DTYPE[m.trainer.precision],
        bandwidth_bytes_per_s=(hw.inter_node_bandwidth_gb_s if m.weight_sync.mode == "broadcast"
                               else hw.storage_bandwidth_gb_s) * 1e9,
        mode=m.weight_sync.mode, trainer_gpus=trainer_gpus, inference_gpus=inference_gpus,
        inference_replicas=sum(g.replicas for g in groups.values()))
    precision = m.inference.precision if m.inference.precision != "fp32" else "bf16"
    teacher_s = 0.0
    if teacher is not None and placement.teacher is not None:
        teacher_s = teacher_scoring_seconds(teacher, rollouts_per_step=o.rollouts_per_step, seq_len=o.seq_len,
                                            gpus=len(placement.teacher.gpus), gpu=spec, precision=precision)
    step_kwargs = dict(
        rollouts_per_step=o.rollouts_per_step, group_size=o.group_size,
        prompt_tokens=o.seq_len - o.max_completion_tokens, completion_tokens=o.max_completion_tokens,
        precision=precision,
        trainer_precision=_DTYPE[m.trainer.precision], kv_cache_dtype=m.inference.kv_cache_dtype,
        prefill_gpus=prefill_gpus,
        max_concurrent_seqs_per_replica=decode_seqs, teacher_seconds=teacher_s)
    try:
        times = step_time_estimate(f, inference_gpus=inference_gpus, inference_replicas=decode_replicas,
                                   trainer_gpus=trainer_gpus, gpu=spec, **step_kwargs)
    except UserError as err:
        return Estimates(summary=[f"no step-time estimate: {err.problems[0].message}"])
    per_replica = groups[decode_name].gpus_per_replica
    split = None
    teacher_nodes = 1 if placement.teacher is not None else 0  # distillation: a node of its own, neither side's
    if hw.nodes - teacher_nodes > 1:
        try:
            other = m.trainer.dp_replicate * m.trainer.cp * m.trainer.tp

            def trainer_fits(gpus: int) -> bool:  # the same layout, FSDP over whatever GPUs remain
                shard = gpus // other
                if shard < 1 or (shard * m.trainer.cp * m.trainer.tp) % m.trainer.ep:
                    return False
                tmem = _trainer_memory(m, f, capacity, shard)
                return tmem.fits and _host_bytes_per_node(tmem, gpus, hw) <= hw.host_memory_gb * GIB

            expected = None
            if o.rollout_profile is not None:
                def expected(inference_gpus: int, replicas: int, trainer_gpus: int) -> float:
                    costs = gpu_costs(f, spec, gpus_per_replica=(inference_gpus - prefill_gpus) / replicas,
                                      precision=step_kwargs["precision"], kv_cache_dtype=m.inference.kv_cache_dtype,
                                      prefill_gpus=prefill_gpus or inference_gpus, trainer_gpus=trainer_gpus,
                                      trainer_precision=_DTYPE[m.trainer.precision], weight_sync_s=sync.seconds,
                                      seq_len=o.seq_len, teacher_s=teacher_s)
                    return _profile_times(m, costs, replicas=replicas, sync=False,
                                          max_concurrent=decode_seqs
                                          ).async_step_seconds
            split = suggest_split(f, total_nodes=hw.nodes - teacher_nodes, gpus_per_inference_replica=per_replica,
                                  gpu=spec,
                                  trainer_fits=trainer_fits, expected_step=expected, **step_kwargs)
        except UserError:
            split = None
    summary = [
        f"weight sync ({sync.mode}): {_g(sync.bytes)} GiB per step, ~{sync.seconds:,.1f} s",
        f"rollout (worst case: full-length sequences): ~{times.rollout_seconds:,.0f} s per step"
        + (f" (the teacher's scoring ~{teacher_s:,.1f} s of it)" if teacher_s else "") + "; "
        f"train: ~{times.train_seconds:,.0f} s per step",
        f"{times.idle_side} idles ~{times.idle_fraction:.0%} of each step" if times.idle_side != "none"
        else "inference and trainer are balanced",
    ]
    profile = None
    if o.rollout_profile is not None:
        costs = gpu_costs(f, spec, gpus_per_replica=(inference_gpus - prefill_gpus) / decode_replicas,
                          precision=step_kwargs["precision"], kv_cache_dtype=m.inference.kv_cache_dtype,
                          prefill_gpus=prefill_gpus or inference_gpus, trainer_gpus=trainer_gpus,
                          trainer_precision=_DTYPE[m.trainer.precision], weight_sync_s=sync.seconds,
                          seq_len=o.seq_len, teacher_s=teacher_s)
        profile = _profile_times(m, costs, replicas=decode_replicas, max_concurrent=decode_seqs)
        summary += _profile_summary(profile)
    now = profile.async_step_seconds if profile else times.step_seconds
    if split and (split.inference_nodes, split.trainer_nodes) != (_inference_nodes(placement), len(placement.trainer)) \
            and split.step_seconds < now * 0.99:  # a split that only ties the current one is no suggestion
        case = "expected" if profile else "worst case"
        summary.append(f"suggestion ({case}): {split.inference_nodes} inference : {split.trainer_nodes} trainer nodes "
                       f"would take ~{split.step_seconds:,.0f} s per step (now ~{now:,.0f} s)")
    return Estimates(
        weight_sync=sync, step=times, profile=profile,
        suggested_split=(SuggestedSplit(inference_nodes=split.inference_nodes, trainer_nodes=split.trainer_nodes,
                                        step_seconds=split.step_seconds) if split else None),
        summary=summary)


def _profile_times(m: Manifest, costs: Costs, *, replicas: int, max_concurrent: int, sync: bool = True) -> ProfileTimes:
    o = m.orchestrator
    return profile_times(profile_of(m), costs, rollouts_per_step=o.rollouts_per_step, group_size=o.group_size,
                         max_off_policy_steps=o.max_off_policy_steps, seq_len=o.seq_len, replicas=replicas,
                         max_concurrent_per_replica=max_concurrent, sync=sync)


def profile_of(m: Manifest) -> Profile:
    o = m.orchestrator
    p = o.rollout_profile
    assert p is not None
    prompt = (p.prompt_tokens.p50, p.prompt_tokens.p99) if p.prompt_tokens else \
        (float(o.seq_len - o.max_completion_tokens),) * 2
    return Profile(prompt_tokens=prompt, completion_tokens=(p.completion_tokens.p50, p.completion_tokens.p99),
                   environment_tokens=(p.environment_tokens.p50, p.environment_tokens.p99),
                   turns=(p.turns.p50, p.turns.p99), tool_latency_s=(p.tool_latency_s.p50, p.tool_latency_s.p99))


def _profile_summary(p: ProfileTimes) -> list[str]:
    return [
        f"expected (rollout_profile): ~{p.expected_tokens:,.0f} tokens per rollout, ~{p.expected_rollout_seconds:,.1f} s "
        f"each, the slowest of a step ~{p.tail_rollout_seconds:,.1f} s; train ~{p.train_seconds:,.1f} s per step",
        f"synchronous: ~{p.sync_step_seconds:,.1f} s per step (trainer idles {p.sync_trainer_idle:.0%}, inference "
        f"{p.sync_inference_idle:.0%})",
        f"async (max_off_policy_steps {p.max_off_policy_steps}, up to {p.concurrency} rollouts in flight): "
        f"~{p.async_step_seconds:,.1f} s per step (trainer idles {p.async_trainer_idle:.0%}, inference "
        f"{p.async_inference_idle:.0%}); predicted async/sync speed-up {p.async_sync_ratio:.2f}x"
        + (f"; ~{p.stale_fraction:.0%} of groups outlast the staleness window and are dropped"
           if p.stale_fraction >= 0.005 else ""),
    ]


def _inference_nodes(placement: Placement) -> int:
    return len({s.node for rp in placement.inference for s in rp.slots})


def _teacher_memory(m: Manifest, teacher: ModelFacts, capacity: int) -> InferenceGroupMemory:
    """The teacher's server, as the students' are counted. On GPUs: per GPU of its `distill.tp`, vLLM filling
    its budget with KV cache. On a CPU node: embedded, its weights, one process's overhead and the KV slots it
    preallocates (max_num_seqs full-length sequences); vLLM, its processes and their fixed-size KV caches
    (builders/vllm_cpu_memory.py)."""
    cpu = m.hardware.gpu == "cpu"
    tp = m.distill.tp  # type: ignore[union-attr]
    mem = inference_memory_per_gpu(
        teacher, precision=m.inference.precision, kv_cache_dtype=m.inference.kv_cache_dtype, tp=tp, ep=1, dp=1,
        gpu_memory_bytes=capacity, gpu_memory_utilization=m.inference.gpu_memory_utilization,
        max_num_seqs=m.inference.max_num_seqs, seq_len=m.orchestrator.seq_len,
        overhead_bytes=EMBEDDED_SERVER_OVERHEAD if cpu else None)
    if not cpu:
        used = mem.weights + mem.activations + mem.overhead + max(mem.kv_cache_bytes, 0)
        return InferenceGroupMemory(
            role="teacher", capacity_bytes=capacity, budget_bytes=mem.budget, used_bytes=used,
            free_bytes=capacity - used, fits=mem.fits,
            breakdown=InferenceBreakdown(weights=mem.weights, activations=mem.activations, overhead=mem.overhead,
                                         kv_cache=max(mem.kv_cache_bytes, 0), weight_staging=0),
            kv_bytes_per_token=mem.kv_bytes_per_token, kv_tokens_capacity=mem.kv_tokens_capacity,
            max_concurrent_seqs=mem.max_concurrent_seqs_total)
    kv_cache = m.inference.max_num_seqs * m.orchestrator.seq_len * mem.kv_bytes_per_token
    if m.inference.engine == "vllm":
        server = vllm_cpu_server(tp, 1)
        mem = dataclasses.replace(mem, weights=mem.weights * tp, activations=mem.activations * tp,
                                  overhead=server.overhead)
        kv_cache = server.kv_cache
    used = mem.weights + mem.activations + mem.overhead + kv_cache
    return InferenceGroupMemory(
        role="teacher", capacity_bytes=capacity, budget_bytes=mem.budget, used_bytes=used, free_bytes=capacity - used,
        fits=used <= capacity, breakdown=InferenceBreakdown(weights=mem.weights, activations=mem.activations,
                                                            overhead=mem.overhead, kv_cache=kv_cache, weight_staging=0),
        kv_bytes_per_token=mem.kv_bytes_per_token, kv_tokens_capacity=kv_cache // mem.kv_bytes_per_token,
        max_concurrent_seqs=m.inference.max_num_seqs)


def _process_count(m: Manifest, group: str) -> int:
    if group == "trainer":
        return m.trainer.ranks or m.trainer.world_size
    if group in ("teacher", "orchestrator"):
        return 1
    return m.inference.groups[group].replicas


def _g(n: float) -> str:
    return f"{n / GIB:,.1f}"


def _inference_fixes(m: Manifest, gpus_per_replica: int, gpus_per_node: int, can) -> str:
    if m.hardware.gpu == "cpu":  # one process holds the whole model: only more memory or a smaller model help
        return "try a larger hardware.host_memory_gb (if the machine has it); or a smaller model"
    fixes = []
    if m.inference.precision != "fp8" and m.hardware.gpu != "cpu" and can("inference.precision", "fp8"):
        fixes.append("precision: fp8 (halves the weights)")
    if m.inference.kv_cache_dtype != "fp8" and can("inference.kv_cache_dtype", "fp8"):
        fixes.append("kv_cache_dtype: fp8")
    if gpus_per_replica < gpus_per_node:
        fixes.append(f"more GPUs per replica (tp*dp up to {gpus_per_node})")
    else:
        fixes.append("nodes_per_replica: +1 with a larger dp and ep")
    fixes.append("a shorter orchestrator.seq_len")
    return "try " + "; or ".join(fixes)


def _trainer_fixes(m: Manifest, tmem, can) -> str:
    t = m.trainer
    fixes = []
    sharded = tmem.params + tmem.grads + tmem.optimizer_state + tmem.master_weights
    # on CPU hardware offloading frees nothing: host memory is where everything is
    if (not t.optimizer.cpu_offload and sharded > 0 and m.hardware.gpu != "cpu"
            and can("trainer.optimizer.cpu_offload", True)):
        fixes.append(f"optimizer.cpu_offload: true (frees {_g(sharded)} GiB)")
    if not t.activation_checkpointing:
        fixes.append("activation_checkpointing: true")
    if tmem.activations > tmem.params and can("trainer.cp", t.cp * 2):
        fixes.append(f"cp: {t.cp * 2} (halves activations per GPU)")
    if t.dp_replicate > 1:  # a replica holds the whole model: sharding over its ranks too divides it
        fixes.append(f"dp_replicate: 1 with dp_shard: {t.dp_shard * t.dp_replicate} (the same GPUs, "
                     f"parameters and optimizer state split {t.dp_replicate}x further)")
    if m.hardware.gpu == "cpu":  # more ranks on one node split the model, not the node's memory
        fixes.append("a larger hardware.host_memory_gb (if the machine has it)")
    else:
        fixes.append(f"more trainer GPUs (dp_shard: {t.dp_shard * 2} on twice the nodes)")
    return "try " + "; or ".join(fixes)
