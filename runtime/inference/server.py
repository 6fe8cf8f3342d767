"""OpenAI-compatible HTTP server over the embedded engine (FastAPI + uvicorn).

Endpoints: /v1/completions, /v1/chat/completions (both with SSE streaming), /v1/models, /health,
/metrics (Prometheus text), and the admin calls /pause, /resume, /update_weights, which need
`Authorization: Bearer <token>` with the token read from an environment variable (never logged).

Every choice carries what an RL orchestrator needs beyond OpenAI's fields (see docs/inference.md):
`prompt_token_ids`, `token_ids`, `token_logprobs`, `policy_version`, `policy_versions` and
`resumed_from_version` (and `routed_experts` when asked on an MoE model).

Entry points: `serve(...)` (blocking; what the runtime calls), `create_app(engine, ...)` (tests), and
`python -m primebuild.runtime.inference.server --model DIR --port N`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from primebuild.errors import UserError

from . import metrics as prometheus
from .engine import ChoiceResult, Engine, SeqUpdate
from .protocol import ApiError, ChatRequest, CompletionRequest, UpdateWeightsRequest, parse_body
from .sampling import SamplingParams
from .tokenizer import ServedTokenizer
from .weight_receiver import BroadcastStage

log = logging.getLogger(__name__)

MAX_PROMPTS = 1024


class _Generation:
    """The engine requests of one API call; updates cross from the engine thread into the event loop."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: SamplingParams):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.n = params.n
        self.remaining = len(prompts) * params.n
        self.requests = []
        try:
            for index, prompt in enumerate(prompts):
                self.requests.append(engine.submit(prompt, params, functools.partial(self._sink, index)))
        except UserError as err:
            self.abort()
            raise ApiError(400, str(err)) from None

    def _sink(self, prompt_index: int, updates: list[SeqUpdate]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (prompt_index, updates))

    async def updates(self) -> AsyncIterator[tuple[int, list[tuple[int, SeqUpdate]]]]:
        """Yields (prompt index, [(choice index, update)]) until every choice has finished."""
        while self.remaining:
            prompt_index, updates = await self.queue.get()
            tagged = []
            for update in updates:
                if update.finish_reason is not None:
                    self.remaining -= 1
                tagged.append((prompt_index * self.n + update.index, update))
            yield prompt_index, tagged

    def abort(self) -> None:
        for request in self.requests:
            request.abort()


class _Choice:
    """One choice being built: accumulated results plus the text already streamed."""

    def __init__(self, index: int, prompt_ids: list[int], tokenizer: ServedTokenizer, stops: list[str]):
        self.result = ChoiceResult(index, prompt_ids)
        self.tokenizer = tokenizer
        self.hold_back = max((len(s) for s in stops), default=1) - 1
        self.sent = ""

    def text(self) -> str:
        text = self.tokenizer.decode(self.result.token_ids)
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

    def extensions(self, final: bool = True) -> dict:
        r = self.result
        out = {
            "token_ids": r.token_ids,
            "token_logprobs": r.logprobs,
            "policy_versions": r.versions,
        }
        if final:
            out.update(
                prompt_token_ids=r.prompt_token_ids,
                policy_version=r.policy_version,
                resumed_from_version=r.resumed_from_version,
            )
            if r.routed_experts is not None:
                out["routed_experts"] = r.routed_experts
        return out


def _completion_logprobs(tok: ServedTokenizer, ids, logprobs, tops, want_top: bool, offset: int) -> dict:
    tokens = [tok.token_text(t) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": [{tok.token_text(i): lp for i, lp in top} for top in tops] if want_top else None,
        "text_offset": offsets,
    }


def _chat_logprobs(tok: ServedTokenizer, ids, logprobs, tops, want_top: bool) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = tok.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for position, (token_id, logprob) in enumerate(zip(ids, logprobs, strict=True)):
        item = entry(token_id, logprob)
        item["top_logprobs"] = [entry(i, lp) for i, lp in tops[position]] if want_top else []
        content.append(item)
    return {"content": content}


def _stream_choice(c: _Choice, new: slice, content: dict, logprobs: dict | None) -> dict:
    """One streamed choice: the new text (`{"text": …}` or `{"delta": …}`), the new tokens with their
    log-probs and policy versions, and on the last chunk the rest of the RL extensions."""
    r = c.result
    item = {
        "index": r.index,
        **content,
        "finish_reason": r.finish_reason,
        "logprobs": logprobs,
        "token_ids": r.token_ids[new],
        "token_logprobs": r.logprobs[new],
        "policy_versions": r.versions[new],
    }
    if r.finish_reason is not None:
        final = c.extensions()
        for key in ("token_ids", "token_logprobs", "policy_versions"):
            final.pop(key)
        item.update(final)
    return item


def create_app(
    engine: Engine,
    tokenizer: ServedTokenizer | None = None,
    *,
    served_model_name: str = "model",
    admin_token: str | None = None,
    shutdown_engine_on_exit: bool = False,
    weight_stage: BroadcastStage | None = None,
) -> FastAPI:
    """The FastAPI app over an already-running engine. `admin_token=None` refuses every admin call."""
    tokenizer = tokenizer or ServedTokenizer(engine.model_path)
    if engine.detokenize is None:
        engine.detokenize = tokenizer.decode
    if not engine.eos_token_ids:
        engine.eos_token_ids = set(tokenizer.eos_token_ids)
    vocab_size = engine.config.vocab_size
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_engine_on_exit:
            engine.shutdown()

    app = FastAPI(title="primebuild inference", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(ApiError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        return JSONResponse(ApiError(400, str(err)[:500]).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, err: Exception):
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, f"internal error: {type(err).__name__}").body(), status_code=500)

    # ------------------------------------------------------------------ helpers
    def check_model(name: str) -> None:
        if name != served_model_name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this server serves `{served_model_name}`.",
                param="model",
                code="model_not_found",
            )

    def check_ids(ids: list[int], param: str) -> None:
        if any(t >= vocab_size for t in ids):
            raise ApiError(
                400, f"{param}: token ids must be below the vocabulary size {vocab_size}", param=param
            )

    def check_limits(prompts: list[list[int]], params: SamplingParams) -> None:
        if params.n > engine.max_num_seqs:
            raise ApiError(400, f"n ({params.n}) exceeds max_num_seqs ({engine.max_num_seqs})", param="n")
        check_ids(params.stop_token_ids, "stop_token_ids")
        for prompt in prompts:
            if not prompt:
                raise ApiError(400, "the prompt is empty (it has no tokens)", param="prompt")
            if len(prompt) + params.max_tokens > engine.max_model_len:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {engine.max_model_len} tokens; the prompt has "
                    f"{len(prompt)} tokens and max_tokens is {params.max_tokens}.",
                    param="max_tokens",
                    code="context_length_exceeded",
                )

    def completion_prompts(prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [tokenizer.encode(prompt)]
        elif not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        elif isinstance(prompt[0], str):
            prompts = [tokenizer.encode(p) for p in prompt]
        else:
            prompts = [list(p) for p in prompt]
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        for ids in prompts:
            check_ids(ids, "prompt")
        return prompts

    def usage(prompts, choices) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c.result.token_ids) for c in choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def sse(data: dict | str) -> str:
        return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"

    async def generate(prompts, params, stream: bool, include_usage: bool, render_full, render_chunk):
        """Runs one API call; the renderers shape completions vs chat."""
        generation = _Generation(engine, prompts, params)
        choices = [
            _Choice(p * params.n + i, prompts[p], tokenizer, params.stop)
            for p in range(len(prompts))
            for i in range(params.n)
        ]
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": served_model_name}

        if not stream:
            try:
                async for _, tagged in generation.updates():
                    for index, update in tagged:
                        choices[index].result.apply(update)
            finally:
                generation.abort()  # no-op once finished; frees slots if the client went away
            errors = [c.result.error for c in choices if c.result.error]
            if errors:
                raise ApiError(500, errors[0])
            return JSONResponse(render_full(meta, choices, usage(prompts, choices)))

        async def events():
            try:
                async for _, tagged in generation.updates():
                    for index, update in tagged:
                        choice = choices[index]
                        before = len(choice.result.token_ids)
                        choice.result.apply(update)
                        if update.error:
                            yield sse(ApiError(500, update.error).body())
                            return
                        yield sse(render_chunk(meta, choice, before))
                if include_usage:
                    yield sse({**meta, "choices": [], "usage": usage(prompts, choices)})
                yield sse("[DONE]")
            finally:
                generation.abort()

        return StreamingResponse(events(), media_type="text/event-stream")

    # ------------------------------------------------------------------ OpenAI endpoints
    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "primebuild",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = parse_body(await request.body(), CompletionRequest)
        check_model(body.model)
        if body.echo or body.suffix:
            raise ApiError(400, "echo and suffix are not supported", param="echo" if body.echo else "suffix")
        prompts = completion_prompts(body.prompt)
        top = body.logprobs or 0
        params = body.sampling(body.max_tokens or 16, top)
        check_limits(prompts, params)
        want_logprobs = body.logprobs is not None

        def full(meta, choices, usage_):
            out = []
            for c in choices:
                r = c.result
                out.append(
                    {
                        "index": r.index,
                        "text": c.text(),
                        "finish_reason": r.finish_reason,
                        "logprobs": _completion_logprobs(
                            tokenizer, r.token_ids, r.logprobs, r.top_logprobs, top > 0, 0
                        )
                        if want_logprobs
                        else None,
                        **c.extensions(),
                    }
                )
            return {**meta, "object": "text_completion", "choices": out, "usage": usage_}

        def chunk(meta, c: _Choice, before: int):
            r = c.result
            offset = len(c.sent)
            delta = c.delta()
            new = slice(before, None)
            logprobs = (
                _completion_logprobs(
                    tokenizer, r.token_ids[new], r.logprobs[new], r.top_logprobs[new], top > 0, offset
                )
                if want_logprobs
                else None
            )
            item = _stream_choice(c, new, {"text": delta}, logprobs)
            return {**meta, "object": "text_completion", "choices": [item]}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await generate(prompts, params, bool(body.stream), include_usage, full, chunk)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatRequest = parse_body(await request.body(), ChatRequest)
        check_model(body.model)
        if not tokenizer.has_chat_template:
            raise ApiError(
                400,
                "the served model's tokenizer has no chat template; use /v1/completions",
                param="messages",
            )
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages, body.add_generation_prompt)
        except Exception as err:  # a template may raise on inputs it does not accept
            raise ApiError(
                400, f"the chat template rejected the messages: {str(err)[:200]}", param="messages"
            ) from None
        check_ids(prompt, "messages")
        max_tokens = (
            body.max_completion_tokens or body.max_tokens or max(1, engine.max_model_len - len(prompt))
        )
        top = (body.top_logprobs or 0) if body.logprobs else 0
        params = body.sampling(max_tokens, top)
        check_limits([prompt], params)
        want_logprobs = bool(body.logprobs)

        def full(meta, choices, usage_):
            out = []
            for c in choices:
                r = c.result
                out.append(
                    {
                        "index": r.index,
                        "message": {"role": "assistant", "content": c.text()},
                        "finish_reason": r.finish_reason,
                        "logprobs": _chat_logprobs(
                            tokenizer, r.token_ids, r.logprobs, r.top_logprobs, top > 0
                        )
                        if want_logprobs
                        else None,
                        **c.extensions(),
                    }
                )
            return {**meta, "object": "chat.completion", "choices": out, "usage": usage_}

        def chunk(meta, c: _Choice, before: int):
            r = c.result
            new = slice(before, None)
            delta = {"content": c.delta()}
            if before == 0:
                delta["role"] = "assistant"
            logprobs = (
                _chat_logprobs(tokenizer, r.token_ids[new], r.logprobs[new], r.top_logprobs[new], top > 0)
                if want_logprobs
                else None
            )
            item = _stream_choice(c, new, {"delta": delta}, logprobs)
            return {**meta, "object": "chat.completion.chunk", "choices": [item]}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await generate([prompt], params, bool(body.stream), include_usage, full, chunk)

    # ------------------------------------------------------------------ operations
    @app.get("/health")
    async def health():
        state = {
            "status": "ok",
            "model": served_model_name,
            "policy_version": engine.version,
            "paused": engine.paused,
        }
        if weight_stage is not None:
            state["received_version"] = weight_stage.received_version
            state["broadcast_error"] = weight_stage.error
        return state

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            prometheus.render(engine, served_model_name),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    def authorize(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if (
            not admin_token
            or scheme.lower() != "bearer"
            or not hmac.compare_digest(given.strip().encode(), admin_token.encode())
        ):
            raise ApiError(
                401,
                "admin calls need 'Authorization: Bearer <admin token>'",
                code="unauthorized",
                kind="authentication_error",
            )

    @app.post("/pause")
    async def pause(request: Request):
        authorize(request)
        engine.pause()
        return {"status": "paused", "policy_version": engine.version}

    @app.post("/resume")
    async def resume(request: Request):
        authorize(request)
        engine.resume()
        return {"status": "running", "policy_version": engine.version}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        authorize(request)
        body: UpdateWeightsRequest = parse_body(await request.body(), UpdateWeightsRequest)
        started = time.monotonic()
        try:
            if body.source == "broadcast":
                if weight_stage is None:
                    raise ApiError(400, "this server was started without a weight broadcast", param="source")
                origin = weight_stage.take(body.version)
            else:
                origin = body.path
            await asyncio.to_thread(engine.update_weights, origin, body.version, body.in_flight)
        except UserError as err:
            raise ApiError(400, str(err), param="source" if body.source == "broadcast" else "path") from None
        except TimeoutError as err:
            raise ApiError(409, str(err)) from None
        log.info("weights updated to version %s from %s", body.version, body.path or "the broadcast")
        return {
            "status": "ok",
            "policy_version": engine.version,
            "seconds": round(time.monotonic() - started, 3),
        }

    return app


def serve(
    *,
    model_path: str,
    host: str = "127.0.0.1",
    port: int,
    served_model_name: str,
    admin_token_env: str = "PRIMEBUILD_ADMIN_TOKEN",
    max_num_seqs: int = 64,
    max_model_len: int = 2048,
    dtype: str = "float32",
    seed: int = 0,
    num_threads: int | None = None,
    policy_version: int = 0,
    weight_broadcast: tuple[str, int, int] | None = None,
) -> None:
    """Load the model and serve it until interrupted (blocking). `weight_broadcast` = (init_method,
    rank, world_size) joins the trainer's weight broadcast group (see weight_receiver.py)."""
    import torch
    import uvicorn

    if num_threads:
        torch.set_num_threads(num_threads)
    admin_token = os.environ.get(admin_token_env) or None
    if admin_token is None:
        log.warning("environment variable %s is not set: admin calls will be refused", admin_token_env)
    tokenizer = ServedTokenizer(model_path)
    weight_stage = None
    if weight_broadcast is not None:  # (init_method, rank, world_size)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        weight_stage = BroadcastStage(*weight_broadcast, device=device)
    engine = Engine(
        model_path,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        dtype=dtype,
        seed=seed,
        policy_version=policy_version,
        eos_token_ids=tokenizer.eos_token_ids,
        detokenize=tokenizer.decode,
    )
    app = create_app(
        engine,
        tokenizer,
        served_model_name=served_model_name,
        admin_token=admin_token,
        shutdown_engine_on_exit=True,
        weight_stage=weight_stage,
    )
    uvicorn.run(app, host=host, port=port, log_level="info")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m primebuild.runtime.inference.server",
        description="Serve an HF Qwen3 / Qwen3-MoE folder over an OpenAI-compatible API.",
    )
    parser.add_argument("--model", required=True, help="HF model folder")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", default=None, help="defaults to the folder name")
    parser.add_argument("--admin-token-env", default="PRIMEBUILD_ADMIN_TOKEN")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--policy-version", type=int, default=0)
    parser.add_argument("--weight-broadcast-init", default=None,
                        help="tcp://HOST:PORT of the trainer's weight broadcast group (broadcast weight sync)")
    parser.add_argument("--weight-broadcast-rank", type=int, default=None)
    parser.add_argument("--weight-broadcast-world", type=int, default=None)
    args = parser.parse_args(argv)
    broadcast_args = (args.weight_broadcast_init, args.weight_broadcast_rank, args.weight_broadcast_world)
    if any(a is not None for a in broadcast_args) and not all(a is not None for a in broadcast_args):
        parser.error("--weight-broadcast-init, --weight-broadcast-rank and --weight-broadcast-world go together")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(
            model_path=args.model,
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name or os.path.basename(os.path.normpath(args.model)),
            admin_token_env=args.admin_token_env,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            dtype=args.dtype,
            seed=args.seed,
            num_threads=args.num_threads,
            policy_version=args.policy_version,
            weight_broadcast=broadcast_args if args.weight_broadcast_init else None,
        )
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
