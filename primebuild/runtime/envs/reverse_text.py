"""Reverse-text: the embedded default's environment.

Task: a string of 4-12 random lowercase letters; the model sees the string followed by the separator
(`"hello>"`) and should answer the string reversed (`"olleh"`).

Reward: the LCS ratio `2 * LCS(completion, answer) / (len(completion) + len(answer))`, where LCS is the
length of the longest common subsequence (exact dynamic programme, not difflib's heuristic matcher).
It is 1.0 exactly for the right answer, 0.0 when no letter lines up, and gives partial credit for
near misses (one swapped pair, a dropped letter), which is what makes it a useful RL signal. Two empty
strings score 1.0 by convention. The completion is compared after stripping surrounding whitespace.

Held-out split by construction: every string belongs to one bucket, a fixed hash of its text. Strings in
the eval bucket (~1 in 10) are never produced by `sample_tasks`; `eval_tasks` draws only from that
bucket with its own fixed seed. The hash is CRC32, not Python's `hash()`, so the split is the same in
every process and on every machine.
"""

from __future__ import annotations

import random
import string
import zlib

from primebuild.errors import UserError
from primebuild.runtime.envs.base import Task
from primebuild.runtime.models.char_tokenizer import SEPARATOR

ENV_ID = "reverse-text"
ENV_VERSION = "1"
EVAL_BUCKETS = 10  # 1 in EVAL_BUCKETS strings is reserved for evaluation
EVAL_SEED = 20240601  # fixes the held-out list forever; changing it means bumping ENV_VERSION


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of `a` and `b` (O(len a * len b), one row kept)."""
    if len(a) < len(b):
        a, b = b, a  # keep the row over the shorter string
    row = [0] * (len(b) + 1)
    for ca in a:
        diagonal = 0  # row[j-1] of the previous row
        for j, cb in enumerate(b, start=1):
            above = row[j]
            row[j] = diagonal + 1 if ca == cb else max(above, row[j - 1])
            diagonal = above
    return row[-1]


def lcs_ratio(a: str, b: str) -> float:
    """`2 * LCS(a, b) / (len(a) + len(b))`, in [0, 1]; 1.0 for two empty strings."""
    if not a and not b:
        return 1.0
    return 2.0 * lcs_length(a, b) / (len(a) + len(b))


def is_eval_string(text: str) -> bool:
    """Whether `text` lies in the held-out bucket (so training never sees it)."""
    return zlib.crc32(text.encode()) % EVAL_BUCKETS == 0


class ReverseStringEnv:
    """What the reverse-a-string environments share: held-out tasks in `_eval`, the prompt (the string and
    the separator), and the reward (lcs_ratio against the reversed string)."""

    _eval: list[Task]

    def eval_tasks(self) -> list[Task]:
        return list(self._eval)

    def format_prompt(self, task: Task) -> str:
        return task.prompt + SEPARATOR

    def score(self, task: Task, completion: str) -> float:
        return lcs_ratio(completion.strip(), task.answer)


class ReverseTextEnv(ReverseStringEnv):
    """Reverse a random lowercase string; see the module docstring for the reward and the split."""

    id = ENV_ID
    version = ENV_VERSION

    def __init__(self, min_length: int = 4, max_length: int = 12, num_eval: int = 200):
        for name, value in (("min_length", min_length), ("max_length", max_length), ("num_eval", num_eval)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise UserError(f"environment {ENV_ID}: {name} must be an integer, got {value!r}")
        if not 1 <= min_length <= max_length:
            raise UserError(
                f"environment {ENV_ID}: need 1 <= min_length <= max_length, "
                f"got min_length={min_length}, max_length={max_length}"
            )
        if num_eval < 1:
            raise UserError(f"environment {ENV_ID}: num_eval must be >= 1, got {num_eval}")
        self.min_length = min_length
        self.max_length = max_length
        self.num_eval = num_eval
        self._eval = self._draw_eval_tasks()

    def _random_string(self, rng: random.Random) -> str:
        length = rng.randint(self.min_length, self.max_length)
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(length))

    def _task(self, text: str) -> Task:
        return Task(prompt=text, answer=text[::-1])

    def sample_tasks(self, rng: random.Random, n: int) -> list[Task]:
        tasks = []
        while len(tasks) < n:
            text = self._random_string(rng)
            if not is_eval_string(text):
                tasks.append(self._task(text))
        return tasks

    def _draw_eval_tasks(self) -> list[Task]:
        rng = random.Random(EVAL_SEED)
        seen: set[str] = set()
        tasks = []
        # A small string space (say min_length=max_length=2) may not hold num_eval distinct eval
        # strings at all: give up after a generous number of draws instead of looping forever.
        for _ in range(1000 * self.num_eval):
            text = self._random_string(rng)
            if is_eval_string(text) and text not in seen:
                seen.add(text)
                tasks.append(self._task(text))
                if len(tasks) == self.num_eval:
                    return tasks
        raise UserError(
            f"environment {ENV_ID}: strings of length {self.min_length}-{self.max_length} cannot "
            f"supply {self.num_eval} distinct held-out tasks",
            hint="lower num_eval or allow longer strings",
        )

