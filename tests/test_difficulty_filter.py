"""Difficulty filtering (orchestrator.filter_zero_advantage, primebuild/runtime/orchestrator/pool.py): a group
whose rewards are all equal is set aside and counted, another group is sampled in its place, and a step
whose refills keep coming back equal trains on some of them once FILTER_BUDGET batches' worth were set
aside, so it cannot sample forever. The pool is checked on groups whose rewards we set; then one short
real run of the embedded default whose one-token completions make most groups equal."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import run_shrunk, sft_workspace

from primebuild.contracts.run_dir import RunDir
from primebuild.runtime.envs.base import Task
from primebuild.runtime.envs.transcript import Transcript
from primebuild.runtime.metrics import read_metrics
from primebuild.runtime.orchestrator.pool import FILTER_BUDGET, Group, RolloutPool
from primebuild.runtime.orchestrator.rollout import Rollout
from primebuild.runtime.rollout_file import load_batch


async def rollouts(rewards: list[float]) -> list[Rollout]:
    await asyncio.sleep(0.001)
    out = []
    for r in rewards:
        t = Transcript([1])
        t.add_model_turn([2], [-1.0], 0)
        out.append(Rollout(t, r, 0.001, "episode"))
    return out


def cut_one_batch(pool: RolloutPool, rewards_of) -> tuple[list[Group], int]:
    """Run the orchestrator's loop (fill the open slots, wait, try to cut) until batch 1 is cut; the group
    with stream number `seq` gets rewards `rewards_of(seq)`. Returns the batch and how many groups started."""
    async def main():
        seq = 0
        while True:
            for _ in range(pool.open_slots(served_version=0)):
                pool.start(Group(seq=seq, env=None, task=Task(prompt="", answer=""), started_version=0),
                           rollouts(rewards_of(seq)))
                seq += 1
            batch = pool.take_batch()
            if batch is not None:
                await pool.cancel()
                return batch, seq
            await pool.wait(0.01)
    return asyncio.run(main())


def test_equal_reward_groups_are_set_aside_counted_and_the_batch_is_refilled():
    # every third group is all-correct, every third all-wrong: only seq % 3 == 1 has a learning signal
    pattern = {0: [1.0, 1.0, 1.0], 1: [1.0, 0.0, 0.5], 2: [0.0, 0.0, 0.0]}
    pool = RolloutPool(groups_per_step=4, max_off_policy_steps=0, next_step=1, max_failed_in_a_row=1,
                       filter_equal_rewards=True)
    batch, started = cut_one_batch(pool, lambda seq: pattern[seq % 3])
    assert len(batch) == 4 and all(g.seq % 3 == 1 for g in batch)  # full, and only groups that differ
    assert started > 4  # sampled beyond the step's own groups to refill it (synchronous: 4 slots)
    # the groups that finished before the cut: 4 trained, the equal ones among them counted
    assert pool.filtered >= 2 * 3 and pool.equal_trained == 0
    assert pool.next_step == 2 and pool.equal == []


def test_filtering_off_trains_on_equal_reward_groups():
    pool = RolloutPool(groups_per_step=4, max_off_policy_steps=0, next_step=1, max_failed_in_a_row=1)
    batch, started = cut_one_batch(pool, lambda seq: [1.0, 1.0, 1.0])
    assert len(batch) == 4 and started == 4 and pool.filtered == 0


def test_a_step_whose_groups_are_all_equal_trains_on_them_after_the_budget():
    pool = RolloutPool(groups_per_step=4, max_off_policy_steps=0, next_step=1, max_failed_in_a_row=1,
                       filter_equal_rewards=True)
    batch, started = cut_one_batch(pool, lambda seq: [0.0, 0.0, 0.0])
    assert len(batch) == 4 and pool.equal_trained == 4
    # cut as the budget's last group finished, from the newest of the set-aside ones; the rest counted
    assert sorted(g.seq for g in batch) == list(range(FILTER_BUDGET * 4 - 4, FILTER_BUDGET * 4))
    assert pool.filtered == FILTER_BUDGET * 4 - 4
    assert started == (FILTER_BUDGET + 1) * 4  # and no more: the 4 in flight at the cut are the next batch's


@pytest.mark.timeout(240)
def test_a_real_run_counts_filtered_groups_per_step_and_trains_full_batches(tmp_path: Path, short_sft_store):
    """One-token completions: a group's reward depends only on whether its eight one-letter answers are
    in the reversed text, so most groups are all equal; every step still trains rollouts_per_step
    samples, and the equal groups in a batch are exactly those the metrics say the budget let in."""
    sft_workspace(tmp_path, seed_store=short_sft_store)
    done, run_dir = run_shrunk(tmp_path / "manifests" / "reverse-text.yaml", tmp_path, "orchestrator.max_steps=3",
                               "orchestrator.eval_prompts=8", "orchestrator.max_completion_tokens=1",
                               "orchestrator.max_off_policy_steps=0", timeout=220)
    assert done.returncode == 0, done.stdout + done.stderr
    run = RunDir(run_dir)
    steps = {k: r for k, r in read_metrics(run.metrics, role="orchestrator").items() if "filtered_groups" in r}
    assert sorted(steps) == [1, 2, 3]
    assert sum(r["filtered_groups"] for r in steps.values()) > 0, steps
    for step, r in steps.items():
        assert 0 <= r["filtered_fraction"] < 1
        samples = load_batch(run.rollout(step)).samples
        assert len(samples) == 32
        groups = [samples[i:i + 8] for i in range(0, 32, 8)]
        equal = sum(len({s.reward for s in g}) == 1 for g in groups)
        assert equal == r["equal_reward_groups_trained"], (step, r)
