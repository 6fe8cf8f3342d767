"""`primebuild run` end to end on the local target: real processes, a real store, tiny step counts.

Every test runs the same path as the README's main job (SFT derivation in the store, embedded inference
server, trainer, orchestrator, supervisor), shrunk with `--set` so that a run takes seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cluster_helpers import processes_of
from conftest import free_port, sft_workspace

REPO = Path(__file__).resolve().parents[1]
SMALL_RL = ["--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40"]


def _small(*args: str) -> list[str]:
    """Shrunk RL settings on a port nobody else on this machine holds."""
    return [*SMALL_RL, "--set", f"inference.port={free_port()}", *args]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, short_sft_store) -> Path:
    """A copy of the reverse-text manifests with a short SFT, and a private store that already holds it."""
    root = tmp_path_factory.mktemp("run")
    sft_workspace(root, ("reverse-text.yaml", "reverse-text-pd.yaml"), seed_store=short_sft_store)
    return root


def _env(workspace: Path) -> dict:
    return {**os.environ, "PRIMEBUILD_STORE": str(workspace / "store"), "PYTHONUNBUFFERED": "1"}


def _run(workspace: Path, runs: Path, *args: str, manifest: str = "reverse-text.yaml") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "primebuild.cli", "run", str(workspace / "manifests" / manifest),
         "--runs-dir", str(runs), "--quiet", *_small(*args)],
        capture_output=True, text=True, env=_env(workspace), timeout=280)


def _as_in_a_terminal() -> None:
    # Ctrl-C reaches a foreground command; a suite started in the background (`ci &`) hands its children
    # SIGINT ignored, and Python then never raises KeyboardInterrupt: the interrupt test ran to the end.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(workspace: Path, runs: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "primebuild.cli", "run", str(workspace / "manifests" / "reverse-text.yaml"),
         "--runs-dir", str(runs), "--quiet", *_small(*args)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(workspace),
        preexec_fn=_as_in_a_terminal)


def _run_dir(runs: Path) -> Path:
    (found,) = [p for p in runs.iterdir() if p.is_dir()]
    return found


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _trained_steps(run_dir: Path) -> list[int]:
    return sorted(r["step"] for r in _metrics(run_dir) if r["role"] == "trainer" and r["name"] == "loss")


def _wait_until(ready, what: str, proc: subprocess.Popen, runs: Path, timeout: float = 200):
    """`ready()`'s first true answer, polled while the run `proc` (its runs under `runs`) lives."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, (proc.stdout.read() if proc.stdout else "") + _logs(runs)
        found = ready()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout} s\n" + _logs(runs))


def _wait_for_trained(run_dir_parent: Path, step: int, proc: subprocess.Popen, timeout: float = 200) -> Path:
    def trained() -> Path | None:
        dirs = [p for p in run_dir_parent.iterdir() if p.is_dir()] if run_dir_parent.exists() else []
        if dirs and (dirs[0] / "metrics.jsonl").exists() and step in _trained_steps(dirs[0]):
            return dirs[0]
        return None

    return _wait_until(trained, f"step {step} was not trained", proc, run_dir_parent, timeout)


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen, runs: Path, timeout: float = 200) -> None:
    _wait_until(lambda: path.exists() and text in path.read_text(), f"{text!r} not in {path}", proc, runs, timeout)


@pytest.fixture(scope="module")
def three_synchronous_steps(workspace: Path, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One 3-step run with max_off_policy_steps 0, for the two tests below that read it (a launch costs
    ~8 s; the asynchronous default runs in the tests further down)."""
    runs = tmp_path_factory.mktemp("three-steps") / "runs"
    result = _run(workspace, runs, "--set", "orchestrator.max_steps=3", "--set", "orchestrator.max_off_policy_steps=0")
    return result, runs


def test_run_completes_with_summary_report_and_records(three_synchronous_steps):
    result, runs = three_synchronous_steps
    assert result.returncode == 0, result.stdout + result.stderr + _logs(runs)
    assert "Traceback" not in result.stdout + result.stderr
    run_dir = _run_dir(runs)
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("eval_reward_before", "eval_reward_after", "wall_seconds", "mismatch_kl_max"):
        assert key in summary, summary
    assert 0.0 <= summary["eval_reward_before"] <= 1.0 and 0.0 <= summary["eval_reward_after"] <= 1.0
    assert summary["eval_reward_after_step"] == 3
    assert _trained_steps(run_dir) == [1, 2, 3]
    rollouts = sorted(p.name for p in (run_dir / "rollouts").iterdir())
    assert rollouts == ["step_000001.safetensors", "step_000002.safetensors", "step_000003.safetensors"]
    assert (run_dir / "weights" / "step_000003" / "STABLE").exists()
    assert (run_dir / "report.png").stat().st_size > 1000
    # the run records exactly what ran
    plan = json.loads((run_dir / "plan.json").read_text())
    record = json.loads((run_dir / "run.json").read_text())
    assert record["plan_hash"] == plan["plan_hash"]
    assert (run_dir / "manifests" / "reverse-text.yaml").exists()
    for name in ("inference-0", "trainer", "orchestrator"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    # status, logs and stop read and write the run folder only
    status = subprocess.run([sys.executable, "-m", "primebuild.cli", "status", str(run_dir), "-o", "json"],
                            capture_output=True, text=True, timeout=60)
    state = json.loads(status.stdout)
    assert state["steps_trained"] == 3 and state["outcome"] == "run complete"
    newest = subprocess.run([sys.executable, "-m", "primebuild.cli", "status", "-o", "json"],  # no RUN_DIR
                            capture_output=True, text=True, timeout=60, cwd=runs.parent)  # ./runs/ is there
    assert json.loads(newest.stdout)["run_dir"] == str(run_dir)
    logs = subprocess.run([sys.executable, "-m", "primebuild.cli", "logs", "--process", "trainer", "-n", "50",
                           "--runs-dir", str(runs)], capture_output=True, text=True, timeout=60)
    assert logs.returncode == 0 and "step 3 loss" in logs.stdout
    missing = subprocess.run([sys.executable, "-m", "primebuild.cli", "logs", str(run_dir), "-p", "nope"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "processes: inference-0, orchestrator, trainer" in missing.stderr
    stop = subprocess.run([sys.executable, "-m", "primebuild.cli", "stop", str(run_dir)],
                          capture_output=True, text=True, timeout=60)  # a finished run: nothing to stop, no STOP
    assert stop.returncode == 0 and "has already ended (run complete)" in stop.stdout, stop.stdout + stop.stderr
    assert not (run_dir / "STOP").exists()
    # nothing secret lands in the run folder: the admin token lives only in the processes' environment
    everything = "".join(p.read_text(errors="ignore") for p in run_dir.rglob("*") if p.is_file()
                         and p.suffix in {".json", ".log", ".jsonl"})
    assert "Bearer" not in everything and "PRIMEBUILD_ADMIN_TOKEN=" not in everything


def test_a_default_run_shows_about_one_line_per_step_and_keeps_its_folder_small(workspace: Path, tmp_path: Path):
    """No --quiet: progress lines, the held-out evals and the summary; access logs and per-request lines
    only in logs/. Retention keeps the newest weight folders (the orchestrator retires older ones)."""
    runs = tmp_path / "runs"
    steps = 60
    result = subprocess.run(
        [sys.executable, "-m", "primebuild.cli", "run", str(workspace / "manifests" / "reverse-text.yaml"),
         "--runs-dir", str(runs), *_small("--set", f"orchestrator.max_steps={steps}")],
        capture_output=True, text=True, env=_env(workspace), timeout=280)
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 0, "\n".join(lines) + _logs(runs)
    assert len(lines) <= 1.2 * steps, "\n".join(lines)
    assert sum(line.startswith("step ") for line in lines) == steps
    assert not any("POST /v1/completions" in line for line in lines)
    run_dir = _run_dir(runs)
    assert "POST /v1/completions" in (run_dir / "logs" / "inference-0.log").read_text()  # kept in logs/
    weights = sorted(p.name for p in (run_dir / "weights").iterdir() if not p.name.startswith("."))
    assert weights == [f"step_{s:06d}" for s in range(steps - 2, steps + 1)]  # keep_weights: 3


def test_store_reuses_the_sft_model(workspace: Path, tmp_path: Path):
    """The SFT derivation built by the first run (or built now) is a cache hit the second time."""
    sft = workspace / "manifests" / "reverse-text-sft.yaml"
    first = subprocess.run([sys.executable, "-m", "primebuild.cli", "run", str(sft)], capture_output=True,
                           text=True, env=_env(workspace), timeout=200)
    assert first.returncode == 0, first.stderr
    started = time.monotonic()
    second = subprocess.run([sys.executable, "-m", "primebuild.cli", "run", str(sft)], capture_output=True,
                            text=True, env=_env(workspace), timeout=60)
    assert second.returncode == 0, second.stderr
    assert "cache hit" in second.stdout
    print(f"cache hit as a whole process: {time.monotonic() - started:.2f} s")
    entry = second.stdout.split(": ", 1)[1].split(" ", 1)[0]
    assert entry in first.stdout  # the same store entry


def test_synchronous_fp32_mismatch_kl_is_tiny(three_synchronous_steps):
    """With max_off_policy_steps 0 the trainer scores exactly the weights that sampled: KL ~ 0."""
    result, runs = three_synchronous_steps
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = _run_dir(runs)
    kls = [r["value"] for r in _metrics(run_dir) if r["role"] == "trainer" and r["name"] == "mismatch_kl"]
    lags = [r["value"] for r in _metrics(run_dir) if r["role"] == "trainer" and r["name"] == "async_lag_max"]
    assert len(kls) == 3 and all(abs(k) < 1e-3 for k in kls), kls
    assert lags == [0, 0, 0]


def test_asynchronous_broadcast_reaches_the_last_step(workspace: Path, tmp_path: Path):
    """Broadcast with the orchestrator two steps ahead: it writes the last batch while the trainer still has
    steps to send, and each send waits until every server loaded the step before it. Waiting for the last
    step must load the ones announced meanwhile; it once waited for step 4 while the trainer waited for
    step 3 to be loaded, until the sender's 600 s timeout."""
    runs = tmp_path / "runs"
    result = _run(workspace, runs, "--set", "orchestrator.max_steps=4", "--set", "weight_sync.mode=broadcast",
                  "--set", "orchestrator.max_off_policy_steps=2", "--set", f"weight_sync.port={free_port()}")
    assert result.returncode == 0, result.stdout + result.stderr + _logs(runs)
    run_dir = _run_dir(runs)
    server_log = (run_dir / "logs" / "inference-0.log").read_text()
    assert "loaded the weights of step 4 from the broadcast" in server_log
    assert json.loads((run_dir / "summary.json").read_text())["eval_reward_after_step"] == 4
    assert _trained_steps(run_dir) == [1, 2, 3, 4]


def test_prefill_decode_split_with_a_context_parallel_trainer_and_broadcast_weights(workspace: Path, tmp_path: Path):
    """reverse-text-pd.yaml (prefill server -> KV over ZMQ -> decode server, a router in front) with a
    2-rank cp=2 trainer, synchronous, the weights sent by broadcast (no step folders) in 0.1 MiB buckets
    (the model, ~2 MB, in many) and as deltas, to both servers: the trainer, scoring each sequence split
    over two ranks, gives the log-probs the decode server reported on shipped KV caches (mismatch KL at
    float noise), which it can only if both servers loaded exactly the weights it trained."""
    runs = tmp_path / "runs"
    result = _run(workspace, runs, "--set", "orchestrator.max_steps=3", "--set", "orchestrator.max_off_policy_steps=0",
                  "--set", "trainer.ranks=2", "--set", "trainer.cp=2", "--set", "weight_sync.mode=broadcast",
                  "--set", "weight_sync.bucket_mb=0.1", "--set", "weight_sync.delta=true",
                  "--set", f"weight_sync.port={free_port()}", manifest="reverse-text-pd.yaml")
    assert result.returncode == 0, result.stdout + result.stderr + _logs(runs)
    run_dir = _run_dir(runs)
    names = {p["name"] for p in json.loads((run_dir / "plan.json").read_text())["processes"]}
    assert {"prefill-0", "decode-0", "router", "trainer", "orchestrator"} <= names
    kls = [r["value"] for r in _metrics(run_dir) if r["role"] == "trainer" and r["name"] == "mismatch_kl"]
    assert len(kls) == 3 and all(abs(k) < 1e-6 for k in kls), kls
    router_log = (run_dir / "logs" / "router.log").read_text()
    assert router_log.count("POST /v1/completions") >= 3 * 4  # every sample went through the router
    assert "prefilling it here" not in (run_dir / "logs" / "decode-0.log").read_text()  # no KV was stale
    assert not (run_dir / "weights").exists()
    for server in ("prefill-0", "decode-0"):
        assert "loaded the weights of step 3 from the broadcast" in (run_dir / "logs" / f"{server}.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["eval_reward_after_step"] == 3


@pytest.mark.timeout(600)  # two sessions and a server restart: minutes on a loaded 2-core machine
def test_killed_inference_is_restarted_then_interrupt_checkpoints_and_resume_continues_the_steps(
        workspace: Path, tmp_path: Path):
    """Two ends of a run in one (a run start costs more CPU than its steps): the inference server killed
    after step 2 is restarted and no step is lost; Ctrl-C after step 4 checkpoints and stops; `--resume`
    trains the rest of the step sequence."""
    steps = 30
    runs = tmp_path / "runs"
    # steps take ~0.2 s on a quiet machine: enough of them that the Ctrl-C lands mid-run
    proc = _start(workspace, runs, "--set", f"orchestrator.max_steps={steps}")
    try:
        run_dir = _wait_for_trained(runs, 2, proc)
        victim = _pid_of(run_dir, "primebuild.runtime.inference.server")
        os.kill(victim, signal.SIGKILL)
        # the restart before the Ctrl-C: the trainer can train the rollouts sampled before the kill faster
        # than the supervisor's next look, and a server that dies after a stop is asked for is not restarted
        _wait_for_text(run_dir / "logs" / "inference-0.log", "(restart 1)", proc, runs)
        # the replacement killed while it starts: one more restart of the policy's three, not the run's end
        replacement = _wait_for_pid(run_dir, "primebuild.runtime.inference.server", victim)
        os.kill(replacement, signal.SIGKILL)
        _wait_for_text(run_dir / "logs" / "inference-0.log", "(restart 2)", proc, runs)
        _wait_for_trained(runs, max(4, _trained_steps(run_dir)[-1] + 1), proc)
        # the run holds the store entry its servers load: `store gc` keeps it (it removed it, and a
        # restarted server then found no model)
        model = Path(json.loads((run_dir / "rendezvous.json").read_text())["model_path"])
        gc = subprocess.run([sys.executable, "-m", "primebuild.cli", "store", "--store", str(model.parent), "gc",
                             "--all", "--dry-run", "-o", "json"], capture_output=True, text=True, timeout=120)
        assert gc.returncode == 0 and model.name in json.loads(gc.stdout)["in_use"], gc.stdout + gc.stderr
        proc.send_signal(signal.SIGINT)  # what Ctrl-C does
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + _logs(runs)  # a requested stop is a normal end
    assert "restarting (2/3)" in out and "restart 2" in (run_dir / "logs" / "inference-0.log").read_text(), out
    assert "stopped at step" in out and "--resume" in out and "error" not in out
    assert json.loads((runs.iterdir().__next__() / "summary.json").read_text())["eval_reward_before"] >= 0
    done = _trained_steps(run_dir)
    assert done and done == list(range(1, len(done) + 1)) and 4 <= len(done) < steps  # each step exactly once
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if (p / "STABLE").exists())
    assert checkpoints and checkpoints[-1] == f"step_{done[-1]:06d}"

    resumed = subprocess.run([sys.executable, "-m", "primebuild.cli", "run", "--resume", str(run_dir), "--quiet"],
                             capture_output=True, text=True, env=_env(workspace), timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + _logs(runs)
    assert _trained_steps(run_dir) == list(range(1, steps + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_reward_after_step"] == steps and "eval_reward_before" in summary


def test_resume_past_a_damaged_checkpoint_evaluates_the_weights_it_trained_last(workspace: Path, tmp_path: Path):
    """The final eval of a resumed run scores the weights of the last step trained in *this* session, not
    the weights the previous session had published past the checkpoint the run falls back to."""
    runs = tmp_path / "runs"
    first = _run(workspace, runs, "--set", "orchestrator.max_steps=4", "--set", "trainer.checkpoint_every=2")
    assert first.returncode == 0, first.stdout + first.stderr + _logs(runs)
    run_dir = _run_dir(runs)
    shard = sorted((run_dir / "checkpoints" / "step_000004").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    resumed = subprocess.run([sys.executable, "-m", "primebuild.cli", "run", "--resume", str(run_dir), "--quiet"],
                             capture_output=True, text=True, env=_env(workspace), timeout=240)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out + _logs(runs)
    assert "skipping step_000004" in out and "sha256 differs" in out and "Traceback" not in out
    assert "resuming" in out and "after step 2" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_reward_after_step"] == 4
    rows = _metrics(run_dir)
    trained = [i for i, r in enumerate(rows) if r["role"] == "trainer" and r["name"] == "loss" and r["step"] == 4]
    evals = [i for i, r in enumerate(rows) if r["name"] == "eval_reward" and r["step"] == 4]
    assert len(trained) == 2 and evals[-1] > trained[-1]  # step 4 retrained, then evaluated


def test_a_port_held_by_another_program_is_refused_before_anything_starts(workspace: Path, tmp_path: Path):
    runs = tmp_path / "runs"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _run(workspace, runs, "--set", "orchestrator.max_steps=1", "--set", f"inference.port={port}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"port(s) already in use: {port}" in result.stderr and "Traceback" not in result.stderr


def test_a_crashing_trainer_stops_the_run_with_a_clear_message(workspace: Path, tmp_path: Path):
    """Fail fast: input the trainer cannot use is refused or named before any restart is tried."""
    runs = tmp_path / "runs"
    result = _run(workspace, runs, "--set", "orchestrator.max_steps=2",
                  "--set", "trainer.micro_batch_tokens=1")
    # micro_batch_tokens=1 is refused by the planner before anything starts: a clean exit 2
    assert result.returncode == 2, result.stdout + result.stderr
    assert "micro_batch_tokens" in result.stderr and "Traceback" not in result.stderr
    assert not runs.exists() or not any(runs.iterdir())  # nothing half-written

    bad_model = workspace / "broken-model"
    bad_model.mkdir(exist_ok=True)
    (bad_model / "config.json").write_text("{}")
    broken = workspace / "manifests" / "broken.yaml"
    doc = yaml.safe_load((workspace / "manifests" / "reverse-text.yaml").read_text())
    doc["model"] = {"path": str(bad_model), "facts": "models/reverse-text-tiny.json", "dtype": "float32"}
    broken.write_text(yaml.safe_dump(doc))
    result = subprocess.run([sys.executable, "-m", "primebuild.cli", "run", str(broken), "--runs-dir", str(runs),
                             "--quiet", *_small()], capture_output=True, text=True, env=_env(workspace), timeout=120)
    assert result.returncode != 0
    assert "inference-0" in result.stderr and "logs" in result.stderr


def _logs(runs: Path) -> str:
    """The tail of every process log of every run under `runs`, for assertion messages."""
    out = []
    for log in sorted(runs.glob("*/logs/*.log")) if runs.exists() else []:
        out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="ignore").splitlines()[-15:]))
    return "\n".join(out)


def _wait_for_pid(run_dir: Path, needle: str, other_than: int, timeout: float = 60) -> int:
    """_pid_of a process started anew (not `other_than`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = _pid_of(run_dir, needle)
            if pid != other_than:
                return pid
        except AssertionError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"no new process {needle} for {run_dir} within {timeout:g} s")


def _pid_of(run_dir: Path, needle: str) -> int:
    """The process whose command line contains `needle` and whose environment names this run folder."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (entry / "environ").read_bytes().decode(errors="ignore")
        except OSError:
            continue
        if needle in cmdline and f"PRIMEBUILD_RUN_DIR={run_dir}" in environ:
            return int(entry.name)
    raise AssertionError(f"no process {needle} for {run_dir}")


def test_a_killed_orchestrator_ends_the_run_within_30_s_naming_it_and_resume_loses_no_step(
        workspace: Path, tmp_path: Path):
    """Fail fast: the orchestrator has no restart policy. Its death stops every other process within
    30 s, the run exits non-zero, failure.json names it with its exit status and last log lines, and the
    trainer has checkpointed the step it finished, so --resume trains each step exactly once."""
    runs = tmp_path / "runs"
    proc = _start(workspace, runs, "--set", "orchestrator.max_steps=12")
    try:
        run_dir = _wait_for_trained(runs, 2, proc)
        os.kill(_pid_of(run_dir, "primebuild.runtime.orchestrator.main"), signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"local: orchestrator SIGKILLed -> run over in {ended:.1f} s")
    assert proc.returncode != 0 and ended < 30, out
    assert "orchestrator (orchestrator) was killed by SIGKILL" in out, out
    failure = json.loads((run_dir / "failure.json").read_text())
    assert (failure["process"], failure["signal"], failure["exit_code"]) == ("orchestrator", "SIGKILL", -9)
    assert failure["log_tail"] and failure["log"].endswith("orchestrator.log")
    assert processes_of(run_dir) == []
    done = _trained_steps(run_dir)
    assert done == list(range(1, len(done) + 1)) and len(done) < 12  # batches written ahead may still train

    resumed = subprocess.run([sys.executable, "-m", "primebuild.cli", "run", "--resume", str(run_dir), "--quiet"],
                             capture_output=True, text=True, env=_env(workspace), timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + _logs(runs)
    assert _trained_steps(run_dir) == list(range(1, 13))
    assert not (run_dir / "failure.json").exists()  # the resumed session ended well


def test_sigkill_of_primebuild_run_leaves_no_process_behind(workspace: Path, tmp_path: Path):
    """`kill -9` of `primebuild run`: its watchdog and the workers' PR_SET_PDEATHSIG end the rest."""
    runs = tmp_path / "runs"
    proc = _start(workspace, runs, "--set", "orchestrator.max_steps=200")
    try:
        run_dir = _wait_for_trained(runs, 1, proc)
        assert len(processes_of(run_dir)) >= 3
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        killed = time.monotonic()
        deadline = killed + 30
        while processes_of(run_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = processes_of(run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"local: `primebuild run` SIGKILLed -> nothing of the run left after {time.monotonic() - killed:.1f} s")
    assert left == [], left
