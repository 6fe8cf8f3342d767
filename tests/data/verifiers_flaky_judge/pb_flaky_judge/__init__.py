"""A single-turn verifiers (0.4) taskset whose scoring fails the way real ones do, for primebuild's tests of
failing rollouts: some rows are malformed (their reward raises every time), or the judge that scores goes
down after a number of answers (every later score raises). Prompts use lowercase letters and spaces only,
for the tiny character model; the reward is 1 when the reply starts with the row's letter.

Put the folder holding this package on PYTHONPATH (no install needed): the taskset id is
`verifiers:pb-flaky-judge`.
"""

import verifiers.v1 as vf

__all__ = ["FlakyJudgeTaskset"]

LETTERS = "abcdefghijklmnopqrstuvwxyz"
_scored = 0  # answers scored in this process: the judge's uptime


class FlakyJudgeData(vf.TaskData):
    answer: str
    row: int


class FlakyJudgeTask(vf.Task[FlakyJudgeData]):
    broken_every: int = 0
    judge_up_for: int = -1

    @vf.reward
    async def starts_with_letter(self, task, trace) -> float:
        global _scored
        _scored += 1
        if self.broken_every and task.row % self.broken_every == 0:
            raise ValueError(f"row {task.row} is malformed: no answer key")
        if 0 <= self.judge_up_for < _scored:
            raise ConnectionError(f"the judge is down (it scored {self.judge_up_for} answers)")
        return float((trace.last_reply or "").startswith(task.answer))


class FlakyJudgeTasksetConfig(vf.TasksetConfig):
    rows: int = 60
    broken_every: int = 0  # 0: no malformed row; k: rows 0, k, 2k ... are
    judge_up_for: int = -1  # -1: the judge never goes down; n: it scores n answers, then fails every call


class FlakyJudgeTaskset(vf.Taskset[FlakyJudgeTask, FlakyJudgeTasksetConfig]):
    def load(self):
        for row in range(self.config.rows):
            letter = LETTERS[row % len(LETTERS)]
            task = FlakyJudgeTask(FlakyJudgeData(prompt=f"say {letter} {row % 7}", answer=letter, row=row),
                                  self.config.task)
            task.broken_every, task.judge_up_for = self.config.broken_every, self.config.judge_up_for
            yield task
