"""One rollout group: an environment's turn loop through an inference server, token in / token out.

A group is `n` episodes of one task. The first model turn is one request with `n` choices (the prompt
is prefilled once); each episode then goes its own way: the environment answers a model turn (a game's
feedback, a tool's output), its reply is appended to the episode's token sequence as environment tokens
(loss mask 0), and the next model turn continues the exact ids so far (primebuild/runtime/envs/transcript.py).
An episode ends when the environment says so, after the environment's `max_turns` model turns, or when
the next turn would not fit in `seq_len` tokens.

Every model turn is a new request, so it is sampled by whatever policy the server holds then: a long
episode spans weight updates, and each turn records the oldest policy version that sampled one of its
tokens. Before each turn the orchestrator may declare the episode stale (`is_useful`): then the group
is abandoned, since no batch it could still join would accept its oldest token (max_off_policy_steps).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import numpy as np

from primebuild.contracts.completion import CompletionResult, SampledChoice
from primebuild.contracts.rollout import Sample
from primebuild.errors import UserError
from primebuild.runtime.envs.base import Environment, Task, episode_reward, max_turns, start_episode
from primebuild.runtime.envs.framing import framing
from primebuild.runtime.envs.transcript import Transcript
from primebuild.runtime.orchestrator.agent_rollouts import agent_group, plays_itself

# sample(prompt_ids, n=, temperature=, max_tokens=, seed=) -> CompletionResult: one request to a server
SampleFn = Callable[..., Awaitable[CompletionResult]]


class StaleRollout(Exception):
    """The episode's oldest token is older than any batch it could still join accepts."""


@dataclass
class Rollout:
    transcript: Transcript
    reward: float
    seconds: float  # wall time of the episode, first request to reward
    finish: str  # "episode" (the environment ended it), "turns" or "seq_len" (a budget did)
    # router replay: the last model turn's routes, [fed positions of the whole transcript, moe_layers, top_k].
    # That request computed every position (the transcript so far is its prompt); with the weights
    # unchanged an earlier turn's request routed the shared positions the same way.
    routes: np.ndarray | None = None

    def sample(self, env_id: str) -> Sample:
        t = self.transcript
        return Sample(prompt_ids=list(t.prompt_ids), completion_ids=list(t.completion_ids),
                      inference_logprobs=list(t.logprobs), advantage=0.0, reward=self.reward,
                      policy_version=min(t.turn_versions), env_id=env_id, completion_mask=list(t.loss_mask),
                      policy_versions=list(t.turn_versions),
                      routed_experts=self.routes)


async def all_episodes(episodes: Iterable[Awaitable[Rollout]]) -> list[Rollout]:
    """Every episode of a group, or the first error with the others cancelled: a group is dropped whole
    (stale or failed), and its other episodes would only spend inference and environment time."""
    tasks = [asyncio.ensure_future(e) for e in episodes]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class RolloutRunner:
    def __init__(self, tokenizer, *, max_tokens_per_turn: int, seq_len: int,
                 routes_of: Callable[[SampledChoice], np.ndarray] | None = None):
        self.tokenizer = tokenizer
        self.routes_of = routes_of  # router replay: a choice's routes (None: not carried)
        self.max_tokens_per_turn = max_tokens_per_turn
        self.seq_len = seq_len

    async def group(self, sample: SampleFn, env: Environment, task: Task, *, n: int, temperature: float,
                    seed: int | None = None, is_useful: Callable[[int], bool] = lambda oldest: True) -> list[Rollout]:
        if plays_itself(env):  # an agent program calls the policy (a verifiers harness with tools)
            return await agent_group(self, sample, env, task, n=n, temperature=temperature, seed=seed)
        framed = framing(env, self.tokenizer)  # plain text, or the model's chat template (envs/framing.py)
        prompt_ids = framed.prompt_ids(task)
        room = self.seq_len - len(prompt_ids)
        if room < 1:
            raise UserError(f"environment {env.id}: a prompt of {len(prompt_ids)} tokens leaves no room in seq_len "
                            f"{self.seq_len}", hint="raise orchestrator.seq_len")
        started = time.monotonic()
        first = await sample(prompt_ids, n=n, temperature=temperature, max_tokens=min(self.max_tokens_per_turn, room),
                             seed=seed)
        return await all_episodes(
            self._episode(sample, env, framed, task, prompt_ids, choice, started, temperature=temperature,
                          seed=None if seed is None else seed + 7919 * (j + 1), is_useful=is_useful)
            for j, choice in enumerate(first.choices))

    async def _episode(self, sample: SampleFn, env: Environment, framed, task: Task, prompt_ids: list[int],
                       choice: SampledChoice, started: float, *, temperature: float, seed: int | None,
                       is_useful: Callable[[int], bool]) -> Rollout:
        transcript = Transcript(list(prompt_ids))
        episode = start_episode(env, task)
        turn_limit = max_turns(env)
        try:
            while True:
                transcript.add_model_turn(list(choice.token_ids), list(choice.token_logprobs),
                                          choice.oldest_policy_version)
                reply = await episode.step(choice.text)
                if reply is None:
                    finish = "episode"
                    break
                if transcript.turns >= turn_limit:
                    finish = "turns"
                    break
                reply_ids = framed.reply_ids(task, list(choice.token_ids), reply)
                room = self.seq_len - len(transcript) - len(reply_ids)
                if room < 1:
                    finish = "seq_len"
                    break
                transcript.add_environment(reply_ids)
                if not is_useful(min(transcript.turn_versions)):
                    raise StaleRollout
                answer = await sample(transcript.ids, n=1, temperature=temperature,
                                      max_tokens=min(self.max_tokens_per_turn, room),
                                      seed=None if seed is None else seed + transcript.turns)
                choice = answer.choices[0]
            reward = await episode_reward(env, episode)
        finally:
            await episode.close()
        routes = None if self.routes_of is None else self.routes_of(choice)
        return Rollout(transcript, reward, time.monotonic() - started, finish, routes)
