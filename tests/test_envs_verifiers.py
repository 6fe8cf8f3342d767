"""The verifiers adapter, run against real verifiers 0.4 tasksets built here in the test."""

from __future__ import annotations

import asyncio
import random
import textwrap

import pytest

from primebuild.errors import UserError
from primebuild.runtime.envs.base import Environment

vf = pytest.importorskip(
    "verifiers.v1", reason="verifiers is not installed (pip install verifiers==0.4.0); adapter untested here"
)

from primebuild.runtime.envs.registry import load_environment  # noqa: E402
from primebuild.runtime.envs.verifiers_adapter import VerifiersEnvironment  # noqa: E402


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def right_length(self, task, trace) -> float:
        return float(len(trace.last_reply) == len(task.answer))


def _words(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefgh") for _ in range(6)) for _ in range(n)]


class ReverseTaskset(vf.Taskset[ReverseTask]):
    words: list[str] = _words(60)

    def load(self):
        for word in self.words:
            yield ReverseTask(ReverseData(prompt=word, answer=word[::-1]), self.config.task)


def test_adapter_scores_with_the_tasksets_own_rewards():
    env = VerifiersEnvironment(ReverseTaskset(vf.TasksetConfig()), num_eval=10)
    assert isinstance(env, Environment)
    assert env.id == "verifiers:ReverseTaskset" and env.version.startswith("verifiers-")
    task = env.eval_tasks()[0]
    assert task.answer == task.prompt[::-1]
    assert env.format_prompt(task) == task.prompt
    # exact (weight 1) + right_length (weight 0.5), both computed by verifiers' Task.score
    assert env.score(task, task.answer) == pytest.approx(1.5)
    assert env.score(task, task.prompt) == pytest.approx(0.5 if task.prompt != task.answer else 1.5)
    assert env.score(task, "x") == 0.0


def test_adapter_score_works_inside_a_running_event_loop():
    env = VerifiersEnvironment(ReverseTaskset(vf.TasksetConfig()), num_eval=10)
    task = env.eval_tasks()[0]

    async def from_async_code():
        return env.score(task, task.answer), await env.ascore(task, "x")

    assert asyncio.run(from_async_code()) == (pytest.approx(1.5), 0.0)


def test_adapter_split_is_fixed_disjoint_and_independent_of_load_order():
    env = VerifiersEnvironment(ReverseTaskset(vf.TasksetConfig()), num_eval=10)
    held_out = [t.prompt for t in env.eval_tasks()]
    assert len(held_out) == len(set(held_out)) == 10
    training = {t.prompt for t in env.sample_tasks(random.Random(0), 2000)}
    assert len(training) == 50  # every other task, sampled with replacement
    assert not training & set(held_out)

    class Reversed(ReverseTaskset):
        words = ReverseTaskset.words[::-1] + ReverseTaskset.words[:5]  # other order, duplicates

    again = VerifiersEnvironment(Reversed(vf.TasksetConfig()), num_eval=10)
    assert [t.prompt for t in again.eval_tasks()] == held_out
    assert env.sample_tasks(random.Random(1), 20) == env.sample_tasks(random.Random(1), 20)


def test_adapter_refuses_unbounded_or_too_small_tasksets():
    class Endless(ReverseTaskset):
        INFINITE = True

    with pytest.raises(UserError, match="forever"):
        VerifiersEnvironment(Endless(vf.TasksetConfig()))
    assert VerifiersEnvironment(Endless(vf.TasksetConfig()).take(30), num_eval=5).eval_tasks()
    with pytest.raises(UserError, match="cannot hold 200 eval tasks"):
        VerifiersEnvironment(ReverseTaskset(vf.TasksetConfig()))


PACKAGE = textwrap.dedent(
    """
    import verifiers.v1 as vf

    __all__ = ["CountTaskset"]


    class CountData(vf.TaskData):
        answer: str


    class CountTask(vf.Task[CountData]):
        @vf.reward
        async def correct(self, task, trace) -> float:
            return float(trace.last_reply == task.answer)


    class CountConfig(vf.TasksetConfig):
        size: int = 20


    class CountTaskset(vf.Taskset[CountTask, CountConfig]):
        def load(self):
            for i in range(self.config.size):
                yield CountTask(CountData(prompt=f"{i}+1", answer=str(i + 1)), self.config.task)
    """
)


def test_registry_loads_an_installed_taskset_package_by_id(tmp_path, monkeypatch):
    (tmp_path / "pb_count_taskset.py").write_text(PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("verifiers:pb-count-taskset", None, {"size": 30, "num_eval": 5})
    assert env.id == "verifiers:pb-count-taskset"
    assert len(env.eval_tasks()) == 5
    assert len({t.prompt for t in env.sample_tasks(random.Random(0), 500)}) == 25
    task = env.eval_tasks()[0]
    assert env.score(task, task.answer) == 1.0 and env.score(task, "nope") == 0.0
    with pytest.raises(UserError, match="invalid args"):
        load_environment("verifiers:pb-count-taskset", None, {"size": "many"})
    with pytest.raises(UserError, match="could not be loaded"):
        load_environment("verifiers:pb-no-such-taskset")
