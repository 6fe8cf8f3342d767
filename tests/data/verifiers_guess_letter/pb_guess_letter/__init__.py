"""Guess a hidden letter: a multi-turn verifiers 0.4 environment, small enough for primebuild's tiny
character model (every message uses lowercase letters and spaces only).

The env plays the user (`GuessLetterEnv.run`): the task's prompt opens the exchange, then after each
reply that does not contain the hidden letter it answers `no`, until the letter appears in a reply or
`max_guesses` replies were given. The task scores the trace with its own rewards: `found` is 1 for a
find at the first reply and loses 1/max_guesses per further reply (0 if never found).
"""

import verifiers.v1 as vf

__all__ = ["GuessLetterEnv", "GuessLetterTaskset"]

NO = "no"


class GuessLetterData(vf.TaskData):
    answer: str
    max_guesses: int


def first_find(replies: list[str], letter: str) -> int | None:
    """1-based index of the first reply holding `letter`, or None."""
    return next((i for i, reply in enumerate(replies, 1) if letter in reply), None)


class GuessLetterTask(vf.Task[GuessLetterData]):
    @vf.reward
    async def found(self, task, trace) -> float:
        replies = [m.content or "" for m in trace.assistant_messages]
        at = first_find(replies, task.answer)
        return 0.0 if at is None else (task.max_guesses - at + 1) / task.max_guesses

    @vf.metric
    async def replies(self, trace) -> float:
        return float(trace.num_turns)


class GuessLetterTasksetConfig(vf.TasksetConfig):
    letters: str = "abcdefghijklmnopqrstuvwxyz"
    max_guesses: int = 4


class GuessLetterTaskset(vf.Taskset[GuessLetterTask, GuessLetterTasksetConfig]):
    def load(self):
        for letter in self.config.letters:
            for opening in ("guess", "find", "say", "try"):
                data = GuessLetterData(prompt=f"{opening} my letter", answer=letter,
                                       max_guesses=self.config.max_guesses)
                yield GuessLetterTask(data, self.config.task)


class GuessLetterEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessLetterEnv(vf.Env[GuessLetterEnvConfig]):
    async def run(self, task, agents):
        letter, limit = task.data.answer, task.data.max_guesses
        async with agents.player.interaction(task) as game:
            segment = await game.turn()  # the prompted task speaks first
            for _ in range(limit - 1):
                if segment.terminated or letter in segment.last_reply:
                    return
                segment = await game.turn(NO)
