"""An OpenAI chat endpoint in front of the orchestrator's sampler, recording each call's tokens.

An agent program (a verifiers harness, any OpenAI client) plays an episode by calling
`/v1/chat/completions` with its whole conversation each time, tools included. The interception turns
those calls into one token sequence, token in / token out:

- the first call's messages and tools are rendered by the model's chat template (the prompt);
- each later call must repeat the conversation so far, the assistant turns exactly as answered here, and
  add tool results or user messages: only those are rendered (primebuild/runtime/inference/chat_template.py) and
  appended after the sampled ids as environment tokens; the sampled ids are never re-tokenised;
- the model turn is sampled through the orchestrator's `sample` (`/v1/completions` on token ids, either
  engine), its ids, log-probs and policy version recorded (primebuild/runtime/envs/transcript.py), and its text
  parsed into OpenAI `tool_calls` (primebuild/runtime/inference/tool_parser.py) for the program.

A streamed call gets the whole turn as one chunk (it is sampled before it is answered). A call that
rewrites earlier turns (a harness that compacts its history) or changes the tools is refused
with a 400: its tokens could not continue the recorded sequence. The program's own sampling parameters
are not used: the orchestrator samples (temperature, seeds, max tokens per turn, seq_len), as it does for
every environment. Each episode has its own URL (`/episodes/<key>/v1`), and the server binds 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from primebuild.runtime.envs.transcript import Transcript
from primebuild.runtime.inference.chat_template import ChatTemplate, TemplateError
from primebuild.runtime.inference.protocol import ApiError, ChatRequest, parse_body, read_body
from primebuild.runtime.inference.tool_parser import parse_tool_calls

SampleFn = Callable[..., Awaitable[Any]]  # as primebuild/runtime/orchestrator/rollout.py: (prompt_ids, n=, ...) -> CompletionResult


@dataclass
class Conversation:
    """One episode's calls: the messages as the program sent and got them, and the token sequence."""

    key: str
    seed: int | None = None  # the episode's; each call samples with seed + 7919 * calls
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    transcript: Transcript | None = None
    last_sampled: list[int] = field(default_factory=list)
    finish: str | None = None  # why the last turn ended ("stop", "length", "tool_calls")
    calls: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ChatInterception:
    def __init__(self, template: ChatTemplate, sample: SampleFn, *, tool_call_parser: str = "hermes",
                 max_tokens_per_turn: int, seq_len: int, temperature: float = 1.0):
        self.template, self.sample = template, sample
        self.tool_call_parser = tool_call_parser
        self.max_tokens_per_turn, self.seq_len = max_tokens_per_turn, seq_len
        self.temperature = temperature
        self.conversations: dict[str, Conversation] = {}
        self.url: str | None = None
        self._server = None
        self._task: asyncio.Task | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> str:
        """Serve on 127.0.0.1 (a free port) on the running event loop; returns the base URL."""
        import socket

        import uvicorn

        # The socket is bound here and handed to uvicorn, never closed in between: a port found free and
        # bound again later can be taken by another program meanwhile (seen under a busy machine: uvicorn's
        # bind failed and its sys.exit ended the orchestrator).
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        port = listening.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=port, log_level="warning",
                                                     lifespan="off"))
        self._task = asyncio.create_task(self._server.serve(sockets=[listening]), name="chat interception")
        while not self._server.started:
            if self._task.done():
                listening.close()
                self._task.result()  # raises why it did not start
            await asyncio.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None

    def open(self, seed: int | None = None) -> Conversation:
        """A new episode; its program calls `base_url(conversation)`."""
        conversation = Conversation(key=secrets.token_urlsafe(16), seed=seed)
        self.conversations[conversation.key] = conversation
        return conversation

    def base_url(self, conversation: Conversation) -> str:
        return f"{self.url}/episodes/{conversation.key}/v1"

    def close(self, conversation: Conversation) -> Transcript | None:
        return self.conversations.pop(conversation.key).transcript

    # --- the endpoint ----------------------------------------------------------------------------

    def app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, err: ApiError):
            return JSONResponse(err.body(), status_code=err.status)

        @app.post("/episodes/{key}/v1/chat/completions")
        async def chat(key: str, request: Request):
            conversation = self.conversations.get(key)
            if conversation is None:
                raise ApiError(404, "no such episode (it ended, or the URL is wrong)")
            body = parse_body(await read_body(request), ChatRequest)
            async with conversation.lock:
                answer = await self.turn(conversation, body)
            if not body.stream:
                return JSONResponse(answer)
            # a streaming client (verifiers' relay) gets the whole turn as one chunk: it is sampled first
            return StreamingResponse(_events(answer, bool(body.stream_options and body.stream_options.include_usage)),
                                     media_type="text/event-stream")

        return app

    async def turn(self, conversation: Conversation, body: ChatRequest) -> dict:
        messages = [m.template_input() for m in body.messages]
        tools = body.template_tools()
        try:
            prompt = self._extend(conversation, messages, tools)
        except TemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        room = self.seq_len - len(prompt)
        if room < 1:
            raise ApiError(400, f"the episode fills seq_len ({self.seq_len} tokens)", code="context_length_exceeded")
        t = conversation.transcript
        seed = None if conversation.seed is None else conversation.seed + 7919 * conversation.calls
        result = await self.sample(prompt, n=1, temperature=self.temperature,
                                   max_tokens=min(self.max_tokens_per_turn, room), seed=seed)
        choice = result.choices[0]
        t.add_model_turn(list(choice.token_ids), list(choice.token_logprobs), choice.oldest_policy_version)
        conversation.last_sampled = list(choice.token_ids)
        conversation.calls += 1
        parsed = parse_tool_calls(self.tool_call_parser, choice.text) if tools and body.tool_choice != "none" else None
        message: dict = {"role": "assistant", "content": choice.text if parsed is None else parsed.content}
        finish = choice.finish_reason or "stop"
        if parsed is not None and parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
            finish = "tool_calls" if finish == "stop" else finish
        conversation.messages = [*messages, message]
        conversation.finish = finish
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.model or "policy",
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None,
                             "token_ids": list(choice.token_ids), "prompt_token_ids": prompt}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(choice.token_ids),
                          "total_tokens": len(prompt) + len(choice.token_ids)}}

    def _extend(self, conversation: Conversation, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The ids to sample from: the first call's rendering, or the recorded sequence plus the new messages."""
        if conversation.transcript is None:
            conversation.tools = tools
            conversation.transcript = Transcript(self.template.prompt_ids(messages, tools=tools))
            return conversation.transcript.ids
        if tools != conversation.tools:
            raise TemplateError("the tools changed within the episode: the rendered system turn would change")
        known = conversation.messages
        if len(messages) <= len(known) or not all(_same(a, b) for a, b in zip(known, messages, strict=False)):
            raise TemplateError("this call does not continue the episode's conversation (earlier turns were "
                                "changed or dropped): its tokens cannot extend the recorded sequence")
        new = messages[len(known):]
        ids = self.template.continuation_ids(conversation.last_sampled, new, tools=tools)
        conversation.transcript.add_environment(ids)
        return conversation.transcript.ids


async def _events(answer: dict, include_usage: bool):
    choice = answer["choices"][0]
    delta = dict(choice["message"])
    if "tool_calls" in delta:
        delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(delta["tool_calls"])]
    head = {k: v for k, v in answer.items() if k not in ("choices", "usage")} | {"object": "chat.completion.chunk"}
    yield f"data: {json.dumps(head | {'choices': [{'index': 0, 'delta': delta, 'finish_reason': choice['finish_reason']}]})}\n\n"
    if include_usage:
        yield f"data: {json.dumps(head | {'choices': [], 'usage': answer['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def _same(known: dict, sent: dict) -> bool:
    """A message the program sends back is the one it had: same role and text, same tool calls."""
    if known.get("role") != sent.get("role") or (known.get("content") or "") != (sent.get("content") or ""):
        return False
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in known.get("tool_calls") or []]
    return calls == [(c["function"]["name"], c["function"]["arguments"]) for c in sent.get("tool_calls") or []]
