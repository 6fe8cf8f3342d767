"""A verifiers taskset for the bash harness where the command depends on the task: "what does NAME say?".

Each task's setup writes, into the rollout's sandbox only, the file NAME with a random text and two decoy
files (other names, other texts). The reward is 1 when some command's whole output is NAME's text, so the
model has to put the name from the prompt into its command (`cat NAME`); `cat *` prints the decoys too and
scores 0, and no policy can know a text without running a command. One task per name: primebuild's split
(by a hash of the task's content, primebuild/runtime/envs/verifiers_adapter.py) then holds out whole names,
so the held-out names never appear in training and a policy that scores on them copies names it never saw.

Names are `NAME_LENGTH` letters over `ALPHABET` plus `.txt` (16 x 16 = 256 names, 256 tasks). Used by
bench/bash_files.py (a warm start, then RL through `primebuild run`) and tests/test_bash_files.py.
"""

from __future__ import annotations

import itertools
import random

import verifiers.v1 as vf

ALPHABET = "abcdefghijklmnop"
NAME_LENGTH = 2
SEED = 7  # the texts and decoys are fixed per name, so a task's content (and its split) never changes
DECOYS = 2


def file_names() -> list[str]:
    return ["".join(letters) + ".txt" for letters in itertools.product(ALPHABET, repeat=NAME_LENGTH)]


def command(name: str) -> str:
    """The command a demonstration runs for `name` (the warm start imitates it)."""
    return f"cat {name}"


class FileRow(vf.TaskData):
    name: str = ""
    text: str = ""
    decoys: dict[str, str] = {}


class FilesTask(vf.Task[FileRow]):
    async def setup(self, trace, runtime):  # the files exist only in this rollout's sandbox
        await runtime.write(self.data.name, self.data.text.encode())
        for decoy, text in self.data.decoys.items():
            await runtime.write(decoy, text.encode())

    @vf.reward
    async def printed_the_file(self, trace) -> float:
        return float(any(m.role == "tool" and str(m.content).strip() == self.data.text for m in trace.messages))


class FilesTaskset(vf.Taskset[FilesTask, vf.TasksetConfig]):
    def load(self):
        names = file_names()
        rng = random.Random(SEED)
        for name in names:
            text = "".join(rng.choice("0123456789qrstuvwxyz") for _ in range(6))
            others = rng.sample([n for n in names if n != name], DECOYS)
            decoys = {other: "".join(rng.choice("0123456789qrstuvwxyz") for _ in range(6)) for other in others}
            yield FilesTask(FileRow(prompt=f"what does {name} say?", name=name, text=text, decoys=decoys),
                            self.config.task)


__all__ = ["FilesTaskset"]
