"""The ssh target for real: two "hosts" on loopback (sshd on 127.0.0.2 and 127.0.0.3, scripts/ci-services)
— inference on the first, trainer and orchestrator on the second — started with fabric, host keys
checked against known_hosts. The run folder and the primebuild install are reached through paths
full of shell metacharacters, so every quoted command line runs for real."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from cluster_helpers import (
    NASTY,
    REPO,
    SSH_HOSTS,
    cli,
    kill_the_trainer_keeping_the_rest,
    logs_tail,
    require_sshd,
    start,
    trained_steps,
    wait_gone,
    wait_trained,
)
from conftest import SHIPPED_NAMES, free_port, sft_workspace
from test_trainer_restart import _assert_retrained_identically

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ws(tmp_path_factory, short_sft_store):
    config = require_sshd()
    root = tmp_path_factory.mktemp("ssh")
    manifests = sft_workspace(root, SHIPPED_NAMES, seed_store=short_sft_store)
    workdir = root / "primebuild $(touch PWNED) ;x"
    workdir.symlink_to(REPO)  # the install on every "host", under a name a shell would love to run
    env = {**os.environ, "PRIMEBUILD_STORE": str(root / "store"), "PYTHONUNBUFFERED": "1",
           "PRIMEBUILD_SSH_CONFIG": str(config)}
    return manifests, env, workdir, config


def _ssh_connection(pid: int) -> str:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.decode() for e in environ if e.startswith(b"SSH_CONNECTION=")).split("=", 1)[1]


def test_a_run_spans_two_ssh_hosts(ws, tmp_path: Path):
    manifests, env, workdir, _ = ws
    runs = tmp_path / NASTY
    proc = start("run", manifests / "reverse-text-ssh.yaml", "--runs-dir", runs, "--quiet",
                 "--set", "orchestrator.max_steps=4", "--set", "orchestrator.rollouts_per_step=32",
                 "--set", "orchestrator.eval_prompts=40", "--set", f"inference.port={free_port()}",
                 "--set", f"target.workdir={workdir}", env=env)
    try:
        run_dir = wait_trained(runs, 1, proc)
        # each process runs in an ssh session of its plan node's host: inference on hosts[0], the rest on [1]
        served = {}
        for record in (run_dir / "pids").glob("*.json"):
            data = json.loads(record.read_text())
            served[data["process"]] = _ssh_connection(data["pid"]).split()[2]  # the server side of the session
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + logs_tail(run_dir)
    assert served == {"inference-0": SSH_HOSTS[0], "trainer": SSH_HOSTS[1], "orchestrator": SSH_HOSTS[1]}
    assert trained_steps(run_dir) == [1, 2, 3, 4]
    rendezvous = json.loads((run_dir / "rendezvous.json").read_text())
    assert rendezvous["hosts"] == list(SSH_HOSTS)
    # the server bound its host's address (clients come from the other host), never all interfaces
    assert f"Uvicorn running on http://{SSH_HOSTS[0]}:" in (run_dir / "logs" / "inference-0.log").read_text()
    orchestrator = json.loads((run_dir / "config" / "orchestrator.json").read_text())
    assert orchestrator["endpoints"][0].startswith(f"http://{SSH_HOSTS[0]}:")
    for name in ("summary.json", "report.png", "launch.json", "outcome.json"):
        assert (run_dir / name).is_file(), name
    assert not list(tmp_path.rglob("PWNED*")) and not list(workdir.parent.glob("PWNED*"))
    assert wait_gone(run_dir, 10) == []
    # the admin token went over stdin: in no log, config or record
    token_env = [p for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".log")
                 and "PRIMEBUILD_ADMIN_TOKEN=" in p.read_text(errors="ignore")]
    assert token_env == []


def test_an_unknown_host_key_is_refused_before_anything_starts(ws, tmp_path: Path):
    manifests, env, workdir, config = ws
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    other = tmp_path / "config"
    other.write_text(config.read_text().replace(str(config.parent / "known_hosts"), str(empty)))
    runs = tmp_path / "runs"
    result = cli("run", manifests / "reverse-text-ssh.yaml", "--runs-dir", runs, "--set",
                 f"target.workdir={workdir}", env={**env, "PRIMEBUILD_SSH_CONFIG": str(other)}, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "not found in known_hosts" in result.stderr and "Traceback" not in result.stderr
    assert not runs.exists()
    assert empty.read_text() == ""  # nothing was added behind the user's back


def test_the_rendered_script_gates_each_start_order_on_health_over_real_ssh(ws, tmp_path: Path):
    """ssh.sh, run by hand as an engineer would, through the real sshd: the inference worker starts on
    hosts[0] (its log comes back through the session) and, without a rendezvous, never becomes healthy;
    the script then fails fast: nothing of the next start order starts, the STOP file is written, exit 1."""
    manifests, env, workdir, config = ws
    run_dir = tmp_path / NASTY / "run"
    run_dir.mkdir(parents=True)
    rendered = cli("render", manifests / "reverse-text-ssh.yaml", "--target", "ssh", "--run-dir", run_dir,
                   "--set", f"target.workdir={workdir}", env=env, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    plan = cli("plan", manifests / "reverse-text-ssh.yaml", "-o", "json", "--set", f"target.workdir={workdir}",
               env=env, timeout=120)
    (run_dir / "plan.json").write_text(plan.stdout)
    assert json.loads(plan.stdout)["plan_hash"] in rendered.stdout  # the script is of this very plan
    bin_dir = tmp_path / "bin"  # `ssh` with the CI services' client config (known hosts, key)
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {shlex.quote(str(config))} \"$@\"\n")
    (bin_dir / "ssh").chmod(0o755)
    done = subprocess.run(["bash", "-c", rendered.stdout], capture_output=True, text=True, timeout=240,
                          env={**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PRIMEBUILD_ADMIN_TOKEN": "t"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "inference-0 did not become healthy" in done.stderr
    log = (run_dir / "logs" / "inference-0.log").read_text()
    assert "rendezvous" in log.lower() and "Traceback" not in log, log  # the worker's own located error
    assert not (run_dir / "logs" / "trainer.log").exists() and not (run_dir / "logs" / "orchestrator.log").exists()
    assert (run_dir / "STOP").exists()


def test_the_rendered_script_stops_the_process_groups_its_workers_recorded_over_real_ssh(ws, tmp_path: Path):
    """ssh.sh's stop_all (what ends every run it supervises, and every failure): the process group a worker
    recorded in pids/NAME.json gets TERM through the real sshd of its host and ends; a group whose leader
    belongs to no run of this folder is left alone."""
    manifests, env, workdir, config = ws
    run_dir = tmp_path / NASTY / "run"
    (run_dir / "pids").mkdir(parents=True)
    rendered = cli("render", manifests / "reverse-text-ssh.yaml", "--target", "ssh", "--run-dir", run_dir,
                   "--set", f"target.workdir={workdir}", env=env, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    functions = rendered.stdout.split("\nstart_order ", 1)[0]  # everything but starting the run
    ours = subprocess.Popen(["sleep", "300"], start_new_session=True,
                            env={**os.environ, "PRIMEBUILD_RUN_DIR": str(run_dir)})
    other = subprocess.Popen(["sleep", "300"], start_new_session=True,
                             env={**os.environ, "PRIMEBUILD_RUN_DIR": str(tmp_path / "another-run")})
    try:
        (run_dir / "pids" / "inference-0.json").write_text(json.dumps({"pid": ours.pid, "pgid": ours.pid}))
        (run_dir / "pids" / "trainer.json").write_text(json.dumps({"pid": other.pid, "pgid": other.pid}))
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "ssh").write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {shlex.quote(str(config))} \"$@\"\n")
        (bin_dir / "ssh").chmod(0o755)
        done = subprocess.run(["bash", "-c", functions + "\nterm_seconds=1\nstop_all\necho stopped"],
                              capture_output=True, text=True, timeout=60,
                              env={**env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PRIMEBUILD_ADMIN_TOKEN": "t"})
        assert done.returncode == 0 and "stopped" in done.stdout, done.stdout + done.stderr
        assert "command not found" not in done.stderr, done.stderr
        assert ours.wait(timeout=10) == -15  # TERM, sent over ssh
        assert other.poll() is None  # not this run's: left alone
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


def test_a_killed_trainer_restarts_alone_on_its_host_under_broadcast(ws, tmp_path: Path):
    """Trainer-only restart on the ssh target, in glm5's weight-sync mode: the trainer (the weight sender, on
    the second host) is SIGKILLed after step 4; the supervisor starts it again over ssh from the checkpoint
    of step 3, while the inference server on the first host keeps its process and weights, reconnects to
    the restarted sender and registers with the step it holds. Every step is in metrics once, the
    retrained ones with their first attempt's values (the plan claims this restart for ssh:
    primebuild/builders/trainer_restart.py)."""
    manifests, env, workdir, _ = ws
    runs = tmp_path / "runs"
    steps = 7
    proc = start("run", manifests / "reverse-text-ssh.yaml", "--runs-dir", runs, "--quiet",
                 "--set", f"orchestrator.max_steps={steps}", "--set", "orchestrator.rollouts_per_step=32",
                 "--set", "orchestrator.eval_prompts=40", "--set", f"inference.port={free_port()}",
                 "--set", "weight_sync.mode=broadcast", "--set", f"weight_sync.port={free_port()}",
                 "--set", "trainer.checkpoint_every=3", "--set", f"target.workdir={workdir}", env=env)
    try:
        run_dir = wait_trained(runs, 4, proc)
        kills = kill_the_trainer_keeping_the_rest(run_dir, runs, proc, timeout=240)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + logs_tail(run_dir)
    assert "restarting the trainer (1/3)" in out, out
    _assert_retrained_identically(run_dir, steps, kills)
    server_log = (run_dir / "logs" / "inference-0.log").read_text()
    assert "(restart 1)" not in server_log and "rejoined the weight sender of epoch" in server_log, server_log[-3000:]
    assert wait_gone(run_dir, 10) == []


def test_a_secret_with_a_line_break_is_refused_before_anything_starts(tmp_path: Path):
    """Secrets travel to the hosts as NAME=value lines on the workers' stdin: one with a line break was dropped
    without a word, and the process started without it."""
    runs = tmp_path / "runs"
    done = cli("run", REPO / "manifests" / "reverse-text-ssh.yaml", "--set", "secrets=[MY_SECRET]",
               "--runs-dir", runs, env={**os.environ, "MY_SECRET": "line one\nline two"}, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "secret MY_SECRET holds a line break" in done.stderr and "line one" not in done.stdout + done.stderr
    assert not runs.exists()
