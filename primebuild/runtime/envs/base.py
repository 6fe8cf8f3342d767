"""What the runtime needs from an environment, and nothing more.

An environment hands out tasks, says how a task is shown to the model, and scores a completion.
Trainer, orchestrator and evaluation only ever talk to this protocol, so a built-in environment
(reverse-text) and a wrapped `verifiers` taskset are interchangeable.

Multi-turn environments (`MultiTurnEnvironment`) also `start` an `Episode` per rollout: the
orchestrator sends each model turn's text to `Episode.step`, which answers with the environment's
reply (a game's feedback, a tool's output) or None when the episode is over; `Episode.reward` scores
the whole episode. The reply text is appended to the rollout's token sequence as environment tokens
(encoded without special tokens, so the environment writes its own framing: a separator, a chat
template's turn markers), masked out of the loss. A single-turn environment is an episode of one
turn (`start_episode` wraps it), so the orchestrator has one rollout loop for both.

Two sources of tasks, kept apart on purpose:
- `sample_tasks(rng, n)`: training tasks, as many as asked, driven by the caller's seeded RNG.
- `eval_tasks()`: a fixed held-out list, the same on every call and every machine, and disjoint from
  anything `sample_tasks` can return, so an eval reward measures generalisation, not memory.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

MODEL, ENVIRONMENT = True, False  # who wrote a demonstration segment (SFT trains on the model's only)


@dataclass(frozen=True)
class Task:
    """One problem: what the user asks, the reference answer, and environment-private details."""

    prompt: str
    """The problem text (user content), before `Environment.format_prompt` frames it."""
    answer: str
    """The reference answer; it doubles as the SFT demonstration where the environment has one."""
    info: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Anything else the environment needs to score the task (read-only by convention)."""


@runtime_checkable
class Environment(Protocol):
    id: str
    version: str

    def sample_tasks(self, rng: random.Random, n: int) -> list[Task]:
        """`n` training tasks drawn with `rng`; never one of `eval_tasks()`."""
        ...

    def eval_tasks(self) -> list[Task]:
        """The fixed held-out tasks (same list, same order, on every call)."""
        ...

    def format_prompt(self, task: Task) -> str:
        """The exact text sent to the model (the tokenizer adds its own begin-of-sequence token)."""
        ...

    def score(self, task: Task, completion: str) -> float:
        """Reward in [0, 1] for the model's completion text (special tokens already removed)."""
        ...


class Episode(Protocol):
    """One rollout's environment side. Methods are async: a tool may run a process or wait on I/O."""

    async def step(self, completion: str) -> str | None:
        """The environment's reply to one model turn, or None when the episode is over."""
        ...

    async def reward(self) -> float:
        """Reward in [0, 1] of the episode so far (called once, after the last turn)."""
        ...

    async def close(self) -> None:
        """Release what the episode holds (a sandbox folder, a process); called exactly once."""
        ...


@runtime_checkable
class MultiTurnEnvironment(Environment, Protocol):
    max_turns: int  # model turns per episode at most (the orchestrator also stops at seq_len tokens)

    def start(self, task: Task) -> Episode:
        ...

    def demonstration(self, task: Task, rng: random.Random) -> list[tuple[bool, str]]:
        """A good episode for SFT: (MODEL, text) and (ENVIRONMENT, text) segments in order, starting
        with a model turn; each model turn is followed by the end-of-sequence token when encoded."""
        ...


class SingleTurnEpisode:
    """A single-turn environment as an episode: the first model turn ends it and is scored."""

    def __init__(self, env: Environment, task: Task):
        self.env, self.task = env, task
        self.completion: str | None = None

    async def step(self, completion: str) -> str | None:
        self.completion = completion
        return None

    async def reward(self) -> float:
        ascore = getattr(self.env, "ascore", None)
        if ascore is not None:  # a scorer that awaits (verifiers) runs on the orchestrator's own loop
            return await ascore(self.task, self.completion or "")
        return self.env.score(self.task, self.completion or "")  # checked by episode_reward

    async def close(self) -> None:
        pass


class RewardError(ValueError):
    """An environment's reward that is no finite number: the rollout fails, naming the environment (a NaN
    reaching the trainer made the loss non-finite, far from its cause)."""


async def episode_reward(env: Environment, episode: Episode) -> float:
    """`episode.reward()`, checked (finite_reward)."""
    return finite_reward(env.id, await episode.reward())


def finite_reward(env_id: str, value: object) -> float:
    """`value` as a float when it is a finite number, else RewardError naming the environment."""
    try:
        reward = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):
        raise RewardError(f"environment {env_id}: its reward {value!r} is not a finite number")
    return reward


def start_episode(env: Environment, task: Task) -> Episode:
    return env.start(task) if isinstance(env, MultiTurnEnvironment) else SingleTurnEpisode(env, task)


def max_turns(env: Environment) -> int:
    return env.max_turns if isinstance(env, MultiTurnEnvironment) else 1


def demonstration(env: Environment, task: Task, rng: random.Random) -> list[tuple[bool, str]]:
    """What SFT imitates: a multi-turn environment's demonstration, else the task's answer."""
    if isinstance(env, MultiTurnEnvironment):
        return env.demonstration(task, rng)
    return [(MODEL, task.answer)]
