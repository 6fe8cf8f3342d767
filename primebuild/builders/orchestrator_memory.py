"""The host memory of the orchestrator's node taken by primebuild's own CPU processes. Pure.

The orchestrator is one asyncio process; beside it run the supervisor (`primebuild run` and its
watchdog) on the local target and on Slurm's batch host, and every episode of an agent environment has
programs of its own: a verifiers harness program per episode (`args.harness`; for `bash` forked from one
sandboxed zygote per orchestrator, each command in a nested sandbox), and swe-tiny's sandboxed test run. Their number is the pool's bound
(primebuild/runtime/orchestrator/pool.py): each environment has at most (1 + max_off_policy_steps) steps'
worth of its groups in flight, and a held-out eval runs its share of `eval_prompts` at once beside them.

Sizes are peak resident sets measured on this project's CPU machine (bench/RESULTS.md): the
orchestrator of the main job 105 MiB, `primebuild run` with its watchdog 127 MiB
(bench/process_memory.py); the bash harness's zygote 104 MiB once, and a bash-harness episode its forked
program's private memory, 39 MiB while the zygote has not yet learnt what the program imports as it runs
(the first wave of episodes, all in flight at once) and 20 MiB after, plus its command's nested sandbox
(bwrap, timeout, bash: ~4 MiB); a null-harness episode its program; a swe-tiny test run in its sandbox 18 MiB; the embedded
engine's P/D router 61 MiB (vLLM's imports 60 MiB before it serves: counted alike). The P/D router runs
on this node with the embedded engine; vLLM's runs on the first prefill server's node, which is this one
only on a one-node plan (on GPU nodes its host memory is not modelled, as the servers' is not).
"""

from __future__ import annotations

from primebuild.contracts.environments import SANDBOXED, VERIFIERS_PREFIX
from primebuild.contracts.memory import OrchestratorBreakdown, OrchestratorGroupMemory
from primebuild.manifest.schema import Manifest

MIB = 1 << 20
ORCHESTRATOR_BYTES = 112 * MIB  # 105 MiB measured, rounded up
SUPERVISOR_BYTES = 152 * MIB  # `primebuild run` + watchdog: 149 MiB (RSS) measured as a 700-step run draws its report
HARNESS_PROGRAM_BYTES = {"null": 76 * MIB, "bash": 44 * MIB}  # per episode in flight
HARNESS_ZYGOTE_BYTES = {"bash": 112 * MIB}  # once per orchestrator: 104 MiB measured (program_zygote.py)
SANDBOXED_RUN_BYTES = 20 * MIB  # swe-tiny: one sandboxed test run per episode at a time
ROUTER_BYTES = 80 * MIB  # the P/D router: 61 MiB measured (embedded P/D), rounded up
SUPERVISED_HERE = ("local", "slurm")  # over ssh `primebuild run` supervises from the machine it was typed on


def episode_program_bytes(env) -> int:
    """What one episode of `env` runs beside the orchestrator while it is in flight."""
    if env.id.startswith(VERIFIERS_PREFIX) and "harness" in (env.args or {}):
        return HARNESS_PROGRAM_BYTES[env.args["harness"]]
    if env.id in SANDBOXED:
        return SANDBOXED_RUN_BYTES
    return 0


def programs_in_flight(m: Manifest) -> list[int]:
    """Per environment: episodes that may be in flight at once, training groups and a held-out eval."""
    from primebuild.runtime.orchestrator.mixture import split  # no torch

    o = m.orchestrator
    weights = [e.weight for e in m.environments]
    groups = split(o.rollouts_per_step // o.group_size, weights)
    evals = split(o.eval_prompts, weights)
    return [(1 + o.max_off_policy_steps) * g * o.group_size + e for g, e in zip(groups, evals, strict=True)]


def router_here(m: Manifest) -> bool:
    """Does a P/D router run on the orchestrator's node (builders/processes.py places it)?"""
    if not m.inference.disaggregation:
        return False
    return m.inference.engine == "embedded" or m.hardware.nodes == 1


def orchestrator_memory(m: Manifest, capacity_bytes: int) -> OrchestratorGroupMemory:
    """The orchestrator's node: its process, the supervisor where it runs there, and its episodes' programs."""
    counts = programs_in_flight(m)
    programs = sum(n * episode_program_bytes(e) for n, e in zip(counts, m.environments, strict=True))
    harnesses = {e.args["harness"] for e in m.environments
                 if e.id.startswith(VERIFIERS_PREFIX) and "harness" in (e.args or {})}
    programs += sum(HARNESS_ZYGOTE_BYTES.get(h, 0) for h in harnesses)
    breakdown = OrchestratorBreakdown(
        process=ORCHESTRATOR_BYTES, supervisor=SUPERVISOR_BYTES if m.target.kind in SUPERVISED_HERE else 0,
        episode_programs=programs, router=ROUTER_BYTES if router_here(m) else 0)
    used = sum(dict(breakdown).values())
    running = sum(n for n, e in zip(counts, m.environments, strict=True) if episode_program_bytes(e))
    return OrchestratorGroupMemory(role="orchestrator", capacity_bytes=capacity_bytes, budget_bytes=capacity_bytes,
                                   used_bytes=used, free_bytes=capacity_bytes - used, fits=used <= capacity_bytes,
                                   breakdown=breakdown, programs_in_flight=running)
