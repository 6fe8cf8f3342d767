"""Checkpoints and published weights you can trust: every step folder lists its files with sha256 in its
STABLE marker; damage is detected and named, resume falls back to the newest folder that verifies, a
non-finite step stops the run before anything of it is applied or published."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import call_cli
from safetensors.torch import load_file, save_file
from trainer_fixtures import make_tiny_model, trainer_config, write_rollouts

from primebuild.contracts.run_dir import RunDir
from primebuild.errors import UserError
from primebuild.runtime.metrics import read_metrics
from primebuild.runtime.resume import reconcile
from primebuild.runtime.rollout_file import load_batch, save_batch
from primebuild.runtime.trainer.main import run_trainer
from primebuild.runtime.weight_sync import filesystem as fs


def flip_a_byte(path: Path, offset: int = -9) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def folder_with(tmp_path: Path, files: dict[str, bytes]) -> Path:
    def write(stage: Path) -> None:
        for name, data in files.items():
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            (stage / name).write_bytes(data)
    return fs.publish_dir(fs.step_folder(tmp_path, 1), write, 1)


@pytest.mark.parametrize(("damage", "named"), [
    (lambda f: (f / "a.bin").write_bytes(b"012"), "a.bin: 3 bytes, STABLE says 10 (truncated?)"),
    (lambda f: flip_a_byte(f / "sub" / "b.bin"), "sub/b.bin: sha256 differs"),
    (lambda f: (f / "a.bin").unlink(), "a.bin: missing"),
    (lambda f: (f / "extra").write_text("x"), "extra: not listed in STABLE"),
    (lambda f: (f / "STABLE").unlink(), "no STABLE marker"),
])
def test_damage_to_a_step_folder_is_detected_and_named(tmp_path, damage, named):
    folder = folder_with(tmp_path, {"a.bin": b"0123456789", "sub/b.bin": b"abcdefghijklmnop"})
    fs.verify(folder)  # intact
    damage(folder)
    with pytest.raises(fs.DamagedFolder) as err:
        fs.verify(folder)
    assert named in str(err.value) and str(folder) in str(err.value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    model = make_tiny_model(root / "model")
    write_rollouts(root / "src", model, range(1, 6))
    return model, root / "src" / "rollouts"


def new_run(tmp_path: Path, tiny, **fields):
    model, rollouts = tiny
    run = RunDir(tmp_path / "run")
    run.rollouts.mkdir(parents=True, exist_ok=True)
    for f in rollouts.iterdir():
        (run.rollouts / f.name).write_bytes(f.read_bytes())
    return run, trainer_config(model_path=str(model), run_dir=str(run.root), **fields)


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path, tiny, caplog):
    run, cfg = new_run(tmp_path, tiny, max_steps=4, checkpoint_every=1)
    run_trainer(cfg)
    shard = sorted(fs.step_folder(run.checkpoints, 4).glob("*.distcp"))[0]
    flip_a_byte(shard)
    (fs.step_folder(run.checkpoints, 3) / "trainer_state.json").write_text('{"step": 3')  # truncated
    echoed = []
    assert reconcile(run, echoed.append) == 2  # what `run --resume` does before starting anything
    assert any("step_000004" in e and "sha256 differs" in e for e in echoed)
    assert fs.step_folders(run.weights) == [1, 2]  # weights trained past the checkpoint are dropped
    with caplog.at_level("WARNING"):
        run_trainer(cfg.model_copy(update={"max_steps": 5}))
    assert "skipping step_000004" in caplog.text and "skipping step_000003" in caplog.text
    lines = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    assert [x["step"] for x in lines if x["name"] == "loss"] == [1, 2, 3, 4, 3, 4, 5]  # 3, 4 trained again
    assert fs.step_folders(run.weights) == [1, 2, 3, 4, 5] and fs.latest_verified(run.checkpoints)[0] == 5


def test_resume_with_no_checkpoint_that_verifies_is_a_clean_error(tmp_path, tiny):
    run, cfg = new_run(tmp_path, tiny, max_steps=2, checkpoint_every=1)
    run_trainer(cfg)
    for step in (1, 2):
        (fs.step_folder(run.checkpoints, step) / fs.STABLE).unlink()
    with pytest.raises(UserError, match="no checkpoint verifies"):
        run_trainer(cfg.model_copy(update={"max_steps": 3}))


def test_a_nan_loss_stops_the_run_at_its_step_and_publishes_nothing_of_it(tmp_path, tiny):
    run, cfg = new_run(tmp_path, tiny, max_steps=4, checkpoint_every=1)
    batch = load_batch(run.rollout(3))
    batch.samples[1].advantage = float("nan")  # bad data: the loss of step 3 is NaN
    save_batch(run.rollout(3), batch)
    config = tmp_path / "trainer.json"
    config.write_text(cfg.model_dump_json())
    done = subprocess.run([sys.executable, "-m", "primebuild.runtime.trainer.main", "--config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "error: step 3: the loss of samples" in done.stderr and "is not finite" in done.stderr
    assert "Traceback" not in done.stderr
    assert fs.step_folders(run.weights) == [1, 2] and fs.step_folders(run.checkpoints) == [1, 2]
    assert sorted(read_metrics(run.metrics)) == [1, 2]


def test_inference_refuses_damaged_or_non_finite_weights(tmp_path):
    from inference_helpers import save_model

    from primebuild.runtime.inference.engine import Engine

    base = save_model(tmp_path / "base")
    engine = Engine(str(base), max_num_seqs=2, max_model_len=32)
    try:
        tensors = load_file(base / "model.safetensors")
        published = fs.publish_dir(fs.step_folder(tmp_path / "weights", 1), lambda d: _copy_folder(base, d), 1)
        engine.update_weights(str(published), 1)  # intact: loads
        flip_a_byte(published / "model.safetensors")
        with pytest.raises(UserError, match="model.safetensors: sha256 differs"):
            engine.update_weights(str(published), 2)
        poisoned = tmp_path / "poisoned"
        _copy_folder(base, poisoned)
        name = next(k for k, v in tensors.items() if v.is_floating_point() and v.dim() == 2)
        save_file({**tensors, name: torch.full_like(tensors[name], float("nan"))}, poisoned / "model.safetensors")
        with pytest.raises(UserError, match="non-finite values"):
            engine.update_weights(str(poisoned), 3)
        assert engine.version == 1  # the served weights stayed the verified ones
    finally:
        engine.shutdown()


def _copy_folder(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())


def test_primebuild_verify_names_every_damaged_folder(tmp_path, tiny, capsys):
    run, cfg = new_run(tmp_path, tiny, max_steps=2, checkpoint_every=1)
    run_trainer(cfg)
    (run.plan).write_text("{}")  # a run folder (verify reads no plan content)
    clean = call_cli(capsys, "verify", run.root)
    assert clean.code == 0 and "4 folder(s) checked, 0 damaged" in clean.out
    flip_a_byte(fs.step_folder(run.weights, 2) / "model.safetensors")
    (fs.step_folder(run.checkpoints, 1) / fs.STABLE).unlink()
    damaged = call_cli(capsys, "verify", run.root, "-o", "json")
    assert damaged.code == 2
    rows = {(r["kind"], r["step"]): r for r in json.loads(damaged.out)["folders"]}
    assert "sha256 differs" in rows[("weights", 2)]["problem"]
    assert "no STABLE marker" in rows[("checkpoint", 1)]["problem"]
    assert rows[("checkpoint", 2)]["ok"] and rows[("weights", 1)]["ok"]
