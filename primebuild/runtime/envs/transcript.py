"""One rollout as one token sequence: the prompt, then model turns and environment replies, in order.

Token in, token out: every model turn continues the exact ids of the transcript so far and is appended
as the engine sampled it (its final `<eos>` included), every environment reply is appended as the ids
of its text encoded without special tokens. Nothing is decoded and re-encoded, so the sequence the
trainer scores is the sequence the model saw, turn boundaries included. Used by the orchestrator
(sampling through an inference server) and by greedy evaluation in process (SFT), alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Transcript:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on the model's tokens, 0 on the environment's
    logprobs: list[float] = field(default_factory=list)  # sampling log-prob of model tokens, 0.0 elsewhere
    turn_versions: list[int] = field(default_factory=list)  # oldest policy version of each model turn
    model_tokens: int = 0
    environment_tokens: int = 0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def turns(self) -> int:
        return len(self.turn_versions)

    def add_model_turn(self, token_ids: list[int], logprobs: list[float] | None = None, version: int = 0) -> None:
        logprobs = [0.0] * len(token_ids) if logprobs is None else list(logprobs)
        if len(logprobs) != len(token_ids):
            raise ValueError(f"{len(logprobs)} log-probs for {len(token_ids)} tokens")
        self.completion_ids += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.logprobs += logprobs
        self.turn_versions.append(version)
        self.model_tokens += len(token_ids)

    def add_environment(self, token_ids: list[int]) -> None:
        self.completion_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.environment_tokens += len(token_ids)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """The prompt as the engines encode a text prompt: with the tokenizer's special tokens (`<bos>`)."""
    return list(tokenizer(text)["input_ids"])


def encode_reply(tokenizer, text: str) -> list[int]:
    """An environment reply: its text only, the environment's own framing included."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
