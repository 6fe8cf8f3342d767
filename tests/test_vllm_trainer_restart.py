"""Trainer-only restart beside a vLLM server (the embedded engine's cases are tests/test_trainer_restart.py,
whose helpers this uses): apart from them so that only this test joins the serial `vllm` group
(tests/parallel_groups.py) and the others run beside it.

Faults are real: the trainer rank of a real run is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from cluster_helpers import processes_of
from conftest import free_port, sft_workspace
from test_hang_watchdog import _pids
from test_run_local import _wait_for_trained
from test_trainer_restart import _assert_retrained_identically, _start
from vllm_helpers import vllm_python

from primebuild.runtime.metrics import read_metrics


@pytest.fixture(scope="module")
def manifests(tmp_path_factory, short_sft_store) -> Path:
    return sft_workspace(tmp_path_factory.mktemp("restart-vllm"), ("reverse-text.yaml", "reverse-text-vllm.yaml"),
                         seed_store=short_sft_store)


@pytest.mark.vllm
@pytest.mark.timeout(1200)  # a vLLM start costs minutes on a loaded 2-core machine
def test_a_killed_trainer_restarts_beside_the_vllm_server_it_keeps(manifests: Path, tmp_path: Path):
    """The same with vLLM serving, under broadcast weight sync (glm5's pairing; the filesystem mode's restart
    is the embedded test's above, and a vLLM start is the costly part): the trainer's rank 0 hosted the
    weight group's store and died with it. The vLLM server process is never restarted: its worker
    reconnects to the restarted sender, registers with the step it holds, and loads every step after it;
    every step trains once in the record, with identical values."""
    vllm_python()
    runs = tmp_path / "runs"
    steps = 7
    proc = _start(manifests, runs, "--set", f"orchestrator.max_steps={steps}", "--set", "orchestrator.eval_every=0",
                  "--set", "weight_sync.mode=broadcast", "--set", f"weight_sync.port={free_port()}",
                  manifest="reverse-text-vllm.yaml")
    try:
        run_dir = _wait_for_trained(runs, 4, proc, timeout=900)
        servers = sorted(_pids(run_dir, "inference-0"))  # the API server and its EngineCore
        (trainer,) = _pids(run_dir, "trainer")
        os.kill(trainer, signal.SIGKILL)
        killed = time.monotonic()
        trained_before = max(read_metrics(run_dir / "metrics.jsonl", role="trainer"))
        _wait_for_trained(runs, trained_before + 1, proc, timeout=600)
        recovered = time.monotonic() - killed
        assert sorted(_pids(run_dir, "inference-0")) == servers
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"vLLM run (broadcast): trainer SIGKILLed after step {trained_before} -> step {trained_before + 1} trained "
          f"{recovered:.1f} s later (load average {os.getloadavg()[0]:.1f})")
    assert proc.returncode == 0, out
    assert "restarting the trainer (1/3)" in out, out
    _assert_retrained_identically(run_dir, steps, [trained_before])
    log = (run_dir / "logs" / "inference-0.log").read_text()
    assert "(restart 1)" not in log
    assert "rejoined the weight sender of epoch" in log, log[-3000:]  # (the worker's lines: broadcast_engine.py)
    after = log.split("rejoined the weight sender of epoch")[1]
    held = int(after.split("holding step ")[1].split()[0])
    loaded = [int(line.split("weights of step ")[1].split()[0]) for line in after.splitlines()
              if "loaded the weights of step" in line]
    # the server serves the restarted trainer's steps: each one after the step it held, up to the last
    assert loaded == list(range(held + 1, steps + 1)), (held, loaded, log[-3000:])
    assert json.loads((run_dir / "summary.json").read_text())["eval_reward_after_step"] == steps
    assert processes_of(run_dir) == []
