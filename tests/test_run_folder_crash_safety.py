"""Every rename, retention and clean-up in the run folder survives a kill at any instant.

Each operation runs in a forked child that SIGKILLs itself just before its n-th file-system call (a
rename, an unlink, an fsync …), for n = 1, 2, … until the operation finishes: the folder then holds
exactly what a `kill -9` at that instant leaves, with no Python clean-up run. For every such state,
readers see only whole step folders, the next start (`finish_interrupted`, `reconcile`) finishes it
without an error and leaves nothing hidden behind, and doing the operation again (what the resumed run
does) succeeds. tests/test_run_kill.py kills real runs.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from primebuild.contracts.run_dir import RunDir, write_json_atomic
from primebuild.runtime.metrics import MetricsWriter, read_metrics
from primebuild.runtime.resume import finish_interrupted, reconcile
from primebuild.runtime.rollout_file import load_batch, save_batch
from primebuild.runtime.weight_sync import filesystem as fs

# The calls a kill is placed before: every step of a write, rename or delete goes through one of them.
FILE_SYSTEM_CALLS = ("rename", "replace", "unlink", "rmdir", "mkdir", "fsync", "truncate")


def killed_before_call(n: int, operation: Callable[[], object]) -> bool:
    """Run `operation` in a forked child that SIGKILLs itself just before its n-th file-system call.
    True when it finished first (n is past its last call)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            calls = 0

            def counted(real):
                def call(*args, **kwargs):
                    nonlocal calls
                    calls += 1
                    if calls == n:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*args, **kwargs)
                return call

            for name in FILE_SYSTEM_CALLS:
                setattr(os, name, counted(getattr(os, name)))
            operation()
        except BaseException:  # noqa: BLE001 (reported as exit status 3)
            os._exit(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return False
    assert os.WEXITSTATUS(status) == 0, f"the operation failed (not killed) before call {n}"
    return True


def every_kill(setup: Callable[[Path], Callable[[], object]], tmp_path: Path):
    """Yield (n, folder) for every kill instant of the operation `setup(folder)` returns, each in a fresh
    folder; the last one is the operation run to its end."""
    n = 0
    while True:
        n += 1
        folder = tmp_path / f"kill-{n}"
        folder.mkdir(parents=True)
        finished = killed_before_call(n, setup(folder))
        yield n, folder
        if finished:
            assert n > 2  # the operation did make file-system calls to kill it before
            return


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".")) if root.is_dir() else []


def write_parts(tag: bytes):
    def write(stage: Path) -> None:
        for i in range(3):
            (stage / f"part{i}.bin").write_bytes(tag * (1000 + i))
    return write


def content(folder: Path) -> bytes:
    return (folder / "part0.bin").read_bytes()[:3]


def assert_readers_see_whole_steps(root: Path) -> None:
    """What a server or the trainer would find now: every step folder with a marker verifies."""
    for step in fs.stable_steps(root):
        fs.verify(fs.step_folder(root, step))


# --- step folders: publish, replace, retention ----------------------------------------------------------


def test_publishing_a_step_killed_anywhere_leaves_whole_steps_and_is_finished_at_the_next_start(tmp_path):
    def setup(root: Path):
        for step in (1, 2):
            fs.publish_dir(fs.step_folder(root, step), write_parts(b"old"), step)
        return lambda: fs.publish_dir(fs.step_folder(root, 3), write_parts(b"new"), 3)

    states = set()
    for _, root in every_kill(setup, tmp_path):
        assert_readers_see_whole_steps(root)
        assert fs.latest_stable(root)[0] in (2, 3)
        states |= set(hidden(root)) | {f"{p.name} unmarked" for p in root.glob("step_*") if not fs.is_stable(p)}
        fs.finish_interrupted(root)
        assert hidden(root) == []
        assert all(fs.is_stable(fs.step_folder(root, s)) for s in fs.step_folders(root))
        assert fs.step_folders(root) in ([1, 2], [1, 2, 3])
        fs.publish_dir(fs.step_folder(root, 3), write_parts(b"new"), 3)  # the resumed trainer publishes it
        assert fs.step_folders(root) == [1, 2, 3] and hidden(root) == []
        assert_readers_see_whole_steps(root)
    # the kills did land mid-write and between the rename and the marker
    assert states == {".step_000003.staging", "step_000003 unmarked"}


def test_replacing_a_step_killed_anywhere_never_shows_a_mix_of_old_and_new(tmp_path):
    def setup(root: Path):
        for step in (1, 2, 3):
            fs.publish_dir(fs.step_folder(root, step), write_parts(b"old"), step)
        return lambda: fs.publish_dir(fs.step_folder(root, 3), write_parts(b"new"), 3)

    seen = set()
    for _, root in every_kill(setup, tmp_path):
        assert_readers_see_whole_steps(root)
        fs.finish_interrupted(root)
        assert hidden(root) == []
        assert_readers_see_whole_steps(root)
        if fs.step_folder(root, 3).exists():
            seen.add(content(fs.step_folder(root, 3)))
        else:
            seen.add(None)  # killed between moving the old copy away and moving the new one in
        fs.publish_dir(fs.step_folder(root, 3), write_parts(b"new"), 3)
        assert content(fs.step_folder(root, 3)) == b"new" and hidden(root) == []
    assert seen == {b"old", b"new", None}


def test_retention_killed_anywhere_is_finished_and_never_trips_over_its_own_trash(tmp_path):
    """Steps 2 and 4 go; step 4 is a step published again after a resume, and an earlier session was
    killed while deleting its first copy (the trash name of primebuild before unique trash names)."""
    def setup(root: Path):
        for step in (1, 2, 3, 4, 5):
            fs.publish_dir(fs.step_folder(root, step), write_parts(b"old"), step)
        leftover = root / ".step_000004.trash"
        leftover.mkdir()
        (leftover / "model.safetensors").write_bytes(b"half deleted")
        return lambda: fs.remove_steps(root, [2, 4])

    for _, root in every_kill(setup, tmp_path):
        assert_readers_see_whole_steps(root)
        fs.finish_interrupted(root)
        assert hidden(root) == []
        fs.remove_steps(root, [2, 4])  # the next retention asks again; a step already gone is no error
        assert fs.step_folders(root) == [1, 3, 5] and hidden(root) == []


def test_the_reported_failure_a_leftover_trash_of_a_step_published_again(tmp_path):
    """After `kill -9` mid-retention the resumed run published step 31 again; retiring it failed with
    OSError: [Errno 39] Directory not empty: weights/step_000031 -> weights/.step_000031.trash."""
    weights = tmp_path / "weights"
    fs.publish_dir(fs.step_folder(weights, 31), write_parts(b"v1"), 31)
    os.rename(fs.step_folder(weights, 31), weights / ".step_000031.trash")  # the kill came after the rename
    fs.publish_dir(fs.step_folder(weights, 31), write_parts(b"v2"), 31)
    fs.publish_dir(fs.step_folder(weights, 32), write_parts(b"v2"), 32)
    fs.remove_steps(weights, [31])
    assert fs.step_folders(weights) == [32]
    assert fs.finish_interrupted(weights) == ["deleted weights/.step_000031.trash (an unfinished removal)"]
    assert hidden(weights) == []


def test_an_older_unmarked_folder_is_damage_and_is_left_to_verify_to_name(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        fs.publish_dir(fs.step_folder(root, step), write_parts(b"x"), step)
    (fs.step_folder(root, 2) / fs.STABLE).unlink()  # not a state a kill leaves: the newest is always last
    assert fs.finish_interrupted(root) == []
    assert fs.step_folders(root) == [1, 2, 3]


# --- checkpoints: DCP save, commit and retention together ----------------------------------------------


def test_a_checkpoint_killed_anywhere_resumes_from_a_whole_one(tmp_path):
    from primebuild.runtime.trainer.checkpoint import load_checkpoint, save_checkpoint
    from primebuild.runtime.trainer.model import DistEnv

    env = DistEnv(0, 1, torch.device("cpu"))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()

    def setup(root: Path):
        for step in (1, 2):
            save_checkpoint(root, step, model, optimizer, env, keep_last=2)
        return lambda: save_checkpoint(root, 3, model, optimizer, env, keep_last=2)

    resumed_from = set()
    for _, root in every_kill(setup, tmp_path):
        fs.finish_interrupted(root)
        assert hidden(root) == []
        step, folder = fs.latest_verified(root, warn=pytest.fail)
        assert load_checkpoint(folder, model, optimizer) == step
        resumed_from.add(step)
        save_checkpoint(root, 3, model, optimizer, env, keep_last=2)  # the step trained again
        assert fs.step_folders(root) == [2, 3] and hidden(root) == []
    assert resumed_from == {2, 3}


# --- the other writers of the run folder ---------------------------------------------------------------


def test_a_rollout_batch_or_a_json_record_killed_mid_write_is_whole_or_absent_and_cleaned(tmp_path):
    from trainer_fixtures import make_batch, make_tiny_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "model"))
    batch = make_batch(model, step=1)

    def setup(folder: Path):
        run = RunDir(folder)

        def write_both():
            save_batch(run.rollout(1), batch)
            write_json_atomic(run.orchestrator_state, {"eval_reward_before": 0.5})
        return write_both

    for _, folder in every_kill(setup, tmp_path / "kills"):
        run = RunDir(folder)
        finish_interrupted(run)
        assert hidden(run.rollouts) == [] and hidden(run.root) == []
        if run.rollout(1).exists():
            assert len(load_batch(run.rollout(1)).samples) == len(batch.samples)
        if run.orchestrator_state.exists():
            assert json.loads(run.orchestrator_state.read_text()) == {"eval_reward_before": 0.5}


def test_a_torn_metrics_line_is_cut_so_the_next_row_is_readable(tmp_path):
    run = RunDir(tmp_path)
    MetricsWriter(run.metrics).write(1, {"loss": 0.5, "grad_norm": 1.0})
    torn = '{"step": 2, "role": "trainer", "name": "lo'  # a write the kill cut short
    with open(run.metrics, "a") as f:
        f.write(torn)
    assert finish_interrupted(run) == [f"cut {len(torn)} bytes off the end of metrics.jsonl (a line whose "
                                       "writer was killed)"]
    MetricsWriter(run.metrics).write(2, {"loss": 0.25})
    assert read_metrics(run.metrics) == {1: {"loss": 0.5, "grad_norm": 1.0}, 2: {"loss": 0.25}}


# --- reconcile: the checkpoint a run resumes from and its metrics row -----------------------------------


def run_with(tmp_path: Path, checkpoints: list[int], rows: list[int], weights: list[int]) -> RunDir:
    run = RunDir(tmp_path / "run")
    for step in checkpoints:
        fs.publish_dir(fs.step_folder(run.checkpoints, step), write_parts(b"ckp"), step)
    for step in weights:
        fs.publish_dir(fs.step_folder(run.weights, step), write_parts(b"wts"), step)
    writer = MetricsWriter(run.metrics)
    for step in rows:
        writer.write(step, {"loss": 0.1 * step})
    return run


def test_a_checkpoint_whose_metrics_row_was_never_written_is_trained_again(tmp_path):
    """Killed between checkpoint 3 and its row: resuming after 3 would leave step 3 out of metrics.jsonl."""
    run = run_with(tmp_path, checkpoints=[1, 2, 3], rows=[1, 2], weights=[1, 2, 3])
    echoed = []
    assert reconcile(run, echoed.append) == 2
    assert any("step 3 has a checkpoint but no metrics row" in e and "resuming after step 2" in e for e in echoed)
    assert fs.step_folders(run.checkpoints) == [1, 2] and fs.step_folders(run.weights) == [1, 2]
    assert reconcile(run, echoed.append) == 2  # idempotent


def test_the_first_checkpoint_without_its_row_restarts_from_the_model(tmp_path):
    run = run_with(tmp_path, checkpoints=[1], rows=[], weights=[1])
    run.metrics.write_text("")
    assert reconcile(run, lambda _: None) == 0
    assert fs.step_folders(run.checkpoints) == [] and fs.step_folders(run.weights) == []


def test_a_checkpoint_without_its_row_is_kept_when_the_step_before_has_none(tmp_path):
    """Checkpoints every 2 steps: falling back would retrain two steps for one row."""
    run = run_with(tmp_path, checkpoints=[2, 4], rows=[1, 2, 3], weights=[3, 4])
    echoed = []
    assert reconcile(run, echoed.append) == 4
    assert any("its row stays missing" in e for e in echoed)
    assert fs.step_folders(run.checkpoints) == [2, 4]


def test_reconcile_finishes_every_leftover_at_once_and_names_each(tmp_path):
    run = run_with(tmp_path, checkpoints=[1, 2], rows=[1, 2], weights=[1, 2])
    (run.checkpoints / ".step_000003.staging").mkdir()
    (run.weights / ".step_000001.trash-0a1b2c3d").mkdir()
    fs.step_folder(run.weights, 3).mkdir()  # renamed into place, killed before its marker
    run.rollouts.mkdir()
    (run.rollouts / ".step_000004.safetensors.k2j4.tmp").write_bytes(b"half")
    (run.root / ".launch.json.4242.tmp").write_text("{")
    echoed = []
    assert reconcile(run, echoed.append) == 2
    text = "\n".join(echoed)
    for name in (".step_000003.staging", ".step_000001.trash-0a1b2c3d", "weights/step_000003",
                 ".step_000004.safetensors.k2j4.tmp", ".launch.json.4242.tmp"):
        assert name in text, text
    assert hidden(run.root) == hidden(run.weights) == hidden(run.checkpoints) == hidden(run.rollouts) == []
    assert reconcile(run, echoed.append) == 2 and len(echoed) == len(text.splitlines())  # nothing left to do
