"""The curriculum (orchestrator.curriculum, primebuild/runtime/orchestrator/curriculum.py): prompts are
assigned to easy / normal / hard pools by the mean reward of their last `window` groups, each step's groups
split over the pools by the mix exactly and reproducibly from the seed, an empty pool lends its slots, and
the pass rates survive a resume. A pool that can never fill is refused by the plan, located. Then one short
real run of reverse-text whose metrics show the pools."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import MANIFESTS, call_cli, free_port, sft_workspace

from primebuild.contracts.orchestrator import CurriculumConfig
from primebuild.contracts.run_dir import RunDir
from primebuild.runtime.envs.base import Task
from primebuild.runtime.envs.wordle import WordleEnv
from primebuild.runtime.metrics import read_metrics
from primebuild.runtime.orchestrator.curriculum import Curriculum, pool_of, prompt_key, prompt_set

# The real runs: reverse-text over 16 prompts, 4 groups a step, synchronous, with all three pools in the mix.
RUN_SETS = ("orchestrator.eval_prompts=8", "orchestrator.max_off_policy_steps=0",
            "orchestrator.curriculum={prompts: 16, window: 2, easy_at: 0.9, hard_at: 0.6, "
            "mix: {easy: 1, normal: 2, hard: 1}}")


class Numbered:
    """An environment of `n` training prompts, "p0" .. "p{n-1}"."""

    id, version = "numbered", "1"

    def __init__(self, n: int):
        self.n = n

    def sample_tasks(self, rng: random.Random, n: int) -> list[Task]:
        return [Task(prompt=f"p{rng.randrange(self.n)}", answer="") for _ in range(n)]


def config(**changes) -> CurriculumConfig:
    base = {"prompts": 20, "window": 2, "easy_at": 0.75, "hard_at": 0.25,
            "mix": {"easy": 0.25, "normal": 0.5, "hard": 0.25}}
    return CurriculumConfig.model_validate({**base, **changes})


def curriculum(seed: int = 0, groups_per_step: int = 4, **changes) -> Curriculum:
    return Curriculum(config(**changes), [Numbered(20)], ["numbered"], seed, groups_per_step)


def key(i: int) -> str:
    return prompt_key(Task(prompt=f"p{i}", answer=""))


def record(c: Curriculum, seq: int, prompt: int, rewards: list[float]) -> None:
    """As if group `seq` had drawn prompt `prompt` and finished with `rewards`."""
    c.drawn[seq] = (0, key(prompt), "normal")
    c.finished(seq, rewards)


def test_thresholds_assign_pools_and_unseen_prompts_are_normal():
    assert pool_of(None, 0.75, 0.25) == "normal"
    assert [pool_of(r, 0.75, 0.25) for r in (0.0, 0.25, 0.26, 0.74, 0.75, 1.0)] == \
        ["hard", "hard", "normal", "normal", "easy", "easy"]
    c = curriculum()
    assert c.sizes() == {"easy": 0, "normal": 20, "hard": 0}
    record(c, 0, 3, [1.0, 1.0, 1.0])
    record(c, 1, 4, [0.0, 0.0, 0.0])
    record(c, 2, 5, [1.0, 0.0, 0.0, 1.0])
    assert c.pool(0, key(3)) == "easy" and c.pool(0, key(4)) == "hard" and c.pool(0, key(5)) == "normal"
    assert c.sizes() == {"easy": 1, "normal": 18, "hard": 1}


def test_the_pass_rate_is_the_mean_of_the_last_window_groups():
    c = curriculum(window=2)
    for seq, mean in enumerate([0.0, 0.0, 1.0]):  # window 2: the first 0.0 is forgotten
        record(c, seq, 7, [mean] * 4)
    assert c.pass_rate(0, key(7)) == 0.5 and c.pool(0, key(7)) == "normal"
    record(c, 3, 7, [1.0, 1.0])
    assert c.pass_rate(0, key(7)) == 1.0 and c.pool(0, key(7)) == "easy"


def test_each_step_splits_over_the_pools_by_the_mix_and_the_seed_fixes_the_draws():
    c = curriculum(groups_per_step=8, mix={"easy": 1, "normal": 2, "hard": 1})
    for prompt in range(0, 6):
        record(c, 1000 + prompt, prompt, [1.0])  # easy: p0..p5
    for prompt in range(6, 12):
        record(c, 1000 + prompt, prompt, [0.0])  # hard: p6..p11; normal: p12..p19
    for step in range(3):
        seqs = range(step * 8, step * 8 + 8)
        assert Counter(c.slot_pool(s) for s in seqs) == {"easy": 2, "normal": 4, "hard": 2}
        tasks = [c.draw(s, 0) for s in seqs]
        pools = Counter(c.pool(0, prompt_key(t)) for t in tasks)
        assert pools == {"easy": 2, "normal": 4, "hard": 2}, step
        assert len({prompt_key(t) for t in tasks}) == 8  # a running prompt is not drawn twice
        for s in seqs:  # the groups end (rewards unknown here: the pools stay as set) before the batch
            c.ended(s)
        metrics = c.step_metrics(list(seqs))
        assert (metrics["curriculum_sampled_easy"], metrics["curriculum_sampled_normal"],
                metrics["curriculum_sampled_hard"], metrics["curriculum_borrowed"]) == (2, 4, 2, 0)
        assert (metrics["curriculum_easy"], metrics["curriculum_normal"], metrics["curriculum_hard"]) == (6, 8, 6)

    def draws(seed: int) -> list[str]:
        other = curriculum(seed=seed, groups_per_step=8)
        return [prompt_key(other.draw(s, 0)) for s in range(8)]
    assert draws(0) == draws(0) and draws(0) != draws(1)


def test_an_empty_pool_lends_its_slots_and_says_so():
    c = curriculum(groups_per_step=4)  # every prompt unseen: only normal has prompts
    tasks = [c.draw(s, 0) for s in range(4)]
    assert all(c.pool(0, prompt_key(t)) == "normal" for t in tasks)
    metrics = c.step_metrics(list(range(4)))
    assert metrics["curriculum_borrowed"] == 2  # the easy and the hard slot (mix 1:2:1 of 4)
    assert metrics["curriculum_sampled_normal"] == 4


def test_with_every_prompt_running_a_draw_still_gives_one():
    c = curriculum(groups_per_step=4)
    drawn = [prompt_key(c.draw(s, 0)) for s in range(21)]  # 20 prompts, none ended
    assert len(set(drawn[:20])) == 20 and drawn[20] in drawn[:20]


def test_the_pool_tells_of_every_group_that_stops_running():
    """RolloutPool.on_done: finished groups with their rewards, failed ones without (the curriculum frees
    their prompt), cancelled ones too."""
    import asyncio

    from primebuild.runtime.envs.transcript import Transcript
    from primebuild.runtime.orchestrator.pool import Group, RolloutPool
    from primebuild.runtime.orchestrator.rollout import Rollout

    async def rollouts(rewards, fail=False, hang=False):
        await asyncio.sleep(10 if hang else 0.001)
        if fail:
            raise RuntimeError("environment broke")
        t = Transcript([1])
        t.add_model_turn([2], [-1.0], 0)
        return [Rollout(t, r, 0.001, "episode") for r in rewards]

    done = []
    pool = RolloutPool(groups_per_step=2, max_off_policy_steps=0, next_step=1, max_failed_in_a_row=5,
                       filter_equal_rewards=True, on_done=lambda g: done.append((g.seq, [r.reward for r in g.rollouts])))

    async def main():
        env = type("E", (), {"id": "e"})()
        for seq, work in enumerate([rollouts([1.0, 1.0]), rollouts([0.0, 1.0], fail=True), rollouts([0.0], hang=True)]):
            pool.start(Group(seq=seq, env=env, task=Task(prompt="", answer=""), started_version=0), work)
        while len(done) < 2:
            await pool.wait(0.05)
        await pool.cancel()
    asyncio.run(main())
    assert sorted(done) == [(0, [1.0, 1.0]), (1, []), (2, [])]  # the equal group too: set aside, still told


def test_pass_rates_survive_a_resume(tmp_path: Path):
    c = curriculum()
    record(c, 0, 3, [1.0, 1.0])
    record(c, 1, 4, [0.0, 0.0])
    c.save(tmp_path / "curriculum.json", step=5)
    resumed = curriculum()
    assert resumed.load(tmp_path / "curriculum.json") == 5
    assert resumed.sizes() == c.sizes() == {"easy": 1, "normal": 18, "hard": 1}
    assert [resumed.draw(s, 0) for s in range(8)] == [c.draw(s, 0) for s in range(8)]
    assert curriculum().load(tmp_path / "absent.json") is None


def test_the_prompt_set_is_distinct_reproducible_and_no_larger_than_the_environment():
    env = WordleEnv(word_length=3, num_eval=10)  # 216 words, 179 of them training words
    tasks = prompt_set(env, 100, seed=0, index=0)
    assert len({t.answer for t in tasks}) == 100 and tasks == prompt_set(env, 100, seed=0, index=0)
    assert tasks != prompt_set(env, 100, seed=1, index=0)
    assert len(prompt_set(env, 500, seed=0, index=0)) == len(env._train) == 179


def test_a_curriculum_pool_that_can_never_fill_is_refused_located(capsys, tmp_path: Path):
    manifest = tmp_path / "wordle-curriculum.yaml"
    manifest.write_text(f"""apiVersion: primebuild/v1
kind: Experiment
extends: [{MANIFESTS / 'wordle.yaml'}]
orchestrator:
  curriculum:
    prompts: 2000
    easy_at: 1.5
    mix: {{easy: 0.2, normal: 1, hard: 0.01}}
""")
    result = call_cli(capsys, "plan", manifest)
    assert result.code == 2 and "Traceback" not in result.err
    lines = manifest.read_text().splitlines()

    def at(text: str) -> str:
        line = next(i for i, t in enumerate(lines, 1) if t.strip().startswith(text))
        return f"{manifest}:{line}:"
    assert f"{at('easy_at:')}5: orchestrator.curriculum.easy_at: the easy pool (pass rate >= 1.5) can never fill" \
        in result.err
    assert "hint: set easy_at to at most 1, or mix.easy: 0" in result.err
    assert "orchestrator.curriculum.mix.hard: mix.hard (0.01 of 1.21) of a step's 16 groups rounds to none" in result.err
    assert (f"{at('prompts:')}5: orchestrator.curriculum.prompts: environment wordle (environments[0]) has 1029 "
            "distinct training prompts, fewer than the 2000") in result.err
    assert "hint: set prompts to at most 1029" in result.err
    contradictory = call_cli(capsys, "plan", MANIFESTS / "wordle.yaml",
                             "--set", "orchestrator.curriculum={easy_at: 0.3, hard_at: 0.6}")
    assert contradictory.code == 2
    assert "orchestrator.curriculum.hard_at: hard_at (0.6) is not below easy_at (0.3)" in contradictory.err
    too_few = call_cli(capsys, "plan", MANIFESTS / "wordle.yaml", "--set", "orchestrator.curriculum={prompts: 10}")
    assert too_few.code == 2 and "runs up to 32 groups at once (16 a step, 2 steps in flight)" in too_few.err
    fine = call_cli(capsys, "plan", MANIFESTS / "wordle.yaml", "--set", "orchestrator.curriculum={prompts: 512}",
                    "-o", "json")
    assert fine.code == 0, fine.err
    (orch,) = [p for p in json.loads(fine.out)["processes"] if p["role"] == "orchestrator"]
    assert orch["config"]["curriculum"]["prompts"] == 512


@pytest.fixture(scope="module")
def stopped_then_resumed(tmp_path_factory, short_sft_store) -> dict:
    """The module's one real run, 6 steps: `primebuild stop` after step 3, then `run --resume` to the end. Both
    tests below read it (a run's start costs ~10 s of CPU): the pools per step, and the resume's pools."""
    root = tmp_path_factory.mktemp("curriculum-run")
    sft_workspace(root, seed_store=short_sft_store)
    runs = root / "runs"
    sets = [*RUN_SETS, "orchestrator.max_steps=6", "orchestrator.rollouts_per_step=32",
            f"inference.port={free_port()}"]
    env = {**os.environ, "PRIMEBUILD_STORE": str(root / "store"), "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "primebuild.cli"]
    first = subprocess.Popen([*cli, "run", str(root / "manifests" / "reverse-text.yaml"), "--runs-dir", str(runs),
                              "--quiet", *[a for o in sets for a in ("--set", o)]],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while not (list(runs.glob("*")) and RunDir(next(runs.iterdir())).rollout(3).exists()):
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read() if first.poll() else ""
            time.sleep(0.2)
        (run_dir,) = runs.iterdir()
        run = RunDir(run_dir)
        run.stop_file.touch()  # what `primebuild stop` writes
        first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    saved = json.loads(run.curriculum.read_text())
    run.stop_file.unlink(missing_ok=True)
    resumed = subprocess.run([*cli, "run", "--resume", str(run_dir), "--quiet"], capture_output=True, text=True,
                             timeout=300, env=env)
    return {"run": run, "saved_at_stop": saved, "resumed": resumed}


@pytest.mark.timeout(420)  # the module's run starts with its first test
def test_a_real_run_shows_the_pools_per_step_and_resumes_them(stopped_then_resumed: dict):
    """reverse-text over a set of 16 prompts, 4 groups a step: the metrics give each step's pool sizes and
    draws, every step's groups come from the mix (borrowed ones counted), and curriculum.json holds the
    pass rates a resume reads (the run was stopped after step 3 and resumed: both sessions' steps)."""
    done, run = stopped_then_resumed["resumed"], stopped_then_resumed["run"]
    assert done.returncode == 0, done.stdout + done.stderr
    steps = {k: r for k, r in read_metrics(run.metrics, role="orchestrator").items() if "curriculum_normal" in r}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    for step, r in steps.items():
        assert r["curriculum_easy"] + r["curriculum_normal"] + r["curriculum_hard"] == 16, (step, r)
        assert r["curriculum_sampled_easy"] + r["curriculum_sampled_normal"] + r["curriculum_sampled_hard"] == 4
    # step 1: every prompt unseen, so the easy and hard slots borrowed from normal
    assert steps[1]["curriculum_sampled_normal"] == 4 and steps[1]["curriculum_borrowed"] == 2
    assert steps[4]["curriculum_normal"] < 16, steps[4]  # the pass rates moved prompts out of normal
    assert steps[6]["curriculum_normal"] < 16, steps[6]
    saved = json.loads(run.curriculum.read_text())
    assert saved["step"] == 6 and len(saved["history"]["reverse-text"]) >= 4


@pytest.mark.timeout(420)
def test_a_stopped_run_resumes_with_its_pools(stopped_then_resumed: dict):
    """`primebuild stop` after step 3, then `run --resume`: the orchestrator reads back curriculum.json and
    starts with the pools it had, not with every prompt normal again."""
    run, saved, resumed = (stopped_then_resumed[k] for k in ("run", "saved_at_stop", "resumed"))
    history = saved["history"]["reverse-text"]
    expected = Counter(pool_of(sum(r) / len(r), 0.9, 0.6) for r in history.values())
    expected = {p: expected[p] + (16 - len(history) if p == "normal" else 0) for p in ("easy", "normal", "hard")}
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    log = (run.root / "logs" / "orchestrator.log").read_text()
    assert f"curriculum: pass rates as of step {saved['step']} (resuming at step {saved['step'] + 1}): " \
           f"{expected}" in log, log[-3000:]
    steps = {k: r for k, r in read_metrics(run.metrics, role="orchestrator").items() if "curriculum_normal" in r}
    assert sorted(steps) == list(range(1, 7))
