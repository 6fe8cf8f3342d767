"""The long-tail time model (primebuild/builders/rollout_time.py) by hand on made-up costs, and what the plan says
with a rollout profile; environments checked at plan time (primebuild/builders/environments.py)."""

from __future__ import annotations

import math

import pytest
from conftest import MANIFESTS, call_cli, plan_json

from primebuild.builders.rollout_time import Costs, Durations, Profile, profile_times, quantile

COSTS = Costs(decode_step_s=lambda batch, context: 0.01, prefill_s_per_token=0.0, turn_overhead_s=0.0,
              request_s=0.0, train_s=lambda sequences, tokens: 2.0, weight_sync_s=1.0)


def times(profile: Profile, m: int = 1, costs: Costs = COSTS, **kw):
    args = dict(rollouts_per_step=8, group_size=2, max_off_policy_steps=m, seq_len=10_000, replicas=1,
                max_concurrent_per_replica=64)
    return profile_times(profile, costs, **{**args, **kw})


def test_fixed_length_rollouts_by_hand():
    # every rollout: 100 tokens at 0.01 s, 3 turns with 2 tool calls of 0.5 s -> 2.0 s
    t = times(Profile(prompt_tokens=(10, 10), completion_tokens=(100, 100), turns=(3, 3), tool_latency_s=(0.5, 0.5)))
    assert t.expected_rollout_seconds == pytest.approx(2.0)
    assert t.tail_rollout_seconds == pytest.approx(2.0, rel=1e-6)
    assert t.sync_step_seconds == pytest.approx(2.0 + 2.0 + 1.0, rel=1e-6)  # rollouts, train, weight sync
    # async: 16 slots, but while the trainer trains (2 s) and the weights sync (1 s) the pool has one batch
    # less room: lag = 3 / T, 8 · (2 - 3 / T) slots; a group holds its slots for its 2.0 s and then half a
    # step until its batch is cut, so T = 8 · (2.0 + T / 2) / (8 · (2 - 3 / T)): 2T - 3 = 2 + T / 2, T = 10/3
    assert t.concurrency == 16 and t.async_step_seconds == pytest.approx(10 / 3, rel=1e-6)
    assert t.async_sync_ratio == pytest.approx(5.0 / (10 / 3), rel=1e-6)
    assert t.stale_fraction == 0.0 and t.async_trainer_idle == pytest.approx(1 - 2.0 / (10 / 3), rel=1e-6)
    assert t.sync_trainer_idle == pytest.approx(3.0 / 5.0)  # rollouts and weight sync
    assert t.sync_inference_idle == pytest.approx(3.0 / 5.0)  # training and weight sync


def test_a_heavy_tail_lengthens_the_synchronous_step_only():
    base = Profile(prompt_tokens=(10, 10), completion_tokens=(100, 100), turns=(3, 3), tool_latency_s=(0.5, 0.5))
    tail = Profile(prompt_tokens=(10, 10), completion_tokens=(100, 1000), turns=(3, 30), tool_latency_s=(0.5, 5.0))
    fixed, heavy = times(base), times(tail)
    assert heavy.tail_rollout_seconds > 2 * heavy.expected_rollout_seconds
    assert heavy.sync_step_seconds > fixed.sync_step_seconds * 2.5
    assert heavy.async_sync_ratio > fixed.async_sync_ratio


def test_a_wider_staleness_window_drops_fewer_groups_when_the_trainer_sets_the_pace():
    tail = Profile(prompt_tokens=(10, 10), completion_tokens=(100, 1000), turns=(3, 30), tool_latency_s=(0.5, 5.0))
    slow_trainer = Costs(**{**COSTS.__dict__, "train_s": lambda s, t: 5.0})
    stale = [times(tail, m, costs=slow_trainer).stale_fraction for m in (1, 2, 4, 8)]
    assert stale == sorted(stale, reverse=True) and stale[0] > 0.05 and stale[-1] < stale[0] / 2
    # with a fast trainer, more rollouts in flight mostly make steps faster: the window in seconds, and
    # with it the share dropped, stays near where the rollouts' own work puts it
    fast_trainer = Costs(**{**COSTS.__dict__, "train_s": lambda s, t: 0.01})
    fast = [times(tail, m, costs=fast_trainer) for m in (1, 4)]
    windows = [2 * fast[0].async_step_seconds, 5 * fast[1].async_step_seconds]
    assert fast[1].async_step_seconds < fast[0].async_step_seconds / 2
    assert windows[1] == pytest.approx(windows[0], rel=0.25)
    assert fast[1].stale_fraction == pytest.approx(fast[0].stale_fraction, abs=0.1)


def test_the_slowest_of_a_group_shares_its_lengths_and_draws_its_latencies_apart():
    one = Durations([1.0, 3.0], [1.0, 1.0], (0.4, 4.0))  # two tasks: 1 s and 3 s of work, one tool call
    four = one.slowest_of(4)
    # a constant part stays what it is; the latency's median moves to the single draw's 0.5^(1/4) quantile
    assert Durations([2.0], [0.0], (0.4, 4.0)).slowest_of(4).mean == pytest.approx(2.0)
    # per task, the slowest of 4 is slower than one draw, and faster than a draw from the slower task alone
    assert one.quantile(0.5) < four.quantile(0.5) < Durations([3.0], [1.0], (0.4, 4.0)).slowest_of(4).quantile(0.5)
    assert Durations([0.0], [1.0], (0.4, 4.0)).slowest_of(4).quantile(0.5) == pytest.approx(
        Durations([0.0], [1.0], (0.4, 4.0)).quantile(0.5 ** 0.25), rel=1e-6)
    assert four.mean > one.mean and four.window(100.0)[0] == pytest.approx(1.0)


def test_durations_of_one_tool_call_are_its_latency_distribution():
    d = Durations([0.0], [1.0], (0.4, 4.0))
    assert d.quantile(0.5) == pytest.approx(0.4, rel=1e-6)
    assert d.quantile(0.99) == pytest.approx(4.0, rel=1e-6)
    assert quantile(0.4, 4.0, 0.99) == pytest.approx(4.0)
    assert d.mean == pytest.approx(0.4 * math.exp((math.log(10) / 2.3263478740408408) ** 2 / 2))


def test_the_plan_reports_expected_and_worst_case_with_a_profile():
    glm5 = plan_json(MANIFESTS / "glm5.yaml")
    est = glm5["estimates"]
    assert est["profile"]["sync_step_seconds"] > est["profile"]["async_step_seconds"] > 0
    assert est["step"]["rollout_seconds"] > 0  # the worst case stays
    text = "\n".join(est["summary"])
    assert "worst case: full-length sequences" in text and "predicted async/sync speed-up" in text
    assert plan_json(MANIFESTS / "reverse-text.yaml")["estimates"].get("profile") is None  # no profile: as before
    cpu = plan_json(MANIFESTS / "long-tail.yaml")["estimates"]["profile"]  # a CPU manifest with a profile
    assert cpu["async_sync_ratio"] > 1


def test_unknown_and_uninstalled_environments_are_located_plan_errors(capsys):
    for env_id, message in (("swe-gym", "unknown environment id 'swe-gym'"),
                            ("verifiers:no-such-taskset", "verifiers taskset 'no-such-taskset' is not installed")):
        result = call_cli(capsys, "plan", str(MANIFESTS / "reverse-text.yaml"), "--set",
                          f"environments=[{{id: '{env_id}'}}]")
        assert result.code == 2 and message in result.err and "environments[0].id" in result.err
        assert "Traceback" not in result.err
    result = call_cli(capsys, "plan", str(MANIFESTS / "reverse-text.yaml"), "--set",
                      "environments=[{id: reverse-text, args: {min_length: 3, bogus_arg: 1}}]")
    assert result.code == 2 and "environments[0].args.bogus_arg: environment reverse-text has no arg 'bogus_arg'" \
        in result.err and "its args: min_length, max_length, num_eval" in result.err, result.err
    result = call_cli(capsys, "plan", str(MANIFESTS / "qwen3-30b-a3b.yaml"))
    assert result.code == 2 and "qwen3-30b-a3b.yaml:" in result.err and "module 'math_python'" in result.err
    assert call_cli(capsys, "plan", str(MANIFESTS / "qwen3-30b-a3b.yaml"), "--design").code == 0
