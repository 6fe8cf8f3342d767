"""Every batch holds the manifest's environment split (primebuild/runtime/orchestrator/pool.py), with real
environments of two speeds: reverse-text (one turn) beside long-tail (several turns, each reply after a
tool latency). The episodes are played by a scripted policy (the reference answer, or a wrong one) so no
server is needed; the environments' own episodes, rewards and latencies are the real ones. The loop is
the orchestrator's: admit per environment, wait, cut, and the trainer publishes version k after batch k."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from primebuild.runtime.envs.base import MODEL, Task, demonstration, start_episode
from primebuild.runtime.envs.long_tail import LongTailEnv
from primebuild.runtime.envs.reverse_text import ReverseTextEnv
from primebuild.runtime.envs.transcript import Transcript
from primebuild.runtime.orchestrator.mixture import split
from primebuild.runtime.orchestrator.pool import FILTER_BUDGET, Group, RolloutPool
from primebuild.runtime.orchestrator.rollout import Rollout, StaleRollout

FAST, SLOW = 0, 1
TURN_SECONDS = 0.002  # the model's share of a turn; long-tail adds its tool latency between turns
QUOTAS = split(4, [3.0, 1.0])  # four groups per step over weights 3:1


def environments():
    return [ReverseTextEnv(), LongTailEnv(turns_p50=3, turns_p99=5, latency_p50_s=0.02, latency_p99_s=0.08,
                                          max_turns=5)]


async def play(env, task: Task, n: int, correct: list[bool], served: list[int], pool: RolloutPool) -> list[Rollout]:
    """`n` episodes of `task`; episode j answers every turn with the reference answer if correct[j], else
    with nothing. Each turn is sampled by the version served then and checked for staleness before."""
    answers = [text for who, text in demonstration(env, task, random.Random(0)) if who == MODEL]

    async def episode(j: int) -> Rollout:
        episode, t = start_episode(env, task), Transcript([1])
        for answer in answers:
            if not pool.is_useful(min([*t.turn_versions, served[0]])):
                raise StaleRollout
            await asyncio.sleep(TURN_SECONDS)
            t.add_model_turn([2], [-1.0], served[0])
            reply = await episode.step(answer if correct[j] else "")
            if reply is None:
                break
            t.add_environment([3])
        return Rollout(t, await episode.reward(), 0.0, "episode")

    return list(await asyncio.gather(*(episode(j) for j in range(n))))


def run(pool: RolloutPool, steps: int, all_correct) -> tuple[list[list[Group]], list[Counter], Counter]:
    """The orchestrator's loop until `steps` batches are cut. A group of environment i that is the k-th
    started of its environment answers all 4 episodes right if all_correct(i, k), else half of them.
    Returns the batches, per batch the environments of the finished groups waiting right after it, and how
    many groups of each environment were started."""
    envs = environments()

    async def main():
        served, seq, started = [0], 0, Counter()
        batches, waiting = [], []
        while len(batches) < steps:
            for index, free in enumerate(pool.open_slots_by_env(served[0])):
                for _ in range(free):
                    env = envs[index]
                    (task,) = env.sample_tasks(random.Random(seq), 1)
                    correct = [True] * 4 if all_correct(index, started[index]) else [True, False, True, False]
                    pool.start(Group(seq=seq, env=env, task=task, started_version=served[0], env_index=index),
                               play(env, task, 4, correct, served, pool))
                    seq, started[index] = seq + 1, started[index] + 1
            step = pool.next_step
            batch = pool.take_batch()
            if batch is None:
                await pool.wait(0.005)
                continue
            for g in batch:
                assert g.oldest_version >= step - 1 - pool.max_off, (step, g.oldest_version)
            batches.append(batch)
            waiting.append(Counter(g.env_index for g in pool.finished))
            served[0] = step  # the trainer publishes the weights trained on this batch
        await pool.cancel()
        return batches, waiting, started

    return asyncio.run(main())


def test_async_batches_hold_the_split_while_the_fast_environment_waits():
    pool = RolloutPool(groups_per_step=4, max_off_policy_steps=1, next_step=1, max_failed_in_a_row=1,
                       quotas=QUOTAS)
    batches, waiting, _ = run(pool, steps=8, all_correct=lambda env, k: False)
    for batch in batches:
        assert [sum(g.env_index == i for g in batch) for i in (FAST, SLOW)] == QUOTAS == [3, 1]
    # the situation that made batches drift: finished reverse-text groups were there when a batch was
    # cut, and they wait for a later one instead of standing in for long-tail's share
    assert sum(w[FAST] for w in waiting) > 0, waiting
    # long-tail is the slow one: its episodes run several turns, each reply after a tool latency
    assert max(r.transcript.turns for b in batches for g in b if g.env_index == SLOW for r in g.rollouts) > 1


def test_a_fast_environments_finished_groups_never_take_a_slow_ones_slots():
    pool = RolloutPool(groups_per_step=4, max_off_policy_steps=1, next_step=1, max_failed_in_a_row=1,
                       quotas=QUOTAS)
    envs = environments()
    t = Transcript([1])
    t.add_model_turn([2], [-1.0], 0)
    # two batches' worth of reverse-text finished (a global bound of 8 groups would admit 2 more of any kind)
    pool.finished = [Group(seq=s, env=envs[FAST], task=Task("ab", "ba"), started_version=0, env_index=FAST,
                           rollouts=[Rollout(t, 1.0, 0.0, "episode")]) for s in range(6)]
    assert pool.open_slots_by_env(served_version=0) == [0, 2]
    assert pool.take_batch() is None  # three reverse-text groups alone are not a batch


def test_the_difficulty_filter_refills_the_short_environment_and_keeps_the_split():
    pool = RolloutPool(groups_per_step=4, max_off_policy_steps=1, next_step=1, max_failed_in_a_row=1,
                       filter_equal_rewards=True, quotas=QUOTAS)
    # long-tail's groups: two in every three are all correct (equal rewards: set aside); reverse-text's never
    steps = 6
    batches, _, started = run(pool, steps=steps, all_correct=lambda env, k: env == SLOW and k % 3 != 0)
    for batch in batches:
        assert [sum(g.env_index == i for g in batch) for i in (FAST, SLOW)] == QUOTAS
        assert all(not g.rewards_all_equal for g in batch)  # under the budget: nothing equal trained
    # every set-aside group was long-tail's, and its slot went to a new long-tail group: about three
    # long-tail groups started per batch, while reverse-text started no more than admission allows
    assert pool.filtered_by_env[FAST] == 0 and pool.equal_trained == 0
    assert started[SLOW] >= 3 * steps - 2 and started[FAST] <= 3 * (steps + 2), started


def test_the_filter_budget_is_per_environment():
    """Long-tail's groups are all equal: after FILTER_BUDGET quotas' worth its share is completed from the
    newest of them, while reverse-text's share stays filtered as before."""
    pool = RolloutPool(groups_per_step=4, max_off_policy_steps=0, next_step=1, max_failed_in_a_row=1,
                       filter_equal_rewards=True, quotas=QUOTAS)
    batches, _, _ = run(pool, steps=2, all_correct=lambda env, k: env == SLOW)
    for batch in batches:
        fast = [g for g in batch if g.env_index == FAST]
        slow = [g for g in batch if g.env_index == SLOW]
        assert len(fast) == 3 and not any(g.rewards_all_equal for g in fast)
        assert len(slow) == 1 and slow[0].rewards_all_equal
    assert pool.equal_trained == 1 and pool.filtered_by_env == [0, FILTER_BUDGET * QUOTAS[SLOW] - 1]
