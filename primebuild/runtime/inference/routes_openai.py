"""The OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

Nothing whose cost grows with the request runs on the event loop: bodies are parsed by `BodyParser`,
prompts are rendered and tokenised in a worker thread, so one huge request does not stall the others.
"""

from __future__ import annotations

import asyncio
import functools
import time

from fastapi import APIRouter, Request

from .body_parser import BodyParser
from .disaggregation import Disaggregation
from .engine import Engine
from .protocol import ApiError, ChatRequest, CompletionRequest, authorize, read_body
from .responses import answer, with_prompt_logprobs
from .tokenizer import ServedTokenizer
from .tool_parser import parse_tool_calls
from .validation import RequestChecks


def openai_router(engine: Engine, tokenizer: ServedTokenizer, served_model_name: str,
                  body_parser: BodyParser, pd: Disaggregation | None = None,
                  tool_call_parser: str | None = None, admin_token: str | None = None) -> APIRouter:
    """`tool_call_parser` (e.g. "hermes"): how tool calls are read from a chat answer's text when the
    request gives `tools`; None refuses such requests (vLLM without --enable-auto-tool-choice).
    A body with `kv_transfer` needs `admin_token`: only the P/D router sends one."""
    router = APIRouter()
    pd = pd or Disaggregation(None)  # P/D: a prefill server exports, a decode server continues
    check = RequestChecks(engine, tokenizer, served_model_name)
    created = int(time.time())

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "primebuild", "max_model_len": engine.max_model_len}]}

    @router.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await body_parser.parse(await read_body(request), CompletionRequest)
        if body.kv_transfer is not None:  # the P/D router's, not a client's
            authorize(request, admin_token)
        check.model(body.model)
        if body.echo or body.suffix:
            raise ApiError(400, "echo and suffix are not supported", param="echo" if body.echo else "suffix")
        prompts = await asyncio.to_thread(check.completion_prompts, body.prompt)
        top = body.logprobs or 0
        params = body.sampling(body.max_tokens or 16, top)
        check.limits(prompts, params)
        if body.prompt_logprobs is not None and (body.stream or body.kv_transfer):
            raise ApiError(400, "prompt_logprobs is answered whole: not with stream or a KV transfer",
                           param="prompt_logprobs")
        exported, prefilled = await pd.handle(engine, body.kv_transfer, prompts, params)
        if exported is not None:
            return exported
        response = await answer(engine, tokenizer, served_model_name, "completion", prompts, params,
                                stream=bool(body.stream), include_usage=_include_usage(body),
                                logprobs=body.logprobs is not None, top=top, prefilled=prefilled,
                                disconnected=request.is_disconnected)
        if body.prompt_logprobs is None:
            return response
        scored = await asyncio.to_thread(lambda: [engine.prompt_logprobs(p) for p in prompts])
        return with_prompt_logprobs(response, prompts, scored, params.n)

    def chat_prompt(body: ChatRequest) -> list[int]:
        messages = [m.template_input() for m in body.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages, body.add_generation_prompt, tools=body.template_tools())
        except Exception as err:  # a template may raise on inputs it does not accept
            raise ApiError(400, f"the chat template rejected the messages: {str(err)[:200]}",
                           param="messages") from None
        check.ids(prompt, "messages")
        return prompt

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatRequest = await body_parser.parse(await read_body(request), ChatRequest)
        if body.kv_transfer is not None:  # the P/D router's, not a client's
            authorize(request, admin_token)
        check.model(body.model)
        if not tokenizer.has_chat_template:
            raise ApiError(400, "the served model's tokenizer has no chat template; use /v1/completions",
                           param="messages")
        parse_tools = None
        if body.parses_tool_calls:
            if tool_call_parser is None:
                raise ApiError(400, '"auto" tool choice needs a tool-call parser, which this server was not started '
                               'with (inference.tool_call_parser)', param="tool_choice")
            if body.stream:
                raise ApiError(400, "tool calls are parsed from a whole answer: stream is not supported with tools",
                               param="stream")
            parse_tools = functools.partial(parse_tool_calls, tool_call_parser)
        prompt = await asyncio.to_thread(chat_prompt, body)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, engine.max_model_len - len(prompt))
        top = (body.top_logprobs or 0) if body.logprobs else 0
        params = body.sampling(max_tokens, top)
        check.limits([prompt], params, prompt_param="messages")
        exported, prefilled = await pd.handle(engine, body.kv_transfer, [prompt], params)
        if exported is not None:
            return exported
        return await answer(engine, tokenizer, served_model_name, "chat", [prompt], params,
                            stream=bool(body.stream), include_usage=_include_usage(body),
                            logprobs=bool(body.logprobs), top=top, prefilled=prefilled, parse_tools=parse_tools,
                            disconnected=request.is_disconnected)

    return router


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
