"""SFT on reverse-text: completion-only loss, determinism, the CLI, and that it actually learns."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from primebuild.contracts.sft import RL_START_REWARD, SFTConfig  # noqa: E402
from primebuild.errors import UserError  # noqa: E402
from primebuild.runtime.envs.base import MODEL  # noqa: E402
from primebuild.runtime.envs.reverse_text import ReverseTextEnv  # noqa: E402
from primebuild.runtime.evaluate import evaluate_greedy  # noqa: E402
from primebuild.runtime.models.char_tokenizer import build_char_tokenizer  # noqa: E402
from primebuild.runtime.models.tiny import build_tiny_model, init_tiny_model, tiny_config  # noqa: E402
from primebuild.runtime.sft import completion_loss, encode_batch, run_sft  # noqa: E402

torch.set_num_threads(1)


def test_only_completion_tokens_and_eos_are_targets():
    tokenizer = build_char_tokenizer()
    ids, mask = encode_batch(tokenizer, ["abc>", "hello>"], [[(MODEL, "cba")], [(MODEL, "olleh")]])
    a, b, c, sep, eos, pad, bos = 4, 5, 6, 30, 2, 0, 1
    assert ids[0].tolist() == [bos, a, b, c, sep, c, b, a, eos, pad, pad, pad, pad]
    # mask[t] marks "token t+1 is a target": c, b, a, <eos> (positions 5..8)
    assert mask[0].tolist() == [False] * 4 + [True] * 4 + [False] * 4
    assert mask[1].sum() == len("olleh") + 1
    assert mask.shape == (2, ids.shape[1] - 1)


def test_completion_loss_is_the_mean_over_target_tokens_only():
    tokenizer = build_char_tokenizer()
    model = init_tiny_model(tiny_config(), seed=0)
    ids, mask = encode_batch(tokenizer, ["abc>", "hello>"], [[(MODEL, "cba")], [(MODEL, "olleh")]])
    logits = model(input_ids=ids).logits[:, :-1]
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    expected = per_token[mask].mean()
    assert completion_loss(model, ids, mask).item() == pytest.approx(expected.item(), rel=1e-6)
    # Changing a prompt letter changes what the model conditions on but adds no target of its own.
    assert int(mask.sum()) == 10


def run_sft_to(out: str, **fields) -> dict:
    return run_sft(SFTConfig(**fields), out)


def _weights(folder):
    return (folder / "model.safetensors").read_bytes()


def test_sft_is_deterministic_given_a_seed(tmp_path):
    base = dict(steps=12, eval_n=0)
    m1 = run_sft_to(str(tmp_path / "a"), seed=5, **base)
    m2 = run_sft_to(str(tmp_path / "b"), seed=5, **base)
    run_sft_to(str(tmp_path / "c"), seed=6, **base)
    assert m1["final_loss"] == m2["final_loss"]
    assert _weights(tmp_path / "a") == _weights(tmp_path / "b")
    assert _weights(tmp_path / "a") != _weights(tmp_path / "c")
    assert m1["steps"] == 12 and m1["eval_reward"] is None


def test_mid_run_evaluation_does_not_change_training(tmp_path):
    base = dict(steps=6, seed=2, eval_n=20)
    plain = run_sft_to(str(tmp_path / "plain"), **base)
    watched = run_sft_to(str(tmp_path / "watched"), eval_every=2, **base)
    assert [s for s, _ in watched["eval_curve"]] == [2, 4]
    assert watched["final_loss"] == plain["final_loss"]
    assert _weights(tmp_path / "plain") == _weights(tmp_path / "watched")


def test_stop_at_reward_stops_at_the_first_check_that_reaches_it(tmp_path):
    config = SFTConfig(steps=50, stop_at_reward=0.0, min_steps=4, check_every=2, eval_n=0)
    metrics = run_sft(config, str(tmp_path / "stop"))
    assert metrics["steps"] == 4 and metrics["validation_reward"] >= 0.0
    # Unreachable target: runs to the cap, reporting the last validation reward it saw.
    capped = run_sft(SFTConfig(steps=6, stop_at_reward=1.0, min_steps=4, validation_n=20, eval_n=0),
                     str(tmp_path / "cap"))
    assert capped["steps"] == 6 and 0.0 <= capped["validation_reward"] < 0.2


def test_sft_refuses_an_existing_output_folder(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match="already exists"):
        run_sft_to(str(tmp_path / "out"), steps=1)


def test_sft_continues_from_an_existing_folder(tmp_path):
    start = build_tiny_model(tmp_path / "start", seed=1)
    metrics = run_sft_to(str(tmp_path / "next"), init_model_dir=str(start), steps=3, eval_n=0)
    assert metrics["steps"] == 3
    assert _weights(tmp_path / "next") != _weights(start)


def test_cli_writes_a_loadable_folder_and_prints_metrics(tmp_path):
    out = tmp_path / "cli"
    config = tmp_path / "sft.json"
    config.write_text(SFTConfig(steps=3, seed=1).model_dump_json())
    cmd = [sys.executable, "-m", "primebuild.runtime.sft", "--config", str(config), "--out", str(out), "--no-early-stop"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["metrics"]["steps"] == 3 and 0.0 <= report["metrics"]["eval_reward"] <= 1.0
    assert report["config"]["stop_at_reward"] is None
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.mark.slow
def test_150_steps_lift_the_reward_far_above_random_init(tmp_path):
    env = ReverseTextEnv()
    random_init = evaluate_greedy(build_tiny_model(tmp_path / "init", seed=0), env)
    metrics = run_sft_to(str(tmp_path / "sft"), steps=150, seed=0, stop_at_reward=None)
    assert metrics["steps"] == 150
    assert random_init < 0.05
    assert metrics["eval_reward"] > 0.6
    assert metrics["final_loss"] < 1.0
    # The saved folder evaluates to the reward reported at the end of training.
    assert evaluate_greedy(tmp_path / "sft", env) == pytest.approx(metrics["eval_reward"], abs=1e-9)


@pytest.mark.slow
def test_stop_at_rl_start_reward_lands_in_the_rl_band(tmp_path):
    metrics = run_sft(SFTConfig(seed=1), str(tmp_path / "sft"))  # the defaults
    assert metrics["steps"] < 300
    assert metrics["validation_reward"] >= RL_START_REWARD
    assert 0.70 <= metrics["eval_reward"] <= 0.86  # held out: never used to decide when to stop
