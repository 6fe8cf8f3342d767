"""Experiment trackers as metric sinks: a short run with wandb (offline, for real) and TensorBoard on;
both read back, with the trackers' own formats and readers, equal metrics.jsonl; the API key, passed by
name as a secret, is in no file of the run folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import free_port, sft_workspace
from tracker_helpers import jsonl_metrics, tensorboard_scalars, wandb_history

for _package in ("wandb", "tensorboard"):  # both come with the test extra: under CI=true a missing one fails
    try:
        __import__(_package)
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"{_package} is not installed (pip install -e '.[test]')", allow_module_level=True)
pytestmark = pytest.mark.timeout(400)
CANARY = "pb-canary-4c1d9a7e0b1f"  # a fake API key: it must not appear in any file


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, short_sft_store) -> Path:
    root = tmp_path_factory.mktemp("trackers")
    manifests = sft_workspace(root, seed_store=short_sft_store)
    (manifests / "tracked.yaml").write_text(yaml.safe_dump({
        "extends": ["reverse-text.yaml"], "name": "tracked", "secrets": ["PB_WANDB_KEY"],
        "trackers": {"wandb": {"project": "reverse-text", "mode": "offline", "api_key_secret": "PB_WANDB_KEY",
                               "tags": ["ci"]},
                     "tensorboard": {"flush_secs": 1}}}))
    env = {**os.environ, "PRIMEBUILD_STORE": str(root / "store"), "PB_WANDB_KEY": CANARY,
           "WANDB_CONFIG_DIR": str(root / "wandb-config"), "WANDB_CACHE_DIR": str(root / "wandb-cache")}
    done = subprocess.run(
        [sys.executable, "-m", "primebuild.cli", "run", str(manifests / "tracked.yaml"), "--runs-dir",
         str(root / "runs"), "--quiet", "--set", "orchestrator.max_steps=3", "--set",
         "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40", "--set",
         f"inference.port={free_port()}"], capture_output=True, text=True, env=env, timeout=360)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = (root / "runs").iterdir()
    return run


@pytest.mark.parametrize("role", ["trainer", "orchestrator"])
def test_wandb_offline_run_holds_the_metrics(run_dir: Path, role: str):
    expected = jsonl_metrics(run_dir / "metrics.jsonl", role)
    assert len(expected) >= 3
    (log,) = (run_dir / "wandb").glob(f"offline-run-*-{run_dir.name}-{role}/run-*.wandb")
    got = wandb_history(log)
    assert got == {step: {f"{role}/{k}": v for k, v in row.items()} for step, row in expected.items()}


@pytest.mark.parametrize("role", ["trainer", "orchestrator"])
def test_tensorboard_events_read_back_equal_metrics_jsonl(run_dir: Path, role: str):
    expected = jsonl_metrics(run_dir / "metrics.jsonl", role)
    assert tensorboard_scalars(run_dir / "tensorboard" / role) == expected


def test_the_api_key_is_in_no_file(run_dir: Path):
    """The secret reaches the processes by name; its value is in no file the run wrote, binary or not."""
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and any("tfevents" in p.name for p in files)
    leaked = [str(p) for p in files if CANARY.encode() in p.read_bytes()]
    assert leaked == []
    # nor the run's admin token (test_run_local's check, here over the trackers' folders, binary files too)
    tracked = [p for p in files if p.relative_to(run_dir).parts[0] in ("wandb", "tensorboard")]
    assert not [str(p) for p in tracked if b"Bearer" in p.read_bytes() or b"PRIMEBUILD_ADMIN_TOKEN" in p.read_bytes()]
    plan = (run_dir / "plan.json").read_text()
    assert "PB_WANDB_KEY" in plan and CANARY not in plan  # by name only
