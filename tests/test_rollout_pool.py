"""The continuous rollout pool's policy (primebuild/runtime/orchestrator/pool.py), on groups whose durations we set:
admission by the served policy version, a batch cut as soon as enough groups finish (never waiting for
the slowest), and the staleness bound held per group (stale ones dropped, running or finished)."""

from __future__ import annotations

import asyncio

from primebuild.runtime.envs.base import Task
from primebuild.runtime.envs.transcript import Transcript
from primebuild.runtime.orchestrator.pool import Group, RolloutPool
from primebuild.runtime.orchestrator.rollout import Rollout, StaleRollout

TASK = Task(prompt="", answer="")


def group(seq: int, version: int) -> Group:
    return Group(seq=seq, env=None, task=TASK, started_version=version)


async def episode(seconds: float, versions: list[int], pool: RolloutPool | None = None) -> list[Rollout]:
    """One rollout whose turns were sampled by `versions`; with `pool`, it checks staleness before each
    turn like the real runner does."""
    t = Transcript([1])
    for v in versions:
        if pool is not None and not pool.is_useful(min([*t.turn_versions, v])):
            raise StaleRollout
        t.add_model_turn([2], [-1.0], v)
        await asyncio.sleep(seconds / len(versions))
    return [Rollout(t, 1.0, seconds, "episode")]


def test_synchronous_admits_one_batch_per_policy_version():
    pool = RolloutPool(groups_per_step=4, max_off_policy_steps=0, next_step=1, max_failed_in_a_row=1)
    assert pool.open_slots(served_version=0) == 4  # batch 1 is trained on version 0
    pool.next_step = 2  # batch 1 written; version 1 not served yet
    assert pool.open_slots(served_version=0) == 0
    assert pool.open_slots(served_version=1) == 4


def test_async_admits_up_to_max_off_policy_batches_ahead():
    pool = RolloutPool(groups_per_step=4, max_off_policy_steps=2, next_step=1, max_failed_in_a_row=1)
    assert pool.open_slots(served_version=0) == 12  # batches 1, 2, 3 accept version 0
    pool.next_step = 3
    assert pool.open_slots(served_version=0) == 4
    assert pool.open_slots(served_version=1) == 8


def test_a_batch_is_cut_without_waiting_for_the_slowest_group():
    async def main():
        pool = RolloutPool(groups_per_step=2, max_off_policy_steps=1, next_step=1, max_failed_in_a_row=1)
        durations = [0.02, 5.0, 0.03, 0.04, 0.05]  # one long tail, started second
        for seq, d in enumerate(durations):
            pool.start(group(seq, 0), episode(d, [0]))
        started = asyncio.get_running_loop().time()
        batches = []
        while len(batches) < 2:
            batch = pool.take_batch()
            if batch is None:
                await pool.wait(0.01)
                continue
            batches.append([g.seq for g in batch])
        elapsed = asyncio.get_running_loop().time() - started
        assert batches == [[0, 2], [3, 4]]
        assert elapsed < 1.0 and len(pool.running) == 1  # the 5 s group is still running, nobody waited for it
        await pool.cancel()
    asyncio.run(main())


def test_stale_groups_are_dropped_finished_or_running():
    async def main():
        pool = RolloutPool(groups_per_step=1, max_off_policy_steps=1, next_step=3, max_failed_in_a_row=1)
        # batch 3 accepts versions >= 1
        pool.start(group(0, 0), episode(0.01, [0]))  # finished, too old
        pool.start(group(1, 1), episode(0.01, [1, 2]))  # oldest token v1: accepted
        pool.start(group(2, 0), episode(0.2, [1, 1, 1, 1], pool))  # running; stops once batch 4 is next
        while len(pool.finished) + pool.dropped < 2:
            await pool.wait(0.01)
        batch = pool.take_batch()
        assert [g.seq for g in batch] == [1] and pool.dropped == 1 and pool.next_step == 4
        pool.next_step = 5  # batch 4 written too: batch 5 needs version >= 3
        while pool.running:
            await pool.wait(0.01)
        assert pool.dropped == 2 and pool.finished == []
    asyncio.run(main())


def test_a_group_older_than_the_bound_is_never_in_a_batch():
    """A property over many interleavings: every group of batch k has oldest version >= k - 1 - m."""
    async def main():
        m = 1
        pool = RolloutPool(groups_per_step=3, max_off_policy_steps=m, next_step=1, max_failed_in_a_row=1)
        served, seq, written = 0, 0, []
        while len(written) < 6:
            for _ in range(pool.open_slots(served)):
                # later turns of a long group are sampled by newer versions, its first by the served one
                turns = [served] + [served + 1] * (seq % 3)
                pool.start(group(seq, served), episode(0.003 * (1 + 7 * (seq % 5 == 0)), turns, pool))
                seq += 1
            step = pool.next_step
            batch = pool.take_batch()
            if batch is None:
                await pool.wait(0.002)
                continue
            written.append((step, [g.oldest_version for g in batch]))
            served = step  # the trainer publishes version k after batch k
        for step, versions in written:
            assert len(versions) == 3 and min(versions) >= step - 1 - m, written
        await pool.cancel()
    asyncio.run(main())
