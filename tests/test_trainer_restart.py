"""Trainer-only restart (primebuild/runtime/supervisor.py, builders/trainer_restart.py): a trainer group that
dies or hangs starts again from its newest checkpoint while the inference server keeps its model and the
orchestrator its rollouts; the steps after the checkpoint are retrained from the same rollout files.

Faults are real: a trainer rank of a real run is SIGKILLed or frozen with SIGSTOP. The same beside a vLLM
server is tests/test_vllm_trainer_restart.py: apart, so that only it joins the serial `vllm` group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cluster_helpers import processes_of
from conftest import free_port, plan_json, sft_workspace
from test_hang_watchdog import _pids
from test_run_local import _wait_for_trained

from primebuild.runtime.metrics import read_metrics
from primebuild.runtime.supervisor import _reported_an_error
from primebuild.runtime.weight_sync.broadcast import STALL_ENV

pytestmark = pytest.mark.timeout(420)
TIMINGS = {"wait_s", "step_s", "publish_s"}  # wall-clock metrics: the only values a retrained step may change


@pytest.fixture(scope="module")
def manifests(tmp_path_factory, short_sft_store) -> Path:
    return sft_workspace(tmp_path_factory.mktemp("restart"), ("reverse-text.yaml", "reverse-text-vllm.yaml"),
                         seed_store=short_sft_store)


def _start(manifests: Path, runs: Path, *args: str, manifest: str = "reverse-text.yaml",
           env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "primebuild.cli", "run", str(manifests / manifest), "--runs-dir", str(runs),
         "--quiet", "--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40",
         "--set", f"inference.port={free_port()}", "--set", "trainer.checkpoint_every=3", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PRIMEBUILD_STORE": str(manifests.parent / "store"), "PYTHONUNBUFFERED": "1", **(env or {})})


def _trainer_rows(run_dir: Path) -> list[dict]:
    """Every trainer line of metrics.jsonl, in order: a retrained step's lines come twice."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["role"] == "trainer"]


def _attempts(run_dir: Path) -> dict[int, list[dict[str, float]]]:
    """step -> the values each attempt at it wrote (one dict per attempt)."""
    out: dict[int, list[dict[str, float]]] = {}
    for r in _trainer_rows(run_dir):
        tries = out.setdefault(r["step"], [])
        if not tries or r["name"] in tries[-1]:
            tries.append({})
        tries[-1][r["name"]] = r["value"]
    return out


def _assert_retrained_identically(run_dir: Path, steps: int, kills: list[int]) -> list[int]:
    """Steps 1..steps each in metrics once (readers keep the last line); after each kill (`kills`: the newest
    step trained when it came) the steps after the checkpoint the trainer restarted from were trained twice,
    with identical values; returns those steps."""
    restarts = [json.loads(line) for line in (run_dir / "trainer_restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == len(kills), restarts
    assert sorted(read_metrics(run_dir / "metrics.jsonl", role="trainer")) == list(range(1, steps + 1))
    attempts = _attempts(run_dir)
    assert all(len(tries) <= 2 for tries in attempts.values()), attempts
    twice = sorted(s for s, tries in attempts.items() if len(tries) == 2)
    spans = [(r["resume_after"], before) for r, before in zip(restarts, kills, strict=True)]
    for after, before in spans:
        assert 0 < after <= before and after % 3 == 0, (after, before)  # checkpoint_every=3
        assert set(range(after + 1, before + 1)) <= set(twice), (spans, twice)  # each row written before the kill
    # nothing else: a step whose row came between the kill and the look at metrics is the only extra one
    assert all(any(after < s <= before + 1 for after, before in spans) for s in twice), (spans, twice)
    for step in twice:
        first, second = ({k: v for k, v in t.items() if k not in TIMINGS} for t in attempts[step])
        assert first == second, (step, first, second)  # same checkpoint, same rollout file: same values
    return twice


def _newest_trained(run_dir: Path) -> int:
    return max(read_metrics(run_dir / "metrics.jsonl", role="trainer"))


def kill_inside_a_send(run_dir: Path, proc: subprocess.Popen, stall: Path, trainer: int,
                       settle_s: float) -> tuple[int, list[int]]:
    """Stall the trainer's next weight send half-way (STALL_ENV's file), give the buckets that crossed
    `settle_s` to be installed (milliseconds; seconds on a loaded CI machine), then SIGKILL the trainer.
    Returns the step whose send stalled and [the newest step trained when it died]."""
    stall.touch()
    trainer_log = run_dir / "logs" / "trainer.log"
    deadline = time.monotonic() + 300
    while "stalls after" not in trainer_log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "no send stalled"
        time.sleep(0.1)
    stalled = int(trainer_log.read_text().split("the send of step ")[1].split()[0])
    time.sleep(settle_s)
    kills = [_newest_trained(run_dir)]
    os.kill(trainer, signal.SIGKILL)
    return stalled, kills


def assert_completions_refused_as_mixed(url: str, model: str) -> None:
    refused = httpx.post(url + "/v1/completions", json={"model": model, "prompt": [1, 5, 6], "max_tokens": 4},
                         timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "weights_mixed", refused.text


def test_a_killed_then_a_frozen_trainer_rank_each_restart_the_trainer_alone(manifests: Path, tmp_path: Path):
    """A 2-rank trainer loses rank 1 to SIGKILL after step 4: torchrun ends the group, and the supervisor
    starts it again from the checkpoint of step 3. After step 8 rank 0 of the new group is frozen (SIGSTOP):
    the hang watchdog names it and the trainer alone is restarted again, from step 6's checkpoint. The
    inference server and the orchestrator are the same processes throughout, and every retrained step logs
    exactly the values of its first attempt."""
    runs = tmp_path / "runs"
    steps = 11
    proc = _start(manifests, runs, "--set", "trainer.ranks=2", "--set", "trainer.dp_shard=2",
                  # 3x the bound while a restarted trainer loads: room for a start-up on a loaded machine
                  "--set", f"orchestrator.max_steps={steps}", "--hang-timeout", "30")
    try:
        run_dir = _wait_for_trained(runs, 4, proc, timeout=300)
        (server,) = _pids(run_dir, "inference-0")
        (orchestrator,) = _pids(run_dir, "orchestrator")
        (rank1,) = _pids(run_dir, "trainer", RANK="1")
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        kills = [_newest_trained(run_dir)]
        _wait_for_trained(runs, kills[0] + 1, proc, timeout=300)
        recovered = time.monotonic() - killed
        # the same server and orchestrator processes, still up, after the trainer came back
        assert _pids(run_dir, "inference-0") == [server] and _pids(run_dir, "orchestrator") == [orchestrator]

        _wait_for_trained(runs, 8, proc, timeout=300)
        (rank0,) = _pids(run_dir, "trainer", RANK="0")
        os.kill(rank0, signal.SIGSTOP)
        kills.append(_newest_trained(run_dir))
        _wait_for_trained(runs, kills[1] + 1, proc, timeout=300)
        assert _pids(run_dir, "inference-0") == [server] and _pids(run_dir, "orchestrator") == [orchestrator]
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"trainer rank 1 SIGKILLed after step {kills[0]} -> step {kills[0] + 1} trained {recovered:.1f} s "
          f"later (trainer-only restart; load average {os.getloadavg()[0]:.1f})")
    assert proc.returncode == 0, out
    assert "restarting the trainer (1/3)" in out and "starting again after the checkpoint of step" in out, out
    assert f"trainer (pid {rank0}) is stopped" in out and "restarting the trainer (2/3)" in out, out
    assert not (run_dir / "failure.json").exists()
    twice = _assert_retrained_identically(run_dir, steps, kills)
    print(f"retrained steps {twice}: identical values")
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "(restart 2) ---" in log and "resumed from" in log
    # the republished weights are the very bytes already served: the folder stayed in place
    assert "written again with the same bytes; the published folder stays" in log, log[-3000:]
    for name in ("inference-0", "orchestrator"):
        assert "(restart 1)" not in (run_dir / "logs" / f"{name}.log").read_text()
    assert processes_of(run_dir) == []


def test_under_broadcast_the_servers_rejoin_the_restarted_trainers_weight_group(manifests: Path, tmp_path: Path):
    """Broadcast weight sync (glm5's mode): the trainer's rank 0 is the sender and hosts the weight group's
    store, so killing it -9 takes the store down too. The trainer alone restarts from its newest checkpoint
    and hosts the store again on the same port; both servers (same processes, same loaded model) reconnect,
    register with the step they hold, and load the restarted trainer's next steps. The retrained steps the
    servers already hold are not sent again; every step trains once in the record, with identical values."""
    runs = tmp_path / "runs"
    steps = 9
    proc = _start(manifests, runs, "--set", "weight_sync.mode=broadcast", "--set", f"weight_sync.port={free_port()}",
                  "--set", "inference.replicas=2", "--set", f"orchestrator.max_steps={steps}")
    try:
        run_dir = _wait_for_trained(runs, 4, proc, timeout=300)
        servers = sorted(_pids(run_dir, "inference-0") + _pids(run_dir, "inference-1"))
        (orchestrator,) = _pids(run_dir, "orchestrator")
        (trainer,) = _pids(run_dir, "trainer")
        os.kill(trainer, signal.SIGKILL)
        killed = time.monotonic()
        kills = [_newest_trained(run_dir)]
        _wait_for_trained(runs, kills[0] + 1, proc, timeout=300)
        recovered = time.monotonic() - killed
        assert sorted(_pids(run_dir, "inference-0") + _pids(run_dir, "inference-1")) == servers
        assert _pids(run_dir, "orchestrator") == [orchestrator]
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"broadcast: trainer SIGKILLed after step {kills[0]} -> step {kills[0] + 1} trained {recovered:.1f} s "
          f"later (trainer-only restart; load average {os.getloadavg()[0]:.1f})")
    assert proc.returncode == 0, out
    assert "restarting the trainer (1/3)" in out, out
    _assert_retrained_identically(run_dir, steps, kills)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    restarted = trainer_log.split("(restart 1) ---")[1]
    held = [int(line.split("step ")[1].split(":")[0]) for line in restarted.splitlines() if "not sent again" in line]
    for name in ("inference-0", "inference-1"):
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert "(restart 1)" not in log and "rejoined the weight sender of epoch" in log, log[-3000:]
        after = log.split("rejoined the weight sender of epoch")[1]
        loaded = [int(line.split("weights of step ")[1].split()[0]) for line in after.splitlines()
                  if "loaded the weights of step" in line]
        # the servers serve the restarted trainer's steps: each one after the step they held, up to the last
        assert loaded == list(range(loaded[0], steps + 1)) and loaded[0] > max(held, default=0), (loaded, held)
    assert json.loads((run_dir / "summary.json").read_text())["eval_reward_after_step"] == steps
    assert processes_of(run_dir) == []


def test_a_sender_killed_inside_a_load_leaves_the_server_up_until_the_restarted_trainers_whole_update(
        manifests: Path, tmp_path: Path):
    """Broadcast, the window the test above misses: the trainer's sender is SIGKILLed half-way through a
    step's buckets (a test-only stall holds it there: broadcast.STALL_ENV), so the server has part of that
    step installed in place and part not, with no copy to go back to. The server process stays (same pid,
    never restarted); meanwhile its /health says weights_mixed and completions answer 503 weights_mixed,
    and none is answered 200 until a whole update; the orchestrator counts it down, and the restarted
    trainer's next send (whole) brings it back. Every step trains once in the record, retrained identically."""
    runs = tmp_path / "runs"
    steps = 7
    stall = tmp_path / "stall-the-send"
    # 50 kB buckets: the model's ~1 MB layers cross in several, so a send has a half-way point
    proc = _start(manifests, runs, "--set", "weight_sync.mode=broadcast", "--set", f"weight_sync.port={free_port()}",
                  "--set", "weight_sync.bucket_mb=0.05", "--set", f"orchestrator.max_steps={steps}",
                  "--set", "orchestrator.eval_every=0", env={STALL_ENV: str(stall)})
    try:
        run_dir = _wait_for_trained(runs, 4, proc, timeout=300)
        (server,) = _pids(run_dir, "inference-0")
        (trainer,) = _pids(run_dir, "trainer")
        served = json.loads((run_dir / "config" / "inference-0.json").read_text())
        url = f"http://{served['host']}:{served['port']}"
        stalled, kills = kill_inside_a_send(run_dir, proc, stall, trainer, settle_s=3.0)
        deadline = time.monotonic() + 60
        while (health := httpx.get(url + "/health", timeout=10).json())["status"] != "weights_mixed":
            assert time.monotonic() < deadline, health
            time.sleep(0.1)
        assert health["policy_version"] == stalled - 1, (health, stalled)  # the last whole one, not a clean new label
        assert_completions_refused_as_mixed(url, served["served_model_name"])
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert _pids(run_dir, "inference-0") == [] and "restarting the trainer (1/3)" in out, out
    log = (run_dir / "logs" / "inference-0.log").read_text()
    assert "(restart 1)" not in log and f"[{server}]" in log.split("\n", 2)[1], log[:500]  # one server process
    mixed = log.split("the served weights are a mix of two policies (")[1]
    installed = int(mixed.split("stopped after ")[1].split()[0])
    assert installed >= 1, mixed[:300]
    while_mixed, mended = mixed.split("is whole: serving again", 1)
    whole = int(while_mixed.rsplit("policy version ", 1)[1].split()[0])
    assert stalled <= whole <= steps, (whole, stalled)  # the restarted trainer's first send (whole), no earlier step
    # nothing answered from the mix; what came meanwhile (requests held by the update, new ones) got 503
    assert '"POST /v1/completions HTTP/1.1" 200' not in while_mixed, while_mixed[-3000:]
    assert '"POST /v1/completions HTTP/1.1" 503' in while_mixed, while_mixed[-3000:]
    assert "rejoined the weight sender of epoch" in while_mixed, while_mixed[-3000:]
    loaded = [int(line.split("weights of step ")[1].split()[0]) for line in mended.splitlines()
              if "loaded the weights of step" in line]
    assert loaded == list(range(whole + 1, steps + 1)), (loaded, whole)
    assert '"POST /v1/completions HTTP/1.1" 200' in mended  # serving again, the restarted trainer's steps
    orchestrator_log = (run_dir / "logs" / "orchestrator.log").read_text()
    assert "the served weights are a mix of two policies" in orchestrator_log, orchestrator_log[-3000:]  # not counted
    # a rollout that reached the server meanwhile (timing: the off-policy bound may hold them all back) had it
    # counted down, and the trainer's next update admitted it again; else the next sync brought it back
    after_mixed = orchestrator_log.split("the served weights are a mix of two policies", 1)[1]
    if f"{url}/v1 is gone" in after_mixed:
        assert "rejoined the weight group at policy version" in after_mixed, orchestrator_log[-3000:]
    _assert_retrained_identically(run_dir, steps, kills)
    assert json.loads((run_dir / "summary.json").read_text())["eval_reward_after_step"] == steps
    assert processes_of(run_dir) == []


def test_the_plan_gives_the_trainer_restarts_where_they_work_and_refuses_them_elsewhere(manifests: Path):
    def trainer_restart(*sets: str) -> dict:
        (spec,) = [p for p in plan_json(manifests / "reverse-text.yaml", sets, design=False)["processes"]
                   if p["role"] == "trainer"]
        return spec["restart"]

    assert trainer_restart() == {"policy": "on-failure", "max_restarts": 3}
    assert trainer_restart("trainer.max_restarts=0") == {"policy": "never", "max_restarts": 0}
    assert trainer_restart("weight_sync.mode=broadcast") == {"policy": "on-failure", "max_restarts": 3}
    assert trainer_restart("weight_sync.mode=broadcast", "trainer.max_restarts=2") == {"policy": "on-failure",
                                                                                        "max_restarts": 2}
    assert trainer_restart("target.kind=kubernetes") == {"policy": "never", "max_restarts": 0}
    refused = subprocess.run(
        [sys.executable, "-m", "primebuild.cli", "plan", str(manifests / "reverse-text.yaml"),
         "--set", "target.kind=kubernetes", "--set", "trainer.max_restarts=2"],
        capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "trainer.max_restarts" in refused.stderr and "Kubernetes" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_trainer_that_reported_its_own_error_is_not_restarted(tmp_path: Path):
    """config_main's `error:` line (bad input, a non-finite step) would come again from the same checkpoint
    and batches; a crash or a kill prints none. Only lines since the last start count."""
    log = tmp_path / "trainer.log"
    log.write_text("--- start 2026-12-05T06:00:00 (restart 0) ---\n[rank0]: error: step 4: the loss is not finite\n"
                   "--- start 2026-12-05T06:01:00 (restart 1) ---\nTraceback (most recent call last):\n"
                   "RuntimeError: Connection reset by peer\n")
    assert not _reported_an_error(log)
    log.write_text(log.read_text() + "error: step 4: the loss is not finite\n")
    assert _reported_an_error(log)
