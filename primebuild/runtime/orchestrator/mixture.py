"""The manifest's environments as one source of tasks, each drawn in proportion to its weight.

Counts are split by largest remainder, so a step of 16 groups over weights 3:1 always trains 12 and 4
(no sampling noise in the mix itself: the rollout pool cuts every batch to this split, pool.py), and the
same split applies to the held-out evaluation prompts.
"""

from __future__ import annotations

import logging
import random

from primebuild.contracts.orchestrator import EnvironmentConfig
from primebuild.runtime.envs.base import Environment, Task
from primebuild.runtime.envs.registry import load_environment

log = logging.getLogger("primebuild.orchestrator")


def split(total: int, weights: list[float]) -> list[int]:
    """`total` items over `weights` by largest remainder (ties: earlier environments first)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


class EnvironmentMix:
    def __init__(self, specs: list[EnvironmentConfig]):
        if not specs:
            raise ValueError("the plan gives the orchestrator no environments")
        self.envs: list[Environment] = [load_environment(s.id, s.version, s.args) for s in specs]
        self.weights = [s.weight for s in specs]
        self._short_said: set[str] = set()  # environments whose held-out set was said to be short
        # What metrics and summary.json call each environment: its id, or id#index when the manifest
        # lists one id twice (e.g. the same environment with other args).
        ids = [s.id for s in specs]
        self.names = [i if ids.count(i) == 1 else f"{i}#{n}" for n, i in enumerate(ids)]

    def name_of(self, env: Environment) -> str:
        return self.names[next(i for i, e in enumerate(self.envs) if e is env)]

    def sample(self, rng: random.Random, n: int) -> list[tuple[Environment, Task]]:
        out = []
        for env, count in zip(self.envs, split(n, self.weights), strict=True):
            out += [(env, task) for task in env.sample_tasks(rng, count)]
        return out

    def quotas(self, per_step: int) -> list[int]:
        """Each environment's groups in every batch of `per_step` groups (the pool holds every batch to it)."""
        return split(per_step, self.weights)

    def draw(self, index: int, seq: int, seed: int) -> Task:
        """The task of rollout group number `seq`, of environment number `index` (the pool's admission chose
        it: the environment whose quota has room): from an RNG seeded by `seq`, so a group is the same
        whenever (and in whichever batch) it runs."""
        return self.envs[index].sample_tasks(random.Random(seed * 1_000_003 + seq), 1)[0]

    def eval_tasks(self, n: int) -> list[tuple[Environment, Task]]:
        """`n` held-out tasks split by weight; an environment with fewer held-out tasks than its share gives
        all it has, and says so once (the eval then averages over fewer prompts than eval_prompts asks)."""
        out = []
        for env, count in zip(self.envs, split(n, self.weights), strict=True):
            held_out = env.eval_tasks()
            if count > len(held_out) and env.id not in self._short_said:
                self._short_said.add(env.id)
                log.warning("environment %s has %d held-out tasks, fewer than its share %d of "
                            "orchestrator.eval_prompts: its evals use those %d", env.id, len(held_out), count,
                            len(held_out))
            out += [(env, task) for task in held_out[:count]]
        return out
