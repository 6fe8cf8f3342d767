"""The hang watchdog (primebuild/runtime/hang_watchdog.py) and the loopback-only trainer rendezvous (primebuild/runtime/trainer/launch.py).

Hangs are real: a process of a real run is frozen with SIGSTOP (a rank that stopped coming to a
collective, a server that stopped answering), nothing in the code under test knows it is a test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import listening_sockets, processes_of
from conftest import free_port, sft_workspace
from test_run_local import _trained_steps, _wait_for_trained

from primebuild.contracts.estimates import Estimates, ProfileTimes
from primebuild.contracts.run_dir import RunDir
from primebuild.runtime.hang_watchdog import FIRST_STEP_FACTOR, HangWatchdog, run_processes
from primebuild.runtime.stacks import PROCESS_ENV, RUN_DIR_ENV

pytestmark = pytest.mark.timeout(420)
# seconds: small, so that a frozen run ends quickly here (its steps take well under a second; before the
# first step, and after a restart, the bound is FIRST_STEP_FACTOR times this: a minute to load models)
HANG_FLOOR = 20


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _plan(estimate_s: float):
    from types import SimpleNamespace

    profile = ProfileTimes(**{**dict.fromkeys(ProfileTimes.model_fields, 0), "sync_step_seconds": estimate_s,
                              "async_step_seconds": 1.0})
    return SimpleNamespace(estimates=Estimates(summary=[], profile=profile), processes=[])


def test_the_bound_grows_with_the_slowest_step_and_the_plans_estimate(tmp_path: Path, monkeypatch):
    clock = _Clock()
    watchdog = HangWatchdog(_plan(2.0), RunDir(tmp_path), floor_s=10.0, clock=clock)
    monkeypatch.setattr(watchdog, "diagnose", lambda: "the culprit")
    started = (("inference-0", 0, None),)
    assert watchdog.check(0, started) is None
    assert watchdog.bound() == FIRST_STEP_FACTOR * 10.0  # start-up: models load, the first evaluation runs
    clock.now = 25.0
    assert watchdog.check(1, started) is None  # step 1 after 25 s: start-up, not a step time
    assert watchdog.bound() == 10.0  # max(5 × no step yet, 4 × the 2 s estimate, floor 10 s)
    clock.now = 29.0
    assert watchdog.check(2, started) is None and watchdog.slowest_s == 4.0
    assert watchdog.bound() == 20.0  # 5 × the slowest step (4 s)
    clock.now = 45.0
    assert watchdog.check(2, (("inference-0", 1, None),)) is None  # a restart is progress: the clock starts again
    assert watchdog.bound() == FIRST_STEP_FACTOR * 20.0  # and the restarted server loads its model again
    clock.now = 50.0
    # step 3, 5 s after the restart, paid for the reload: not a step time, the bound stays 5 × 4 s
    assert watchdog.check(3, (("inference-0", 1, None),)) is None and watchdog.bound() == 20.0
    clock.now = 70.0
    assert watchdog.check(3, (("inference-0", 1, None),)) is None
    clock.now = 71.0
    message = watchdog.check(3, (("inference-0", 1, None),))
    assert message is not None and "step 4 made no progress for 21 s (bound 20 s" in message
    assert "the culprit" in message


def test_steps_retrained_after_a_trainer_restart_are_progress(tmp_path: Path, monkeypatch):
    """A restarted trainer trains the steps after its checkpoint again: the newest step stays where it was
    for a while, and yet the run moves (primebuild/runtime/supervisor.py's trainer-only restart)."""
    clock = _Clock()
    watchdog = HangWatchdog(_plan(0.0), RunDir(tmp_path), floor_s=10.0, clock=clock)
    monkeypatch.setattr(watchdog, "diagnose", lambda: "the culprit")
    up, restarted = (("trainer", 0, None),), (("trainer", 1, None),)
    assert watchdog.check(0, up, 0) is None
    clock.now = 5.0
    assert watchdog.check(5, up, 5) is None
    clock.now = 6.0
    assert watchdog.check(5, restarted, 5) is None and watchdog.bound() == FIRST_STEP_FACTOR * 10.0
    for trained, now in ((6, 30.0), (7, 31.0), (8, 32.0)):  # steps 4 and 5 again, 1 s apart; then step 6
        clock.now = now
        assert watchdog.check(5 if trained < 8 else 6, restarted, trained) is None
    assert watchdog.bound() == 10.0 and watchdog.slowest_s == 1.0  # the first one after the restart: start-up
    clock.now = 43.0
    message = watchdog.check(6, restarted, 8)
    assert message is not None and "step 7 made no progress for 11 s" in message


def test_a_resumed_session_starts_its_first_step_bound_after_the_old_steps(tmp_path: Path):
    clock = _Clock()
    watchdog = HangWatchdog(_plan(0.5), RunDir(tmp_path), floor_s=10.0, clock=clock)
    assert watchdog.check(7, ()) is None  # metrics.jsonl already holds steps 1..7 of the earlier session
    assert watchdog.bound() == FIRST_STEP_FACTOR * 10.0


def test_a_disabled_watchdog_never_fires(tmp_path: Path):
    clock = _Clock()
    watchdog = HangWatchdog(_plan(1.0), RunDir(tmp_path), floor_s=0, clock=clock)
    clock.now = 1e9
    assert watchdog.check(0, ()) is None


_BLOCKED = """
import threading
from primebuild.runtime.stacks import dump_on_signal

def wait_for_a_peer_that_never_comes(lock):
    print("ready", flush=True)  # from inside: a dump that comes at once finds this frame (CI caught <module>)
    lock.acquire()

dump_on_signal()
lock = threading.Lock()
lock.acquire()
wait_for_a_peer_that_never_comes(lock)
"""


def _wait_for_state(pid: int, state: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rindex(")") + 2] == state:
            return
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} did not reach state {state}")


def test_stacks_of_a_blocked_process_name_its_frame_and_a_stopped_one_is_named_first(tmp_path: Path):
    """Real processes: one blocked in C (a lock), one frozen by SIGSTOP; a third is no primebuild process."""
    from types import SimpleNamespace

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    env = {**os.environ, RUN_DIR_ENV: str(run.root)}
    blocked = subprocess.Popen([sys.executable, "-c", _BLOCKED], env={**env, PROCESS_ENV: "trainer"},
                               stdout=subprocess.PIPE, text=True)
    frozen = subprocess.Popen([sys.executable, "-c", _BLOCKED], env={**env, PROCESS_ENV: "inference-0"},
                              stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen(["sleep", "60"], env={**env, PROCESS_ENV: "orchestrator"})
    try:
        assert blocked.stdout.readline() == "ready\n" and frozen.stdout.readline() == "ready\n"
        os.kill(frozen.pid, signal.SIGSTOP)
        _wait_for_state(frozen.pid, "T")
        plan = SimpleNamespace(estimates=Estimates(summary=[]), processes=[
            SimpleNamespace(name=n, role=n.split("-")[0]) for n in ("trainer", "inference-0", "orchestrator", "router")])
        watchdog = HangWatchdog(plan, run, floor_s=1.0)
        states = {p.pid: p for p in run_processes(run)}
        assert {blocked.pid, frozen.pid, other.pid} <= set(states)
        assert states[frozen.pid].state == "T" and not states[other.pid].catches_dump
        assert states[blocked.pid].catches_dump
        culprit = watchdog.diagnose()
    finally:
        for p in (blocked, frozen, other):
            p.kill()
            p.wait()
    assert culprit.startswith(f"inference-0 (pid {frozen.pid}) is stopped")
    assert watchdog.culprit_process == "inference-0"
    dump = run.stack_file("trainer", blocked.pid).read_text()
    assert "wait_for_a_peer_that_never_comes" in dump
    report = (run.stacks / "hang.txt").read_text()
    assert f"trainer (pid {blocked.pid}): main thread in wait_for_a_peer_that_never_comes" in report, report
    assert "takes no stack requests" in report and "not on this host (no stacks taken): router" in report


_IDLE_SERVER = """
import asyncio
from primebuild.runtime.stacks import dump_on_signal

async def serve():
    asyncio.get_running_loop().call_later(0.3, lambda: print("ready", flush=True))  # once it waits
    await asyncio.Event().wait()  # an event loop with nothing to do, as a server nobody asks

dump_on_signal()
asyncio.run(serve())
"""

_REWARD_THAT_NEVER_RETURNS = """
import time
from primebuild.runtime.stacks import dump_on_signal

def score_forever():
    print("ready", flush=True)
    while True:
        time.sleep(0.05)

dump_on_signal()
score_forever()
"""


def test_a_process_stuck_in_its_own_code_is_named_before_an_idle_server(tmp_path: Path):
    """A reward that never returned: the watchdog named the inference server (first by pid, idle in its
    event loop) instead of the orchestrator, busy in the environment's code."""
    from types import SimpleNamespace

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    env = {**os.environ, RUN_DIR_ENV: str(run.root)}
    server = subprocess.Popen([sys.executable, "-c", _IDLE_SERVER], env={**env, PROCESS_ENV: "inference-0"},
                              stdout=subprocess.PIPE, text=True)
    orchestrator = subprocess.Popen([sys.executable, "-c", _REWARD_THAT_NEVER_RETURNS],
                                    env={**env, PROCESS_ENV: "orchestrator"}, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "ready\n" and orchestrator.stdout.readline() == "ready\n"
        _wait_for_state(server.pid, "S")  # back in its loop's select, not still in the print (a loaded machine)
        plan = SimpleNamespace(estimates=Estimates(summary=[]), processes=[
            SimpleNamespace(name="inference-0", role="inference"), SimpleNamespace(name="orchestrator",
                                                                                    role="orchestrator")])
        culprit = HangWatchdog(plan, run, floor_s=1.0).diagnose()
    finally:
        for p in (server, orchestrator):
            p.kill()
            p.wait()
    assert culprit.startswith(f"orchestrator (pid {orchestrator.pid}) main thread in score_forever"), culprit
    report = (run.stacks / "hang.txt").read_text()
    assert f"inference-0 (pid {server.pid}): waits on its event loop's sockets" in report, report


# --- end to end: real runs on the local target --------------------------------------------------------


@pytest.fixture(scope="module")
def manifests(tmp_path_factory, short_sft_store) -> Path:
    return sft_workspace(tmp_path_factory.mktemp("hang"), seed_store=short_sft_store)


def _env(manifests: Path) -> dict:
    return {**os.environ, "PRIMEBUILD_STORE": str(manifests.parent / "store"), "PYTHONUNBUFFERED": "1"}


def _start(manifests: Path, runs: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "primebuild.cli", "run", str(manifests / "reverse-text.yaml"), "--runs-dir", str(runs),
         "--quiet", "--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40",
         "--set", f"inference.port={free_port()}", "--hang-timeout", str(HANG_FLOOR), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(manifests))


def _pids(run_dir: Path, process: str, **env: str) -> list[int]:
    """Live pids of plan process `process` of this run whose environment also holds `env`."""
    found = []
    for p in run_processes(RunDir(run_dir)):
        if p.process != process:
            continue
        environ = Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")
        if all(f"{k}={v}".encode() in environ for k, v in env.items()):
            found.append(p.pid)
    return found


def test_a_rank_that_stops_coming_ends_the_run_naming_it_and_nothing_listens_beyond_loopback(
        manifests: Path, tmp_path: Path):
    """A 2-rank trainer: every socket of the run listens on loopback (torchrun's rendezvous too); then
    rank 1 is frozen, rank 0 waits in a collective, and the watchdog ends the run within its bound,
    naming the trainer, with the stacks of rank 0 showing the collective. (No trainer-only restart here:
    tests/test_trainer_restart.py has the watchdog restart a frozen trainer.)"""
    runs = tmp_path / "runs"
    proc = _start(manifests, runs, "--set", "trainer.ranks=2", "--set", "trainer.dp_shard=2",
                   "--set", "orchestrator.max_steps=200", "--set", "trainer.max_restarts=0")
    try:
        run_dir = _wait_for_trained(runs, 2, proc, timeout=300)
        sockets = listening_sockets([int(line.split(":")[0]) for line in processes_of(run_dir)])
        trainer_pids = set(_pids(run_dir, "trainer"))
        assert any(pid in trainer_pids for pid, _, _ in sockets), sockets  # the rendezvous, the ranks' gloo
        wildcard = [s for s in sockets if s[1] in ("0.0.0.0", "::")]
        assert not wildcard, f"listening on every interface: {wildcard}"
        assert all(s[1] == "127.0.0.1" for s in sockets), sockets
        print(f"2-rank run: {len(sockets)} listening sockets, all on 127.0.0.1")

        (rank1,) = _pids(run_dir, "trainer", RANK="1")
        (rank0,) = _pids(run_dir, "trainer", RANK="0")
        os.kill(rank1, signal.SIGSTOP)
        frozen = time.monotonic()
        out, _ = proc.communicate(timeout=360)
        ended = time.monotonic() - frozen
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    bound = float(re.search(r"\(bound (\d+) s", out)[1])
    print(f"rank 1 frozen -> run over in {ended:.0f} s (bound {bound:.0f} s)")
    print(next(line for line in out.splitlines() if line.startswith("error: hang")))
    # the bound, the stack dumps, then a stop: the frozen rank SIGKILLed at once (24 s seen, 45 s while it
    # got SIGTERM and 10 s to take it), rank 0 ends with the collective it waited in
    assert ended < bound + 60, out
    assert "hang: step" in out and f"trainer (pid {rank1}) is stopped" in out, out
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["process"] == "trainer" and "hang:" in failure["message"]
    report = (run_dir / "stacks" / "hang.txt").read_text()
    print(report)
    assert f"trainer (pid {rank0}): waits on a collective" in report, report
    assert "torch/distributed/" in (run_dir / "stacks" / f"trainer.{rank0}.txt").read_text()  # the frame it waits in
    assert processes_of(run_dir) == []


def test_a_frozen_inference_server_is_named_and_max_restarts_finishes_every_step_once(manifests: Path, tmp_path: Path):
    runs = tmp_path / "runs"
    proc = _start(manifests, runs, "--set", "orchestrator.max_steps=6", "--max-restarts", "1")
    try:
        run_dir = _wait_for_trained(runs, 2, proc, timeout=300)
        (server,) = _pids(run_dir, "inference-0")
        os.kill(server, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert_frozen_server_named_and_run_resumed(out, run_dir, server, steps=6)


def assert_frozen_server_named_and_run_resumed(out: str, run_dir: Path, server: int, steps: int) -> None:
    """The watchdog named the frozen inference-0 and dumped the stacks; the one restart (`--max-restarts 1`)
    resumed and trained steps 1..steps exactly once (also the vLLM fault run's, tests/test_run_vllm.py)."""
    print(next(line for line in out.splitlines() if line.startswith("error: hang")))
    assert f"inference-0 (pid {server}) is stopped" in out and "restart 1/1" in out, out
    assert "resuming" in out and "run complete" in out, out
    assert _trained_steps(run_dir) == list(range(1, steps + 1))  # each step exactly once, none lost
    report = (run_dir / "stacks" / "hang.txt").read_text()
    assert f"inference-0 (pid {server}): stopped" in report and "orchestrator (pid" in report, report
    assert not (run_dir / "failure.json").exists()  # the resumed session ended well
