"""What flows through the engine: a request, the sequences it samples, and the updates they emit.

A `Request` is one API prompt; the engine thread turns it into `params.n` `Sequence`s, and reports each
step's new tokens (or the finish) as immutable `SeqUpdate`s to the request's sink, which a `ChoiceResult`
accumulates on the other side (the HTTP layer, or `Engine.generate`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .prefilled import Prefilled
from .sampling import SamplingParams


class SeqUpdate(NamedTuple):
    """What one sequence produced in one engine step (new tokens only), or how it finished."""

    index: int  # choice index inside its request
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_text: str | None = None  # the stop string that ended it, if any
    routed_experts: str | None = None  # on the final update only: primebuild/kernels/routing.py's wire form
    error: str | None = None
    error_code: str | None = None  # with `error`: the API's code for it (None: an internal error, 500)


@dataclass
class ChoiceResult:
    """Accumulates the updates of one sequence (used by the server and by `Engine.generate`)."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_text: str | None = None
    routed_experts: str | None = None  # base64 .npy [position, decoder_layer, k] (primebuild/kernels/routing.py)
    error: str | None = None
    error_code: str | None = None

    def apply(self, update: SeqUpdate) -> None:
        self.token_ids.extend(update.token_ids)
        self.logprobs.extend(update.logprobs)
        self.versions.extend(update.versions)
        if update.top_logprobs is not None:
            self.top_logprobs.extend(update.top_logprobs)
        if update.finish_reason is not None:
            self.finish_reason = update.finish_reason
            self.stop_text = update.stop_text
            self.routed_experts = update.routed_experts
            self.error = update.error
            self.error_code = update.error_code

    @property
    def policy_version(self) -> int | None:
        return self.versions[-1] if self.versions else None

    @property
    def resumed_from_version(self) -> int | None:
        """The version a sequence started on, if it then continued on newer weights."""
        if self.versions and self.versions[0] != self.versions[-1]:
            return self.versions[0]
        return None


class Request:
    """One API prompt: `params.n` sequences sharing a prompt prefill."""

    def __init__(
        self,
        request_id: int,
        prompt_ids: list[int],
        params: SamplingParams,
        sink,
        on_abort: Callable[[], None] | None = None,
        prefilled: Prefilled | None = None,
        export: bool = False,
    ):
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.sink: Callable[[list[SeqUpdate]], None] = sink
        self.aborted = False
        self._on_abort = on_abort
        self.prefilled = prefilled  # P/D decode: the prompt's KV, computed by a prefill server
        self.export = export  # P/D prefill: compute the prompt's KV and hand it to the sink, sample nothing

    def abort(self) -> None:
        """Thread-safe: the engine drops the request at its next step."""
        self.aborted = True
        if self._on_abort is not None:
            self._on_abort()


class Sequence:
    def __init__(
        self,
        request: Request,
        index: int,
        generator: torch.Generator | None,
        eos_token_ids: set[int] = frozenset(),
        max_model_len: int = 1 << 62,
    ):
        params = request.params
        self.request = request
        self.index = index
        self.params = params
        self.tokens = list(request.prompt_ids)  # prompt + generated; the last one is not yet in the cache
        self.prompt_len = len(request.prompt_ids)
        self.generator = generator
        self.slot = -1
        self.stop_scan_from = 0  # text offset already searched for stop strings
        # Finish conditions, decided once here so that the per-token check is two look-ups.
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self.length_limit = min(self.prompt_len + params.max_tokens, max_model_len)
        self.plain_greedy = params.temperature == 0 and not params.top_logprobs
