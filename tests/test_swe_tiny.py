"""swe-tiny and its sandbox, for real: bubblewrap namespaces and rlimits around every program an episode
runs. A fix passes its tests (reward 1); code under test that writes outside its folder, loops forever,
exhausts memory or sleeps is ended, scores 0, leaves no process and no file behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

from primebuild.runtime.envs.swe_tiny import BUGS, SweTinyEnv

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None and os.environ.get("CI") != "true",
                                 reason="bubblewrap is not installed (scripts/bootstrap --test installs it)"),
              pytest.mark.xdist_group("swe-tiny")]  # with test_run_swe_tiny.py: both watch OUTSIDE and /tmp's sandboxes
OUTSIDE = Path("/var/tmp/primebuild-swe-tiny-escaped")  # writable here, absent inside the sandbox


def env(**kw) -> SweTinyEnv:
    return SweTinyEnv(cpu_seconds=1, wall_seconds=4.0, memory_mb=256, hostile=True, **kw)


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def play(e: SweTinyEnv, name: str, commands: list[str]) -> tuple[float, list[str | None], Path, float]:
    episode = e.start(e._task(name))
    root = episode.sandbox.root
    replies = [await episode.step(c) for c in commands]
    started = time.monotonic()
    reward = await episode.reward()
    seconds = time.monotonic() - started
    await episode.close()
    return reward, replies, root, seconds


def test_the_right_edit_passes_the_tests_and_a_wrong_one_does_not():
    e = env()
    name = "add"
    reward, replies, root, _ = asyncio.run(play(e, name, ["ls", "cat calc", BUGS[name][1], "test"]))
    assert reward == 1.0
    assert replies[0].startswith("calc.py checks.py") and "operator.sub" in replies[1]
    assert replies[2].startswith("edited calc.py") and replies[3] is None  # max_turns (4) ends the episode
    assert not root.exists()  # the sandbox folder goes with the episode
    reward, replies, _, _ = asyncio.run(play(e, name, ["edit calc sub mul", "test", "done"]))
    assert reward == 0.0 and "FAILED" in replies[1] and replies[2] is None


def test_commands_cannot_reach_outside_the_repository():
    reward, replies, _, _ = asyncio.run(play(env(), "add", ["cat ../../etc/hostname", "edit ../x a b", "rm calc"]))
    assert replies[0].startswith("no file") and replies[1].startswith("no file")
    assert replies[2].startswith("commands:") and reward == 0.0


@pytest.mark.parametrize("name", ["escape", "spin", "hog", "sleeper"])
def test_hostile_code_is_ended_scored_zero_and_leaves_nothing(name):
    OUTSIDE.unlink(missing_ok=True)
    e = env()
    reward, _, root, seconds = asyncio.run(play(e, name, ["done"]))
    assert reward == 0.0
    assert seconds < e.limits.wall_seconds + 3  # ended at the limits, not when the code gave up
    assert not OUTSIDE.exists()  # nothing outside the sandbox was written
    assert not root.exists() and processes_mentioning(str(root)) == []  # nothing left running
