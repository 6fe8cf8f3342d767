"""The Slurm target for real: `primebuild run` submits reverse-text-slurm.yaml as a heterogeneous job to
the localhost Slurm (scripts/ci-services: slurmctld + five slurmd nodes at 127.0.0.11-15), follows it,
and status / logs / stop / --resume work on it; fault tests end it within 30 s naming the component.

The run folder of the first test sits under a path full of shell metacharacters, so the whole chain
(sbatch header, job script, srun steps, workers) runs with it for real.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from cluster_helpers import (
    NASTY,
    REPO,
    cli,
    kill_the_trainer_keeping_the_rest,
    logs_tail,
    pid_of,
    require_slurm,
    rewards,
    run_dir_of,
    start,
    trained_steps,
    wait_gone,
    wait_trained,
)
from conftest import SHIPPED_NAMES, free_port, sft_workspace
from test_trainer_restart import _assert_retrained_identically

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]
SMALL = ["--set", "orchestrator.rollouts_per_step=32", "--set", "orchestrator.eval_prompts=40"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory, full_sft_store):
    require_slurm()
    root = tmp_path_factory.mktemp("slurm")
    # RL from the default's own start (held-out ~0.77), the session's build of it (conftest full_sft_store)
    manifests = sft_workspace(root, SHIPPED_NAMES, sft_changes=None, seed_store=full_sft_store)
    env = {**os.environ, "PRIMEBUILD_STORE": str(root / "store"), "PYTHONUNBUFFERED": "1"}
    built = cli("run", manifests / "reverse-text-sft.yaml", env=env)  # the store entry every job reads
    assert built.returncode == 0 and "cache hit" in built.stdout, built.stdout + built.stderr
    return manifests, env


DONE = ("COMPLETED", "CANCELLED", "FAILED", "gone")  # ended states


def _wait_ended(job_id: str) -> str:
    """The job's state once it stays ended (CANCELLED turns COMPLETING while its nodes clean up), or as it is
    after a minute."""
    deadline, settled = time.monotonic() + 60, 0
    while settled < 4 and time.monotonic() < deadline:
        settled = settled + 1 if _job_state(job_id) in DONE else 0
        time.sleep(0.5)
    return _job_state(job_id)


def _job_state(job_id: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    fields = dict(p.split("=", 1) for p in shown.stdout.split() if "=" in p)
    return fields.get("JobState", "gone")


def test_a_het_job_runs_the_embedded_default_and_learns(ws, tmp_path: Path):
    manifests, env = ws
    runs = tmp_path / NASTY
    started = time.monotonic()
    result = cli("run", manifests / "reverse-text-slurm.yaml", "--runs-dir", runs, "--quiet",
                 "--set", "orchestrator.max_steps=40", "--set", f"inference.port={free_port()}", env=env, timeout=400)
    wall = time.monotonic() - started
    run_dir = run_dir_of(runs)
    assert result.returncode == 0, result.stdout + result.stderr + logs_tail(run_dir)
    print(f"slurm job: 40 steps, {wall:.1f} s wall (submit to end)")
    # the same run folder as a local run
    for name in ("plan.json", "run.json", "manifest.json", "rendezvous.json", "summary.json", "report.png",
                 "outcome.json", "launch.json", "job.sbatch", "orchestrator.json"):
        assert (run_dir / name).is_file(), name
    assert trained_steps(run_dir) == list(range(1, 41))
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir())[-1] == "step_000040.safetensors"
    for name in ("inference-0", "trainer", "orchestrator"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["target"] == "slurm" and _job_state(record["job_id"]) == "COMPLETED"
    # a real het job: three components on three nodes; the server bound its node's address, not loopback
    shown = subprocess.run(["scontrol", "show", "job", "-o", record["job_id"]], capture_output=True, text=True,
                           timeout=30).stdout
    assert len([line for line in shown.splitlines() if "HetJobOffset=" in line]) == 3
    rendezvous = json.loads((run_dir / "rendezvous.json").read_text())
    assert rendezvous["hosts"][0] in {f"127.0.0.{n}" for n in range(11, 16)}  # a slurmd node's own address
    server_log = re.sub(r"\x1b\[[0-9;]*m", "", (run_dir / "logs" / "inference-0.log").read_text())
    assert f"Uvicorn running on http://{rendezvous['hosts'][0]}:" in server_log
    # it learns: the rollout reward of the last 10 steps beats the first 10 (sampled at temperature 1)
    r = rewards(run_dir)
    first, last = sum(r[:10]) / 10, sum(r[-10:]) / 10
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"rollout reward {first:.3f} -> {last:.3f}; held-out {summary['eval_reward_before']:.3f} -> "
          f"{summary['eval_reward_after']:.3f}")
    assert last > first + 0.01, (first, last)
    # nothing a path smuggled in ran, anywhere
    assert not list(tmp_path.rglob("PWNED*")) and not list(run_dir.rglob("PWNED*"))
    # status / logs read the run folder and ask Slurm
    status = cli("status", run_dir, "-o", "json", env=env, timeout=60)
    state = json.loads(status.stdout)
    assert state["steps_trained"] == 40 and state["outcome"] == "run complete"
    assert state["target"].startswith(f"slurm job {record['job_id']}: COMPLETED")
    logs = cli("logs", run_dir, "--process", "trainer", "-n", "200", env=env, timeout=60)
    assert logs.returncode == 0 and "step 40 loss" in logs.stdout


def test_a_killed_component_ends_the_job_within_30_s_and_resume_loses_no_step(ws, tmp_path: Path):
    manifests, env = ws
    runs = tmp_path / "runs"
    proc = start("run", manifests / "reverse-text-slurm.yaml", "--runs-dir", runs, "--quiet", *SMALL,
                 "--set", "orchestrator.max_steps=12", "--set", f"inference.port={free_port()}", env=env)
    try:
        run_dir = wait_trained(runs, 2, proc)
        os.kill(pid_of(run_dir, "primebuild.runtime.orchestrator.main"), signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"slurm: orchestrator SIGKILLed -> job over and `primebuild run` exited in {ended:.1f} s")
    assert proc.returncode != 0 and ended < 30, (ended, out)
    assert "orchestrator" in out and "SIGKILL" in out, out
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["process"] == "orchestrator" and failure["signal"] == "SIGKILL" and failure["log_tail"]
    job = json.loads((run_dir / "launch.json").read_text())["job_id"]
    assert _job_state(job) == "FAILED"
    assert wait_gone(run_dir, 15) == []
    done = trained_steps(run_dir)
    # the orchestrator runs at most max_off_policy_steps + 1 batches ahead, and the trainer may train
    # those before the job ends: 12 steps leave room on a fast machine for --resume to have work to do
    assert done == list(range(1, len(done) + 1)) and len(done) < 12

    resumed = cli("run", "--resume", run_dir, "--quiet", env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + logs_tail(run_dir)
    assert trained_steps(run_dir) == list(range(1, 13))  # each step exactly once, across two jobs
    assert json.loads((run_dir / "launch.json").read_text())["launches"] == 2


@contextmanager
def _slurmctld_paused():
    """slurmctld stopped (SIGSTOP) for the block: every query of it times out or fails (~10 s)."""
    controller = int(subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True, text=True).stdout.split()[0])
    os.kill(controller, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(controller, signal.SIGCONT)


def _wait_printed(output: Path, text: str, proc: subprocess.Popen, seconds: float = 90) -> None:
    """Until `proc` (still running) has printed `text` into `output`."""
    deadline = time.monotonic() + seconds
    while text not in output.read_text() and time.monotonic() < deadline:
        assert proc.poll() is None, output.read_text()
        time.sleep(0.5)
    assert proc.poll() is None and text in output.read_text(), output.read_text()


def test_detached_stop_then_a_killed_follower_cancels_the_job(ws, tmp_path: Path):
    manifests, env = ws
    runs = tmp_path / "runs"
    submitted = cli("run", manifests / "reverse-text-slurm.yaml", "--runs-dir", runs, "--detach", *SMALL,
                    "--set", "orchestrator.max_steps=100000", "--set", f"inference.port={free_port()}", env=env)
    assert submitted.returncode == 0 and "submitted" in submitted.stdout, submitted.stdout + submitted.stderr
    run_dir = wait_trained(runs, 2, None)
    assert "RUNNING" in json.loads(cli("status", run_dir, "-o", "json", env=env).stdout)["target"]
    # graceful: checkpoint, then end; slurmctld does not answer as it starts, which the stop and a `logs -f`
    # of the detached run wait out, saying so (each exited 2 on the first unanswered query)
    said, logged = tmp_path / "stop.txt", tmp_path / "logs.txt"
    logs, stopping = start("logs", run_dir, "-f", "-n", "1", env=env, output=logged), None
    try:
        with _slurmctld_paused():
            stopping = start("stop", run_dir, "--grace", "60", env=env, output=said)
            _wait_printed(said, "warning: `scontrol show job", stopping)
            _wait_printed(logged, "warning: `scontrol show job", logs)
        stopping.wait(timeout=120)
        logs.wait(timeout=90)  # the job's end, with its outcome, ends the follow
    finally:
        for follower in (logs, stopping):
            if follower is not None and follower.poll() is None:
                follower.kill()
    assert stopping.returncode == 0, said.read_text()
    assert "stopped" in said.read_text().splitlines()[-1], said.read_text()
    assert logs.returncode == 0 and "the run has ended: stopped at step" in logged.read_text(), logged.read_text()
    job = json.loads((run_dir / "launch.json").read_text())["job_id"]
    assert _wait_ended(job) == "COMPLETED"  # it ended by itself, within the grace (COMPLETING a moment after
    # slurmctld's pause, while it hears from the nodes again)
    assert json.loads((run_dir / "outcome.json").read_text())["message"].startswith("stopped at step")
    done = trained_steps(run_dir)
    assert done == list(range(1, len(done) + 1))

    proc = start("run", "--resume", run_dir, "--quiet", env=env)
    try:
        deadline = time.monotonic() + 240
        while trained_steps(run_dir)[-1] <= done[-1] + 1 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)  # the follower dies: its watchdog cancels the job
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    new_job = json.loads((run_dir / "launch.json").read_text())["job_id"]
    assert new_job != job
    deadline = time.monotonic() + 30
    while _job_state(new_job) not in ("CANCELLED", "gone") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _job_state(new_job) in ("CANCELLED", "gone"), (run_dir / "logs" / "watchdog.log").read_text()
    assert wait_gone(run_dir, 30) == []

    # attached again: slurmctld stops answering for a while (SIGSTOP), which the follower rides out, saying
    # so; then Ctrl-C stops the job as `primebuild stop` does: checkpoint, end, exit 130
    _wait_ended(new_job)
    done = trained_steps(run_dir)
    printed = tmp_path / "follower.txt"  # read while it runs: the warning ends slurmctld's pause
    proc = start("run", "--resume", run_dir, "--quiet", env=env, output=printed)
    try:
        deadline = time.monotonic() + 240
        while trained_steps(run_dir)[-1] <= done[-1] and time.monotonic() < deadline:
            assert proc.poll() is None, printed.read_text()
            time.sleep(0.3)
        with _slurmctld_paused():  # scontrol times out or fails (~10 s): the job's state is unknown, not ended
            _wait_printed(printed, "warning: `scontrol show job", proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = printed.read_text()
    assert proc.returncode == 130, out
    assert "warning: `scontrol show job" in out, out  # "did not answer within 30 s", or "failed: ... timed out"
    assert "stopping: slurm job" in out and "interrupted" in out, out
    third = json.loads((run_dir / "launch.json").read_text())["job_id"]
    assert _wait_ended(third) in DONE, out
    assert wait_gone(run_dir, 30) == []
    steps = trained_steps(run_dir)  # the steps after the killed session's checkpoint were trained again
    assert sorted(set(steps)) == list(range(1, max(steps) + 1)) and max(steps) > done[-1]


def test_a_killed_trainer_restarts_alone_inside_the_job_under_broadcast(ws, tmp_path: Path):
    """Trainer-only restart on the Slurm target, in glm5's weight-sync mode: the trainer (rank 0, the weight
    sender, its own het-job component) is SIGKILLed after step 4. The in-job supervisor starts the trainer's
    srun step again from the checkpoint of step 3, inside the same job; the inference server (another
    component, another node) keeps its process and its loaded weights, reconnects to the restarted sender's
    store and registers with the step it holds. Every step is in metrics once, the retrained ones with the
    values of their first attempt (the plan claims this restart for Slurm: primebuild/builders/trainer_restart.py)."""
    manifests, env = ws
    runs = tmp_path / "runs"
    steps = 8
    proc = start("run", manifests / "reverse-text-slurm.yaml", "--runs-dir", runs, "--quiet", *SMALL,
                 "--set", f"orchestrator.max_steps={steps}", "--set", f"inference.port={free_port()}",
                 "--set", "weight_sync.mode=broadcast", "--set", f"weight_sync.port={free_port()}",
                 # the trainer's broadcast address is its own node's (plan: inference on node 0, trainer on 1)
                 "--set", "hardware.nodes=2", "--set", "trainer.checkpoint_every=3", env=env)
    try:
        run_dir = wait_trained(runs, 4, proc)
        kills = kill_the_trainer_keeping_the_rest(run_dir, runs, proc, timeout=300)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + logs_tail(run_dir)
    job = json.loads((run_dir / "launch.json").read_text())
    assert job["launches"] == 1 and _job_state(job["job_id"]) == "COMPLETED"  # one job: no resume, no requeue
    _assert_retrained_identically(run_dir, steps, kills)
    server_log = (run_dir / "logs" / "inference-0.log").read_text()
    assert "(restart 1)" not in server_log
    assert "rejoined the weight sender of epoch" in server_log, server_log[-3000:]
    assert "(restart 1)" in (run_dir / "logs" / "trainer.log").read_text()
    assert wait_gone(run_dir, 30) == []


def test_a_job_script_submitted_by_hand_into_an_empty_folder_says_what_it_misses(tmp_path: Path):
    """`sbatch job.sbatch` where no run folder was prepared: the job stops at once and its output, in the folder
    sbatch ran in, says why (it was sent into the run folder's logs/, which did not exist: sbatch failed the
    launch and wrote nowhere why)."""
    require_slurm()
    script = tmp_path / "job.sbatch"
    rendered = cli("render", REPO / "manifests" / "reverse-text-slurm.yaml", env=os.environ)
    assert rendered.returncode == 0, rendered.stderr
    script.write_text(rendered.stdout)
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp_path, capture_output=True, text=True,
                               timeout=30)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    assert _wait_ended(job) in ("FAILED", "gone", "COMPLETED"), _job_state(job)
    (log,) = tmp_path.glob(f"reverse-text-slurm-{job}.log")
    assert "plan.json is missing" in log.read_text() and "primebuild run MANIFEST --detach" in log.read_text()
