"""Failing rollouts (primebuild/runtime/orchestrator/failures.py): an environment's or a server's error in
one rollout drops its group, counted and logged once with its cause; `orchestrator.max_failed_groups_in_a_row`
failed groups in a row end the run naming the cause.

The pool's policy is checked on rollouts whose outcome we set; then two real runs of the embedded engine on
a verifiers taskset whose scoring fails as real ones do (tests/data/verifiers_flaky_judge: malformed
rows, a judge that goes down), and the manifest field's located errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_MANIFEST, call_cli, free_port, write
from test_rollout_pool import TASK, episode

from primebuild.errors import UserError
from primebuild.runtime.orchestrator.client import InferenceUnavailable
from primebuild.runtime.orchestrator.failures import RolloutsFailing
from primebuild.runtime.orchestrator.pool import Group, RolloutPool
from primebuild.runtime.orchestrator.rollout import Rollout, all_episodes


class Env:
    id = "env-x"


def group(seq: int) -> Group:
    return Group(seq=seq, env=Env(), task=TASK, started_version=0)


async def failing(seconds: float, err: Exception) -> list[Rollout]:
    await asyncio.sleep(seconds)
    raise err


async def drain(pool: RolloutPool) -> None:
    while pool.running:
        await pool.wait(0.01)


def malformed(row: int) -> ValueError:
    try:
        raise ValueError(f"row {row} is malformed")  # one place in the code: one traceback in the log
    except ValueError as err:
        return err


def test_a_failed_group_is_dropped_counted_and_logged_once_with_its_cause(caplog):
    async def main():
        pool = RolloutPool(groups_per_step=2, max_off_policy_steps=1, next_step=1, max_failed_in_a_row=3)
        pool.start(group(0), episode(0.01, [0]))
        pool.start(group(1), failing(0.02, malformed(7)))
        pool.start(group(2), episode(0.03, [0]))
        with caplog.at_level(logging.INFO, logger="primebuild.orchestrator"):
            await drain(pool)
        assert [g.seq for g in pool.take_batch()] == [0, 2] and pool.failed == 1
    asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["rollout group 1 (env-x) failed and is dropped (1 in a row; 3 end the run): "
                        "ValueError: row 7 is malformed"]
    traces = [r.getMessage() for r in caplog.records if "traceback of that failure" in r.getMessage()]
    assert len(traces) == 1 and "ValueError: row 7 is malformed" in traces[0]
    assert all(line.startswith("    | ") for line in traces[0].splitlines()[1:])  # out of the terminal's way


def test_failures_in_a_row_end_the_run_naming_the_cause_and_a_finished_group_resets_the_count(caplog):
    async def main():
        pool = RolloutPool(groups_per_step=8, max_off_policy_steps=1, next_step=1, max_failed_in_a_row=3)
        outcomes = [malformed(1), malformed(2), None, malformed(3), malformed(4),
                    ConnectionError("the judge is down")]
        for seq, outcome in enumerate(outcomes):  # they finish in this order
            work = episode(0.01 * (seq + 1), [0]) if outcome is None else failing(0.01 * (seq + 1), outcome)
            pool.start(group(seq), work)
        with caplog.at_level(logging.INFO, logger="primebuild.orchestrator"), \
                pytest.raises(RolloutsFailing) as ended:
            await drain(pool)
        await pool.cancel()
        return pool, ended.value
    pool, ended = asyncio.run(main())
    assert str(ended) == ("3 rollout groups failed in a row (orchestrator.max_failed_groups_in_a_row: 3); the last, "
                          "5 (env-x): ConnectionError: the judge is down")
    assert pool.failed == 5 and [g.seq for g in pool.finished] == [2]
    traces = [r for r in caplog.records if "traceback of that failure" in r.getMessage()]
    assert len(traces) == 2  # the malformed rows come from one place, the judge from another


@pytest.mark.parametrize("error", [UserError("a prompt of 90 tokens leaves no room in seq_len 64"),
                                   InferenceUnavailable("no inference server answered for 120 s")],
                         ids=["user-error", "no-server"])
def test_an_error_that_is_not_one_rollouts_still_ends_the_run_at_once(error):
    async def main():
        pool = RolloutPool(groups_per_step=2, max_off_policy_steps=1, next_step=1, max_failed_in_a_row=10)
        pool.start(group(0), failing(0.01, error))
        with pytest.raises(type(error)):
            await drain(pool)
        assert pool.failed == 0
    asyncio.run(main())


def test_a_failed_episode_cancels_the_other_episodes_of_its_group():
    ended = []

    async def long_episode() -> Rollout:
        try:
            await asyncio.sleep(30)
        finally:
            ended.append("cancelled")

    async def main():
        started = asyncio.get_running_loop().time()
        with pytest.raises(ValueError, match="row 3"):
            await all_episodes([long_episode(), failing(0.01, malformed(3)), long_episode()])
        return asyncio.get_running_loop().time() - started
    assert asyncio.run(main()) < 5 and ended == ["cancelled", "cancelled"]


# --- real runs --------------------------------------------------------------------------------------------

FLAKY = Path(__file__).parent / "data" / "verifiers_flaky_judge"
RUN_MANIFEST = CPU_MANIFEST.replace("""  rollouts_per_step: 64
  group_size: 8
""", """  rollouts_per_step: 32
  group_size: 8
  max_steps: 3
  eval_prompts: 8
""")


def flaky_run(workdir: Path, args: dict, *sets: str) -> tuple[subprocess.CompletedProcess, Path]:
    """A 3-step run of the tiny model on the flaky taskset with these args (held out: 8 tasks)."""
    pytest.importorskip("verifiers.v1", reason="verifiers is not installed (pip install verifiers==0.4.0)")
    runs = workdir / "runs"
    before = set(runs.iterdir()) if runs.is_dir() else set()
    manifest = write(workdir, "flaky.yaml", RUN_MANIFEST)
    env = {**os.environ, "PRIMEBUILD_STORE": str(workdir / "store"), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(FLAKY), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "primebuild.cli", "run", str(manifest), "--runs-dir", str(runs),
                           "--set", f"inference.port={free_port()}",
                           "--set", "environments=" + json.dumps([{"id": "verifiers:pb-flaky-judge",
                                                                   "args": {"num_eval": 8, **args}}]), *sets],
                          capture_output=True, text=True, env=env, timeout=280)
    (run_dir,) = set(runs.iterdir()) - before
    return done, run_dir


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def flaky_workdir(tmp_path_factory) -> Path:
    import shutil

    from conftest import MANIFESTS

    root = tmp_path_factory.mktemp("flaky")
    shutil.copytree(MANIFESTS / "models", root / "models")
    return root


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_with_malformed_rows_drops_their_groups_counts_them_and_trains_every_step(flaky_workdir):
    done, run_dir = flaky_run(flaky_workdir, {"broken_every": 4})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    trained = sorted(r["step"] for r in rows(run_dir) if r["role"] == "trainer" and r["name"] == "loss")
    assert trained == [1, 2, 3]
    failed = sum(r["value"] for r in rows(run_dir) if r["name"] == "failed_groups")
    log = (run_dir / "logs" / "orchestrator.log").read_text()
    dropped = [line for line in log.splitlines() if "failed and is dropped" in line]
    assert failed >= 1 and len(dropped) == failed, (failed, dropped)  # each failed group counted and logged once
    assert all("ValueError: row" in line and "is malformed" in line for line in dropped)
    assert len({line.split(" (")[0] for line in dropped}) == len(dropped)  # a group is logged once
    assert log.count("traceback of that failure") == 1  # one place in the taskset's code
    assert "Traceback" not in out and sum("failed and is dropped" in line for line in out.splitlines()) == failed
    print(f"\nmalformed rows (every 4th): {failed:.0f} group(s) dropped over 3 steps, each counted and logged once")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_failed_groups_in_a_row_end_the_run_naming_the_cause(flaky_workdir):
    """The judge scores the 8 held-out answers before RL, then goes down: every group fails."""
    done, run_dir = flaky_run(flaky_workdir, {"judge_up_for": 8}, "--set", "orchestrator.max_failed_groups_in_a_row=3")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    cause = ("3 rollout groups failed in a row (orchestrator.max_failed_groups_in_a_row: 3); the last, ")
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["process"] == "orchestrator" and cause in failure["message"]
    assert "ConnectionError: the judge is down (it scored 8 answers)" in failure["message"]
    assert f"error: orchestrator (orchestrator) exited with code 1 ({cause}" in out and "Traceback" not in out
    assert not [r for r in rows(run_dir) if r["role"] == "trainer"]  # nothing was sampled, nothing trained


def test_the_field_takes_bad_input_as_a_located_error(tmp_path, capsys):
    text = CPU_MANIFEST.replace("  group_size: 8\n", "  group_size: 8\n  max_failed_groups_in_a_row: 0\n")
    path = write(tmp_path, "m.yaml", text)
    line = text.splitlines().index("  max_failed_groups_in_a_row: 0") + 1
    result = call_cli(capsys, "validate", path)
    assert result.code == 2
    assert f"{path}:{line}:3: orchestrator.max_failed_groups_in_a_row: " in result.text, result.text
    assert "greater than or equal to 1" in result.text and "Traceback" not in result.text
    words = write(tmp_path, "w.yaml", text.replace("in_a_row: 0", "in_a_row: many"))
    result = call_cli(capsys, "validate", words)
    assert result.code == 2 and f"{words}:{line}:3: orchestrator.max_failed_groups_in_a_row: " in result.text
