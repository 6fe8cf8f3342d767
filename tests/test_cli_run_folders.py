"""status | logs | stop | run --resume on folders that are not run folders: clean errors, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CPU_MANIFEST, call_cli, free_port, run_cli, write


@pytest.mark.parametrize("args", [
    ("status", "{d}"), ("stop", "{d}"), ("logs", "{d}"), ("run", "--resume", "{d}"),
    ("run", "--resume", "{d}/missing"), ("run",), ("worker", "--plan", "{d}/plan.json", "--process", "x"),
    ("status", "--runs-dir", "{d}"), ("logs", "--runs-dir", "{d}"), ("stop", "--runs-dir", "{d}"),
])
def test_not_a_run_folder_is_a_clean_error(args, tmp_path: Path):
    result = run_cli(*(a.format(d=tmp_path) for a in args))
    assert result.code == 2, result.text
    assert "Traceback" not in result.text and result.err.strip()
    assert not (tmp_path / "STOP").exists()


@pytest.mark.parametrize("args", [("stop", "{d}"), ("status", "{d}"), ("logs", "-n", "-2", "{d}")])
def test_a_folder_whose_plan_does_not_read_is_no_run(args, tmp_path: Path):
    (tmp_path / "plan.json").write_text("{bad")
    result = run_cli(*(a.format(d=tmp_path) for a in args))
    assert result.code == 2 and "Traceback" not in result.text and result.err.strip(), result.text
    assert not (tmp_path / "STOP").exists()


def test_runs_of_one_manifest_started_in_the_same_second_get_folders_of_their_own(tmp_path: Path, monkeypatch):
    """A seed sweep starts `primebuild run` of one manifest several times at once: each run claims its own
    folder (it was `internal error: FileExistsError` for all but the first)."""
    import threading
    import time

    from primebuild.commands.run import new_run_folder

    monkeypatch.setattr(time, "strftime", lambda _format: "20261207-044937")
    barrier, claimed = threading.Barrier(8), []

    def claim() -> None:
        barrier.wait()
        claimed.append(new_run_folder(tmp_path / "runs", "bash-files"))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    names = sorted(folder.name for folder in claimed)
    assert names == sorted(["bash-files-20261207-044937"] + [f"bash-files-20261207-044937-{n}" for n in range(2, 9)])
    assert all(folder.is_dir() and not any(folder.iterdir()) for folder in claimed)


def test_a_runs_folder_that_cannot_take_a_run_is_refused_and_left_clean(workdir: Path, capsys, monkeypatch):
    """Read-only, not a folder, or full: exit 2 naming the place, and no half-written run folder that
    `status` would then take for the newest run (it was `internal error: OSError`, and a 0-byte plan.json)."""
    import errno

    import primebuild.builders.lock as lockmod

    monkeypatch.chdir(workdir)
    write(workdir, "m.yaml", CPU_MANIFEST)
    port = ("--set", f"inference.port={free_port()}")
    (workdir / "a-file").write_text("")
    result = call_cli(capsys, "run", "m.yaml", *port, "--runs-dir", str(workdir / "a-file" / "runs"))
    assert result.code == 2 and "no run folder can be made there" in result.err, result.text

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lockmod, "record_lock", full)  # the disk fills while the folder is being written
    result = call_cli(capsys, "run", "m.yaml", *port, "--runs-dir", str(workdir / "runs"))
    assert result.code == 2 and "No space left on device" in result.err, result.text
    assert "Traceback" not in result.text and list((workdir / "runs").iterdir()) == []


def test_verify_skips_a_folder_retention_removes_while_it_reads_it(tmp_path: Path, capsys, monkeypatch):
    """On a running run, retention deletes old weight folders: one that goes mid-check is no damage (it was
    `internal error: FileNotFoundError`)."""
    import shutil

    import primebuild.runtime.weight_sync.filesystem as filesystem

    (tmp_path / "plan.json").write_text("{}")
    for step in (1, 2):
        (tmp_path / "weights" / f"step_{step:06d}").mkdir(parents=True)

    def retention_meanwhile(folder):
        if folder.name == "step_000001":
            shutil.rmtree(folder)
            raise FileNotFoundError(2, "No such file or directory", str(folder / "tokenizer.json"))

    monkeypatch.setattr(filesystem, "verify", retention_meanwhile)
    result = call_cli(capsys, "verify", str(tmp_path))
    assert result.code == 0 and "weights step      2  ok" in result.out and "step      1" not in result.out, result.text


def test_verify_reports_an_odd_marker_an_unreadable_file_and_a_file_for_a_folder(tmp_path: Path, capsys,
                                                                                   monkeypatch):
    """These were `internal error: TypeError` / `PermissionError`, and a file where checkpoints/ should be was
    "0 damaged", exit 0."""
    import json

    import primebuild.runtime.weight_sync.filesystem as filesystem

    (tmp_path / "plan.json").write_text("{}")
    for step in (1, 2):
        filesystem.publish_dir(tmp_path / "weights" / f"step_{step:06d}",
                               lambda out: (out / "model.safetensors").write_bytes(b"w" * 64), step)
    marker = tmp_path / "weights" / "step_000001" / filesystem.STABLE
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "files": None}))
    real_sha = filesystem.sha256_file

    def unreadable(path):
        if "step_000002" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_sha(path)

    monkeypatch.setattr(filesystem, "sha256_file", unreadable)
    (tmp_path / "checkpoints").write_text("")
    result = call_cli(capsys, "verify", str(tmp_path))
    assert result.code == 2 and "internal error" not in result.text, result.text
    assert "step      1  DAMAGED: STABLE: not a file listing" in result.out
    assert "step      2  DAMAGED: model.safetensors: cannot read it (Permission denied)" in result.out
    assert "DAMAGED: checkpoints is not a folder" in result.out


def test_status_tells_a_running_a_failed_and_a_resumed_session_apart(workdir: Path, capsys):
    """`status` read the end-of-session summary only: a running run showed eval_reward_before None after the
    terminal had printed it, a resumed one the last session's outcome, and a failed one stop_requested true
    (STOP is how the supervisor ends the others after a failure)."""
    import json

    write(workdir, "m.yaml", CPU_MANIFEST)
    plan = call_cli(capsys, "plan", str(workdir / "m.yaml"), "-o", "json")
    run_dir = workdir / "runs" / "m-1"
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text(plan.out)

    def status() -> dict:
        result = call_cli(capsys, "status", str(run_dir), "-o", "json")
        assert result.code == 0, result.text
        return json.loads(result.out)

    # a resumed session running: the orchestrator's record is live, the summary is the last session's
    (run_dir / "summary.json").write_text(json.dumps({"eval_reward_before": 0.1, "outcome": "stopped at step 2"}))
    (run_dir / "orchestrator.json").write_text(json.dumps({"eval_reward_before": 0.25}))
    state = status()
    assert state["eval_reward_before"] == 0.25 and state["outcome"] is None and state["stop_requested"] is False
    (run_dir / "STOP").touch()  # `primebuild stop`
    assert status()["stop_requested"] is True
    # a process failed: the supervisor wrote failure.json and STOP, then the session's outcome
    (run_dir / "failure.json").write_text(json.dumps({"process": "trainer", "role": "trainer", "exit_code": 1,
                                                      "message": "trainer exited with 1", "log": "x", "log_tail": []}))
    state = status()
    assert state["stop_requested"] is False and state["failed_process"] == "trainer"
    (run_dir / "outcome.json").write_text(json.dumps({"ok": False, "message": "trainer exited with 1", "exit_code": 1}))
    assert status()["outcome"] == "trainer exited with 1"


def test_a_pid_reused_by_another_process_is_no_supervisor(workdir: Path, capsys):
    """The local target took any live pid whose command line said "primebuild" for the run's supervisor: a
    dead run looked alive, and `stop` sent SIGTERM to whatever process had the pid since."""
    import json
    import socket
    import subprocess

    from primebuild.runtime.targets.processes import process_identity

    write(workdir, "m.yaml", CPU_MANIFEST)
    run_dir = workdir / "runs" / "m-1"
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text(call_cli(capsys, "plan", str(workdir / "m.yaml"), "-o", "json").out)
    stranger = subprocess.Popen(["bash", "-c", "exec -a primebuild-stranger sleep 120"])
    try:
        launch = {"target": "local", "supervisor_host": socket.gethostname(), "supervisor_pid": stranger.pid}
        for identity, alive in (("another-boot:12345", False), (process_identity(stranger.pid), True)):
            (run_dir / "launch.json").write_text(json.dumps({**launch, "supervisor_identity": identity}))
            state = json.loads(call_cli(capsys, "status", str(run_dir), "-o", "json").out)
            assert state["target"] == ("local: running" if alive else "local: not running"), (identity, state)
        (run_dir / "launch.json").write_text(json.dumps({**launch, "supervisor_identity": "another-boot:12345"}))
        result = call_cli(capsys, "stop", str(run_dir), "--now")
        assert result.code == 0 and "not running" in result.out, result.text
        assert stranger.poll() is None  # not signalled
    finally:
        stranger.kill()
        stranger.wait()


def _hand_made_run(workdir: Path, capsys, name: str = "m-1") -> Path:
    """A run folder as `primebuild run` lays it out before anything started: plan and composed manifest."""
    import json

    write(workdir, "m.yaml", CPU_MANIFEST)
    run_dir = workdir / "runs" / name
    run_dir.mkdir(parents=True)
    port = ("--set", f"inference.port={free_port()}")  # a resume checks that the plan's ports are free
    (run_dir / "plan.json").write_text(call_cli(capsys, "plan", str(workdir / "m.yaml"), *port, "-o", "json").out)
    from primebuild.manifest.load import load_manifest

    (run_dir / "manifest.json").write_text(json.dumps(load_manifest(workdir / "m.yaml").document))
    return run_dir


@pytest.mark.parametrize("record, text", [("launch.json", '{"target":'), ("failure.json", "garbage"),
                                          ("outcome.json", "[1, 2]"), ("run.json", "{bad")])
def test_a_damaged_record_of_a_run_folder_is_a_located_error(record: str, text: str, workdir: Path, capsys):
    """These were `internal error: JSONDecodeError` (or AttributeError), exit 1."""
    run_dir = _hand_made_run(workdir, capsys)
    (run_dir / record).write_text(text)
    commands = [("status", str(run_dir))] + ([("replay", "--check", str(run_dir))] if record == "run.json" else [])
    for command in commands:
        result = call_cli(capsys, *command)
        if record == "run.json" and command[0] == "status":
            assert result.code == 0, result.text  # status does not read run.json
            continue
        assert result.code == 2 and f"{run_dir / record}:" in result.err, (command, result.text)
        assert "internal error" not in result.err


def test_metrics_rows_that_are_no_metrics_are_skipped_and_an_unreadable_run_is_passed_over(workdir: Path, capsys):
    import json
    import subprocess
    import sys

    run_dir = _hand_made_run(workdir, capsys)
    rows = [{"step": 1, "role": "trainer", "name": "loss", "value": 0.5}, {"x": 1}, [], "text",
            {"step": "2", "role": "trainer", "name": "loss", "value": 0.4}, {"step": 2, "role": "trainer"}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "ro')
    result = call_cli(capsys, "status", str(run_dir), "-o", "json")
    assert result.code == 0 and json.loads(result.out)["steps_trained"] == 1, result.text  # was KeyError: 'role'
    # a folder of runs/ this user may not enter: the newest run is still found (was PermissionError). Root
    # reads everything, so the check drops the capabilities that let it.
    private = workdir / "runs" / "private"
    private.mkdir()
    (private / "plan.json").write_text("{}")
    private.chmod(0)
    as_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
    done = subprocess.run([*as_user, sys.executable, "-m", "primebuild.cli", "status", "--runs-dir",
                           str(workdir / "runs"), "-o", "json"], capture_output=True, text=True, timeout=60)
    private.chmod(0o755)
    assert done.returncode == 0 and json.loads(done.stdout)["run_dir"] == str(run_dir), done.stdout + done.stderr


def test_logs_follow_waits_for_logs_picks_up_new_ones_and_says_when_one_goes(tmp_path: Path):
    """`logs -f` on a run without logs sat silent for ever, a folder named *.log was `IsADirectoryError`,
    a log removed while followed was `FileNotFoundError`, and it never ended after the run did."""
    import subprocess
    import sys
    import time

    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "logs" / "weird.log").mkdir(parents=True)
    follow = subprocess.Popen([sys.executable, "-m", "primebuild.cli", "logs", str(tmp_path), "-f"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "has written a log yet; waiting" in follow.stdout.readline()
        (tmp_path / "logs" / "trainer.log").write_text("step 1 loss 0.5\n")
        assert follow.stdout.readline() == "step 1 loss 0.5\n"
        (tmp_path / "logs" / "orchestrator.log").write_text("step 1 reward 0.1\n")
        assert follow.stdout.readline() == "[orchestrator] step 1 reward 0.1\n"
        (tmp_path / "logs" / "trainer.log").unlink()
        deadline = time.monotonic() + 30
        line = follow.stdout.readline()
        assert line == "trainer.log: removed; no longer followed\n" and time.monotonic() < deadline, line
        assert follow.poll() is None  # still following the rest
        (tmp_path / "outcome.json").write_text('{"ok": true, "message": "run complete", "exit_code": 0}')
        assert follow.stdout.readline() == "the run has ended: run complete\n"  # and -f ends with it
        assert follow.wait(10) == 0
    finally:
        follow.kill()
        follow.wait()


def test_logs_follow_ends_when_the_session_ended_without_an_outcome(tmp_path: Path):
    """A session whose target runs nothing of it any more and that recorded no outcome (a Slurm job cancelled
    or out of time, a supervisor killed -9): `logs -f` waited for ever for an outcome that never comes."""
    import json
    import socket
    import subprocess
    import sys

    gone = subprocess.Popen(["true"])
    gone.wait()  # a supervisor that is no more
    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer.log").write_text("step 1 loss 0.5\n")
    (tmp_path / "launch.json").write_text(json.dumps({"target": "local", "supervisor_host": socket.gethostname(),
                                                      "supervisor_pid": gone.pid}))
    done = subprocess.run([sys.executable, "-m", "primebuild.cli", "logs", str(tmp_path), "-f"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "step 1 loss 0.5"
    assert "the run is not running and recorded no outcome" in done.stdout


def test_scale_refuses_a_timeout_that_is_no_number_and_says_that_it_waits(workdir: Path, capsys):
    """`--timeout nan` waited for ever; every wait was silent (a replica's start takes minutes)."""
    import json
    import socket
    import subprocess
    import sys

    from primebuild.runtime.targets.processes import process_identity

    run_dir = _hand_made_run(workdir, capsys)
    result = call_cli(capsys, "scale", str(run_dir), "--inference", "+1", "--timeout", "nan")
    assert result.code == 2 and "--timeout" in result.err, result.text
    supervisor = subprocess.Popen(["bash", "-c", "exec -a primebuild-silent sleep 120"])  # alive, never answers
    try:
        (run_dir / "launch.json").write_text(json.dumps({
            "target": "local", "supervisor_host": socket.gethostname(), "supervisor_pid": supervisor.pid,
            "supervisor_identity": process_identity(supervisor.pid)}))
        done = subprocess.run([sys.executable, "-m", "primebuild.cli", "scale", str(run_dir), "--inference", "+1",
                               "--timeout", "1"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "waiting for its answer (at most 1 s)" in done.stdout, done
        assert "no answer from the run's supervisor within 1 s" in done.stderr
    finally:
        supervisor.kill()
        supervisor.wait()


def test_resume_and_export_of_a_run_whose_model_folder_is_gone_say_so(workdir: Path, capsys):
    """After a `store gc` between sessions, `run --resume` started every process to fail on the missing
    folder, and `export` was `internal error: OSError: Repo id must be in the form ...`."""
    import json

    run_dir = _hand_made_run(workdir, capsys)
    gone = str(workdir / "store" / "0123-gone-sft")
    (run_dir / "run.json").write_text(json.dumps({"model_path": gone}))
    (run_dir / "rendezvous.json").write_text(json.dumps({"hosts": ["127.0.0.1"], "model_path": gone}))
    for command in (("run", "--resume", str(run_dir)), ("export", str(run_dir))):
        result = call_cli(capsys, *command)
        assert result.code == 2 and f"model_path {gone} is gone" in result.err, (command, result.text)
        assert "internal error" not in result.err
    assert not (run_dir / "logs").exists() or not list((run_dir / "logs").iterdir())


def test_a_run_still_starting_is_not_resumed_beside_its_supervisor(workdir: Path, capsys):
    """Before its launch record existed, a starting run could be `--resume`d: two supervisors then shared
    the folder (staging folders collided, each ended with a misleading cause), and `status` said "never
    launched" while its servers ran."""
    import json
    import subprocess
    import sys

    run_dir = _hand_made_run(workdir, capsys)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from primebuild.contracts.run_dir import RunDir\n"
                               f"RunDir({str(run_dir)!r}).claim(); print('claimed', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "claimed\n"
        result = call_cli(capsys, "run", "--resume", str(run_dir))
        assert result.code == 2 and "is being run by another `primebuild run`" in result.err, result.text
        assert json.loads(call_cli(capsys, "status", str(run_dir), "-o", "json").out)["target"] == "local: starting"
    finally:
        holder.kill()
        holder.wait()
    assert json.loads(call_cli(capsys, "status", str(run_dir), "-o", "json").out)["target"] == "local: never launched"


def test_stop_leaves_the_supervisor_its_own_grace_before_it_signals(workdir: Path, capsys, monkeypatch):
    """`stop`'s grace equalled the supervisor's: both ended at the same second, and the stop that was asked
    for was recorded as a kill (SIGTERM, exit 143). The supervisor here takes GRACE_SECONDS (shortened)."""
    import json
    import socket
    import subprocess
    import sys

    import primebuild.runtime.supervisor as supervisor
    from primebuild.runtime.targets.processes import process_identity

    monkeypatch.setattr(supervisor, "GRACE_SECONDS", 2)
    monkeypatch.setattr(supervisor, "TERM_SECONDS", 1)
    run_dir = _hand_made_run(workdir, capsys)
    fake = subprocess.Popen([sys.executable, "-c", "import pathlib, time\n"
                             f"run = pathlib.Path({str(run_dir)!r})\n"
                             "while not (run / 'STOP').exists(): time.sleep(0.05)\n"
                             "time.sleep(2.5)  # its grace, then the workers' end\n"
                             "(run / 'outcome.json').write_text('{\"ok\": true, \"message\": \"stopped at step 3\", "
                             "\"exit_code\": 0}')\n"])
    try:
        (run_dir / "launch.json").write_text(json.dumps({
            "target": "local", "supervisor_host": socket.gethostname(), "supervisor_pid": fake.pid,
            "supervisor_identity": process_identity(fake.pid)}))
        result = call_cli(capsys, "stop", str(run_dir), "--grace", "2")
        assert result.code == 0 and "asked its supervisor" not in result.out, result.text
        assert fake.wait(10) == 0  # it ended by itself, not by a signal
        assert "(local: not running)" in result.out
    finally:
        fake.kill()
        fake.wait()
