"""Rollouts of environments that play themselves: an agent program calls the policy as an OpenAI chat
endpoint (a verifiers harness with its tools, primebuild/runtime/envs/verifiers_agents.py) instead of the
orchestrator driving the turns. The endpoint is a `ChatInterception` over the orchestrator's `sample`
(primebuild/runtime/envs/chat_interception.py), so each episode is still one token sequence, token in / token out,
with every model turn's ids, log-probs and policy version recorded, as primebuild/runtime/orchestrator/rollout.py
records them for the environments it drives.
"""

from __future__ import annotations

import time

from primebuild.runtime.envs.base import Task


def plays_itself(env) -> bool:
    return bool(getattr(env, "plays_itself", False))


async def agent_group(runner, sample, env, task: Task, *, n: int, temperature: float, seed: int | None) -> list:
    # here, not at the top: the interception server is FastAPI's, which an orchestrator without an agent
    # environment (most runs) need not import
    from primebuild.runtime.envs.chat_interception import ChatInterception
    from primebuild.runtime.inference.chat_template import ChatTemplate
    from primebuild.runtime.orchestrator.rollout import Rollout, all_episodes

    interception = ChatInterception(ChatTemplate(runner.tokenizer), sample, max_tokens_per_turn=runner.max_tokens_per_turn,
                                    seq_len=runner.seq_len, temperature=temperature)
    await interception.start()

    async def episode(j: int) -> Rollout:
        conversation = interception.open(None if seed is None else seed + 104729 * j)
        started = time.monotonic()
        try:
            reward, stop = await env.play(task, interception.base_url(conversation))
        finally:
            transcript = interception.close(conversation)
        if transcript is None or transcript.turns == 0:
            raise RuntimeError(f"environment {env.id}: its program ended without calling the model")
        finish = "turns" if stop == "max_turns" else "episode"
        return Rollout(transcript, reward, time.monotonic() - started, finish)

    try:
        return await all_episodes(episode(j) for j in range(n))
    finally:
        await interception.stop()
