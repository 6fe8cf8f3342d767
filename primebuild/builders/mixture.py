"""An environment whose weight gives it no group of any step is refused at plan time, located.

Every batch holds each environment's share of the step's groups, the weights split by largest remainder
(the runtime's own split, primebuild/runtime/orchestrator/mixture.py; the rollout pool holds every batch to
it). A weight too small for one group in `rollouts_per_step / group_size` is never trained on (only its
held-out prompts would run), so the field would not mean what it says.
"""

from __future__ import annotations

from primebuild.errors import Problem
from primebuild.manifest.schema import Manifest


def environment_split_problems(m: Manifest) -> list[Problem]:
    from primebuild.runtime.orchestrator.mixture import split  # no torch

    o = m.orchestrator
    groups = o.rollouts_per_step // o.group_size
    weights = [e.weight for e in m.environments]
    if len(weights) < 2:
        return []
    least = sum(weights) / groups  # a weight of this share gets one of a step's groups for sure
    return [Problem(f"environment {e.id} (weight {e.weight:g} of {sum(weights):g}) gets none of a step's {groups} "
                    "groups: it would never be trained on", field=f"environments[{i}].weight",
                    hint=f"raise its weight to at least {least:.3g}, or rollouts_per_step (groups of group_size "
                         "per step)")
            for i, (e, n) in enumerate(zip(m.environments, split(groups, weights), strict=True)) if n == 0]
