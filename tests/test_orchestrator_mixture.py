"""The environment mix: counts follow the weights exactly, each task keeps its own environment."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import MANIFESTS, call_cli

from primebuild.contracts.orchestrator import EnvironmentConfig
from primebuild.runtime.orchestrator.mixture import EnvironmentMix, split


@pytest.mark.parametrize(("total", "weights", "want"), [
    (16, [3.0, 1.0], [12, 4]),
    (10, [1.0, 1.0, 1.0], [4, 3, 3]),  # the remainder goes to the earliest environment
    (7, [0.5, 0.25, 0.25], [3, 2, 2]),  # 3.5, 1.75, 1.75: the larger remainders win
    (1, [1.0, 9.0], [0, 1]),
    (0, [1.0], [0]),
])
def test_split_by_largest_remainder(total, weights, want):
    assert split(total, weights) == want
    assert sum(split(total, weights)) == total


def test_mix_draws_each_environment_by_weight_and_keeps_pairs():
    mix = EnvironmentMix([
        EnvironmentConfig(id="reverse-text", weight=3.0),
        EnvironmentConfig(id="reverse-text", args={"min_length": 20, "max_length": 24, "num_eval": 10}, weight=1.0),
    ])
    pairs = mix.sample(random.Random(0), 8)
    long_ones = [task for env, task in pairs if env is mix.envs[1]]
    assert len(pairs) == 8 and len(long_ones) == 2
    assert all(20 <= len(task.prompt) <= 24 for task in long_ones)
    assert mix.sample(random.Random(0), 8) == pairs  # deterministic given the rng
    evals = mix.eval_tasks(8)
    assert [env for env, _ in evals].count(mix.envs[1]) == 2


def test_no_environment_is_refused():
    with pytest.raises(ValueError):
        EnvironmentMix([])


def test_an_environment_no_step_trains_on_is_refused_located(capsys, tmp_path: Path):
    manifest = tmp_path / "mix.yaml"
    manifest.write_text(f"""apiVersion: primebuild/v1
kind: Experiment
extends: [{MANIFESTS / 'reverse-text-mix.yaml'}]
orchestrator:
  rollouts_per_step: 16
environments:
  - id: reverse-text
    weight: 3
  - id: long-tail
    weight: 0.5
""")
    result = call_cli(capsys, "plan", manifest)
    assert result.code == 2 and "Traceback" not in result.err
    assert (f"{manifest}:10:5: environments[1].weight: environment long-tail (weight 0.5 of 3.5) gets none of a "
            "step's 2 groups: it would never be trained on") in result.err
    assert "hint: raise its weight to at least 1.75" in result.err
    assert call_cli(capsys, "plan", MANIFESTS / "reverse-text-mix.yaml").code == 0  # 3:1 of 16 groups: 12 and 4


def test_a_held_out_set_shorter_than_its_share_gives_all_it_has_and_says_so_once(caplog):
    """eval_prompts larger than an environment's held-out set was cut to the set without a word."""
    mix = EnvironmentMix([EnvironmentConfig(id="reverse-text", args={"num_eval": 10})])
    with caplog.at_level("WARNING", logger="primebuild.orchestrator"):
        assert len(mix.eval_tasks(1000)) == 10
        assert len(mix.eval_tasks(1000)) == 10
    said = [r.getMessage() for r in caplog.records if "held-out tasks" in r.getMessage()]
    assert said == ["environment reverse-text has 10 held-out tasks, fewer than its share 1000 of "
                    "orchestrator.eval_prompts: its evals use those 10"]
