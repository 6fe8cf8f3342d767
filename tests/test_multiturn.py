"""Multi-turn rollouts end to end through a real embedded engine, and what the trainer does with them.

One rollout is one token sequence: model turns sampled by the server (token in, token out), environment
replies appended as environment tokens. The trainer must score every model token with the log-prob the
server sampled it with (same weights, fp32: equal to float noise) across turn boundaries, and give the
environment's tokens no gradient at all.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from inference_helpers import serve_folder
from transformers import AutoTokenizer

from primebuild.runtime.envs.base import ENVIRONMENT, MODEL
from primebuild.runtime.envs.long_tail import LongTailEnv
from primebuild.runtime.envs.transcript import encode_prompt, encode_reply
from primebuild.runtime.models.tiny import build_tiny_model
from primebuild.runtime.orchestrator.client import InferenceClient
from primebuild.runtime.orchestrator.rollout import RolloutRunner
from primebuild.runtime.trainer.batch import pack
from primebuild.runtime.trainer.losses import resolve_loss
from primebuild.runtime.trainer.model import DistEnv, load_model

TURNS = 4


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """A group of 4 episodes of 4 turns each (long-tail with a constant length), sampled by the server."""
    model = build_tiny_model(tmp_path_factory.mktemp("mt") / "model", seed=3)
    env = LongTailEnv(turns_p50=TURNS, turns_p99=TURNS, latency_p50_s=0.001, latency_p99_s=0.001, max_turns=TURNS,
                      min_length=2, max_length=3)
    task = env.sample_tasks(random.Random(0), 1)[0]
    tokenizer = AutoTokenizer.from_pretrained(model)
    runner = RolloutRunner(tokenizer, max_tokens_per_turn=6, seq_len=120)
    with serve_folder(model, max_model_len=120) as served:
        client = InferenceClient(served.v1, "tiny")

        async def play():
            async def sample(prompt_ids, **kw):
                return await client.complete(prompt_ids, top_p=1.0, **kw)
            try:
                return await runner.group(sample, env, task, n=4, temperature=1.0, seed=11)
            finally:
                await client.close()

        group = asyncio.run(play())
    return model, tokenizer, env, task, group


def test_a_rollout_is_one_sequence_of_model_turns_and_environment_replies(rollouts):
    _, tokenizer, env, task, group = rollouts
    assert len(group) == 4
    strings = task.info["strings"]
    for rollout in group:
        t = rollout.transcript
        assert t.turns == TURNS and rollout.finish == "episode"
        assert t.prompt_ids == encode_prompt(tokenizer, env.format_prompt(task))
        # the environment's replies sit between the model's turns, verbatim, masked out
        replies = [encode_reply(tokenizer, s + ">") for s in strings[1:]]
        spans, current, kind = [], [], None
        for token, mask in zip(t.completion_ids, t.loss_mask, strict=True):
            if mask != kind and current:
                spans.append((kind, current))
                current = []
            kind = mask
            current.append(token)
        spans.append((kind, current))
        assert [ids for m, ids in spans if m == 0] == replies
        assert [m for m, _ in spans] == [1, 0, 1, 0, 1, 0, 1]
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if not m)
        assert all(lp < 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m)
        assert t.turn_versions == [0] * TURNS
        sample = rollout.sample(env.id)
        sample.validate_shapes("rollout")
        assert sample.num_loss_tokens == t.model_tokens and sample.policy_versions == [0] * TURNS
    assert len({tuple(r.transcript.completion_ids) for r in group}) > 1  # sampled, not copies


def _micro_batch(model_dir, group, env_id):
    samples = [r.sample(env_id) for r in group]
    for s in samples:
        s.advantage = 1.0 if s.reward > 0.3 else -1.0
    (mb,) = pack(samples, micro_batch_tokens=10_000, world_size=1)[0]
    policy = load_model(str(model_dir), DistEnv(0, 1, torch.device("cpu")), "float32", False, 512)
    return policy, mb


def test_the_trainer_scores_every_model_token_as_the_server_sampled_it(rollouts):
    model_dir, _, env, _, group = rollouts
    policy, mb = _micro_batch(model_dir, group, env.id)
    with torch.no_grad():
        lp, _ = policy(mb.input_ids, mb.position_ids, 1.0)
    trained = mb.loss_mask
    assert int(trained.sum()) == sum(r.transcript.model_tokens for r in group)
    diff = (lp - mb.inference_logprobs)[trained].abs().max().item()
    assert diff < 1e-4, diff  # the same weights in fp32: turns after environment replies included


def test_environment_tokens_carry_zero_gradient(rollouts):
    model_dir, _, env, _, group = rollouts
    policy, mb = _micro_batch(model_dir, group, env.id)
    loss_fn = resolve_loss("grpo")

    def gradients(inference_logprobs, advantages):
        policy.zero_grad(set_to_none=True)
        lp, _ = policy(mb.input_ids, mb.position_ids, 1.0)
        lp.retain_grad()
        loss, _ = loss_fn(lp, inference_logprobs, advantages, mb.loss_mask)
        loss.backward()
        return lp.grad.clone(), [p.grad.clone() for p in policy.parameters()]

    lp_grad, params = gradients(mb.inference_logprobs, mb.advantages)
    environment = mb.real_tokens & ~mb.loss_mask & (mb.position_ids > 0)  # a document's first token: no prediction
    assert environment.any()
    assert torch.count_nonzero(lp_grad[environment]) == 0
    assert torch.count_nonzero(lp_grad[mb.loss_mask]) > 0
    # whatever sits in the environment positions' log-prob and advantage slots changes nothing
    junk = ~mb.loss_mask
    noisy_lp = torch.where(junk, torch.randn_like(mb.inference_logprobs), mb.inference_logprobs)
    noisy_adv = torch.where(junk, torch.randn_like(mb.advantages) * 5, mb.advantages)
    _, params_noisy = gradients(noisy_lp, noisy_adv)
    assert all(torch.equal(a, b) for a, b in zip(params, params_noisy, strict=True))


def test_sft_learns_model_turns_only():
    """A demonstration's model turns (each ended by <eos>) are targets; the environment's replies are not."""
    from primebuild.runtime.models.char_tokenizer import build_char_tokenizer
    from primebuild.runtime.trainer.env_sft import episode_ids

    tokenizer = build_char_tokenizer()
    ids, mask = episode_ids(tokenizer, encode_prompt(tokenizer, ">"), [(MODEL, "ab"), (ENVIRONMENT, "zx>"), (MODEL, "ba")],
                            lambda sampled, text: encode_reply(tokenizer, text))
    bos, sep, eos, a, b, x, z = 1, 30, 2, 4, 5, 27, 29
    assert ids == [bos, sep, a, b, eos, z, x, sep, b, a, eos]
    assert [tok for tok, m in zip(ids, mask, strict=True) if m] == [a, b, eos, b, a, eos]


def test_sampling_requests_wait_in_lanes_of_few_connections():
    """At most max_requests sampling requests in flight, spread over httpx pools of LANE_CONNECTIONS:
    one pool of hundreds of connections cost most of the orchestrator's CPU (bench/RESULTS.md, P10)."""
    from primebuild.runtime.orchestrator.client import LANE_CONNECTIONS, InferenceClient

    client = InferenceClient("http://127.0.0.1:9/v1", "m", max_requests=40)
    assert len(client.lanes) == 3 and client.free_lanes.qsize() == 40
    for lane in client.lanes:
        assert client.free_lanes._queue.count(lane) <= LANE_CONNECTIONS
        assert lane._transport._pool._max_connections == LANE_CONNECTIONS
    asyncio.run(client.close())
