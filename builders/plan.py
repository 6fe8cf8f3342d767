"""The plan compiler: manifest (+ lock) -> plan, a pure function.

The plan is canonical JSON: everything needed to start every process on every host (placement, argv,
env, ports, health checks, start order, restart policy), the memory budget of every GPU and the time
estimates, and nothing secret. Same inputs -> byte-identical JSON -> same `plan_hash`.
"""

from __future__ import annotations

from primebuild import __version__
from primebuild.builders import budget
from primebuild.builders.model_facts import ModelFacts, facts_from_hf_config
from primebuild.builders.model_ref import model_reference, read_facts_json
from primebuild.builders.placement import Placement, place
from primebuild.builders.processes import CONNECTORS_WITHOUT_ROUTER_REPLAY, ProcessSpec, build_processes
from primebuild.errors import Problem, UserError
from primebuild.manifest.load import LoadedManifest, canonical_json, sha256_json
from primebuild.manifest.schema import Manifest

PLAN_VERSION = 1


def compile_plan(loaded: LoadedManifest, lock: dict | None = None) -> dict:
    """Compile a plan; raise UserError (exit 2) naming every problem when it cannot run or does not fit."""
    m = loaded.manifest
    config, facts_shown = read_facts_json(loaded)
    facts = facts_from_hf_config(config, facts_shown)

    problems = check_parallelism(m, facts)
    placement, place_problems = place(m)
    problems += place_problems
    if problems:
        raise UserError([_locate(loaded, p) for p in problems])
    assert placement is not None

    processes = build_processes(m, placement, model_dtype=m.model.dtype)
    memory, estimates, budget_problems, warnings = budget.compute(m, facts, placement)
    warnings = _warnings(m, facts, placement) + warnings
    if budget_problems:
        raise UserError([_locate(loaded, p) for p in budget_problems])

    plan = {
        "plan_version": PLAN_VERSION,
        "primebuild_version": __version__,
        "name": m.name,
        "manifest_hash": loaded.manifest_hash,
        "lock_hash": sha256_json(lock) if lock is not None else None,
        "model": {**model_reference(loaded), "total_params": facts.total_params(),
                  "active_params": facts.active_params(), "architecture": facts.architecture},
        "hardware": m.hardware.model_dump(mode="json"),
        "target": m.target.model_dump(mode="json"),
        "weight_sync": m.weight_sync.model_dump(mode="json"),
        "nodes": _node_map(m, placement, processes),
        "processes": [p.to_json() for p in processes],
        "memory": memory,
        "estimates": estimates,
        "warnings": warnings,
        "fits": True,
    }
    plan["plan_hash"] = plan_hash(plan)
    return plan


def plan_hash(plan: dict) -> str:
    return sha256_json({k: v for k, v in plan.items() if k != "plan_hash"})


def render_json(plan: dict) -> str:
    return canonical_json(plan) + "\n"


def check_parallelism(m: Manifest, f: ModelFacts) -> list[Problem]:
    """Divisibility rules the hardware and the model impose on each parallel layout."""
    problems: list[Problem] = []
    section = "inference.disaggregation" if m.inference.disaggregation else "inference"
    for name, g in m.inference.groups.items():
        path = f"{section}.{name}" if m.inference.disaggregation else section
        if f.num_attention_heads % g.tp:
            problems.append(Problem(f"{name}: {f.num_attention_heads} attention heads are not divisible by tp={g.tp}",
                                    field=f"{path}.tp", hint=_divisors_hint(f.num_attention_heads, "tp")))
        if f.num_kv_heads and g.tp > 1 and f.num_kv_heads % g.tp and g.tp % f.num_kv_heads:
            problems.append(Problem(f"{name}: {f.num_kv_heads} KV heads and tp={g.tp} neither divide the other",
                                    field=f"{path}.tp", hint=_divisors_hint(f.num_kv_heads, "tp")))
        if g.ep > 1 and not f.num_experts:
            problems.append(Problem(f"{name}: ep={g.ep} but the model is dense", field=f"{path}.ep", hint="set ep: 1"))
        elif f.num_experts and f.num_experts % g.ep:
            problems.append(Problem(f"{name}: {f.num_experts} experts are not divisible by ep={g.ep}",
                                    field=f"{path}.ep", hint=_divisors_hint(f.num_experts, "ep")))
    t = m.trainer
    if f.num_attention_heads % t.tp:
        problems.append(Problem(f"trainer: {f.num_attention_heads} heads are not divisible by tp={t.tp}",
                                field="trainer.tp", hint=_divisors_hint(f.num_attention_heads, "tp")))
    if t.tp > 1 and f.vocab_size % t.tp:
        problems.append(Problem(f"trainer: vocab {f.vocab_size} is not divisible by tp={t.tp}", field="trainer.tp"))
    if t.ep > 1:
        if not f.num_experts:
            problems.append(Problem(f"trainer: ep={t.ep} but the model is dense", field="trainer.ep", hint="set ep: 1"))
        elif f.num_experts % t.ep:
            problems.append(Problem(f"trainer: {f.num_experts} experts are not divisible by ep={t.ep}",
                                    field="trainer.ep", hint=_divisors_hint(f.num_experts, "ep")))
        if (t.dp_shard * t.cp) % t.ep:
            problems.append(Problem(f"trainer: ep={t.ep} must divide dp_shard*cp={t.dp_shard * t.cp}",
                                    field="trainer.ep", hint="expert parallelism borrows ranks from dp_shard*cp"))
    if m.hardware.gpu != "cpu" and t.tp > m.hardware.gpus_per_node:
        problems.append(Problem(f"trainer: tp={t.tp} exceeds the {m.hardware.gpus_per_node} GPUs of a node",
                                field="trainer.tp", hint="keep tensor parallelism inside a node"))
    if t.cp > 1 and m.orchestrator.seq_len % (2 * t.cp):
        problems.append(Problem(f"trainer: seq_len {m.orchestrator.seq_len} is not divisible by 2*cp={2 * t.cp} "
                                "(load-balanced context parallelism splits each sequence in 2*cp chunks)",
                                field="trainer.cp"))
    if t.micro_batch_tokens < m.orchestrator.seq_len:
        problems.append(Problem(f"trainer: micro_batch_tokens {t.micro_batch_tokens} cannot hold one sequence of "
                                f"seq_len {m.orchestrator.seq_len}", field="trainer.micro_batch_tokens",
                                hint=f"set micro_batch_tokens >= {m.orchestrator.seq_len}"))
    if m.orchestrator.seq_len > f.max_position_embeddings > 0:
        problems.append(Problem(f"seq_len {m.orchestrator.seq_len} exceeds the model's max_position_embeddings "
                                f"{f.max_position_embeddings}", field="orchestrator.seq_len"))
    if m.hardware.gpu == "cpu" and t.world_size > m.hardware.cpus_per_node:
        problems.append(Problem(f"trainer: {t.world_size} ranks (dp_replicate*dp_shard*cp*tp) on a node of "
                                f"{m.hardware.cpus_per_node} CPUs", field="trainer.dp_shard",
                                hint=f"use at most {m.hardware.cpus_per_node} ranks on CPU-only hardware"))
    if m.hardware.gpu == "cpu" and t.ranks is not None and t.ranks != t.world_size:
        problems.append(Problem(f"trainer: ranks={t.ranks} but dp_replicate*dp_shard*cp*tp={t.world_size}",
                                field="trainer.ranks", hint=f"set dp_shard: {t.ranks}"))
    inf = m.inference
    if inf.router_replay:
        if not f.num_experts:
            problems.append(Problem("router_replay needs a MoE model", field="inference.router_replay",
                                    hint="set router_replay: false"))
        if inf.disaggregation and inf.disaggregation.kv_connector in CONNECTORS_WITHOUT_ROUTER_REPLAY:
            problems.append(Problem(
                f"vLLM cannot return routed experts with {inf.disaggregation.kv_connector}",
                field="inference.disaggregation.kv_connector",
                hint="use kv_connector: P2pNcclConnector, or turn router_replay off"))
    return problems


def _divisors_hint(n: int, name: str) -> str:
    options = [d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n % d == 0]
    return f"{name} must divide {n}: one of {', '.join(map(str, options))}"


def _warnings(m: Manifest, f: ModelFacts, placement: Placement) -> list[str]:
    out = []
    if placement.idle_gpus:
        out.append(f"{len(placement.idle_gpus)} GPU(s) idle: "
                   + ", ".join(f"node{n}:gpu{g}" for n, g in placement.idle_gpus[:8])
                   + (" …" if len(placement.idle_gpus) > 8 else ""))
    if m.inference.host not in ("127.0.0.1", "localhost", "::1"):
        out.append(f"inference binds {m.inference.host}: reachable from the network; admin calls still need the "
                   "run's token")
    if f.num_experts and not m.inference.router_replay and m.inference.engine == "vllm":
        out.append("MoE model without router_replay: train/inference expert choices may differ (higher mismatch KL)")
    if m.weight_sync.mode == "broadcast" and m.inference.engine == "vllm":
        out.append("weight_sync: broadcast with vLLM needs its weight-receiving worker extension, which is not "
                   "wired yet: use filesystem to run this plan today")
    if m.orchestrator.max_off_policy_steps == 0:
        out.append("max_off_policy_steps: 0 runs synchronous RL: inference idles while the trainer steps")
    return out


def _node_map(m: Manifest, placement: Placement, processes: list[ProcessSpec]) -> list[dict]:
    hw = m.hardware
    nodes = [{"index": n, "gpus": [{"index": g, "process": None, "role": None} for g in range(hw.gpus_per_node)],
              "processes": []} for n in range(hw.nodes)]
    for p in processes:
        nodes[p.node]["processes"].append(p.name)
        for g in p.gpus:
            slot = nodes[p.node]["gpus"][g]
            if slot["process"] is not None:
                raise AssertionError(f"GPU {p.node}:{g} assigned twice ({slot['process']}, {p.name})")
            slot.update(process=p.name, role=p.role)
    return nodes


def _locate(loaded: LoadedManifest, problem: Problem) -> Problem:
    """Attach file/line to a compiler problem from the manifest's source map."""
    if problem.file or not problem.field:
        return problem
    path = tuple(problem.field.split("."))
    file, line, col = loaded.source.locate(path)
    return Problem(problem.message, file=file or str(loaded.path), line=line, column=col, field=problem.field,
                   hint=problem.hint)
