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

# Samples per request: one request per sample cost ~4x the step time of RL alone on the 2-core machine (each
# one a pass through the server's scheduler); a whole batch in one request holds the server's engine long.
SAMPLES_PER_REQUEST = 32


class TeacherScorer:
    def __init__(self, client: InferenceClient):
        self.client = client

    async def _score_chunk(self, samples: list[Sample]) -> None:
        sequences = [s.prompt_ids + s.completion_ids for s in samples]
        answers = await self.client.prompt_logprobs(sequences)
        for sample, ids, entries in zip(samples, sequences, answers, strict=True):
            if len(entries) != len(ids):
                raise RuntimeError(f"{self.client.base_url}: {len(entries)} prompt log-probs for {len(ids)} tokens")
            # completion token i is token len(prompt) + i of the whole sequence
            start = len(sample.prompt_ids)
            mine = [entry[str(token)]["logprob"] for token, entry in zip(ids[start:], entries[start:], strict=True)]
            mask = sample.completion_mask or [1] * len(mine)
            sample.teacher_logprobs = [lp if m else 0.0 for lp, m in zip(mine, mask, strict=True)]  # 0.0: unread

    async def score_all(self, samples: list[Sample]) -> None:
        """Fill in every sample's `teacher_logprobs` (0.0 where the completion mask is 0: no loss reads them)."""
        chunks = [samples[i: i + SAMPLES_PER_REQUEST] for i in range(0, len(samples), SAMPLES_PER_REQUEST)]
        await asyncio.gather(*(self._score_chunk(c) for c in chunks))
