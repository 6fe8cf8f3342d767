"""Answers of the OpenAI endpoints: one engine call's results shaped as completions or chat choices.

One builder (`choice_item`) shapes every choice: whole (non-streamed) or as a streamed chunk of new
tokens, for `/v1/completions` and `/v1/chat/completions` alike; on top of OpenAI's fields each choice
carries what an RL orchestrator needs (docs/inference.md): `prompt_token_ids`, `token_ids`,
`token_logprobs`, `policy_version(s)`, `resumed_from_version` and, when asked, `routed_experts`.
Where OpenAI's API leaves a detail open, vLLM's answer decides it (docs/inference.md, "Decided by vLLM").
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from primebuild.contracts.completion import WEIGHTS_MIXED
from primebuild.errors import UserError

from .engine import Engine, EngineDead, WeightsMixed
from .prefilled import Prefilled
from .protocol import ApiError
from .sampling import SamplingParams
from .sequences import ChoiceResult, SeqUpdate
from .tokenizer import ServedTokenizer
from .tool_parser import ParsedMessage

Api = Literal["completion", "chat"]
OBJECT = {("completion", False): "text_completion", ("completion", True): "text_completion",
          ("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk"}
ID_PREFIX = {"completion": "cmpl", "chat": "chatcmpl"}
DISCONNECT_POLL_S = 0.5  # how often a whole (non-streamed) answer being decoded checks that its client is still there
LOGPROB_FLOOR = -9999.0  # vLLM's floor: a token masked by top-k/top-p has -inf, which JSON cannot carry


class Generation:
    """The engine requests of one API call; updates cross from the engine thread into the event loop."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: SamplingParams,
                 prefilled: list[Prefilled | None] | None = None):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.n = params.n
        self.remaining = len(prompts) * params.n
        self.requests = []
        shipped = prefilled or [None] * len(prompts)
        try:
            for index, prompt in enumerate(prompts):
                # max_tokens beyond the context left is cut to it (vLLM's rule; validation.py refused the rest)
                room = engine.max_model_len - len(prompt)
                fitted = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
                self.requests.append(engine.submit(prompt, fitted, functools.partial(self._sink, index),
                                                   prefilled=shipped[index]))
        except UserError as err:
            self.abort()
            raise ApiError(400, str(err)) from None
        except EngineDead as err:
            self.abort()
            raise ApiError(503, str(err), code="engine_dead") from None
        except WeightsMixed:
            self.abort()
            raise  # (server.py answers it)

    def _sink(self, prompt_index: int, updates: list[SeqUpdate]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (prompt_index, updates))

    async def updates(self) -> AsyncIterator[list[tuple[int, SeqUpdate]]]:
        """Yields [(choice index, update)] until every choice has finished."""
        while self.remaining:
            prompt_index, updates = await self.queue.get()
            tagged = []
            for update in updates:
                if update.finish_reason is not None:
                    self.remaining -= 1
                tagged.append((prompt_index * self.n + update.index, update))
            yield tagged

    def abort(self) -> None:
        for request in self.requests:
            request.abort()


class Choice:
    """One choice being built: accumulated results plus the text already streamed."""

    def __init__(self, index: int, prompt_ids: list[int], tokenizer: ServedTokenizer, params: SamplingParams):
        self.result = ChoiceResult(index, prompt_ids)
        self.tokenizer = tokenizer
        self.hold_back = max((len(s) for s in params.stop), default=1) - 1
        self.stop_token_ids = set(params.stop_token_ids)
        self.sent = ""
        self.text_offset = 0  # of the next streamed token in the completions log-probs

    def stop_reason(self) -> str | int | None:
        """vLLM's field: the stop string or stop token id that ended the choice (None for EOS or length)."""
        r = self.result
        if r.finish_reason != "stop":
            return None
        if r.stop_text is not None:
            return r.stop_text
        return r.token_ids[-1] if r.token_ids and r.token_ids[-1] in self.stop_token_ids else None

    def text(self) -> str:
        ids = self.result.token_ids
        if isinstance(self.stop_reason(), int):  # a stop token ends the text without being part of it (vLLM)
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        if self.result.stop_text:
            cut = text.find(self.result.stop_text)
            if cut >= 0:
                text = text[:cut]
        return text

    def delta(self) -> str:
        """New text since the last call; holds back what might still turn out to be a stop string."""
        text = self.text()
        if self.result.finish_reason is None:
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character
            if self.hold_back:
                text = text[: max(len(self.sent), len(text) - self.hold_back)]
        if not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new


def finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(tok: ServedTokenizer, ids, logprobs, tops, want_top: bool, offset: int) -> dict:
    """OpenAI's legacy shape: `top_logprobs` holds the sampled token and the `logprobs` most likely ones
    (up to logprobs + 1 entries; with logprobs 0, the sampled token alone), as OpenAI and vLLM do."""
    tokens = [tok.token_text(t) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top_logprobs = []
    for position, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        entries = {token: finite(logprob)}
        for i, lp in tops[position] if want_top else ():
            entries.setdefault(tok.token_text(i), finite(lp))
        top_logprobs.append(entries)
    return {
        "tokens": tokens,
        "token_logprobs": [finite(lp) for lp in logprobs],
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(tok: ServedTokenizer, ids, logprobs, tops, want_top: bool) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = tok.token_text(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for position, (token_id, logprob) in enumerate(zip(ids, logprobs, strict=True)):
        item = entry(token_id, logprob)
        item["top_logprobs"] = [entry(i, lp) for i, lp in tops[position]] if want_top else []
        content.append(item)
    return {"content": content}


def choice_item(c: Choice, api: Api, tokenizer: ServedTokenizer, *, logprobs: bool, top: int,
                new: slice | None = None, parse_tools: Callable[[str], ParsedMessage] | None = None) -> dict:
    """One choice: the whole of it (`new` None), or a streamed chunk carrying the tokens in `new` — and,
    on the chunk that finishes it, the rest of the RL fields. `parse_tools`: a whole chat answer's text
    becomes content and OpenAI `tool_calls` (finish_reason "tool_calls" when it holds any, as vLLM's)."""
    r = c.result
    stream = new is not None
    window = new if stream else slice(None)
    ids, lps, tops = r.token_ids[window], r.logprobs[window], r.top_logprobs[window]
    if api == "completion":
        content: dict = {"text": c.delta() if stream else c.text()}
        shaped = None
        if logprobs:  # text_offset counts every token's text, special ones included (as vLLM does)
            shaped = completion_logprobs(tokenizer, ids, lps, tops, top > 0, c.text_offset if stream else 0)
            if stream and shaped["tokens"]:
                c.text_offset = shaped["text_offset"][-1] + len(shaped["tokens"][-1])
    else:
        if stream:
            content = {"delta": {"content": c.delta()}}
        else:
            content = {"message": _chat_message(c.text(), parse_tools)}
        shaped = chat_logprobs(tokenizer, ids, lps, tops, top > 0) if logprobs else None
    finish_reason = r.finish_reason
    if not stream and api == "chat" and content["message"].get("tool_calls") and finish_reason == "stop":
        finish_reason = "tool_calls"
    item = {"index": r.index, **content, "finish_reason": finish_reason, "logprobs": shaped,
            "token_ids": ids, "token_logprobs": lps, "policy_versions": r.versions[window]}
    if r.finish_reason is not None or not stream:
        item.update(stop_reason=c.stop_reason(), prompt_token_ids=r.prompt_token_ids,
                    policy_version=r.policy_version, resumed_from_version=r.resumed_from_version)
        if r.routed_experts is not None:
            item["routed_experts"] = r.routed_experts
    return item


def _chat_message(text: str, parse_tools: Callable[[str], ParsedMessage] | None) -> dict:
    if parse_tools is None:
        return {"role": "assistant", "content": text}
    parsed = parse_tools(text)
    message = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message


def usage(prompts: list[list[int]], choices: list[Choice]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.result.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def answer(engine: Engine, tokenizer: ServedTokenizer, served_model_name: str, api: Api,
                 prompts: list[list[int]], params: SamplingParams, *, stream: bool, include_usage: bool,
                 logprobs: bool, top: int, prefilled: list[Prefilled | None] | None = None,
                 parse_tools: Callable[[str], ParsedMessage] | None = None,
                 disconnected: Callable[[], Awaitable[bool]] | None = None):
    """Run one API call on the engine and answer it, whole or as server-sent events (P/D decode:
    continuing from `prefilled` KV caches, one per prompt, None where the prompt is prefilled here).
    `disconnected()` (the request's): a whole answer nobody waits for any more is stopped."""
    generation = Generation(engine, prompts, params, prefilled)
    choices = [Choice(p * params.n + i, prompts[p], tokenizer, params)
               for p in range(len(prompts)) for i in range(params.n)]
    meta = {"id": f"{ID_PREFIX[api]}-{uuid.uuid4().hex}", "created": int(time.time()), "model": served_model_name,
            "object": OBJECT[(api, stream)]}

    if not stream:
        async def collect() -> None:
            async for tagged in generation.updates():
                for index, update in tagged:
                    choices[index].result.apply(update)

        collecting = asyncio.ensure_future(collect())
        try:
            # uvicorn does not cancel a handler whose client left: look, so an abandoned call stops decoding
            while not (await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_S))[0]:
                if disconnected is not None and await disconnected():
                    raise ClientDisconnect()  # (server.py: 499, nobody is waiting for an answer)
            collecting.result()
        finally:
            collecting.cancel()
            generation.abort()  # no-op once finished; frees the slots of a call stopped early
        failed = [c.result for c in choices if c.result.error]
        if failed:
            raise error_answer(failed[0].error, failed[0].error_code)
        items = [choice_item(c, api, tokenizer, logprobs=logprobs, top=top, parse_tools=parse_tools) for c in choices]
        return JSONResponse({**meta, "choices": items, "usage": usage(prompts, choices)})

    async def events():
        try:
            if api == "chat":  # OpenAI's (and vLLM's) first chunk of each choice: the role, no content yet
                for choice in choices:
                    item = choice_item(choice, api, tokenizer, logprobs=False, top=0, new=slice(0, 0))
                    item["delta"] = {"role": "assistant", "content": ""}
                    yield sse({**meta, "choices": [item]})
            async for tagged in generation.updates():
                for index, update in tagged:
                    choice = choices[index]
                    before = len(choice.result.token_ids)
                    choice.result.apply(update)
                    if update.error:
                        yield sse(error_answer(update.error, update.error_code).body())
                        yield sse("[DONE]")  # an error ends the stream as vLLM ends it
                        return
                    item = choice_item(choice, api, tokenizer, logprobs=logprobs, top=top, new=slice(before, None))
                    yield sse({**meta, "choices": [item]})
            if include_usage:
                yield sse({**meta, "choices": [], "usage": usage(prompts, choices)})
            yield sse("[DONE]")
        finally:
            generation.abort()

    return StreamingResponse(events(), media_type="text/event-stream")


def error_answer(message: str, code: str | None) -> ApiError:
    """A choice the engine ended with an error: 503 where the server will serve again (its weights were
    mixed: the client goes elsewhere meanwhile), else 500."""
    return ApiError(503 if code == WEIGHTS_MIXED else 500, message, code=code)


def with_prompt_logprobs(response: JSONResponse, prompts: list[list[int]], scored: list[list[float]],
                         n: int) -> JSONResponse:
    """A whole completions answer with vLLM's `prompt_logprobs` in each choice: None for the first prompt
    token (nothing precedes it), then {token id: {"logprob": x}} per later token. Choice i answers prompt
    i // n."""
    body = json.loads(response.body)
    for item in body["choices"]:
        ids, logprobs = prompts[item["index"] // n], scored[item["index"] // n]
        item["prompt_logprobs"] = [None] + [{str(t): {"logprob": finite(lp)}} for t, lp in zip(ids[1:], logprobs,
                                                                                              strict=True)]
    return JSONResponse(body)
