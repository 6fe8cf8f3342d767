"""Several environments in one run: every batch holds the weights' split (asynchronous too), per-environment
rewards and group counts in metrics.jsonl, each environment's held-out reward in summary.json, and its eval
curve in report.png (manifests/reverse-text-mix.yaml, shrunk)."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from conftest import run_shrunk, sft_workspace

from primebuild.contracts.run_dir import RunDir
from primebuild.runtime.report import environments, summary_of, write_report
from primebuild.runtime.rollout_file import load_batch

pytestmark = pytest.mark.timeout(400)
ENVS = ("reverse-text", "long-tail")


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory, short_sft_store) -> tuple[subprocess.CompletedProcess, Path]:
    root = tmp_path_factory.mktemp("mix")
    manifests = sft_workspace(root, ("reverse-text-mix.yaml",), seed_store=short_sft_store)
    return run_shrunk(
        # asynchronous (the manifest's max_off_policy_steps 1) with the difficulty filter on: every batch
        # still holds exactly the 3 + 1 groups of the split, though long-tail's episodes take longer
        manifests / "reverse-text-mix.yaml", root, "orchestrator.max_steps=3", "orchestrator.eval_every=2",
        timeout=380)


def test_each_environment_has_its_rewards_and_held_out_score(mixed_run):
    result, run_dir = mixed_run
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    names = {(r["step"], r["name"]) for r in rows if r["role"] == "orchestrator"}
    for env in ENVS:
        assert {(s, f"reward_mean/{env}") for s in (1, 2, 3)} <= names  # each step's groups: 3 + 1
        assert {(s, f"eval_reward/{env}") for s in (0, 2, 3)} <= names  # before, every eval_every, after
    split = {(r["step"], r["name"].removeprefix("batch_groups/")): r["value"] for r in rows
             if r["role"] == "orchestrator" and r["name"].startswith("batch_groups/")}
    assert split == {(s, env): n for s in (1, 2, 3) for env, n in zip(ENVS, (3, 1), strict=True)}
    for step in (1, 2, 3):  # the batch files say the same: 8 samples per group, each naming its environment
        samples = load_batch(RunDir(run_dir).rollout(step)).samples
        assert Counter(s.env_id for s in samples) == {"reverse-text": 24, "long-tail": 8}
    # the overall held-out reward is the prompt-weighted mean of the two (30 reverse-text, 10 long-tail)
    at0 = {r["name"]: r["value"] for r in rows if r["role"] == "orchestrator" and r["step"] == 0}
    assert at0["eval_reward"] == pytest.approx(0.75 * at0["eval_reward/reverse-text"]
                                               + 0.25 * at0["eval_reward/long-tail"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["eval_reward_before_by_env"]) == set(ENVS) == set(summary["eval_reward_after_by_env"])
    for env in ENVS:
        assert summary["eval_reward_gain_by_env"][env] == pytest.approx(
            summary["eval_reward_after_by_env"][env] - summary["eval_reward_before_by_env"][env])
        assert f"{env}: " in result.stdout  # the CLI prints each environment's gain
    assert environments(rows) == list(ENVS) and (run_dir / "report.png").stat().st_size > 0


def test_one_environment_has_no_per_environment_entries(tmp_path):
    """A single-environment run's metrics and summary are as before: no `/<env>` names, no by-env dicts."""
    run = RunDir(tmp_path)
    run.metrics.write_text("".join(json.dumps({"step": s, "role": "orchestrator", "name": "eval_reward",
                                               "value": v}) + "\n" for s, v in ((0, 0.5), (3, 0.6))))
    run.orchestrator_state.write_text(json.dumps({"eval_reward_before": 0.5, "eval_reward_after": 0.6}))
    summary = summary_of(run, {})
    summary.write(run.summary)  # as session.finish writes it
    assert summary.eval_reward_gain == pytest.approx(0.1) and summary.eval_reward_gain_by_env is None
    assert "by_env" not in run.summary.read_text()
    assert write_report(run) is not None
