"""`kill -9` of `primebuild run` at many instants of one short run of the embedded default, each session
resumed with `primebuild run --resume`: every step is trained exactly once and the summary is there.

Each session is killed (SIGKILL to the process group of `primebuild run`: its workers then get SIGTERM
from the kernel and its watchdog ends the rest) at the first instant of its kind after it trained a
step of its own: as a checkpoint starts being written, as a step folder is moved to the trash (checkpoint
retention or weight retirement), as weights start being published, as a rollout batch is being written,
or during a held-out eval. The instants are caught with inotify, so the kill lands within about a
millisecond of the operation starting; whether a tiny operation was still under way then is printed (the
resumed session names what it finished). tests/test_run_folder_crash_safety.py places kills
deterministically between every two file-system calls of each operation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cluster_helpers import processes_of
from conftest import call_cli, free_port, sft_workspace
from folder_events import FolderEvents

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

MAX_STEPS = 14
EVAL_EVERY = 2
SETTINGS = {"orchestrator.rollouts_per_step": 32, "orchestrator.eval_prompts": 40,
            "orchestrator.max_steps": MAX_STEPS, "orchestrator.eval_every": EVAL_EVERY,
            # every step checkpointed, the two newest kept, one weight folder kept: each step writes,
            # publishes and retires, so every kind of instant comes round at every step
            "trainer.checkpoint_every": 1, "retention.keep_checkpoints": 2, "retention.keep_weights": 1}


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[1].split(".")[0])


def _in(folder: str, suffix: str) -> Callable[[Path], bool]:
    return lambda p: p.parent.name == folder and p.name.startswith(".step_") and p.name.endswith(suffix)


# (instant, the path whose appearance marks it, seconds to wait after it)
INSTANTS: list[tuple[str, Callable[[Path], bool], float]] = [
    ("mid-checkpoint", _in("checkpoints", ".staging"), 0.0),
    ("mid-retention (checkpoints)", lambda p: p.parent.name == "checkpoints" and ".trash-" in p.name, 0.0),
    ("mid-publish", _in("weights", ".staging"), 0.0),
    ("mid-eval", lambda p: p.parent.name == "rollouts" and p.suffix == ".safetensors"
     and _step_of(p) % EVAL_EVERY == 0, 0.05),  # the batch of an eval step is written, then it evaluates
    ("mid-retention (weights)", lambda p: p.parent.name == "weights" and ".trash-" in p.name, 0.0),
    ("mid-rollout-write", _in("rollouts", ".tmp"), 0.0),
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, short_sft_store) -> Path:
    root = tmp_path_factory.mktemp("kill")
    sft_workspace(root, ("reverse-text.yaml",), seed_store=short_sft_store)
    return root


def _rows(run_dir: Path) -> list[dict]:
    rows = []
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return rows


def _trained(run_dir: Path) -> list[int]:
    return sorted(r["step"] for r in _rows(run_dir) if r["role"] == "trainer" and r["name"] == "loss")


def _evaluated(run_dir: Path) -> set[int]:
    return {r["step"] for r in _rows(run_dir) if r["name"] == "eval_reward"}


def _start(workspace: Path, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PRIMEBUILD_STORE": str(workspace / "store"), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "primebuild.cli", "run", *args, "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own process group, as a shell job would be


def _kill_at(proc: subprocess.Popen, runs: Path, matches, delay: float) -> tuple[Path, str]:
    """Wait for the session's first step of its own, then for the instant; SIGKILL the group of `primebuild
    run`. Returns the run folder and what the kill landed on."""
    events = FolderEvents()
    try:
        deadline = time.monotonic() + 200
        run_dir, first_rows, armed = None, None, False
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before the instant came:\n" + proc.stdout.read()
            seen = events.wait(0.05)
            if run_dir is None:
                found = [p for p in runs.iterdir() if p.is_dir()] if runs.is_dir() else []
                if not found:
                    continue
                run_dir = found[0]
                first_rows = len(_trained(run_dir))
            for sub in ("checkpoints", "weights", "rollouts"):
                events.watch(run_dir / sub)
            if not armed:  # the session's first step of its own: it made progress before it is killed
                armed = len(_trained(run_dir)) > first_rows
                continue
            hit = next((p for p in seen if matches(p)), None)
            if hit is not None:
                time.sleep(delay)
                os.killpg(proc.pid, signal.SIGKILL)
                return run_dir, hit.relative_to(run_dir).as_posix()
        raise AssertionError("the instant did not come within 200 s")
    finally:
        events.close()


def _wait_until_gone(run_dir: Path) -> float:
    started = time.monotonic()
    while processes_of(run_dir) and time.monotonic() - started < 30:
        time.sleep(0.1)
    assert processes_of(run_dir) == [], processes_of(run_dir)
    return time.monotonic() - started


def test_kill_9_at_many_instants_then_resume_trains_every_step_once(workspace: Path, tmp_path: Path, capsys):
    runs = tmp_path / "runs"
    sets = [a for k, v in SETTINGS.items() for a in ("--set", f"{k}={v}")]
    first = [str(workspace / "manifests" / "reverse-text.yaml"), "--runs-dir", str(runs), *sets,
             "--set", f"inference.port={free_port()}"]
    report, run_dir, outputs = [], None, []
    started = time.monotonic()
    for instant, matches, delay in INSTANTS:
        session = time.monotonic()
        proc = _start(workspace, first if run_dir is None else ["--resume", str(run_dir)])
        run_dir, landed = _kill_at(proc, runs, matches, delay)
        proc.wait(timeout=10)
        out = proc.stdout.read()
        outputs.append(out)
        assert "Traceback" not in out, out
        gone = _wait_until_gone(run_dir)
        if instant == "mid-eval":
            step = _step_of(Path(landed))
            landed += " (its eval " + ("done)" if step in _evaluated(run_dir) else "cut short)")
        report.append((instant, landed, _trained(run_dir)[-1:], time.monotonic() - session, gone))

    proc = _start(workspace, ["--resume", str(run_dir)])
    out, _ = proc.communicate(timeout=240)
    outputs.append(out)
    total = time.monotonic() - started
    with capsys.disabled():
        print(f"\nkill -9 of `primebuild run` at {len(INSTANTS)} instants, then resumed: {total:.1f} s in all")
        for (instant, landed, last, seconds, gone), after in zip(report, outputs[1:], strict=True):
            finished = [line.removeprefix("resume: ") for line in after.splitlines() if line.startswith("resume: ")]
            print(f"  {instant:28s} killed at {landed:50s} (last row: step {last}), session {seconds:4.1f} s, "
                  f"processes gone {gone:.1f} s later; the next start: {'; '.join(finished) or 'nothing to finish'}")
    assert proc.returncode == 0, out
    assert "Traceback" not in "".join(outputs)
    assert _trained(run_dir) == list(range(1, MAX_STEPS + 1))  # every step trained exactly once
    assert set(range(0, MAX_STEPS + 1, EVAL_EVERY)) <= _evaluated(run_dir)  # an eval cut short is done again
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_reward_after_step"] == MAX_STEPS and "eval_reward_before" in summary
    for folder in (run_dir, run_dir / "weights", run_dir / "checkpoints", run_dir / "rollouts"):
        assert not [p.name for p in folder.iterdir() if p.name.startswith(".")], folder  # nothing half done left
    verified = call_cli(capsys, "verify", run_dir)
    assert verified.code == 0, verified.text
