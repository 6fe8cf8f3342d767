"""The continuous rollout pool: rollout groups run all the time, and a batch is cut whenever enough have
finished, so the trainer never waits for the slowest rollout of a step.

Policy (docs/async.md):
- Staleness: batch k (trained on weights k-1) accepts a group whose oldest token was sampled by policy
  version v >= k - 1 - max_off_policy_steps. Every model turn is a new request to a server that holds the
  newest weights, so a long episode spans updates; only its oldest token counts against the bound.
- Admission: a group started while the servers serve version v can join batches up to
  v + 1 + max_off_policy_steps, so at most that many batches' worth of groups (from the next unwritten
  batch on) are in flight or finished-but-unbatched. With max_off_policy_steps 0 that is exactly one
  batch, sampled entirely by the weights it trains: synchronous RL.
- Emission: batch k takes groups_per_step finished groups that batch k accepts, those sampled earliest
  first (then in the order they finished): a group that waits is the next to go stale. The rest wait
  for the next batch.
- Drop: a group that no batch can accept any more (its oldest token too old) is dropped, whether it has
  finished or is still running (a running one stops at its next turn), and counted; a new group of a
  new task takes its place. Nothing is resampled for the same task.
- Failure: a group whose environment or server raised is dropped and counted the same way, and too many
  in a row end the run (failures.py).
- Difficulty filter (orchestrator.filter_zero_advantage): a finished group whose rewards are all equal has
  advantage 0 for every sample, so it is set aside and counted instead of trained on; setting it aside
  frees its slot, so another group is sampled to fill the batch. Refilling is bounded: once a step has
  set aside FILTER_BUDGET batches' worth of groups, the batch is completed from the newest of them (see
  FILTER_BUDGET for why the run goes on rather than ends).
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

# A step sets aside at most this many batches' worth of equal-reward groups; then it trains on the newest
# of them instead of sampling on. Why go on rather than end the run: a task the policy has solved (or not
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
                 filter_equal_rewards: bool = False, on_done: Callable[[Group], None] | None = None):
        self.groups_per_step = groups_per_step
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
        self.equal_trained = 0  # equal-reward groups the last batch took because the budget ran out
        self.failures = GroupFailures(max_failed_in_a_row)
        self.idle = IdleClock()  # time with no group running: the inference side has nothing to do

    def accepts(self, step: int, version: int) -> bool:
        """Does batch `step` accept a token sampled by policy `version`?"""
        return version >= step - 1 - self.max_off

    def is_useful(self, oldest_version: int) -> bool:
        """Can a group whose oldest token is that old still join a batch not yet written?"""
        return self.accepts(self.next_step, oldest_version)

    def open_slots(self, served_version: int) -> int:
        last_batch = served_version + 1 + self.max_off  # the last batch a group started now can join
        capacity = max(0, last_batch - self.next_step + 1) * self.groups_per_step
        return max(0, capacity - len(self.running) - len(self.finished))

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
        """The groups of batch `next_step` once enough have finished (dropping the stale ones), else None."""
        kept = []
        for group in self.finished:
            if self.accepts(self.next_step, group.oldest_version):
                kept.append(group)
            else:
                self.dropped += 1
        self.finished = kept
        equal = [g for g in self.equal if self.accepts(self.next_step, g.oldest_version)]
        short = self.groups_per_step - len(kept)
        top_up = []
        if short > 0 and len(equal) >= FILTER_BUDGET * self.groups_per_step:
            top_up = equal[-short:]  # the newest: the least off-policy of them
        if len(kept) + len(top_up) < self.groups_per_step:
            return None
        # oldest first (stable: then in the order they finished): a group that waits goes stale first
        kept.sort(key=lambda g: g.oldest_version)
        batch, self.finished = kept[: self.groups_per_step] + top_up, kept[self.groups_per_step:]
        # every set-aside group counts for this step, stale ones too: each was sampled and not trained on
        self.filtered, self.equal_trained, self.equal = len(self.equal) - len(top_up), len(top_up), []
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
