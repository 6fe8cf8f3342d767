"""SFT of an environment's demonstrations on the RL trainer (primebuild/runtime/trainer/env_sft.py): the old
loop's loss mask as packed documents, 1 rank vs 2 gloo ranks (FSDP2) on the same loss trajectory, the early
stop on rank 0's greedy validation reward that every rank obeys, and the shipped SFT manifests on it."""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")

from primebuild.contracts.sft import EnvSFTConfig  # noqa: E402
from primebuild.runtime.envs.framing import framing  # noqa: E402
from primebuild.runtime.envs.registry import load_environment  # noqa: E402
from primebuild.runtime.models.char_tokenizer import build_char_tokenizer  # noqa: E402
from primebuild.runtime.sft import run_trainer_sft  # noqa: E402
from primebuild.runtime.trainer.env_sft import demonstration_samples  # noqa: E402

ENV_SFT_MANIFESTS = ["reverse-text-sft", "wordle-sft", "tool-use-sft", "tool-use-keys-sft", "swe-tiny-sft",
                     "reverse-text-moe-sft", "reverse-text-teacher-sft"]


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """A random tiny Qwen3 over the char tokenizer (reverse-text's architecture)."""
    from primebuild.runtime.models.tiny import init_tiny_model, save_hf_folder, tiny_config

    path = tmp_path_factory.mktemp("base") / "model"
    save_hf_folder(init_tiny_model(tiny_config(), 0), build_char_tokenizer(), str(path))
    return path


def test_targets_are_the_model_turns_and_their_eos_as_in_the_old_loop():
    tokenizer = build_char_tokenizer()
    env = load_environment("reverse-text", None, {})
    task = env.sample_tasks(random.Random(0), 1)[0]
    (sample,) = demonstration_samples(env, framing(env, tokenizer), tokenizer, [task], random.Random(0))
    ids = sample.prompt_ids + sample.completion_ids
    trained = [i for i, m in zip(sample.completion_ids, sample.completion_mask, strict=True) if m]
    assert trained == tokenizer(task.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[-len(trained):] == trained  # the prompt comes first and is given
    # a multi-turn episode: the environment's replies between the model's turns are given, not learned
    wordle = load_environment("wordle", None, {"word_length": 4, "alphabet": "abcdef", "max_guesses": 6})
    (episode,) = demonstration_samples(wordle, framing(wordle, tokenizer), tokenizer,
                                       wordle.sample_tasks(random.Random(1), 1), random.Random(1))
    mask = episode.completion_mask
    eos_targets = sum(1 for i, m in zip(episode.completion_ids, mask, strict=True) if m and i == tokenizer.eos_token_id)
    assert 0 in mask and eos_targets >= 2  # several model turns, each ending in a trained <eos>
    assert sum(mask) < len(mask)


def test_one_rank_and_two_fsdp_ranks_follow_the_same_loss_trajectory(char_model, tmp_path):
    common = dict(model_path=str(char_model), steps=4, batch_size=16, micro_batch_tokens=128, warmup_steps=2,
                  stop_at_reward=None, eval_n=0)
    one = run_trainer_sft(EnvSFTConfig(ranks=1, **common), str(tmp_path / "one"))  # in this process
    two = run_trainer_sft(EnvSFTConfig(ranks=2, **common), str(tmp_path / "two"))  # torchrun, gloo, FSDP2
    assert one["ranks"] == 1 and two["ranks"] == 2 and one["steps"] == two["steps"] == 4
    assert one["loss_curve"] == pytest.approx(two["loss_curve"], rel=1e-5)
    assert one["loss_curve"][-1] < one["loss_curve"][0]  # it learns
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)


def test_the_early_stop_is_rank_zeros_greedy_reward_and_every_rank_stops(char_model, tmp_path):
    from primebuild.runtime.evaluate import evaluate_greedy

    common = dict(model_path=str(char_model), batch_size=8, micro_batch_tokens=256, min_steps=2, check_every=2,
                  validation_n=16, eval_n=20)
    # reachable at the first check: both ranks leave the loop at step 2 (a rank that went on would hang the run)
    stopped = run_trainer_sft(EnvSFTConfig(steps=50, stop_at_reward=0.0, ranks=2, **common), str(tmp_path / "stop"))
    assert stopped["steps"] == 2 and stopped["validation_curve"] == [[2, stopped["validation_reward"]]]
    # unreachable: runs to the cap, every check recorded
    capped = run_trainer_sft(EnvSFTConfig(steps=5, stop_at_reward=1.0, **common), str(tmp_path / "cap"))
    assert capped["steps"] == 5 and [s for s, _ in capped["validation_curve"]] == [2, 4]
    assert 0.0 <= capped["validation_reward"] < 0.2
    # the folder written is the model that was scored
    env = load_environment("reverse-text", None, {})
    assert evaluate_greedy(tmp_path / "cap", env, n=20) == pytest.approx(capped["eval_reward"], abs=1e-9)


@pytest.mark.parametrize("name", ENV_SFT_MANIFESTS)
def test_the_environment_sft_manifests_plan_on_the_trainer(name):
    from conftest import plan_json

    from primebuild.builders.derivations import SFT_ENV_BUILDER

    plan = plan_json(f"manifests/{name}.yaml", design=False)
    build = plan["build"]
    assert build["builder"] == SFT_ENV_BUILDER and build["config"]["kind"] == "env-sft"
    assert build["config"]["ranks"] >= 1 and build["config"]["model_path"] == "{model_path}"
    memory = plan["memory"]["sft-trainer"]
    # rank 0's greedy-validation copy of the weights is in the model: two fp32 copies of every parameter
    assert memory["breakdown"]["overhead"] >= 2 * 4 * plan["model"]["total_params"]
    assert memory["fits"]
    assert "demonstrations trains on the RL trainer" in json.dumps(plan["estimates"])


def _weights(folder):
    return (folder / "model.safetensors").read_bytes()


def test_same_seed_same_weights_and_mid_run_evaluation_changes_nothing(char_model, tmp_path):
    common = dict(model_path=str(char_model), steps=4, batch_size=8, micro_batch_tokens=256, warmup_steps=2,
                  stop_at_reward=None, eval_n=0)
    plain = run_trainer_sft(EnvSFTConfig(seed=5, **common), str(tmp_path / "plain"))
    watched = run_trainer_sft(EnvSFTConfig(seed=5, **{**common, "eval_n": 10, "eval_every": 2}), str(tmp_path / "watched"))
    run_trainer_sft(EnvSFTConfig(seed=6, **common), str(tmp_path / "other"))
    assert [s for s, _ in watched["eval_curve"]] == [2]  # every 2 steps before the last; the last is eval_reward
    assert watched["loss_curve"] == plain["loss_curve"] and plain["eval_reward"] is None
    assert _weights(tmp_path / "plain") == _weights(tmp_path / "watched")  # greedy decoding draws no random numbers
    assert _weights(tmp_path / "plain") != _weights(tmp_path / "other")


def test_an_existing_output_folder_is_refused(char_model, tmp_path):
    from primebuild.errors import UserError

    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match="already exists"):
        run_trainer_sft(EnvSFTConfig(model_path=str(char_model), steps=1), str(tmp_path / "out"))


@pytest.mark.slow
def test_the_default_stop_lands_in_the_rl_band(full_sft_store):
    """The shipped recipe (reverse-text-sft.yaml's: stop at 0.77, batch 64, lr 1e-3, warm-up 50) on the
    trainer: training-side validation reaches the stop, held-out lands where RL has signal. The build is the
    session's (conftest full_sft_store: `primebuild run reverse-text-sft.yaml` as shipped), which
    tests/test_cluster_slurm.py starts its RL from."""
    from primebuild.contracts.sft import RL_START_REWARD

    (entry,) = full_sft_store.glob("*-reverse-text-sft")
    metrics = json.loads((entry / "sft_metrics.json").read_text())
    assert metrics["trainer"] == "torchtitan" and metrics["ranks"] == 1  # the RL trainer's engine, in process
    assert metrics["steps"] < 300 and metrics["validation_reward"] >= RL_START_REWARD
    assert 0.70 <= metrics["eval_reward"] <= 0.86  # held out: never used to decide when to stop
