"""The trainer loop in one process on a tiny random Qwen3: publish, metrics, stop, checkpoint + resume."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_fixtures import make_tiny_model, trainer_config, write_rollouts
from transformers import AutoModelForCausalLM

from primebuild.errors import UserError
from primebuild.runtime.metrics import read_metrics
from primebuild.runtime.rollout_file import load_batch
from primebuild.runtime.trainer.losses import resolve_loss
from primebuild.runtime.trainer.main import main, run_trainer, train_step
from primebuild.runtime.trainer.model import DistEnv, full_state_dict, load_model
from primebuild.runtime.weight_sync.filesystem import is_stable, publish_hf_weights, stable_steps, step_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(root / "model")
    rollouts = root / "rollouts_src"
    write_rollouts(rollouts, model, range(1, 5))
    return model, rollouts / "rollouts"


def new_run(tmp_path, tiny, name="run", **overrides):
    model, rollouts = tiny
    run = tmp_path / name
    (run / "rollouts").mkdir(parents=True)
    for f in rollouts.iterdir():
        (run / "rollouts" / f.name).write_bytes(f.read_bytes())
    cfg = dict(model_path=str(model), run_dir=str(run), max_steps=3, lr=1e-3, micro_batch_tokens=64, loss="dppo-kl")
    cfg.update(overrides)
    return trainer_config(**cfg)


def test_step1_mismatch_kl_is_zero_and_weights_publish_atomically(tmp_path, tiny):
    cfg = new_run(tmp_path, tiny, max_steps=2, warmup_steps=2)
    run_trainer(cfg)
    m = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert sorted(m) == [1, 2]
    # Same fp32 weights on both sides and logprobs from an unpadded HF forward: no mismatch.
    assert m[1]["mismatch_kl"] < 1e-6 and m[1]["behaviour_kl"] < 1e-6
    # step-2 rollouts come from the base model, one step stale: no same-weights tokens to measure the
    # engine-vs-trainer mismatch on, and the behaviour KL shows the staleness
    assert m[2]["mismatch_kl"] is None
    assert m[2]["behaviour_kl"] > 1e-6
    assert m[2]["async_lag_mean"] == 1.0
    assert m[1]["lr"] == pytest.approx(5e-4) and m[2]["lr"] == pytest.approx(1e-3)
    assert m[1]["tokens"] > 0 and 0 < m[1]["entropy"] < 5.0
    weights = Path(cfg.run_dir) / "weights"
    assert stable_steps(weights) == [1, 2]
    assert not [p for p in weights.iterdir() if p.name.startswith(".")]
    folder = step_folder(weights, 2)
    assert {"config.json", "model.safetensors", "STABLE"} <= {p.name for p in folder.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(cfg.model_path)
    changed = [k for k, v in loaded.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert changed  # training moved the weights


def test_published_weights_equal_trainer_params(tmp_path, tiny):
    cfg = new_run(tmp_path, tiny)
    env = DistEnv(0, 1, torch.device("cpu"))
    model = load_model(cfg.model_path, env, "float32", activation_checkpointing=True, logprob_chunk_tokens=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = load_batch(Path(cfg.run_dir) / "rollouts" / "step_000001.safetensors")
    stats = train_step(model, opt, batch, cfg, resolve_loss("dppo-kl"), env, 1)
    assert torch.isfinite(torch.tensor(stats["loss"]))
    folder = publish_hf_weights(tmp_path / "w", 1, full_state_dict(model, torch.float32), model.config)
    assert is_stable(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for k, v in model.hf.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_resume_continues_identically(tmp_path, tiny):
    straight = new_run(tmp_path, tiny, "straight", max_steps=4, checkpoint_every=0)
    run_trainer(straight)
    # Interrupted: 2 steps (checkpointed at the end), then a resumed process does steps 3 and 4.
    first = new_run(tmp_path, tiny, "resumed", max_steps=2, checkpoint_every=1, keep_checkpoints=1)
    run_trainer(first)
    assert stable_steps(Path(first.run_dir) / "checkpoints") == [2]
    run_trainer(first.model_copy(update={"max_steps": 4, "resume": True}))

    lines = [json.loads(x) for x in (Path(first.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert sorted({x["step"] for x in lines}) == [1, 2, 3, 4]
    assert [x["step"] for x in lines if x["name"] == "loss"] == [1, 2, 3, 4]  # continuous, no repeats
    a = read_metrics(Path(straight.run_dir) / "metrics.jsonl")
    b = read_metrics(Path(first.run_dir) / "metrics.jsonl")
    for step in (1, 2, 3, 4):
        for name in ("loss", "grad_norm", "behaviour_kl", "entropy"):
            assert b[step][name] == pytest.approx(a[step][name], rel=1e-9, abs=1e-12), (step, name)
    wa = load_file(step_folder(Path(straight.run_dir) / "weights", 4) / "model.safetensors")
    wb = load_file(step_folder(Path(first.run_dir) / "weights", 4) / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_stop_file_and_timeout(tmp_path, tiny):
    cfg = new_run(tmp_path, tiny, max_steps=10, rollout_timeout_s=0.5, poll_interval_s=0.05)
    (Path(cfg.run_dir) / "STOP").touch()
    run_trainer(cfg)  # stops before step 1: nothing trained, nothing published
    assert not (Path(cfg.run_dir) / "metrics.jsonl").exists()
    (Path(cfg.run_dir) / "STOP").unlink()
    with pytest.raises(TimeoutError, match="step_000005.safetensors"):
        run_trainer(cfg)  # trains the 4 batches there are, then waits in vain for step 5
    assert sorted(read_metrics(Path(cfg.run_dir) / "metrics.jsonl")) == [1, 2, 3, 4]


def test_temperature_mismatch_is_a_user_error(tmp_path, tiny):
    cfg = new_run(tmp_path, tiny, temperature=0.7)
    with pytest.raises(UserError, match="temperature"):
        run_trainer(cfg)


def test_cli_reports_config_errors(tmp_path, capsys):
    bad = tmp_path / "cfg.json"
    bad.write_text(json.dumps({"model_path": "m", "run_dir": "r", "max_steps": 0, "los": "x"}))
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "max_steps" in err and "los" in err


def test_moe_model_trains_and_publishes_loadable_weights(tmp_path):
    model = make_tiny_model(tmp_path / "moe", moe=True)
    run = tmp_path / "run"
    write_rollouts(run, model, range(1, 2), num_prompts=2)
    cfg = trainer_config(model_path=str(model), run_dir=str(run), max_steps=1, lr=1e-3, loss="cispo")
    run_trainer(cfg)
    m = read_metrics(run / "metrics.jsonl")
    assert m[1]["mismatch_kl"] < 1e-6
    loaded = AutoModelForCausalLM.from_pretrained(step_folder(run / "weights", 1))
    base = AutoModelForCausalLM.from_pretrained(model)
    assert any(not torch.equal(v, base.state_dict()[k]) for k, v in loaded.state_dict().items())
