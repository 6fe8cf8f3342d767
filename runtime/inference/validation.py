"""Request checks that need the served model: its name, vocabulary, context length and slot count.

Every failure is an OpenAI-shaped 4xx (ApiError) naming the parameter; bodies themselves are parsed
and typed in protocol.py.
"""

from __future__ import annotations

from .engine import Engine
from .protocol import ApiError
from .sampling import SamplingParams
from .tokenizer import ServedTokenizer

MAX_PROMPTS = 1024


class RequestChecks:
    def __init__(self, engine: Engine, tokenizer: ServedTokenizer, served_model_name: str):
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.vocab_size = engine.config.vocab_size

    def model(self, name: str) -> None:
        if name != self.served_model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.served_model_name}`.",
                           param="model", code="model_not_found")

    def ids(self, ids: list[int], param: str) -> None:
        if any(t >= self.vocab_size for t in ids):
            raise ApiError(400, f"{param}: token ids must be below the vocabulary size {self.vocab_size}",
                           param=param)

    def limits(self, prompts: list[list[int]], params: SamplingParams) -> None:
        engine = self.engine
        if params.n > engine.max_num_seqs:
            raise ApiError(400, f"n ({params.n}) exceeds max_num_seqs ({engine.max_num_seqs})", param="n")
        self.ids(params.stop_token_ids, "stop_token_ids")
        for prompt in prompts:
            if not prompt:
                raise ApiError(400, "the prompt is empty (it has no tokens)", param="prompt")
            if len(prompt) + params.max_tokens > engine.max_model_len:
                raise ApiError(
                    400, f"This model's maximum context length is {engine.max_model_len} tokens; the prompt has "
                    f"{len(prompt)} tokens and max_tokens is {params.max_tokens}.",
                    param="max_tokens", code="context_length_exceeded")

    def completion_prompts(self, prompt) -> list[list[int]]:
        """A completions `prompt` (text, ids, a list of either) as token id lists."""
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        elif isinstance(prompt[0], str):
            prompts = [self.tokenizer.encode(p) for p in prompt]
        else:
            prompts = [list(p) for p in prompt]
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        for ids in prompts:
            self.ids(ids, "prompt")
        return prompts
