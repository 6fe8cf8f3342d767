"""The elastic inference pool, end to end on the local target (real processes, the embedded engine):
a killed replica degrades the run instead of ending it, and `primebuild scale` adds and retires a
replica mid-run (primebuild/runtime/elastic.py, primebuild/runtime/orchestrator/servers.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_run_local
from conftest import free_port
from test_run_local import _env, _logs, _start, _trained_steps, _wait_for_trained

workspace = test_run_local.workspace  # the same fixture: reverse-text manifests with a short SFT, a private store

pytestmark = pytest.mark.timeout(900)  # the first run builds the SFT model; the machine is shared
FIRST_STEPS_S = 600


def _pool_state(run_dir: Path) -> dict:
    path = run_dir / "inference_pool_state.json"
    return json.loads(path.read_text())["servers"] if path.is_file() else {}


def _url_of(run_dir: Path, name: str) -> str:
    """Its URL as the orchestrator spells it: from the supervisor's pool list where scale is built (it holds
    added replicas too), else from the plan."""
    pool = run_dir / "inference_pool.json"
    if pool.is_file():
        (url,) = [s["url"] for s in json.loads(pool.read_text())["servers"] if s["name"] == name]
        return url
    plan = json.loads((run_dir / "plan.json").read_text())
    (port,) = [p["ports"]["http"] for p in plan["processes"] if p["name"] == name]
    return f"http://127.0.0.1:{port}/v1"


def _wait_until(proc: subprocess.Popen, runs: Path, what: str, check, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, f"the run ended before {what}: " + _logs(runs)
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}\n" + _logs(runs)
        time.sleep(0.2)


def _stop_and_wait(proc: subprocess.Popen, run_dir: Path, workspace: Path) -> str:
    """`primebuild stop`: the run ends normally after the step it is on (the runs are long enough that the
    pool changes happen while they go, however loaded the machine is)."""
    stop = subprocess.run([sys.executable, "-m", "primebuild.cli", "stop", str(run_dir)], capture_output=True,
                          text=True, env=_env(workspace), timeout=200)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    out, _ = proc.communicate(timeout=200)
    return out


def _assert_each_step_trained_once(run_dir: Path) -> int:
    steps = _trained_steps(run_dir)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3, steps
    return len(steps)


def _scale(run_dir: Path, delta: str, workspace: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primebuild.cli", "scale", str(run_dir), "--inference", delta],
                          capture_output=True, text=True, env=_env(workspace), timeout=200)


@pytest.mark.parametrize("sync", ["filesystem", "broadcast"])
def test_a_killed_replica_is_restarted_then_scale_adds_one_and_retires_two(workspace: Path, tmp_path: Path,
                                                                             sync: str):
    """One run of two replicas, the pool changed four times (a run start costs more CPU than its steps, so
    the four changes share one):
    1. inference-1 is killed: the run degrades to inference-0 instead of ending, and the restarted
       inference-1 takes requests again on the current weights, not the base model it restarted on;
    2. `scale +1` adds inference-2, which joins mid-run at the current weights;
    3. `scale -1` twice retires the newest replicas (inference-2, then the planned inference-1), each drained;
    4. a third `scale -1` is refused: the run keeps one server.
    Under broadcast the trainer leaves the dead replica out of its weight group (a new generation,
    primebuild/runtime/weight_sync/membership.py) and admits its restart at the next update; the added one
    joins with the rank after the plan's (3), and a retired one leaves the group as it stops."""
    runs = tmp_path / "runs"
    port = ["--set", f"weight_sync.port={free_port()}"] if sync == "broadcast" else []  # a port of its own
    proc = _start(workspace, runs, "--set", "orchestrator.max_steps=100000", "--set", "inference.replicas=2",
                  "--set", f"weight_sync.mode={sync}", *port)
    try:
        run_dir = _wait_for_trained(runs, 2, proc, timeout=FIRST_STEPS_S)
        # 1. the kill
        victim = json.loads((run_dir / "pids" / "inference-1.json").read_text())["pid"]
        os.kill(victim, signal.SIGKILL)
        restarted_url = _url_of(run_dir, "inference-1")
        orchestrator_log = run_dir / "logs" / "orchestrator.log"
        _wait_until(proc, runs, "the orchestrator set inference-1 aside",
                    lambda: f"{restarted_url} is gone" in orchestrator_log.read_text())
        rejoined: dict = {}  # inference-1's pool state when it was back at work

        def back_at_work() -> bool:
            """Active again, joined at some version, and answered since it rejoined: answered_versions
            starts empty at each join (its request count does not, and the state file can lag a kill)."""
            rejoined.update(_pool_state(run_dir).get(restarted_url, {}))
            return (rejoined.get("state") == "active" and rejoined.get("joined_version") is not None
                    and bool(rejoined.get("answered_versions")))

        _wait_until(proc, runs, "the restarted inference-1 took requests again", back_at_work)
        # 2. scale +1
        added = _scale(run_dir, "+1", workspace)
        assert added.returncode == 0, added.stdout + added.stderr + _logs(runs)
        assert "added inference-2" in added.stdout
        added_url = _url_of(run_dir, "inference-2")
        _wait_until(proc, runs, "inference-2 served requests",
                    lambda: _pool_state(run_dir).get(added_url, {}).get("requests", 0) >= 4)
        joined = _pool_state(run_dir)[added_url]
        # 3. scale -1, twice; 4. the third is refused
        retired = [_scale(run_dir, "-1", workspace) for _ in range(2)]
        for answer in retired:
            assert answer.returncode == 0, answer.stdout + answer.stderr + _logs(runs)
        last = _scale(run_dir, "-1", workspace)
        if sync == "broadcast":  # both retired replicas left the weight group: the next update goes without them
            trainer_log = run_dir / "logs" / "trainer.log"
            _wait_until(proc, runs, "the trainer's next generation with inference-0 alone",
                        lambda: "receiver ranks [1]" in trainer_log.read_text().partition("receiver ranks [1, 2, 3]")[2])
        out = _stop_and_wait(proc, run_dir, workspace)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + _logs(runs)
    assert "stopped at step" in out
    _assert_each_step_trained_once(run_dir)
    # 1. restarted, and brought to the newest weights before its first request
    assert "inference-1" in out and "restarting" in out
    assert "restart 1" in (run_dir / "logs" / "inference-1.log").read_text()
    assert rejoined["joined_version"] >= 2, rejoined
    assert rejoined["answered_versions"][0] >= rejoined["joined_version"], rejoined
    # 2. it joined mid-run on the weights then current (step 2 or later), and answered with them or newer
    assert joined["joined_version"] >= 2 and joined["answered_versions"][0] >= joined["joined_version"], joined
    # 3. the newest first; each its own /metrics: the sequences it finished, read before it was stopped
    assert "retired inference-2, drained; it served " in retired[0].stdout, retired[0].stdout
    assert "retired inference-1, drained; it served " in retired[1].stdout, retired[1].stdout
    sequences = int(retired[0].stdout.split("it served ")[1].split(" sequences")[0])
    assert sequences >= joined["requests"] > 0
    # 4.
    assert last.returncode == 2 and "at least one inference server" in last.stderr
    pool = json.dumps(json.loads((run_dir / "inference_pool.json").read_text()))
    assert added_url not in pool and restarted_url not in pool
    assert "inference-2" in (run_dir / "scale" / "plan.json").read_text()
    assert "inference-2" not in (run_dir / "plan.json").read_text()  # the compiled plan stays what ran
    if sync == "broadcast":
        orchestrator = orchestrator_log.read_text()
        assert f"{restarted_url} rejoined the weight group at policy version" in orchestrator
        assert f"{added_url} rejoined the weight group at policy version" in orchestrator
        assert "weights of step" in (run_dir / "logs" / "inference-1.log").read_text()
        trainer = (run_dir / "logs" / "trainer.log").read_text()
        assert "receiver ranks [1, 2, 3]" in trainer, trainer[-3000:]  # the added one admitted: rank 3


def test_scale_is_refused_where_it_is_not_built(workspace: Path, tmp_path: Path):
    """The cluster targets: exit 2, with the reason."""
    env = _env(workspace)
    manifest = workspace / "manifests" / "reverse-text.yaml"
    for sets, target, expected in (([], "slurm", "local target only"),):
        run_dir = tmp_path / f"run-{target}-{len(sets)}"
        run_dir.mkdir()
        flags = [x for s in sets for x in ("--set", s)]
        plan = subprocess.run([sys.executable, "-m", "primebuild.cli", "plan", str(manifest), *flags, "-o", "json"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert plan.returncode == 0, plan.stderr
        (run_dir / "plan.json").write_text(plan.stdout)
        (run_dir / "launch.json").write_text(json.dumps({"target": target}))
        refused = _scale(run_dir, "+1", workspace)
        assert refused.returncode == 2 and expected in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr


def test_the_orchestrator_follows_the_supervisors_list_and_samples_only_active_servers(tmp_path: Path):
    """Without processes: joining and draining servers get no request, a drained one the list drops is
    forgotten, and a stale list from an earlier session cannot make a server active."""
    import asyncio

    from primebuild.contracts.run_dir import InferencePool, PoolServer, RunDir, write_json_atomic
    from primebuild.runtime.orchestrator.client import InferenceClient
    from primebuild.runtime.orchestrator.servers import ServerSet

    run = RunDir(tmp_path)
    a, b, c = (f"http://127.0.0.1:{port}/v1" for port in (9, 10, 11))

    def listing(urls, draining=()):
        pool = InferencePool(servers=[PoolServer(name=u[-5:], url=u) for u in urls], draining=list(draining))
        write_json_atomic(run.inference_pool, pool.model_dump(mode="json"))
        os.utime(run.inference_pool, ns=(time.time_ns(), time.time_ns()))

    async def scenario():
        servers = ServerSet([InferenceClient(a, "m"), InferenceClient(b, "m")], run,
                            lambda url: InferenceClient(url, "m"), retry_seconds=1)
        listing([a, b, c])
        servers.reconcile()
        assert {u: s.state for u, s in servers.servers.items()} == {a: "active", b: "active", c: "joining"}
        picked = {(await servers.pick()).url for _ in range(6)}
        assert picked == {a, b}  # the joining one gets nothing before it serves the current weights
        await servers.revive(3, load=None)  # nothing listens on port 11: it stays joining
        assert servers.servers[c].state == "joining"
        servers.servers[b].in_flight = 1
        listing([a, b, c], draining=[b[-5:]])
        servers.reconcile()
        servers.settle_drains()
        assert servers.servers[b].state == "draining"  # its request in flight finishes first
        assert {(await servers.pick()).url for _ in range(4)} == {a}
        servers.servers[b].in_flight = 0
        servers.settle_drains()
        listing([a])
        servers.reconcile()
        assert set(servers.servers) == {a}  # b drained and dropped, c never joined and is no longer listed
        servers.write_state()
        state = json.loads(run.inference_pool_state.read_text())["servers"]
        assert state[a]["state"] == "active"
        for s in servers.all_clients():
            await s.close()

    asyncio.run(scenario())


def test_a_sync_while_every_server_is_down_waits_instead_of_failing(tmp_path: Path):
    """Broadcast sync asks the active servers which version each received; with none active (a transient
    read error marked the only one down) there is nothing to ask: the sync leaves the served version as it
    is, and the tending loop brings the server back. It once crashed the orchestrator (min() of nothing)."""
    import asyncio

    from primebuild.contracts.run_dir import RunDir
    from primebuild.runtime.orchestrator.client import InferenceClient
    from primebuild.runtime.orchestrator.main import Orchestrator
    from primebuild.runtime.orchestrator.servers import ServerSet
    from primebuild.runtime.orchestrator.weights import BroadcastWeights

    async def scenario():
        url = "http://127.0.0.1:9/v1"  # nothing listens there
        orchestrator = Orchestrator.__new__(Orchestrator)  # only the sync's state, no tokenizer or clients
        orchestrator.servers = ServerSet([InferenceClient(url, "m")], RunDir(tmp_path),
                                         lambda u: InferenceClient(u, "m"), retry_seconds=1)
        orchestrator.weights, orchestrator.sync_lock, orchestrator.server_version = BroadcastWeights(), asyncio.Lock(), 3
        orchestrator.servers.servers[url].state = "down"
        await orchestrator.sync_servers()
        await orchestrator.sync_if_newer()
        assert orchestrator.server_version == 3
        for client in orchestrator.servers.all_clients():
            await client.close()

    asyncio.run(scenario())
