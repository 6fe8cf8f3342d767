"""Request checks that need the served model: its name, vocabulary, context length and slot count.

Every failure is an OpenAI-shaped 4xx (ApiError) naming the parameter; bodies themselves are parsed
and typed in protocol.py, and sizes no model could take are refused before tokenising (body_parser.py).
Context (vLLM's rules): a prompt must leave room for one token and `max_tokens` may not exceed the
context; a `max_tokens` that only overflows together with the prompt is cut to the room left.
"""

from __future__ import annotations

from .body_parser import PromptBounds, too_long
from .engine import Engine
from .protocol import ApiError
from .sampling import SamplingParams
from .tokenizer import ServedTokenizer


class RequestChecks:
    def __init__(self, engine: Engine, tokenizer: ServedTokenizer, served_model_name: str):
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.vocab_size = engine.config.vocab_size
        self.bounds = PromptBounds(engine.max_model_len, tokenizer.max_chars_per_token)

    def model(self, name: str) -> None:
        if name != self.served_model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.served_model_name}`.",
                           param="model", code="model_not_found")

    def ids(self, ids: list[int], param: str) -> None:
        if any(t >= self.vocab_size for t in ids):
            raise ApiError(400, f"{param}: token ids must be below the vocabulary size {self.vocab_size}",
                           param=param)

    def limits(self, prompts: list[list[int]], params: SamplingParams, prompt_param: str = "prompt") -> None:
        engine = self.engine
        if params.n > engine.max_num_seqs:
            raise ApiError(400, f"n ({params.n}) exceeds max_num_seqs ({engine.max_num_seqs})", param="n")
        self.ids(params.stop_token_ids, "stop_token_ids")
        if params.max_tokens > engine.max_model_len:
            raise ApiError(400, f"max_tokens ({params.max_tokens}) is larger than this model's maximum context "
                           f"length, {engine.max_model_len} tokens", param="max_tokens",
                           code="context_length_exceeded")
        for prompt in prompts:
            if not prompt:
                raise ApiError(400, "the prompt is empty (it has no tokens)", param=prompt_param)
            if len(prompt) >= engine.max_model_len:
                raise too_long(self.bounds, "the prompt", f"{len(prompt)} tokens", prompt_param)

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
        for ids in prompts:
            self.ids(ids, "prompt")
        return prompts
