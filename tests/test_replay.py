"""`primebuild replay`: a recorded run recompiles to the same plan hash, or is refused with a diff."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import CPU_MANIFEST, MANIFESTS, call_cli, free_port, write

from primebuild.builders.lock import lock_hash, read_lock, record_lock
from primebuild.builders.lock_check import load_lock_for
from primebuild.builders.plan import compile_plan
from primebuild.code_version import CHECKOUT, code_changes, code_version
from primebuild.contracts.plan import plan_hash, render_json
from primebuild.hashing import canonical_json
from primebuild.manifest.load import load_manifest


def record_run(run_dir: Path, manifest: Path, sets: tuple[str, ...] = (), locked: bool = False,
               code: str | None = None) -> dict:
    """A run folder laid out as `primebuild run` writes it (plan, composed manifest, copies, run.json), made
    by `code` (default: today's code version)."""
    loaded = load_manifest(manifest, sets)
    lock = load_lock_for(loaded, None, require_fresh=True) if locked else None
    plan = compile_plan(loaded, lock)
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text(render_json(plan))
    plan = plan.to_json()
    (run_dir / "manifest.json").write_text(json.dumps(loaded.document, indent=2, sort_keys=True))
    (run_dir / "manifests").mkdir()
    for path in loaded.files:
        (run_dir / "manifests" / path.name).write_bytes(path.read_bytes())
    (run_dir / "run.json").write_text(json.dumps({"plan_hash": plan["plan_hash"], "code_version": code or code_version(),
                                                  "manifest_hash": loaded.manifest_hash}))
    if locked:
        record_lock(run_dir / "lock.json", loaded)
    return plan


def test_replay_check_verifies_the_recorded_plan(tmp_path: Path, capsys):
    run_dir = tmp_path / "runs" / "rt-1"
    plan = record_run(run_dir, MANIFESTS / "reverse-text.yaml", ("orchestrator.max_steps=2",))
    result = call_cli(capsys, "replay", "--check", "-o", "json", run_dir)  # manifest folder found by content
    assert result.code == 0, result.text
    code = code_version()
    assert json.loads(result.out) == {"run_dir": str(run_dir.resolve()), "plan_hash": plan["plan_hash"],
                                      "verified": True, "started": False,
                                      "code_version": {"recorded": code, "now": code, "changes": []}}


def test_replay_refuses_when_todays_plan_differs(tmp_path: Path, capsys):
    run_dir = tmp_path / "rt-1"
    record_run(run_dir, MANIFESTS / "reverse-text.yaml", code="abc123")
    recorded = json.loads((run_dir / "plan.json").read_text())
    # what a code change looks like from the run folder: the plan compiled then is not today's plan
    for process in recorded["processes"]:
        if process["name"] == "trainer":
            process["config"]["lr"] = 0.5
    recorded["plan_hash"] = plan_hash(recorded)
    (run_dir / "plan.json").write_text(canonical_json(recorded) + "\n")
    result = call_cli(capsys, "replay", "--check", run_dir)
    assert result.code == 2
    assert "today's plan differs from the recorded one" in result.err
    assert "processes[trainer].config.lr: 0.5 -> 0.0002" in result.err
    assert "code abc123" in result.err and "code: code version abc123 -> " in result.err
    assert "Traceback" not in result.err


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"needs primebuild's git checkout with history: git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def test_replay_refuses_other_code_and_says_what_changed(tmp_path: Path, capsys):
    """The same plan made by another commit: refused, naming the commits and files between; allowed on request."""
    parent = _git("rev-parse", "HEAD~1")
    changed = _git("diff", "--name-only", parent, "HEAD").split()
    run_dir = tmp_path / "rt-old"
    plan = record_run(run_dir, MANIFESTS / "reverse-text.yaml", code=parent)
    refused = call_cli(capsys, "replay", "--check", run_dir)
    assert refused.code == 2 and "the plan matches, but today's code is not the code that made the run" in refused.err
    since = _git("rev-list", "--count", f"{parent}..HEAD")  # 1, or more when HEAD is a merge
    assert f"commit {parent[:12]} -> {_git('rev-parse', 'HEAD')[:12]}: {since} commit(s) since the run" in refused.err
    assert f"{len(changed)} file(s) changed" in refused.err and changed[0] in refused.err
    assert f"check out {parent[:12]}" in refused.err and "Traceback" not in refused.err
    allowed = call_cli(capsys, "replay", "--check", "--allow-code-change", "-o", "json", run_dir)
    assert allowed.code == 0, allowed.text
    answer = json.loads(allowed.out)
    assert answer["plan_hash"] == plan["plan_hash"] and answer["code_version"]["recorded"] == parent
    assert answer["code_version"]["now"] == code_version() and answer["code_version"]["changes"]


def test_code_changes_tell_commits_and_uncommitted_edits_apart():
    sha, other = "a" * 40, "0" * 40
    assert code_changes(sha, sha) == []
    assert code_changes(f"{sha}-dirty.111111111111", f"{sha}-dirty.222222222222") == [
        "uncommitted changes differ from the run's"]
    assert code_changes(f"{sha}-dirty", f"{sha}-dirty.222222222222") == [
        "the run had uncommitted changes whose content was not recorded"]
    assert code_changes(f"{sha}-dirty.111111111111", sha) == [
        "the run had uncommitted changes, which this checkout does not have"]
    assert code_changes("0.1.0", "0.2.0") == ["code version 0.1.0 -> 0.2.0"]
    unknown = code_changes(other, sha)
    assert unknown[0].startswith(f"commit {other[:12]} (the run's) is not in this checkout")


def test_replay_with_lock_checks_the_recorded_lock(tmp_path: Path, capsys, locked: Path):
    run_dir = tmp_path / "rt-locked"
    plan = record_run(run_dir, locked / "reverse-text.yaml", locked=True)
    lock = read_lock(run_dir / "lock.json")
    assert plan["lock_hash"] == lock_hash(lock)
    ok = call_cli(capsys, "replay", "--check", "--manifest-dir", locked, run_dir)
    assert ok.code == 0, ok.text
    lock["environments"]["reverse-text"]["version"] = "2"
    (run_dir / "lock.json").write_text(json.dumps(lock))
    bad = call_cli(capsys, "replay", "--check", "--manifest-dir", locked, run_dir)
    assert bad.code == 2 and "is not the lock the run used" in bad.err


def test_replay_of_a_foreign_manifest_needs_its_folder_and_diff_of_run_folders(workdir: Path, capsys):
    manifest = write(workdir, "tiny.yaml", CPU_MANIFEST)
    record_run(workdir / "runs" / "a", manifest)
    record_run(workdir / "runs" / "b", manifest, ("orchestrator.group_size=4",))
    ok = call_cli(capsys, "replay", "--check", "--manifest-dir", workdir, workdir / "runs" / "a")
    assert ok.code == 0, ok.text
    same = call_cli(capsys, "diff", workdir / "runs" / "a", workdir / "runs" / "a")
    assert same.code == 0 and "no differences (manifest, plan, run)" in same.out
    result = call_cli(capsys, "diff", workdir / "runs" / "a", workdir / "runs" / "b")
    assert result.code == 1
    assert "manifest:\n" in result.out and "~ orchestrator.group_size: 8 -> 4" in result.out
    assert "run:\n" in result.out and "~ plan_hash:" in result.out
    not_a_run = call_cli(capsys, "replay", "--check", workdir)
    assert not_a_run.code == 2 and "not a run folder" in not_a_run.err


@pytest.mark.timeout(120)
def test_replay_starts_the_same_plan(tmp_path: Path, capsys, monkeypatch):
    """Replay goes through `primebuild run`: the new run folder holds the very plan that was recorded."""
    monkeypatch.setenv("PRIMEBUILD_STORE", str(tmp_path / "store"))
    manifests = tmp_path / "manifests"
    shutil.copytree(MANIFESTS / "models", manifests / "models")
    manifest = write(manifests, "tiny.yaml", CPU_MANIFEST)
    sets = ("orchestrator.max_steps=2", "orchestrator.rollouts_per_step=16", "orchestrator.group_size=4",
            f"inference.port={free_port()}")  # recorded in the plan: the replay starts on it too
    original = tmp_path / "runs" / "tiny-original"
    plan = record_run(original, manifest, sets)
    result = call_cli(capsys, "replay", "--quiet", "--manifest-dir", manifests, original)
    started = [p for p in (tmp_path / "runs").iterdir() if p != original]
    assert len(started) == 1, result.text  # the run may fail for its own reasons; it must have started
    assert json.loads((started[0] / "plan.json").read_text())["plan_hash"] == plan["plan_hash"]
    assert (started[0] / "plan.json").read_text() == (original / "plan.json").read_text()


def test_replay_refuses_an_edited_plan_writes_nothing_into_the_manifest_folder_and_names_the_record(
        tmp_path: Path, capsys):
    """An edit that kept plan_hash was reported as "matches"; a file of the manifest folder named like the
    staged copy was overwritten through its link; an error in the recorded manifest named a scratch file."""
    run_dir = tmp_path / "rt-1"
    record_run(run_dir, MANIFESTS / "reverse-text.yaml")
    pristine = (run_dir / "plan.json").read_text()
    edited = json.loads(pristine)
    edited["processes"][0]["config"]["max_num_seqs"] = 7  # plan_hash left as it was
    (run_dir / "plan.json").write_text(json.dumps(edited))
    result = call_cli(capsys, "replay", "--check", run_dir)
    assert result.code == 2 and "plan.json was edited after the run compiled it" in result.err, result.text
    (run_dir / "plan.json").write_text(pristine)

    folder = tmp_path / "md"
    shutil.copytree(MANIFESTS, folder)
    (folder / "replay-manifest.json").write_text("precious")
    (folder / f"replay-{edited['name']}.json").write_text("precious too")  # the name the copy used to take
    result = call_cli(capsys, "replay", "--check", "--manifest-dir", folder, run_dir)
    assert result.code == 0, result.text
    assert (folder / "replay-manifest.json").read_text() == "precious"
    assert (folder / f"replay-{edited['name']}.json").read_text() == "precious too"

    (run_dir / "manifest.json").write_text(json.dumps({"apiVersion": "primebuild/v1", "name": "../../x"}))
    result = call_cli(capsys, "replay", "--check", run_dir)
    assert result.code == 2 and f"{run_dir / 'manifest.json'}:" in result.err, result.text
    assert "primebuild-replay-" not in result.err and "Traceback" not in result.err
