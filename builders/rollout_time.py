"""Step time of a workload whose rollouts differ in length: expected and tail, synchronous and async.

The worst case of timing.py (every rollout full-length) is right for a fixed-length task and far off
for agents: most episodes are short, a few are ten times longer, and tools add waits of their own. A
manifest's `orchestrator.rollout_profile` gives medians and 99th percentiles of prompt, completion and
environment tokens, turns and tool latency; each is taken as log-normal through its two quantiles and
all move together (a rollout at quantile q is long in every respect: long episodes are long because
they take more turns). On a grid of quantiles q:

    r(q) = completion(q) · decode_step(B) + turns(q) · (mean tool latency + turn overhead)
           + (prompt(q) / group_size + environment(q)) · prefill per token

is the time of one rollout while the replica decodes B sequences; prompt + completion + environment is
capped at seq_len.

- Synchronous (max_off_policy_steps 0): a step starts its R rollouts together and ends with the
  slowest of its R / group_size independent tasks, at quantile n/(n+1) for n of them (the expected
  maximum's usual approximation); then the trainer trains and weights are synced:
      sync step = (waves - 1) · E[r] + r(tail) + train + weight sync.
- Asynchronous (the continuous pool, runtime/orchestrator/pool.py): up to C = (1 + m) · R rollouts in
  flight, m = max(1, max_off_policy_steps) (a rollout waiting on a tool holds no server slot; the
  servers' max concurrent sequences cap the decode batch B); by Little's law R rollouts complete every
  R · E[r] / C seconds, but no faster than full batches decode their tokens, and the trainer overlaps:
      async step = max(R · E[r] / C, R · E[completion] · decode_step(B) / (B · replicas), train).
  Rollouts longer than the staleness window, (1 + m) async steps, cannot join any batch: the pool
  drops them at the window and starts others (pool.py), so of the work spent only the kept share
  counts: R · E[min(r, window)] / (C · (1 - stale share)), solved as a fixed point with the window.
  A large stale share says max_off_policy_steps is too small for the tail.

Idle fractions: of a synchronous step the trainer idles while rollouts run (and weights sync), the
inference side while the trainer trains; of an async step the side that is not the longer one.
Train time uses the expected tokens per step; everything else is as in timing.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

Z99 = NormalDist().inv_cdf(0.99)
GRID = 400  # quantile midpoints for expectations


def quantile(p50: float, p99: float, q: float) -> float:
    """The log-normal through (median p50, 99th percentile p99) at quantile q (a constant when equal)."""
    if p99 <= p50 or p50 <= 0:
        return p50
    return p50 * math.exp(math.log(p99 / p50) / Z99 * NormalDist().inv_cdf(q))


def mean(p50: float, p99: float) -> float:
    if p99 <= p50 or p50 <= 0:
        return p50
    sigma = math.log(p99 / p50) / Z99
    return p50 * math.exp(sigma * sigma / 2)


@dataclass(frozen=True)
class Profile:
    prompt_tokens: tuple[float, float]
    completion_tokens: tuple[float, float]
    environment_tokens: tuple[float, float] = (0.0, 0.0)
    turns: tuple[float, float] = (1.0, 1.0)
    tool_latency_s: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class Costs:
    """What one replica and the trainer take, from the roofline (GPUs) or CPU calibration."""

    decode_step_s: Callable[[int, float], float]  # (batch, context tokens) -> seconds per decode step
    prefill_s_per_token: float
    turn_overhead_s: float  # per model turn: a request's round trip beyond its tokens
    train_s: Callable[[int, int], float]  # (sequences, tokens per sequence) -> seconds
    weight_sync_s: float


@dataclass(frozen=True)
class ProfileTimes:
    expected_tokens: float  # of one rollout: prompt + completion + environment
    expected_rollout_seconds: float  # E[r] at the async decode batch
    tail_rollout_seconds: float  # r at the tail quantile, at the sync decode batch
    tail_quantile: float
    train_seconds: float
    sync_step_seconds: float
    async_step_seconds: float
    async_sync_ratio: float
    max_off_policy_steps: int  # m of the async estimate
    sync_trainer_idle: float
    sync_inference_idle: float
    async_trainer_idle: float
    async_inference_idle: float
    stale_fraction: float  # rollouts longer than the staleness window (dropped by the async pool)
    concurrency: int  # C


def _shape(p: Profile, q: float, seq_len: int) -> tuple[float, float, float, float]:
    prompt = quantile(*p.prompt_tokens, q)
    completion = quantile(*p.completion_tokens, q)
    environment = quantile(*p.environment_tokens, q)
    turns = max(1.0, quantile(*p.turns, q))
    total = prompt + completion + environment
    if total > seq_len:  # the episode stops at seq_len: what is cut is its later turns' tokens
        keep = max(0.0, (seq_len - prompt) / max(completion + environment, 1e-9))
        completion, environment = completion * keep, environment * keep
    return prompt, completion, environment, turns


def profile_times(p: Profile, costs: Costs, *, rollouts_per_step: int, group_size: int, max_off_policy_steps: int,
                  seq_len: int, replicas: int, max_concurrent_per_replica: int) -> ProfileTimes:
    R = rollouts_per_step
    m = max(1, max_off_policy_steps)
    latency = mean(*p.tool_latency_s)
    per_replica = math.ceil(R / replicas)
    sync_batch = max(1, min(per_replica, max_concurrent_per_replica))
    waves = math.ceil(per_replica / sync_batch)
    # Rollouts in flight: a turn holds a server slot only while it decodes (a rollout waiting on a tool
    # holds none), so max_num_seqs caps the decode batch, not the rollouts in flight.
    concurrency = (1 + m) * R
    async_batch = max(1, min(math.ceil(concurrency / replicas), max_concurrent_per_replica))

    def rollout(q: float, batch: int) -> float:
        prompt, completion, environment, turns = _shape(p, q, seq_len)
        context = prompt + (completion + environment) / 2
        return (completion * costs.decode_step_s(batch, context) + turns * (latency + costs.turn_overhead_s)
                + (prompt / group_size + environment) * costs.prefill_s_per_token)

    grid = [(k + 0.5) / GRID for k in range(GRID)]
    expected_sync = sum(rollout(q, sync_batch) for q in grid) / GRID
    expected_async = sum(rollout(q, async_batch) for q in grid) / GRID
    tokens = sum(sum(_shape(p, q, seq_len)[:3]) for q in grid) / GRID
    tasks = max(1, R // group_size)
    tail_q = tasks / (tasks + 1)
    tail = rollout(tail_q, sync_batch)

    train = costs.train_s(R, max(1, round(tokens)))
    sync_rollout = (waves - 1) * expected_sync + tail
    sync_step = sync_rollout + train + costs.weight_sync_s

    durations = [rollout(q, async_batch) for q in grid]
    async_rollout, stale = R * expected_async / concurrency, 0.0
    for _ in range(100):  # fixed point: a longer step widens the window, so fewer rollouts go stale
        window = (1 + m) * max(async_rollout, train)
        stale = sum(1 for d in durations if d > window) / GRID
        if stale >= 1.0:
            async_rollout = math.inf
            break
        spent = sum(min(d, window) for d in durations) / GRID  # a stale rollout is dropped at the window
        updated = R * spent / (concurrency * (1 - stale))
        if math.isclose(updated, async_rollout, rel_tol=1e-6):
            async_rollout = updated
            break
        async_rollout = updated
    # ... and the servers cannot decode faster than full batches do
    completion = sum(_shape(p, q, seq_len)[1] for q in grid) / GRID
    decode_bound = R * completion * costs.decode_step_s(async_batch, seq_len / 2) / (async_batch * replicas)
    async_rollout = max(async_rollout, decode_bound)
    async_step = max(async_rollout, train)
    return ProfileTimes(
        expected_tokens=tokens, expected_rollout_seconds=expected_async, tail_rollout_seconds=tail,
        tail_quantile=tail_q, train_seconds=train, sync_step_seconds=sync_step, async_step_seconds=async_step,
        async_sync_ratio=sync_step / async_step, max_off_policy_steps=m,
        sync_trainer_idle=(sync_rollout + costs.weight_sync_s) / sync_step,
        sync_inference_idle=(train + costs.weight_sync_s) / sync_step,
        async_trainer_idle=1 - train / async_step, async_inference_idle=1 - async_rollout / async_step,
        stale_fraction=stale, concurrency=concurrency)
