"""On-policy distillation, the orchestrator's side: the teacher's server scores the student's samples.

Each finished sample (prompt + completion, the exact token ids the student saw and sampled) goes to the
teacher's inference server as a completions request with vLLM's `prompt_logprobs: 0` and one token to
generate; the answer's prompt log-probs at the completion positions are the teacher's log-probs of the
student's tokens, `Sample.teacher_logprobs`, which travel in the rollout batch to the trainer
(runtime/trainer/distill.py). Token in, token out: nothing is re-tokenised, which is why the plan refuses
a teacher whose tokenizer differs from the student's (builders/distill.py).
"""

from __future__ import annotations

import asyncio

from primebuild.contracts.rollout import Sample
from primebuild.runtime.orchestrator.client import InferenceClient


class TeacherScorer:
    def __init__(self, client: InferenceClient):
        self.client = client

    async def logprobs(self, token_ids: list[int]) -> list[float]:
        """The teacher's log-prob of token_ids[1:], each given the ones before it."""
        entries = await self.client.prompt_logprobs(token_ids)
        if len(entries) != len(token_ids):
            raise RuntimeError(f"{self.client.base_url}: {len(entries)} prompt log-probs for {len(token_ids)} tokens")
        return [entry[str(token)]["logprob"] for token, entry in zip(token_ids[1:], entries[1:], strict=True)]

    async def score(self, sample: Sample) -> None:
        """Fill in `sample.teacher_logprobs` (0.0 where the completion mask is 0: no loss reads them)."""
        scored = await self.logprobs(sample.prompt_ids + sample.completion_ids)
        mine = scored[len(sample.prompt_ids) - 1:]  # completion token i is token len(prompt) + i of the whole
        mask = sample.completion_mask or [1] * len(mine)
        sample.teacher_logprobs = [lp if m else 0.0 for lp, m in zip(mine, mask, strict=True)]

    async def score_all(self, samples: list[Sample]) -> None:
        await asyncio.gather(*(self.score(s) for s in samples))
