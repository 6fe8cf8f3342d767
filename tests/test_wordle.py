"""The Wordle-like environment: Wordle's marking rule, episodes, rewards, the held-out split, and that
its demonstrations only ever guess words consistent with every mark so far."""

from __future__ import annotations

import asyncio
import random

import pytest

from primebuild.errors import UserError
from primebuild.runtime.envs.base import ENVIRONMENT, MODEL, MultiTurnEnvironment
from primebuild.runtime.envs.wordle import WordleEnv, feedback, is_eval_word


@pytest.mark.parametrize(("guess", "secret", "marks"), [
    ("abcd", "abcd", "zzzz"),
    ("abcd", "efef", "xxxx"),
    ("abcd", "dcba", "yyyy"),
    ("aabb", "abab", "zyyz"),
    ("aaab", "abbb", "zxxz"),  # only one 'a' in the secret: the exact match takes it
    ("abb", "bba", "yzy"),
    ("aab", "abc", "zxy"),
])
def test_marks_follow_wordles_rule_for_repeated_letters(guess, secret, marks):
    assert feedback(guess, secret) == marks


def play(env, task, guesses):
    async def run():
        episode = env.start(task)
        replies = [await episode.step(g) for g in guesses]
        return replies, await episode.reward()
    return asyncio.run(run())


def test_episodes_end_on_a_solve_an_invalid_guess_or_the_last_guess():
    env = WordleEnv(word_length=3, alphabet="abcdef", max_guesses=3, num_eval=10)
    assert isinstance(env, MultiTurnEnvironment) and env.max_turns == 3
    task = env.sample_tasks(random.Random(0), 1)[0]
    secret = task.answer
    wrong = next(w for w in ("abc", "def", "fed") if w != secret)
    replies, reward = play(env, task, [wrong, secret])
    assert replies == [feedback(wrong, secret) + ">", None] and reward == pytest.approx(2 / 3)
    assert play(env, task, [secret]) == ([None], 1.0)
    assert play(env, task, ["abz"]) == ([None], 0.0)  # not in the alphabet: the game ends, unsolved
    assert play(env, task, [wrong, wrong, wrong])[1] == 0.0


def test_the_held_out_words_never_come_up_in_training():
    env = WordleEnv(num_eval=20)
    held_out = {t.answer for t in env.eval_tasks()}
    assert len(held_out) == 20 and all(is_eval_word(w) for w in held_out)
    assert not any(is_eval_word(t.answer) for t in env.sample_tasks(random.Random(1), 500))
    with pytest.raises(UserError, match="alphabet"):
        WordleEnv(alphabet="abz")  # 'z' is a mark


def test_demonstrations_guess_consistently_and_solve():
    env = WordleEnv(word_length=4, alphabet="abcdef", max_guesses=6, num_eval=10)
    rng = random.Random(2)
    for task in env.sample_tasks(rng, 50):
        segments = env.demonstration(task, rng)
        guesses = [text for who, text in segments if who == MODEL]
        marks = [text.removesuffix(">") for who, text in segments if who == ENVIRONMENT]
        assert marks == [feedback(g, task.answer) for g in guesses[:-1]]
        for i, guess in enumerate(guesses):  # consistent with every mark before it
            assert all(feedback(earlier, guess) == m for earlier, m in zip(guesses[:i], marks, strict=False))
        assert guesses[-1] == task.answer or len(guesses) == 6
