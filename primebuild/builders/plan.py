"""The plan compiler: manifest (+ lock) -> Plan, a pure function.

The plan (primebuild/contracts/plan.py) is everything needed to start every process on every host
(placement, argv, env, typed configs, ports, health checks, start order, restart policy), the memory
budget of every GPU and the time estimates, and nothing secret. Same inputs -> byte-identical JSON ->
same `plan_hash`.

What the plan's backends cannot apply is refused (primebuild/builders/capabilities.py): `compile_plan` raises
those refusals, located, unless `design=True`, which returns the plan marked `runnable: false` with
the refusals listed — a design study that no runner starts.
"""

from __future__ import annotations

from pydantic import ValidationError

from primebuild import __version__
from primebuild.builders import budget, derivations
from primebuild.builders.capabilities import SPLIT_TARGETS, Refusal, backend_refusals, refusals
from primebuild.builders.curriculum import curriculum_problems
from primebuild.builders.distill import teacher_facts
from primebuild.builders.environments import environment_mistakes, sandbox_warnings
from primebuild.builders.kv_connector_packages import missing_from_lock
from primebuild.builders.mixture import environment_split_problems
from primebuild.builders.model_facts import ModelFacts, facts_from_hf_config
from primebuild.builders.model_ref import model_reference, read_facts_json
from primebuild.builders.placement import Placement, place
from primebuild.builders.ports import HIGHEST_PORT, out_of_range, port_problems
from primebuild.builders.processes import build_processes
from primebuild.builders.render.slurm import time_limit_problem
from primebuild.builders.trainer_engine import titan_gaps, trainer_engine
from primebuild.builders.vllm_command import KV_CONNECTORS
from primebuild.contracts.estimates import Estimates
from primebuild.contracts.memory import GroupMemory
from primebuild.contracts.plan import BuildSpec, GpuSlot, NodeMap, Plan, ProcessSpec, Unsupported, render_json
from primebuild.errors import Problem, UserError
from primebuild.hashing import sha256_json
from primebuild.manifest.load import LoadedManifest
from primebuild.manifest.schema import Manifest

__all__ = ["compile_plan", "render_json", "check_parallelism"]


def compile_plan(loaded: LoadedManifest, lock: dict | None = None, *, design: bool = False) -> Plan:
    """Compile a plan; raise UserError (exit 2) naming every problem when it cannot run or does not fit."""
    m = loaded.manifest
    config, facts_shown = read_facts_json(loaded, lock)
    facts = facts_from_hf_config(config, facts_shown)

    refused = refusals(m, facts)
    mistakes = environment_mistakes_of(m)  # errors even in a design study
    if m.sft is not None:
        _raise_unless_design(loaded, refused, mistakes, design)
        return _sft_plan(loaded, facts, lock, refused)

    problems = mistakes + check_parallelism(m, facts) + ([] if lock is None else lock_problems(loaded, lock))
    problems += curriculum_problems(m)  # a prompt pool that can never fill
    problems += environment_split_problems(m)  # an environment no step trains on
    problems += _advantage_problems(m)  # a group that can carry no signal
    placement, place_problems = place(m)
    _raise_unless_design(loaded, refused, problems + place_problems, design)
    assert placement is not None

    # the teacher's facts, for its server's memory; refuses a teacher that reads tokens otherwise
    teacher = teacher_facts(loaded, facts)[1] if m.distill is not None else None
    if teacher is not None and (tp_problems := head_split_problems(teacher, m.distill.tp, "teacher", "distill.tp",
                                                                  "distill.tp")):
        raise UserError([_locate(loaded, p) for p in tp_problems])
    engine, why = trainer_engine(m, facts.model_type)
    try:
        processes = build_processes(m, placement, facts.moe_layers, facts.quantized, engine)
    except ValidationError as err:  # a derived port past 65535 (the processes' configs bound their ports)
        ports = [e for e in err.errors() if e["loc"] and str(e["loc"][-1]).endswith("port")
                 and isinstance(e["input"], int) and e["input"] > HIGHEST_PORT]
        if not ports:
            raise
        raise UserError([_locate(loaded, out_of_range(ports[0]["input"], str(ports[0]["loc"][-1])))]) from None
    if shared := shared_addresses(m, processes) + port_problems(m, processes):
        raise UserError([_locate(loaded, p) for p in shared])
    memory, estimates, budget_problems, warnings = budget.compute(m, facts, placement, design=design,
                                                                  teacher=teacher)
    warnings = _warnings(m, facts, placement) + warnings
    if engine != "torchtitan" and m.trainer.engine == "auto":
        warnings.append(f"trainer: {why}")
    if budget_problems:
        raise UserError([_locate(loaded, p) for p in budget_problems])
    plan = _plan(loaded, facts, lock, processes, _node_map(m, processes), memory, estimates, warnings, refused)
    if too_short := time_limit_problem(plan):  # the stop warning needs the plan's own step and checkpoint times
        raise UserError([_locate(loaded, too_short)])
    return plan


def manifest_problems(loaded: LoadedManifest) -> list[Problem]:
    """What `validate` reports beyond the schema, located: environments no machine could load, and the
    fields no built backend applies. What this machine has installed, the model's architecture, the
    placement and the fit are the plan's."""
    m = loaded.manifest
    return _located(loaded, environment_mistakes_of(m), [r.problem() for r in backend_refusals(m)])


def environment_mistakes_of(m: Manifest) -> list[Problem]:
    """builders/environments.environment_mistakes as problems: what no machine could load."""
    return [Problem(message, field=field, hint=hint) for field, message, hint in environment_mistakes(m)]


def _raise_unless_design(loaded: LoadedManifest, refused: list[Refusal], problems: list[Problem],
                         design: bool) -> None:
    """Every problem at once, located: what does not fit or add up, and (unless a design study is asked
    for) what no built backend applies."""
    if located := _located(loaded, problems, [] if design else [r.problem() for r in refused]):
        raise UserError(located)


def _located(loaded: LoadedManifest, problems: list[Problem], blocking: list[Problem]) -> list[Problem]:
    """`problems` in the order the checks found them, then the refused fields in the manifest's order."""
    located = [_locate(loaded, p) for p in problems]
    located += sorted((_locate(loaded, p) for p in blocking),
                      key=lambda p: (p.file or "", p.line or 0, p.column or 0, p.field or ""))
    if blocking:
        located.append(Problem(f"{len(blocking)} field(s) ask for what this plan's backends do not apply; "
                               "`primebuild plan --design` shows the plan anyway, as a design study"))
    return located


def _plan(loaded: LoadedManifest, facts: ModelFacts, lock: dict | None, processes: list[ProcessSpec],
          nodes: list[NodeMap], memory: dict[str, GroupMemory], estimates: Estimates, warnings: list[str], refused: list[Refusal],
          build: BuildSpec | None = None) -> Plan:
    m = loaded.manifest
    return Plan(
        primebuild_version=__version__, name=m.name, manifest_hash=loaded.manifest_hash,
        lock_hash=sha256_json(lock) if lock is not None else None,
        model=model_reference(loaded, facts),
        hardware=m.hardware, target=m.target, weight_sync=m.weight_sync, nodes=nodes, processes=processes, memory=memory,
        estimates=estimates, warnings=warnings, fits=True, runnable=not refused,
        unsupported=[Unsupported(field=r.field, message=r.message, hint=r.hint) for r in refused],
        build=build).hashed()


def _sft_plan(loaded: LoadedManifest, facts: ModelFacts, lock: dict | None, refused: list[Refusal]) -> Plan:
    """An `sft:` manifest starts no processes: it is one build, in the primebuild process, into the store
    (primebuild/runtime/derivations.py); the plan shows what that build reads."""
    m = loaded.manifest
    config = derivations.sft_config(loaded)
    # a chat dataset and an environment's demonstrations both train on the RL trainer: its ranks' memory
    # is the trainer's memory model
    problems = [Problem(f"the SFT trainer is torchtitan's: {gap}", field="model") for gap in titan_gaps(facts.model_type)]
    memory, memory_problems = budget.sft_trainer_memory(m, facts, config)
    if problems + memory_problems:
        raise UserError([_locate(loaded, p) for p in problems + memory_problems])
    chat = m.sft.dataset is not None
    build = BuildSpec(builder=derivations.SFT_CHAT_BUILDER if chat else derivations.SFT_ENV_BUILDER, output=m.name,
                      config=config)
    if config.device == "cpu" and config.ranks == 1 and not chat:
        where = "1 rank in the primebuild process (CPU)"
    else:
        where = f"{config.ranks} torchrun rank(s) on " + ("CPU processes over gloo" if config.device == "cpu" else "GPUs")
    data = f"chats of {m.sft.dataset.path}" if chat else f"{config.env_id}'s demonstrations"
    stop = "" if chat or config.stop_at_reward is None else (
        f"; stops once rank 0's greedy reward on {config.validation_n} training-side tasks reaches "
        f"{config.stop_at_reward} (checked every {config.check_every} steps from step {config.min_steps})")
    estimates = Estimates(summary=[f"SFT of {data} trains on the RL trainer (a store build): {where}, FSDP2, rows of "
                                   f"{config.micro_batch_tokens} packed tokens{stop}; time measured, not modelled"])
    return _plan(loaded, facts, lock, [], _node_map(m, []), memory, estimates, [], refused, build)


def check_parallelism(m: Manifest, f: ModelFacts) -> list[Problem]:
    """Divisibility rules the hardware and the model impose on each parallel layout."""
    problems: list[Problem] = []
    section = "inference.disaggregation" if m.inference.disaggregation else "inference"
    for name, g in m.inference.groups.items():
        path = f"{section}.{name}" if m.inference.disaggregation else section
        problems += head_split_problems(f, g.tp, name, f"{path}.tp")
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
        # torchtitan's sparse mesh (efsdp, ep), ep innermost: EP borrows the FSDP, CP and TP ranks alike,
        # and experts are whole on their EP rank (not TP-split) once ep > 1
        if (t.dp_shard * t.cp * t.tp) % t.ep:
            problems.append(Problem(f"trainer: ep={t.ep} must divide dp_shard*cp*tp={t.dp_shard * t.cp * t.tp}",
                                    field="trainer.ep", hint="expert parallelism borrows ranks from dp_shard*cp*tp"))
        elif t.tp > t.ep and t.dp_replicate * t.dp_shard * t.cp == 1:
            problems.append(Problem(f"trainer: ep={t.ep} < tp={t.tp} with no FSDP rank: the tp/ep ranks that own the "
                                    "same experts would never sum their gradients (FSDP over efsdp does that)",
                                    field="trainer.ep", hint=f"set ep: {t.tp}, or dp_shard >= 2"))
        if t.ep % t.cp and t.cp % t.ep:
            problems.append(Problem(f"trainer: ep={t.ep} and cp={t.cp}: one must be a multiple of the other (an EP "
                                    "group spans whole CP groups, or lies inside one)", field="trainer.ep",
                                    hint=f"set ep to a multiple of {t.cp}"))
    if m.hardware.gpu != "cpu" and t.tp > m.hardware.gpus_per_node:
        problems.append(Problem(f"trainer: tp={t.tp} exceeds the {m.hardware.gpus_per_node} GPUs of a node",
                                field="trainer.tp", hint="keep tensor parallelism inside a node"))
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
                                field="trainer.ranks",  # dp_shard where it is the only dimension, else ranks
                                hint=f"set dp_shard: {t.ranks}" if t.dp_replicate * t.cp * t.tp == 1
                                else f"set ranks: {t.world_size}"))
    inf = m.inference
    if inf.engine == "vllm" and inf.disaggregation and inf.disaggregation.kv_connector not in KV_CONNECTORS:
        problems.append(Problem(f"{inf.disaggregation.kv_connector} is not a KV connector of vLLM 0.32",
                                field="inference.disaggregation.kv_connector",
                                hint="use NixlConnector (GPU clusters), or one of " + ", ".join(KV_CONNECTORS)))
    if inf.router_replay:
        if not f.num_experts:
            problems.append(Problem("router_replay needs a MoE model", field="inference.router_replay",
                                    hint="set router_replay: false"))
        # vLLM P/D: vLLM 0.32's refusal of routes beside NIXL is lifted by our plugin (r3_plugin.py), and the
        # P/D router merges the prompt's routes (prefill) with the completion's (decode): pd_routes.py
    return problems


def _advantage_problems(m: Manifest) -> list[Problem]:
    """The advantage is group-relative (runtime/orchestrator/advantages.py): a group of one sample is its own
    baseline, so its advantage is 0 and every step would train on nothing (unless a teacher's KL adds one)."""
    if m.orchestrator.group_size >= 2 or m.distill is not None:
        return []
    return [Problem("group_size 1: each sample would be its own group's baseline, so every advantage is 0 and no "
                    "step trains on anything", field="orchestrator.group_size",
                    hint="use group_size >= 2 (the default is 8)")]


def lock_problems(loaded: LoadedManifest, lock: dict) -> list[Problem]:
    """What the plan would start that the locked environment cannot import: a KV connector's transport."""
    m = loaded.manifest
    missing = missing_from_lock(m, lock)
    if not missing:
        return []
    connector = m.inference.disaggregation.kv_connector
    return [Problem(f"{connector} needs {', '.join(missing)} in the image's vLLM environment, and the lock's gpu "
                    f"packages lack {'it' if len(missing) == 1 else 'them'} (vLLM imports the transport only when the "
                    "connector starts)", field="inference.disaggregation.kv_connector",
                    hint=f"re-lock with `primebuild lock {loaded.path}` (the gpu extra of uv.lock holds them)")]


def shared_addresses(m: Manifest, processes: list[ProcessSpec]) -> list[Problem]:
    """On a target that allocates every group on its own, a plan node has the address of the one group
    that listens there (primebuild/builders/render/groups.py): two listening groups on one plan node cannot be."""
    if m.target.kind not in SPLIT_TARGETS:
        return []
    listening: dict[int, set[str]] = {}
    for p in processes:
        if p.ports:
            listening.setdefault(p.node, set()).add(p.group)
    return [Problem(f"plan node {node}: groups {', '.join(sorted(groups))} all listen there, but {m.target.kind} "
                    "gives every group an allocation (and address) of its own", field="hardware.nodes",
                    hint="add nodes so that each listening group has nodes of its own, or use target local or ssh")
            for node, groups in sorted(listening.items()) if len(groups) > 1]


def head_split_problems(f: ModelFacts, tp: int, who: str, field: str, label: str = "tp") -> list[Problem]:
    """A server's heads split over its tensor-parallel degree (an inference group's, the teacher's)."""
    problems = []
    if f.num_attention_heads % tp:
        problems.append(Problem(f"{who}: {f.num_attention_heads} attention heads are not divisible by {label}={tp}",
                                field=field, hint=_divisors_hint(f.num_attention_heads, label)))
    if f.num_kv_heads and tp > 1 and f.num_kv_heads % tp and tp % f.num_kv_heads:
        problems.append(Problem(f"{who}: {f.num_kv_heads} KV heads and {label}={tp} neither divide the other",
                                field=field, hint=_divisors_hint(f.num_kv_heads, label)))
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
    if m.inference.host and m.inference.host not in ("127.0.0.1", "localhost", "::1"):
        out.append(f"inference binds {m.inference.host}: reachable from the network; admin calls still need the "
                   "run's token")
    if f.num_experts and not m.inference.router_replay and m.inference.engine == "vllm":
        out.append("MoE model without router_replay: train/inference expert choices may differ (higher mismatch KL)")
    if m.inference.batch_invariant and m.hardware.gpu != "cpu":
        out.append("inference.batch_invariant: the step-time estimate is for the default kernels; batch-invariant "
                   "ones are slower on GPUs, by how much is not measured here")
    if m.orchestrator.max_off_policy_steps == 0:
        out.append("max_off_policy_steps: 0 runs synchronous RL: inference idles while the trainer steps")
    return out + sandbox_warnings(m)


def _node_map(m: Manifest, processes: list[ProcessSpec]) -> list[NodeMap]:
    hw = m.hardware
    owner: dict[tuple[int, int], ProcessSpec] = {}
    for p in processes:
        for g in p.gpus:
            if (p.node, g) in owner:
                raise AssertionError(f"GPU {p.node}:{g} assigned twice ({owner[(p.node, g)].name}, {p.name})")
            owner[(p.node, g)] = p
    return [NodeMap(index=n, processes=[p.name for p in processes if p.node == n],
                    gpus=[GpuSlot(index=g, process=owner[(n, g)].name if (n, g) in owner else None,
                                  role=owner[(n, g)].role if (n, g) in owner else None)
                          for g in range(hw.gpus_per_node)])
            for n in range(hw.nodes)]


def located(loaded: LoadedManifest, problems: list[Problem]) -> list[Problem]:
    """Problems a command found in a compiled plan, with the manifest's file and line of each field."""
    return [_locate(loaded, p) for p in problems]


def _locate(loaded: LoadedManifest, problem: Problem) -> Problem:
    """Attach file/line to a compiler problem from the manifest's source map."""
    if problem.file or not problem.field:
        return problem
    file, line, col = loaded.source.locate(field_path(problem.field))
    return Problem(problem.message, file=file or str(loaded.path), line=line, column=col, field=problem.field,
                   hint=problem.hint)


def field_path(field: str) -> tuple[str | int, ...]:
    """`environments[0].id` -> ("environments", 0, "id"), the source map's keys."""
    out: list[str | int] = []
    for part in field.split("."):
        name, *indices = part.replace("]", "").split("[")
        out.append(name)
        out += [int(i) for i in indices]
    return tuple(out)
