"""A curriculum pool that can never fill is refused at plan time, located (orchestrator.curriculum).

Never fills: thresholds that leave a pool no pass rate (pass rates are mean rewards, in [0, 1]; hard_at not
below easy_at leaves normal none and makes the others overlap), a share so small that no step's split
gives the pool a group, or an environment with fewer distinct training prompts than the curriculum holds
or than its groups in flight need. The prompt count is the runtime's own draw (runtime/orchestrator/
curriculum.py prompt_set, same seed), so the plan and the run agree; built-in environments only, as a
verifiers taskset would import verifiers here (the orchestrator then refuses it at start).
"""

from __future__ import annotations

from primebuild.contracts.environments import VERIFIERS_PREFIX
from primebuild.contracts.orchestrator import CURRICULUM_POOLS as POOLS
from primebuild.errors import Problem, UserError
from primebuild.manifest.schema import Manifest

FIELD = "orchestrator.curriculum"


def curriculum_problems(m: Manifest) -> list[Problem]:
    c = m.orchestrator.curriculum
    if c is None:
        return []
    return _thresholds(m) + _shares(m) + _prompt_sets(m)


def _thresholds(m: Manifest) -> list[Problem]:
    c = m.orchestrator.curriculum
    if c.hard_at >= c.easy_at:
        return [Problem(f"hard_at ({c.hard_at:g}) is not below easy_at ({c.easy_at:g}): a pass rate between them "
                        "would be both hard and easy, and the normal pool (where every prompt starts) has no range",
                        field=f"{FIELD}.hard_at", hint="set hard_at below easy_at, e.g. hard_at: 0.25 and easy_at: 0.75")]
    out = []
    if c.easy_at > 1 and c.mix.easy > 0:
        out.append(Problem(f"the easy pool (pass rate >= {c.easy_at:g}) can never fill: a pass rate is a mean reward, "
                           f"at most 1, yet mix.easy is {c.mix.easy:g}", field=f"{FIELD}.easy_at",
                           hint="set easy_at to at most 1, or mix.easy: 0"))
    if c.hard_at < 0 and c.mix.hard > 0:
        out.append(Problem(f"the hard pool (pass rate <= {c.hard_at:g}) can never fill: a pass rate is a mean reward, "
                           f"at least 0, yet mix.hard is {c.mix.hard:g}", field=f"{FIELD}.hard_at",
                           hint="set hard_at to at least 0, or mix.hard: 0"))
    return out


def _shares(m: Manifest) -> list[Problem]:
    from primebuild.runtime.orchestrator.mixture import split  # the runtime's own split (no torch)

    c, o = m.orchestrator.curriculum, m.orchestrator
    weights = [getattr(c.mix, p) for p in POOLS]
    if sum(weights) == 0:
        return [Problem("every pool's share is 0: no step could draw a prompt", field=f"{FIELD}.mix",
                        hint="give at least one pool a share > 0, e.g. mix: {easy: 0.1, normal: 0.8, hard: 0.1}")]
    groups = o.rollouts_per_step // o.group_size
    counts = split(groups, weights)
    least = sum(weights) / groups  # the share that gets one of a step's groups for sure
    return [Problem(f"mix.{p} ({w:g} of {sum(weights):g}) of a step's {groups} groups rounds to none in every step: "
                    f"the {p} pool is never sampled", field=f"{FIELD}.mix.{p}",
                    hint=f"raise mix.{p} to at least {least:.3g}, or set it to 0")
            for p, w, n in zip(POOLS, weights, counts, strict=True) if w > 0 and n == 0]


def _prompt_sets(m: Manifest) -> list[Problem]:
    # the runtime's environments and its own draw (no torch): the count is the one the run will find
    from primebuild.runtime.envs.registry import load_environment
    from primebuild.runtime.orchestrator.curriculum import prompt_set
    from primebuild.runtime.orchestrator.mixture import split

    c, o = m.orchestrator.curriculum, m.orchestrator
    groups = split(o.rollouts_per_step // o.group_size, [e.weight for e in m.environments])
    out = []
    for i, (spec, per_step) in enumerate(zip(m.environments, groups, strict=True)):
        # groups of this environment that may run at once: its share of every batch that is in flight
        in_flight = per_step * (o.max_off_policy_steps + 1)
        if c.prompts < in_flight:
            out.append(Problem(f"environment {spec.id} runs up to {in_flight} groups at once ({per_step} a step, "
                               f"{o.max_off_policy_steps + 1} steps in flight), more than its {c.prompts} prompts: "
                               "the pools cannot give each a prompt of its own", field=f"{FIELD}.prompts",
                               hint=f"set prompts to at least {in_flight}"))
        if spec.id.startswith(VERIFIERS_PREFIX):
            continue
        try:
            env = load_environment(spec.id, None, spec.args)
        except UserError:
            continue  # the environment's own problem is refused where environments are checked
        found = len(prompt_set(env, c.prompts, m.seed, i))
        if found < c.prompts:
            out.append(Problem(f"environment {spec.id} (environments[{i}]) has {found} distinct training prompts, "
                               f"fewer than the {c.prompts} the curriculum's pools hold", field=f"{FIELD}.prompts",
                               hint=f"set prompts to at most {found}, or give the environment more tasks"))
    return out
