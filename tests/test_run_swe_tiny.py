"""`primebuild run manifests/swe-tiny.yaml` end to end: multi-turn rollouts through the embedded engine,
every episode's tool calls and tests run in its own bubblewrap sandbox, hostile repositories among the
tasks (code under test that escapes, spins, hogs memory, sleeps): the run completes its steps, each
trained once, with rewards from the tests, and leaves no sandbox, process or escaped file behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import free_port, sft_workspace
from test_run_local import REPO, _env, _logs, _run_dir, _trained_steps

from primebuild.runtime.rollout_file import load_batch

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(shutil.which("bwrap") is None and os.environ.get("CI") != "true",
                                 reason="bubblewrap is not installed (scripts/bootstrap --test installs it)"),
              pytest.mark.xdist_group("swe-tiny")]  # with test_swe_tiny.py: both watch ESCAPED and /tmp's sandboxes
ESCAPED = Path("/var/tmp/primebuild-swe-tiny-escaped")


def test_swe_tiny_runs_in_sandboxes_with_real_rewards_and_survives_hostile_code(tmp_path: Path):
    manifests = sft_workspace(tmp_path, (), sft="swe-tiny-sft.yaml",  # short: this test is about the run
                              sft_changes={"steps": 40, "warmup_steps": 10, "batch_size": 16})
    rl = yaml.safe_load((REPO / "manifests" / "swe-tiny.yaml").read_text())
    rl["environments"][0]["args"].update(hostile=True, cpu_seconds=1, wall_seconds=4)
    (manifests / "swe-tiny.yaml").write_text(yaml.safe_dump(rl))
    ESCAPED.unlink(missing_ok=True)
    before = {p.name for p in Path("/tmp").glob("primebuild-swe-tiny-*")}

    runs = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, "-m", "primebuild.cli", "run", str(manifests / "swe-tiny.yaml"), "--runs-dir", str(runs),
         "--quiet", "--set", "orchestrator.max_steps=3", "--set", "orchestrator.rollouts_per_step=8",
         "--set", f"inference.port={free_port()}"],
        capture_output=True, text=True, env={**_env(tmp_path), "TMPDIR": "/tmp"}, timeout=560)
    assert result.returncode == 0, result.stdout + result.stderr + _logs(runs)
    run_dir = _run_dir(runs)
    assert _trained_steps(run_dir) == [1, 2, 3]
    samples = [s.model_dump() for step in (1, 2, 3)
               for s in load_batch(run_dir / "rollouts" / f"step_{step:06d}.safetensors").samples]
    assert {s["reward"] for s in samples} <= {0.0, 1.0}  # the tests passed or they did not
    assert all(s["env_id"] == "swe-tiny" and 0 in s["completion_mask"] for s in samples if len(s["policy_versions"]) > 1)
    assert any(len(s["policy_versions"]) > 1 for s in samples)  # multi-turn episodes
    assert not ESCAPED.exists()
    assert {p.name for p in Path("/tmp").glob("primebuild-swe-tiny-*")} <= before  # every sandbox removed
