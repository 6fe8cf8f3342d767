"""swe-tiny: fix a bug in a small Python repository through tool calls; reward = its tests pass.

Each task is a tiny repository (`calc.py` with a one-word bug, `checks.py` with the unit tests that
catch it). Every episode copies its repository into a sandbox of its own (sandbox.py: a temporary
folder, bubblewrap namespaces without network, rlimits on CPU, memory, file size, a wall-clock limit),
and the model works on it one command per turn:

    ls                   the repository's files
    cat NAME             a file (NAME: its name, or its name without `.py`)
    edit NAME OLD NEW    replace the first whole word OLD in the file by NEW
    test                 run the tests in the sandbox; the reply is the end of their output
    done                 end the episode

Commands are lowercase words, so the character-level tiny model can type every one of them; any
reply (file contents, test output) is environment tokens, masked out of the loss. The episode ends on
`done` or after `max_turns` commands; then the tests run once more, for real, in the sandbox: reward
1.0 if they pass, 0.0 otherwise — also when the code under test loops forever, exhausts memory or
tries to write outside its folder: the sandbox ends it and the run goes on.

`hostile: true` adds repositories whose code under test does exactly those things (for tests and for
demonstrating the sandbox in a real run); they are never solvable.
"""

from __future__ import annotations

import random
import re
import zlib
from types import MappingProxyType

from primebuild.errors import UserError
from primebuild.runtime.envs.base import ENVIRONMENT, MODEL, Task
from primebuild.runtime.envs.sandbox import Limits, Result, Sandbox, python_in_sandbox
from primebuild.runtime.models.char_tokenizer import SEPARATOR

ENV_ID = "swe-tiny"
ENV_VERSION = "1"
TESTS = "checks.py"
REPLY_CHARS = 400  # the end of a long output is what matters (the failing assertion)

# name -> (the buggy line of calc.py, the fix as an `edit calc OLD NEW` command, the test body)
BUGS: dict[str, tuple[str, str, str]] = {
    "add": ("def add(a, b):\n    return operator.sub(a, b)\n", "edit calc sub add",
            "self.assertEqual(calc.add(2, 3), 5)"),
    "largest": ("def largest(xs):\n    return min(xs)\n", "edit calc min max",
                "self.assertEqual(calc.largest([3, 9, 4]), 9)"),
    "smallest": ("def smallest(xs):\n    return max(xs)\n", "edit calc max min",
                 "self.assertEqual(calc.smallest([3, 9, 4]), 3)"),
    "shout": ("def shout(s):\n    return s.lower()\n", "edit calc lower upper",
              "self.assertEqual(calc.shout('hey'), 'HEY')"),
    "whisper": ("def whisper(s):\n    return s.upper()\n", "edit calc upper lower",
                "self.assertEqual(calc.whisper('HEY'), 'hey')"),
    "total": ("def total(xs):\n    return len(xs)\n", "edit calc len sum",
              "self.assertEqual(calc.total([2, 5]), 7)"),
    "count": ("def count(xs):\n    return sum(xs)\n", "edit calc sum len",
              "self.assertEqual(calc.count([2, 5, 9]), 3)"),
    "product": ("def product(a, b):\n    return operator.add(a, b)\n", "edit calc add mul",
                "self.assertEqual(calc.product(4, 5), 20)"),
    "ordered": ("def ordered(xs):\n    return list(reversed(xs))\n", "edit calc reversed sorted",
                "self.assertEqual(calc.ordered([3, 1, 2]), [1, 2, 3])"),
    "capital": ("def capital(s):\n    return s.lower()\n", "edit calc lower title",
                "self.assertEqual(calc.capital('ada lovelace'), 'Ada Lovelace')"),
}
# Code under test that misbehaves: the sandbox must end it and the episode score 0.
HOSTILE: dict[str, str] = {
    "spin": "def spin():\n    while True:\n        pass\n",
    "hog": "def hog():\n    return bytearray(1 << 40)\n",
    "escape": "def escape():\n    with open(OUTSIDE, 'w') as f:\n        f.write('escaped')\n    return True\n",
    "sleeper": "def sleeper():\n    import time\n    time.sleep(3600)\n",
}


def repository(name: str, outside: str = "/var/tmp/primebuild-swe-tiny-escaped") -> dict[str, str]:
    """The files of task `name` (a bug of BUGS or a hostile repository of HOSTILE). `outside` is where the
    escape attempt writes: a writable place on the host, absent (read-only) inside the sandbox."""
    if name in BUGS:
        code, _, check = BUGS[name]
        test = f"    def test_{name}(self):\n        {check}\n"
    else:
        code = f"OUTSIDE = {outside!r}\n\n" + HOSTILE[name]
        test = f"    def test_{name}(self):\n        self.assertTrue(calc.{name}())\n"
    calc = f'"""A small module with a bug."""\n\nimport operator\n\n\n{code}'
    checks = f"import unittest\n\nimport calc\n\n\nclass Checks(unittest.TestCase):\n{test}\n\nif __name__ == '__main__':\n    unittest.main()\n"
    return {"calc.py": calc, TESTS: checks}


def is_eval_task(name: str) -> bool:
    return zlib.crc32(name.encode()) % 5 == 0


class SweTinyEpisode:
    def __init__(self, files: dict[str, str], limits: Limits, max_turns: int, reply_chars: int = REPLY_CHARS):
        self.sandbox = Sandbox(limits, prefix="primebuild-swe-tiny-")
        self.reply_chars = reply_chars
        for name, text in files.items():
            self.sandbox.path(name).write_text(text)
        self.max_turns = max_turns
        self.turns = 0
        self.final: Result | None = None

    async def run_tests(self) -> Result:
        return await self.sandbox.run([python_in_sandbox(), "-m", "unittest", "-q", TESTS.removesuffix(".py")])

    async def step(self, completion: str) -> str | None:
        self.turns += 1
        words = completion.split()
        if words == ["done"]:
            return None
        reply = await self._tool(words)
        if self.turns >= self.max_turns:
            return None
        return reply[-self.reply_chars:] + "\n" + SEPARATOR

    async def _tool(self, words: list[str]) -> str:
        if words == ["ls"]:
            return " ".join(sorted(p.name for p in self.sandbox.root.iterdir()))
        if words == ["test"]:
            result = await self.run_tests()
            return "timed out" if result.timed_out else (result.stdout + result.stderr).strip() or "ok"
        if len(words) == 2 and words[0] == "cat":
            file = self._file(words[1])
            return file.read_text() if file else f"no file {words[1]}"
        if len(words) == 4 and words[0] == "edit":
            file = self._file(words[1])
            if file is None:
                return f"no file {words[1]}"
            text, n = re.subn(rf"\b{re.escape(words[2])}\b", words[3], file.read_text(), count=1)
            if not n:
                return f"no {words[2]} in {file.name}"
            file.write_text(text)
            return f"edited {file.name}"
        return "commands: ls, cat NAME, edit NAME OLD NEW, test, done"

    def _file(self, name: str):
        for candidate in (name, name + ".py"):
            try:
                path = self.sandbox.path(candidate)
            except ValueError:
                return None
            if path.is_file() and path.parent == self.sandbox.root.resolve():
                return path
        return None

    async def reward(self) -> float:
        self.final = await self.run_tests()
        return 1.0 if self.final.ok else 0.0

    async def close(self) -> None:
        self.sandbox.close()


class SweTinyEnv:
    """See the module docstring."""

    id = ENV_ID
    version = ENV_VERSION
    max_tokens_per_turn = 32  # the longest command and its <eos> (greedy evaluation in SFT reads it)

    def __init__(self, max_turns: int = 4, cpu_seconds: int = 5, wall_seconds: float = 20.0,
                 memory_mb: int = 512, hostile: bool = False, reply_chars: int = REPLY_CHARS):
        for name, value in (("max_turns", max_turns), ("cpu_seconds", cpu_seconds), ("memory_mb", memory_mb)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"environment {ENV_ID}: {name} must be a positive integer, got {value!r}")
        self.max_turns = max_turns
        self.reply_chars = reply_chars
        self.limits = Limits(cpu_seconds=cpu_seconds, wall_seconds=float(wall_seconds),
                             memory_bytes=memory_mb << 20)
        names = sorted(BUGS)
        self._train = [self._task(n) for n in names if not is_eval_task(n)]
        self._eval = [self._task(n) for n in names if is_eval_task(n)]
        if hostile:
            self._train += [self._task(n) for n in sorted(HOSTILE)]

    @staticmethod
    def _task(name: str) -> Task:
        fix = BUGS[name][1] if name in BUGS else ""
        return Task(prompt=f"fix {name}", answer=fix, info=MappingProxyType({"name": name}))

    def sample_tasks(self, rng: random.Random, n: int) -> list[Task]:
        return [rng.choice(self._train) for _ in range(n)]

    def eval_tasks(self) -> list[Task]:
        return list(self._eval)

    def format_prompt(self, task: Task) -> str:
        return task.prompt + SEPARATOR

    def score(self, task: Task, completion: str) -> float:
        raise NotImplementedError("swe-tiny is multi-turn: its reward comes from running the tests of an episode")

    def start(self, task: Task) -> SweTinyEpisode:
        return SweTinyEpisode(repository(task.info["name"]), self.limits, self.max_turns, self.reply_chars)

    def demonstration(self, task: Task, rng: random.Random) -> list[tuple[bool, str]]:
        """Look, fix, test, finish."""
        shown = repository(task.info["name"])["calc.py"][-self.reply_chars:]
        return [(MODEL, "cat calc"), (ENVIRONMENT, shown + "\n" + SEPARATOR), (MODEL, task.answer),
                (ENVIRONMENT, "edited calc.py\n" + SEPARATOR), (MODEL, "done")]
