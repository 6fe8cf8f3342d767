"""What the runtime needs from an environment, and nothing more.

An environment hands out tasks, says how a task is shown to the model, and scores a completion.
Trainer, orchestrator and evaluation only ever talk to this protocol, so a built-in environment
(reverse-text) and a wrapped `verifiers` taskset are interchangeable.

Two sources of tasks, kept apart on purpose:
- `sample_tasks(rng, n)`: training tasks, as many as asked, driven by the caller's seeded RNG.
- `eval_tasks()`: a fixed held-out list, the same on every call and every machine, and disjoint from
  anything `sample_tasks` can return, so an eval reward measures generalisation, not memory.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable


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
