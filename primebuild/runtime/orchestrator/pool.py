"""The continuous rollout pool: rollout groups run all the time, and a batch is cut whenever enough have
finished, so the trainer never waits for the slowest rollout of a step.

Policy (docs/async.md):
- The environment split: every batch holds exactly `quotas[i]` groups of environment i (the manifest's
  weights split by largest remainder over the step's groups: mixture.split), whichever finish first. A
  batch cut from whatever finished first would over-represent the fast environments whenever episodes
  run long in one and short in another, and the trained mix would drift from the manifest's weights.
  So every rule below holds per environment: a group counts only against its own environment's quota.
- Staleness: batch k (trained on weights k-1) accepts a group whose oldest token was sampled by policy
  version v >= k - 1 - max_off_policy_steps. Every model turn is a new request to a server that holds the
  newest weights, so a long episode spans updates; only its oldest token counts against the bound.
- Admission, per environment: a group started while the servers serve version v can join batches up to
  v + 1 + max_off_policy_steps, so at most that many batches' worth of each environment's groups (from
  the next unwritten batch on, quotas[i] per batch) are in flight or finished-but-unbatched. A slow
  environment thus always has as many groups in flight as the staleness bound lets be useful, whatever
  the fast one has finished: a fast environment's finished groups wait for their batch in their own
  slots and never take a slow one's. With max_off_policy_steps 0 that is exactly one batch, sampled
  entirely by the weights it trains: synchronous RL.
- Emission: batch k takes, of each environment, its quota of finished groups that batch k accepts,
  those sampled earliest first (then in the order they finished): a group that waits is the next to go
  stale. The rest wait for the next batch. The batch is cut as soon as every environment has its quota:
  the trainer waits for nothing but the slowest environment's share, which no batch can do without
  and keep the split (its groups were started as early as the bound allows). The wait ends: no newer
  batch is cut meanwhile, so a group started on the current weights cannot go stale before it finishes.
- Drop: a group that no batch can accept any more (its oldest token too old) is dropped, whether it has
  finished or is still running (a running one stops at its next turn), and counted; a new group of a
  new task of the same environment takes its place. Nothing is resampled for the same task.
- Failure: a group whose environment or server raised is dropped and counted the same way, and too many
  in a row (of any environment) end the run (failures.py).
- Difficulty filter (orchestrator.filter_zero_advantage): a finished group whose rewards are all equal has
  advantage 0 for every sample, so it is set aside and counted instead of trained on; setting it aside
  frees its environment's slot, so another group of that environment is sampled to fill its quota.
  Refilling is bounded per environment: once a step has set aside FILTER_BUDGET quotas' worth of an
  environment's groups, that environment's share is completed from the newest of them (see FILTER_BUDGET
  for why the run goes on rather than ends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from primebuild.runtime.envs.base import Environment, Task
from primebuild.runtime.orchestrator.failures import GroupFailures, costs_the_run
from primebuild.runtime.orchestrator.rollout import Rollout, StaleRollout

# A step sets aside at most this many quotas' worth of an environment's equal-reward groups; then it trains
# on the newest of them instead of sampling on. Why go on rather than end the run: a task the policy has solved (or not
# yet begun to solve) gives equal groups too, and that run is still worth finishing, with its last eval
# and summary; the metrics show it (equal_reward_groups_trained > 0). Why 4: a step then samples at most
# 4x its groups, enough while at most 3 in 4 groups are equal: with group_size 8 and a 0/1 reward, pass
# rates from ~4% to ~96%.
FILTER_BUDGET = 4


@dataclass
class Group:
    seq: int  # position in the run's stream of groups (seeds its task)
    env: Environment
    task: Task
    started_version: int
    env_index: int = 0  # which of the run's environments (the pool's quotas are per environment)
    rollouts: list[Rollout] = field(default_factory=list)

    @property
    def oldest_version(self) -> int:
        return min(min(r.transcript.turn_versions) for r in self.rollouts)

    @property
    def rewards_all_equal(self) -> bool:
        """Exactly equal: the group-relative advantage of every sample is then 0 (advantages.py)."""
        return len({r.reward for r in self.rollouts}) <= 1


class RolloutPool:
    def __init__(self, groups_per_step: int, max_off_policy_steps: int, next_step: int, max_failed_in_a_row: int,
                 filter_equal_rewards: bool = False, on_done: Callable[[Group], None] | None = None,
                 quotas: list[int] | None = None):
        self.groups_per_step = groups_per_step
        # groups of each environment in every batch (mixture.split of the weights); one environment: all
        self.quotas = [groups_per_step] if quotas is None else list(quotas)
        if sum(self.quotas) != groups_per_step:
            raise ValueError(f"environment quotas {self.quotas} do not add up to {groups_per_step} groups per step")
        # told of every group that stops running (its rollouts empty unless it finished): the curriculum
        self.on_done = on_done
        self.filter_equal_rewards = filter_equal_rewards
        self.max_off = max_off_policy_steps
        self.next_step = next_step  # the first batch not yet written
        self.running: dict[asyncio.Task, Group] = {}
        self.finished: list[Group] = []  # in the order they finished
        self.dropped = 0  # groups dropped as too stale, since the last batch
        self.failed = 0  # groups dropped because a rollout raised, since the last batch
        self.equal: list[Group] = []  # equal-reward groups set aside since the last batch, in the order they finished
        self.filtered = 0  # equal-reward groups left out of the last batch cut
        self.filtered_by_env = [0] * len(self.quotas)  # the same, per environment
        self.equal_trained = 0  # equal-reward groups the last batch took because the budget ran out
        self.failures = GroupFailures(max_failed_in_a_row)
        self.idle = IdleClock()  # time with no group running: the inference side has nothing to do

    def accepts(self, step: int, version: int) -> bool:
        """Does batch `step` accept a token sampled by policy `version`?"""
        return version >= step - 1 - self.max_off

    def is_useful(self, oldest_version: int) -> bool:
        """Can a group whose oldest token is that old still join a batch not yet written?"""
        return self.accepts(self.next_step, oldest_version)

    def open_slots_by_env(self, served_version: int) -> list[int]:
        """How many new groups of each environment may start now (admission, per environment)."""
        last_batch = served_version + 1 + self.max_off  # the last batch a group started now can join
        batches = max(0, last_batch - self.next_step + 1)
        held = [0] * len(self.quotas)
        for group in [*self.running.values(), *self.finished]:
            held[group.env_index] += 1
        return [max(0, batches * quota - n) for quota, n in zip(self.quotas, held, strict=True)]

    def open_slots(self, served_version: int) -> int:
        return sum(self.open_slots_by_env(served_version))

    def start(self, group: Group, work: Coroutine[Any, Any, list[Rollout]]) -> None:
        self.idle.enter()
        self.running[asyncio.ensure_future(work)] = group

    async def wait(self, timeout: float) -> None:
        """Until a group finishes or `timeout` passes; finished groups move to `finished`."""
        if self.running:
            await asyncio.wait(self.running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(timeout)
        for task in [t for t in self.running if t.done()]:
            group = self.running.pop(task)
            self.idle.leave()
            try:
                group.rollouts = task.result()
            except StaleRollout:
                self.dropped += 1
                self.done(group)
                continue
            except Exception as err:  # noqa: BLE001 (an environment's or a server's error costs the group)
                self.done(group)
                if costs_the_run(err):
                    raise
                self.failed += 1
                self.failures.failed(f"{group.seq} ({group.env.id})", err)
                continue
            self.done(group)
            self.failures.finished()
            if self.filter_equal_rewards and group.rewards_all_equal:
                self.equal.append(group)  # out of running and finished: its slot goes to a new group
            else:
                self.finished.append(group)

    def take_batch(self) -> list[Group] | None:
        """The groups of batch `next_step` once every environment has its quota finished (dropping the stale
        ones), else None. The batch lists each environment's groups in turn."""
        kept = []
        for group in self.finished:
            if self.accepts(self.next_step, group.oldest_version):
                kept.append(group)
            else:
                self.dropped += 1
        self.finished = kept
        # oldest first (stable: then in the order they finished): a group that waits goes stale first
        kept = sorted(kept, key=lambda g: g.oldest_version)
        equal = [g for g in self.equal if self.accepts(self.next_step, g.oldest_version)]
        shares, top_ups = [], []
        for index, quota in enumerate(self.quotas):
            mine = [g for g in kept if g.env_index == index]
            short = quota - len(mine)
            top_up = []
            mine_equal = [g for g in equal if g.env_index == index]
            if short > 0 and len(mine_equal) >= FILTER_BUDGET * quota:
                top_up = mine_equal[-short:]  # the newest: the least off-policy of them
            if len(mine) + len(top_up) < quota:
                return None
            shares.append(mine[:quota] + top_up)
            top_ups.append(top_up)
        batch = [g for share in shares for g in share]
        taken = {id(g) for g in batch}
        self.finished = [g for g in self.finished if id(g) not in taken]
        # every set-aside group counts for this step, stale ones too: each was sampled and not trained on
        self.filtered_by_env = [sum(g.env_index == i for g in self.equal) - len(top_ups[i])
                                for i in range(len(self.quotas))]
        self.filtered, self.equal_trained = sum(self.filtered_by_env), sum(map(len, top_ups))
        self.equal = []
        self.next_step += 1
        return batch

    def done(self, group: Group) -> None:
        if self.on_done is not None:
            self.on_done(group)

    async def cancel(self) -> None:
        for task in self.running:
            task.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)
        for group in self.running.values():
            self.idle.leave()
            self.done(group)
        self.running.clear()


class IdleClock:
    """Wall time during which nothing was in flight (things enter and leave)."""

    def __init__(self):
        self.in_flight = 0
        self._idle = 0.0
        self._since = time.monotonic()

    def _tick(self) -> None:
        now = time.monotonic()
        if self.in_flight == 0:
            self._idle += now - self._since
        self._since = now

    def enter(self) -> None:
        self._tick()
        self.in_flight += 1

    def leave(self) -> None:
        self._tick()
        self.in_flight -= 1

    def seconds(self) -> float:
        self._tick()
        return self._idle
