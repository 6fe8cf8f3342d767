"""Step time of a workload whose rollouts differ in length: expected and tail, synchronous and async.

The worst case of timing.py (every rollout full-length) is right for a fixed-length task and far off
for agents: most episodes are short, a few are ten times longer, and tools add waits of their own. A
manifest's `orchestrator.rollout_profile` gives medians and 99th percentiles of prompt, completion and
environment tokens, turns and tool latency; each is taken as log-normal through its two quantiles and
all move together (a rollout at quantile q is long in every respect: long episodes are long because
they take more turns). On a grid of 100 quantiles q:

    r(q) = completion(q) · decode_step(B) + turns(q) · turn overhead + (turns(q) - 1) · mean tool latency
           + (prompt(q) / group_size + environment(q)) · prefill per token

is the time of one rollout while the replica decodes B sequences; prompt + completion + environment is
capped at seq_len.

- Synchronous (max_off_policy_steps 0): a step starts its R rollouts together and ends with the
  slowest, at quantile R/(R+1) of the duration distribution (the expected maximum's usual approximation;
  durations: `Durations`, tool latencies drawn per call); then the trainer trains and weights are synced:
      sync step = (waves - 1) · E[r] + r(tail) + train + weight sync.
- Asynchronous (the continuous pool, primebuild/runtime/orchestrator/pool.py): up to C = (1 + m) · R rollouts in
  flight, m = max(1, max_off_policy_steps) (a rollout waiting on a tool holds no server slot; the
  servers' max concurrent sequences cap the decode batch B); one batch fewer while the servers still
  serve the weights before the last batch written (train + weight sync of each step), so on average
  C' = (1 + m - lag) · R, lag = min(1, (train + weight sync) / step). A group holds its slots until it
  is batched: its slowest rollout G (the group's rollouts share the task's lengths and draw their tool
  latencies apart: `Durations.slowest_of`), then half a step until the next batch is cut. By Little's
  law, with the window W = (1 + m) · step after which a group can join no batch and is dropped (the work
  spent on it lost), and no faster than full batches decode their tokens, nor than the servers take
  requests where their handling serializes, while the trainer overlaps:
      async step = max(R · (E[min(G, W)] + P[G ≤ W] · step / 2) / (C' · P[G ≤ W]),
                       R · E[completion] · decode_step(B) / (B · replicas),
                       R · E[turns] · request / replicas, train)
  (request: server time per request that serializes on a replica; the embedded engine's only), solved
  as a fixed point in the step. The stale share 1 - P[G ≤ W] is the groups dropped; a large one says
  max_off_policy_steps is too small for the tail. Measured against the CPU long-tail bench within 5-15%
  where the pool's window binds (bench/RESULTS.md).

Idle fractions: of a synchronous step the trainer idles while rollouts run (and weights sync), the
inference side while the trainer trains; of an async step the side that is not the longer one.
Train time uses the expected tokens per step; everything else is as in timing.py.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

from primebuild.contracts.estimates import ProfileTimes

Z99 = NormalDist().inv_cdf(0.99)
SQRT2 = math.sqrt(2)
GRID = 100  # quantile midpoints for expectations (400 moved the GLM-5 estimates by < 1%)


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
    request_s: float  # of that, server time that serializes on a replica (the embedded engine's one thread)
    train_s: Callable[[int, int], float]  # (sequences, tokens per sequence) -> seconds
    weight_sync_s: float
    teacher_s: float = 0.0  # distillation: the teacher scores each step's batch before the trainer gets it


class Durations:
    """How long one rollout takes: over the quantile grid (its lengths move together), a fixed part plus the
    sum of its tool calls' latencies, independent draws summed as one log-normal of the same mean and
    variance (Fenton-Wilkinson). A step's slowest rollout is mostly a latency outlier, not just the
    longest episode: this is what makes the synchronous tail long. Closed forms only (erf): `plan` runs
    this for every inference:trainer split it compares."""

    def __init__(self, fixed: list[float], calls: list[float], latency: tuple[float, float]):
        p50, p99 = latency
        sigma = math.log(p99 / p50) / Z99 if p99 > p50 > 0 else 0.0
        latency_mean = mean(p50, p99)
        latency_var = (math.exp(sigma * sigma) - 1) * latency_mean ** 2
        # per component: (fixed, sum's mean, log-mean, log-sd); log-sd 0 = a constant sum
        self.parts: list[tuple[float, float, float, float]] = []
        for f, k in zip(fixed, calls, strict=True):
            m, v = k * latency_mean, k * latency_var
            if m <= 0 or v <= 0:
                self.parts.append((f, m, 0.0, 0.0))
            else:
                s2 = math.log(1 + v / (m * m))
                self.parts.append((f, m, math.log(m) - s2 / 2, math.sqrt(s2)))

    @property
    def mean(self) -> float:
        return sum(f + m for f, m, _, _ in self.parts) / len(self.parts)

    def slowest_of(self, n: int) -> Durations:
        """The slowest of `n` rollouts of one task: they share its lengths (the grid point) and draw their
        tool latencies independently. Per grid point, the maximum of n draws of a log-normal sum is taken as
        the log-normal through its median and 99th percentile (the sum's quantiles 0.5^(1/n), 0.99^(1/n))."""
        z50, z99 = NormalDist().inv_cdf(0.5 ** (1 / n)), NormalDist().inv_cdf(0.99 ** (1 / n))
        slowest = copy.copy(self)
        slowest.parts = []
        for f, m, mu, sd in self.parts:
            if sd == 0.0:  # a constant: the slowest of n is the same constant
                slowest.parts.append((f, m, mu, sd))
                continue
            mu_n, sd_n = mu + sd * z50, sd * (z99 - z50) / Z99
            slowest.parts.append((f, math.exp(mu_n + sd_n * sd_n / 2), mu_n, sd_n))
        return slowest

    def cdf(self, x: float) -> float:
        total = 0.0
        for f, m, mu, sd in self.parts:
            if sd == 0.0:
                total += 1.0 if x >= f + m else 0.0
            elif x > f:
                total += 0.5 * (1 + math.erf((math.log(x - f) - mu) / (sd * SQRT2)))
        return total / len(self.parts)

    def quantile(self, p: float) -> float:
        lo, hi = 0.0, max(f + m for f, m, _, _ in self.parts) + 1.0
        while self.cdf(hi) < p:
            hi *= 2
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.cdf(mid) < p else (lo, mid)
        return hi

    def window(self, w: float) -> tuple[float, float]:
        """(P[duration <= w], E[min(duration, w)]) in one pass: per component f + E[min(S, w - f)], with
        E[min(S, c)] of a log-normal S = mean · Φ((ln c - μ - σ²)/σ) + c · (1 - Φ((ln c - μ)/σ))."""
        below = spent = 0.0
        for f, m, mu, sd in self.parts:
            c = w - f
            if c <= 0:
                spent += w
            elif sd == 0.0:
                below += 1.0 if m <= c else 0.0
                spent += f + min(m, c)
            else:
                z = (math.log(c) - mu) / sd
                p = _phi(z)
                below += p
                spent += f + m * _phi(z - sd) + c * (1 - p)
        return below / len(self.parts), spent / len(self.parts)


def _phi(z: float) -> float:
    return 0.5 * (1 + math.erf(z / SQRT2))


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
                  seq_len: int, replicas: int, max_concurrent_per_replica: int, sync: bool = True) -> ProfileTimes:
    """`sync=False` skips the synchronous step (its fields are then 0): comparing splits needs only the async one."""
    R = rollouts_per_step
    m = max(1, max_off_policy_steps)
    per_replica = math.ceil(R / replicas)
    sync_batch = max(1, min(per_replica, max_concurrent_per_replica))
    waves = math.ceil(per_replica / sync_batch)
    # Rollouts in flight: a turn holds a server slot only while it decodes (a rollout waiting on a tool
    # holds none), so max_num_seqs caps the decode batch, not the rollouts in flight.
    concurrency = (1 + m) * R
    async_batch = max(1, min(math.ceil(concurrency / replicas), max_concurrent_per_replica))

    grid = [(k + 0.5) / GRID for k in range(GRID)]
    shapes = [_shape(p, q, seq_len) for q in grid]

    def durations(batch: int) -> Durations:
        fixed, calls = [], []
        for prompt, completion, environment, turns in shapes:
            context = prompt + (completion + environment) / 2
            fixed.append(completion * costs.decode_step_s(batch, context) + turns * costs.turn_overhead_s
                         + (prompt / group_size + environment) * costs.prefill_s_per_token)
            calls.append(turns - 1)  # every model turn but the last gets the environment's reply (a tool)
        return Durations(fixed, calls, p.tool_latency_s)

    async_durations = durations(async_batch)
    tokens = sum(sum(shape[:3]) for shape in shapes) / GRID
    train = costs.train_s(R, max(1, round(tokens)))
    tail_q = R / (R + 1)  # the expected slowest of R rollouts
    tail = sync_rollout = sync_step = 0.0
    if sync:
        sync_durations = durations(sync_batch)
        tail = sync_durations.quantile(tail_q)
        sync_rollout = (waves - 1) * sync_durations.mean + tail
        sync_step = sync_rollout + costs.teacher_s + train + costs.weight_sync_s

    # The servers cannot decode faster than full batches do, nor take requests faster than one at a time
    # where their handling serializes: floors under the async step, with the trainer's.
    completion = sum(shape[1] for shape in shapes) / GRID
    turns = sum(shape[3] for shape in shapes) / GRID
    decode_bound = R * completion * costs.decode_step_s(async_batch, seq_len / 2) / (async_batch * replicas)
    request_bound = R * turns * costs.request_s / replicas
    floor = max(decode_bound, request_bound, costs.teacher_s)  # the teacher scores one batch at a time

    expected_async = async_durations.mean
    group_durations = async_durations.slowest_of(group_size)  # a group is batched whole, or dropped whole

    def needed(step: float) -> tuple[float, float]:
        """(rollout time per step, stale share) if a step took `step`. The pool (pool.py) holds a slot per
        rollout of a group from its start until the group is batched: its slowest rollout, then half a
        step on average until the next batch is cut. A group whose slowest rollout outlasts the window is
        dropped there, and the work spent on it is lost. The pool admits groups for the batches the served
        version may still join: from when a batch is written until the servers serve the weights trained
        on it (train + weight sync) that is one batch fewer, so (1 + m - lag) · R slots on average."""
        kept, spent = group_durations.window((1 + m) * step)
        if kept <= 1e-12:
            return math.inf, 1.0
        hold = spent + kept * step / 2
        lag = min(1.0, (costs.teacher_s + train + costs.weight_sync_s) / step)
        # R rollouts kept per step out of (1 + m - lag) · R slots: R cancels
        return max(hold / ((1 + m - lag) * kept), floor), 1 - kept

    # The step T solves T = max(train, needed(T)): needed falls as T grows (a wider window drops less), so
    # T - max(train, needed(T)) rises through zero once: bisect.
    lo = max(train, floor, R * expected_async / concurrency)
    hi = lo
    while hi - max(train, needed(hi)[0]) < 0 and hi < 1e12:
        hi *= 2
    for _ in range(36):  # to ~1e-11 of the bracket
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid - max(train, needed(mid)[0]) < 0 else (lo, mid)
    async_rollout, stale = needed(hi)
    if async_rollout == math.inf:
        async_rollout = hi
    async_step = max(async_rollout, train)
    return ProfileTimes(
        expected_tokens=tokens, expected_rollout_seconds=expected_async, tail_rollout_seconds=tail,
        tail_quantile=tail_q, train_seconds=train, sync_step_seconds=sync_step, async_step_seconds=async_step,
        async_sync_ratio=sync_step / async_step, max_off_policy_steps=m,
        sync_trainer_idle=(sync_rollout + costs.teacher_s + costs.weight_sync_s) / sync_step if sync else 0.0,
        sync_inference_idle=(costs.teacher_s + train + costs.weight_sync_s) / sync_step if sync else 0.0,
        async_trainer_idle=1 - train / async_step, async_inference_idle=1 - async_rollout / async_step,
        stale_fraction=stale, concurrency=concurrency)
