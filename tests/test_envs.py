"""Reverse-text environment and the environment registry."""

from __future__ import annotations

import random
import string

import pytest

from primebuild.errors import UserError
from primebuild.runtime.envs.base import Environment, Task
from primebuild.runtime.envs.registry import load_environment
from primebuild.runtime.envs.reverse_text import (
    ReverseTextEnv,
    is_eval_string,
    lcs_length,
    lcs_ratio,
)


@pytest.mark.parametrize(
    ("a", "b", "lcs"),
    [
        ("abc", "abc", 3),
        ("abc", "def", 0),
        ("abcde", "ace", 3),
        ("abcd", "acbd", 3),  # one swapped pair costs one letter
        ("AGGTAB", "GXTXAYB", 4),  # the textbook example: GTAB
        ("", "abc", 0),
        ("aaaa", "aa", 2),
    ],
)
def test_lcs_length_hand_computed(a, b, lcs):
    assert lcs_length(a, b) == lcs
    assert lcs_length(b, a) == lcs


@pytest.mark.parametrize(
    ("a", "b", "ratio"),
    [
        ("olleh", "olleh", 1.0),
        ("olleh", "xyz", 0.0),
        ("abcde", "ace", 6 / 8),
        ("AGGTAB", "GXTXAYB", 8 / 13),
        ("", "", 1.0),
        ("", "abc", 0.0),
    ],
)
def test_lcs_ratio_hand_computed(a, b, ratio):
    assert lcs_ratio(a, b) == pytest.approx(ratio)


def test_lcs_matches_brute_force_on_small_strings():
    # Brute force: the longest subsequence of `a` that is also a subsequence of `b`.
    from itertools import combinations

    def is_subsequence(sub, s):
        it = iter(s)
        return all(c in it for c in sub)

    rng = random.Random(7)
    for _ in range(200):
        a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 6)))
        b = "".join(rng.choice("abc") for _ in range(rng.randint(0, 6)))
        best = max(
            (k for k in range(len(a) + 1) for sub in combinations(a, k) if is_subsequence(sub, b)), default=0
        )
        assert lcs_length(a, b) == best, (a, b)


def test_task_shape_prompt_and_score():
    env = ReverseTextEnv()
    assert isinstance(env, Environment)
    assert (env.id, env.version) == ("reverse-text", "1")
    tasks = env.sample_tasks(random.Random(0), 500)
    assert len(tasks) == 500
    for task in tasks:
        assert 4 <= len(task.prompt) <= 12
        assert set(task.prompt) <= set(string.ascii_lowercase)
        assert task.answer == task.prompt[::-1]
        assert env.format_prompt(task) == task.prompt + ">"
        assert env.score(task, task.answer) == 1.0
    task = Task(prompt="abc", answer="cba")
    assert env.score(task, " cba\n") == 1.0  # surrounding whitespace is not the model's error
    assert env.score(task, "cb") == pytest.approx(2 * 2 / 5)
    assert env.score(task, "abc") == pytest.approx(2 * 1 / 6)
    assert env.score(task, "") == 0.0


def test_sampling_is_driven_by_the_callers_rng():
    env = ReverseTextEnv()
    assert env.sample_tasks(random.Random(3), 50) == env.sample_tasks(random.Random(3), 50)
    assert env.sample_tasks(random.Random(3), 50) != env.sample_tasks(random.Random(4), 50)


def test_eval_set_is_fixed_distinct_and_held_out():
    env = ReverseTextEnv()
    held_out = env.eval_tasks()
    assert len(held_out) == 200
    assert held_out == ReverseTextEnv().eval_tasks()  # same list from a fresh instance
    assert held_out == env.eval_tasks()  # and on every call
    # Pinned: a changed eval set would silently make old and new rewards incomparable.
    assert [t.prompt for t in held_out[:3]] == ["msegjhh", "ymmjclnfykxr", "yngwnowtlqt"]
    prompts = {t.prompt for t in held_out}
    assert len(prompts) == 200
    assert all(is_eval_string(p) for p in prompts)
    training = {t.prompt for seed in range(5) for t in env.sample_tasks(random.Random(seed), 5000)}
    assert not training & prompts
    assert not any(is_eval_string(p) for p in training)


def test_eval_list_cannot_be_mutated_through_the_returned_copy():
    env = ReverseTextEnv()
    env.eval_tasks().clear()
    assert len(env.eval_tasks()) == 200


def test_impossible_eval_size_is_a_user_error():
    with pytest.raises(UserError, match="distinct held-out tasks"):
        ReverseTextEnv(min_length=2, max_length=2, num_eval=200)


def test_registry_builds_reverse_text_with_args():
    env = load_environment("reverse-text", "1", {"min_length": 5, "max_length": 6, "num_eval": 20})
    assert isinstance(env, ReverseTextEnv)
    assert len(env.eval_tasks()) == 20
    assert all(5 <= len(t.prompt) <= 6 for t in env.sample_tasks(random.Random(0), 100))
    assert isinstance(load_environment("reverse-text"), ReverseTextEnv)  # version is optional


def test_registry_unknown_id_lists_known_ones():
    with pytest.raises(UserError) as err:
        load_environment("reverse-txt")
    message = str(err.value)
    assert "reverse-txt" in message and "reverse-text" in message and "verifiers:" in message


def test_registry_rejects_wrong_version_and_unknown_or_bad_args():
    with pytest.raises(UserError, match="version '2'"):
        load_environment("reverse-text", "2")
    with pytest.raises(UserError, match="unknown args.*max_len") as err:
        load_environment("reverse-text", None, {"max_len": 5})
    assert "max_length" in str(err.value)  # the hint names what is accepted
    with pytest.raises(UserError, match="min_length must be an integer"):
        load_environment("reverse-text", None, {"min_length": "4"})
    with pytest.raises(UserError, match="min_length <= max_length"):
        load_environment("reverse-text", None, {"min_length": 9, "max_length": 3})
