"""long-tail: multi-turn episodes whose lengths and tool latencies are heavy-tailed, for benchmarks.

Agentic workloads are long-tailed: most episodes take a few turns, a few take ten times more, and
each tool call (a test run, a search) takes a variable while. This environment reproduces that shape
with a task the tiny reverse-text model can do: every turn the environment names a short string, after
a simulated tool latency, and the model answers it reversed.

    <bos> ab>  ba<eos>  c>  c<eos>  dbe>  ebd<eos> ...

- turns per episode: log-normal through (`turns_p50`, `turns_p99`), drawn per task, at most `max_turns`;
- tool latency: each reply waits a log-normal delay through (`latency_p50_s`, `latency_p99_s`), drawn
  per reply and per episode (two episodes of one task do not wait alike);
- reward: the mean LCS ratio of the model's answers (reverse-text's reward), over the episode's turns.

The same quantiles, declared in the manifest's `orchestrator.rollout_profile`, are what the plan's time
model predicts from (primebuild/builders/timing.py); bench/async_rl.py measures the two side by side.
"""

from __future__ import annotations

import asyncio
import math
import random
import string
import zlib
from types import MappingProxyType

from primebuild.errors import UserError
from primebuild.runtime.envs.base import ENVIRONMENT, MODEL, Task
from primebuild.runtime.envs.reverse_text import ReverseStringEnv, lcs_ratio
from primebuild.runtime.models.char_tokenizer import SEPARATOR

ENV_ID = "long-tail"
ENV_VERSION = "1"
Z99 = 2.3263478740408408  # the standard normal's 99th percentile


def lognormal(rng: random.Random, p50: float, p99: float) -> float:
    """A draw of the log-normal whose median is p50 and 99th percentile p99."""
    sigma = math.log(p99 / p50) / Z99 if p99 > p50 else 0.0
    return p50 * math.exp(sigma * rng.gauss(0.0, 1.0))


class LongTailEpisode:
    def __init__(self, strings: list[str], latency: tuple[float, float], seed: int):
        self.strings = strings
        self.latency = latency
        self.rng = random.Random(seed)
        self.scores: list[float] = []

    async def step(self, completion: str) -> str | None:
        self.scores.append(lcs_ratio(completion.strip(), self.strings[len(self.scores)][::-1]))
        if len(self.scores) >= len(self.strings):
            return None
        await asyncio.sleep(lognormal(self.rng, *self.latency))  # the tool call
        return self.strings[len(self.scores)] + SEPARATOR

    async def reward(self) -> float:
        return sum(self.scores) / len(self.strings)

    async def close(self) -> None:
        pass


class LongTailEnv(ReverseStringEnv):
    """See the module docstring."""

    id = ENV_ID
    version = ENV_VERSION

    def __init__(self, turns_p50: float = 2.0, turns_p99: float = 20.0, latency_p50_s: float = 0.02,
                 latency_p99_s: float = 0.2, max_turns: int = 24, min_length: int = 1, max_length: int = 2,
                 num_eval: int = 50):
        if not 1 <= turns_p50 <= turns_p99 or not 0 < latency_p50_s <= latency_p99_s:
            raise UserError(f"environment {ENV_ID}: need 1 <= turns_p50 <= turns_p99 and 0 < latency_p50_s <= "
                            "latency_p99_s")
        if not 1 <= min_length <= max_length or max_turns < 1:
            raise UserError(f"environment {ENV_ID}: need 1 <= min_length <= max_length and max_turns >= 1")
        self.turns = (float(turns_p50), float(turns_p99))
        self.latency = (float(latency_p50_s), float(latency_p99_s))
        self.max_turns = max_turns
        self.lengths = (min_length, max_length)
        self._eval = [self._draw(random.Random(f"eval-{i}"), i) for i in range(num_eval)]
        self._episodes = 0

    def _draw(self, rng: random.Random, index: int) -> Task:
        turns = max(1, min(self.max_turns, round(lognormal(rng, *self.turns))))
        strings = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(*self.lengths)))
                   for _ in range(turns)]
        return Task(prompt=strings[0], answer=strings[0][::-1],
                    info=MappingProxyType({"strings": tuple(strings), "seed": zlib.crc32(f"{index}".encode())}))

    def sample_tasks(self, rng: random.Random, n: int) -> list[Task]:
        return [self._draw(rng, rng.randrange(1 << 30) + len(self._eval)) for _ in range(n)]

    def start(self, task: Task) -> LongTailEpisode:
        # each episode draws its own latencies (episodes of one task do not wait alike); reproducible per run
        self._episodes += 1
        return LongTailEpisode(list(task.info["strings"]), self.latency, task.info["seed"] * 1_000_003 + self._episodes)

    def demonstration(self, task: Task, rng: random.Random) -> list[tuple[bool, str]]:
        segments: list[tuple[bool, str]] = []
        for i, s in enumerate(task.info["strings"]):
            if i:
                segments.append((ENVIRONMENT, s + SEPARATOR))
            segments.append((MODEL, s[::-1]))
        return segments
