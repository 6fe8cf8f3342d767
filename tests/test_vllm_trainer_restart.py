"""Trainer-only restart beside a vLLM server (the embedded engine's cases are tests/test_trainer_restart.py,
whose helpers this uses): apart from them so that only this test joins the serial `vllm` group
(tests/parallel_groups.py) and the others run beside it.

Faults are real: the trainer of a real run is SIGKILLed inside a weight send.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
from cluster_helpers import processes_of
from conftest import free_port, sft_workspace
from test_hang_watchdog import _pids
from test_run_local import _wait_for_trained
from test_trainer_restart import (
    _assert_retrained_identically,
    _start,
    assert_completions_refused_as_mixed,
    kill_inside_a_send,
)
from vllm_helpers import vllm_python

from primebuild.runtime.weight_sync.broadcast import STALL_ENV


@pytest.fixture(scope="module")
def manifests(tmp_path_factory, short_sft_store) -> Path:
    return sft_workspace(tmp_path_factory.mktemp("restart-vllm"), ("reverse-text.yaml", "reverse-text-vllm.yaml"),
                         seed_store=short_sft_store)


@pytest.mark.vllm
@pytest.mark.timeout(1200)  # a vLLM start costs minutes on a loaded 2-core machine
def test_a_trainer_killed_inside_a_vllm_load_restarts_beside_the_server_it_keeps(manifests: Path, tmp_path: Path):
    """The same with vLLM serving, under broadcast weight sync (glm5's pairing; the filesystem mode's restart
    is tests/test_trainer_restart.py's, and a vLLM start is the costly part), in the hardest window: the trainer's
    sender is SIGKILLed half-way through a step's buckets (STALL_ENV), so vLLM's worker has part of that step
    installed. The vLLM server is never restarted (API server and EngineCore keep their pids): the worker
    finishes the reload without raising (a failed worker RPC would kill the engine) and marks its weights
    mixed; meanwhile /weight_info and /health say weights_mixed, completions answer 503 and none is answered
    200 until a whole update. The worker registers with the restarted sender holding its last whole step,
    whose first send (whole) mends it, then loads every later step; every step trains once in the record,
    retrained identically."""
    vllm_python()
    runs = tmp_path / "runs"
    steps = 7
    stall = tmp_path / "stall-the-send"
    # 50 kB buckets: the model's layers cross in several, so a send has a half-way point
    proc = _start(manifests, runs, "--set", f"orchestrator.max_steps={steps}", "--set", "orchestrator.eval_every=0",
                  "--set", "weight_sync.mode=broadcast", "--set", f"weight_sync.port={free_port()}",
                  "--set", "weight_sync.bucket_mb=0.05", manifest="reverse-text-vllm.yaml", env={STALL_ENV: str(stall)})
    try:
        run_dir = _wait_for_trained(runs, 4, proc, timeout=900)
        servers = sorted(_pids(run_dir, "inference-0"))  # the API server and its EngineCore
        (trainer,) = _pids(run_dir, "trainer")
        served = json.loads((run_dir / "config" / "orchestrator.json").read_text())
        url = served["endpoints"][0].removesuffix("/v1")
        stalled, kills = kill_inside_a_send(run_dir, proc, stall, trainer, settle_s=5.0)
        killed = time.monotonic()
        deadline = time.monotonic() + 120
        while (info := httpx.get(url + "/weight_info", timeout=30).json()).get("status") != "weights_mixed":
            assert time.monotonic() < deadline, info
            time.sleep(0.1)
        assert info["weight_version"] == str(stalled - 1), (info, stalled)  # the last whole step, not a new label
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "weights_mixed", health.text  # up
        assert_completions_refused_as_mixed(url, served["served_model_name"])
        _wait_for_trained(runs, kills[0] + 1, proc, timeout=600)
        recovered = time.monotonic() - killed
        assert sorted(_pids(run_dir, "inference-0")) == servers
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"vLLM run (broadcast): trainer SIGKILLed inside the send of step {stalled} (after step {kills[0]} trained)"
          f" -> step {kills[0] + 1} trained {recovered:.1f} s later (load average {os.getloadavg()[0]:.1f})")
    assert proc.returncode == 0, out
    assert "restarting the trainer (1/3)" in out, out
    _assert_retrained_identically(run_dir, steps, kills)
    log = (run_dir / "logs" / "inference-0.log").read_text()
    assert "(restart 1)" not in log
    # from the worker's line (broadcast_engine.py; the API server's guard, weights_mixed_guard.py, follows)
    mixed = log.split("the served weights are a mix of two policies (", 1)[1]
    installed = int(mixed.split("stopped after ")[1].split()[0])
    assert installed >= 1, mixed[:300]
    while_mixed, mended = mixed.split(" are whole: serving again", 1)
    whole = int(while_mixed.rsplit("the weights of step ", 1)[1].split()[0])
    assert stalled <= whole <= steps, (whole, stalled)  # the restarted trainer's first send (whole), no earlier step
    # nothing answered from the mix: the server stayed paused and refused new requests with 503
    assert '"POST /v1/completions HTTP/1.1" 200' not in while_mixed, while_mixed[-3000:]
    assert '"POST /v1/completions HTTP/1.1" 503' in while_mixed, while_mixed[-3000:]
    assert "rejoined the weight sender of epoch" in while_mixed, while_mixed[-3000:]
    held = int(while_mixed.split("rejoined the weight sender of epoch")[1].split("holding step ")[1].split()[0])
    assert held == stalled - 1, (held, stalled)  # its last whole step, not the mixed one
    loaded = [int(line.split("weights of step ")[1].split()[0]) for line in mended.splitlines()
              if "loaded the weights of step" in line]
    # the server serves the restarted trainer's steps: each one after the whole send, up to the last
    assert loaded == list(range(whole + 1, steps + 1)), (whole, loaded, log[-3000:])
    orchestrator_log = (run_dir / "logs" / "orchestrator.log").read_text()
    assert "the served weights are a mix of two policies" in orchestrator_log, orchestrator_log[-3000:]  # not counted
    assert json.loads((run_dir / "summary.json").read_text())["eval_reward_after_step"] == steps
    assert processes_of(run_dir) == []
