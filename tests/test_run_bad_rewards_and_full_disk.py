"""A run that meets a reward that is no number, or a runs folder that fills up, ends with an outcome that
names the cause; it was `internal error` with no outcome recorded, and `status` said nothing for ever."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_MANIFEST, free_port, write

from primebuild.runtime.envs.base import RewardError, SingleTurnEpisode, Task, episode_reward
from primebuild.runtime.progress import Progress


class _Scorer:
    id, version = "scorer", "1"

    def __init__(self, value):
        self.value = value

    def score(self, task: Task, completion: str):
        return self.value


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, None, "0.5x"])
def test_a_reward_that_is_no_finite_number_fails_the_rollout_naming_the_environment(value):
    env = _Scorer(value)
    with pytest.raises(RewardError, match="environment scorer: its reward .* is not a finite number"):
        asyncio.run(episode_reward(env, SingleTurnEpisode(env, Task("p", "a"))))
    good = _Scorer(0.25)
    assert asyncio.run(episode_reward(good, SingleTurnEpisode(good, Task("p", "a")))) == 0.25


def test_progress_prints_a_metric_that_was_not_finite_as_a_dash(tmp_path: Path):
    """metrics.jsonl writes a NaN as null; the progress line formatted it with :.4f (TypeError, which ended
    `primebuild run` with an internal error)."""
    rows = [{"step": 0, "role": "orchestrator", "name": "eval_reward", "value": None},
            {"step": 1, "role": "orchestrator", "name": "reward_mean", "value": None},
            {"step": 1, "role": "trainer", "name": "loss", "value": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines: list[str] = []
    progress = Progress(tmp_path / "metrics.jsonl", lines.append)
    progress.poll()
    assert lines[0].startswith("held-out eval reward - ") and lines[1].startswith("step    1 | reward - |")
    assert "-" in str(progress.panel().columns[1]._cells)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 20 MB tmpfs: the run's first checkpoints fill it."""
    folder = tmp_path / "small"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(folder)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs as root and can mount a tmpfs: {done.stderr.strip()}")
        pytest.skip(f"needs root to mount a tmpfs: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_a_runs_folder_that_fills_up_ends_the_run_naming_the_cause(workdir: Path, small_disk: Path):
    write(workdir, "m.yaml", CPU_MANIFEST)
    run = subprocess.run(
        [sys.executable, "-m", "primebuild.cli", "run", "m.yaml", "--runs-dir", str(small_disk), "--quiet",
         "--set", "orchestrator.max_steps=40", "--set", "trainer.checkpoint_every=1",
         "--set", f"inference.port={free_port()}"],
        cwd=workdir, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "internal error" not in out and "Exception in thread" not in out, out
    assert "No space left on device" in out.splitlines()[-1], out  # the outcome names the cause
    assert "restarting the trainer" not in out  # a full disk fails the same way again
    (run_dir,) = small_disk.iterdir()
    status = subprocess.run([sys.executable, "-m", "primebuild.cli", "status", str(run_dir), "-o", "json"],
                            capture_output=True, text=True, timeout=60)
    state = json.loads(status.stdout)
    assert state["outcome"] and state["stop_requested"] is False, state  # said, whether or not it could be written


def test_the_process_that_supervises_a_run_keeps_none_of_its_model_builds_memory(tmp_path: Path):
    """`primebuild run` built the model (random init, one-rank CPU SFT) in its own process, then supervised the
    whole RL run holding torch, the model and the SFT's optimiser (528 MiB measured, where the plan counts
    152 MiB for it). The builds run in a forked child now: the supervising process never imports torch."""
    from conftest import sft_workspace

    manifests = sft_workspace(tmp_path, sft_changes={"steps": 4, "warmup_steps": 1, "stop_at_reward": None})
    # VmHWM, not ru_maxrss: Linux keeps the latter across execve, so it would count the pytest worker this
    # probe was forked from
    probe = ("import re, sys\nfrom pathlib import Path\nfrom primebuild.cli import main\n"
             f"code = main(['run', {str(manifests / 'reverse-text.yaml')!r}, '--quiet', '--runs-dir', "
             f"{str(tmp_path / 'runs')!r}, '--set', 'orchestrator.max_steps=1', '--set', "
             f"'inference.port={free_port()}'])\n"
             "peak = int(re.search(r'VmHWM:\\s+(\\d+)', Path('/proc/self/status').read_text()).group(1))\n"
             "print('RESULT', code, 'torch' in sys.modules, peak // 1024)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PRIMEBUILD_STORE": str(tmp_path / "store")})
    result = next((line for line in done.stdout.splitlines() if line.startswith("RESULT")), "")
    assert "built in" in done.stdout and result.split()[1:3] == ["0", "False"], done.stdout + done.stderr
    assert int(result.split()[3]) < 200, result  # MiB: the CLI and the report, not torch and a model
