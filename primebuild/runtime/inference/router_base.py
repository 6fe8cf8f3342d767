"""What both P/D routers share (the embedded engine's, router.py, and vLLM's, vllm/pd_router.py): the
FastAPI app with OpenAI-style errors, one pooled httpx client for the servers behind it, the pools'
least-busy pick, the admin token check and the client's JSON body."""

from __future__ import annotations

import itertools
import json
import logging
import os

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from primebuild.runtime.http_pool import pool_limits

from .protocol import ApiError, answer_errors_in_openai_shape, read_body


class Pool:
    """Servers of one kind and the requests each has in flight (least-busy first, then in turn)."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.busy = [0] * len(urls)
        self._turn = itertools.count()

    def pick(self) -> int:
        n, start = len(self.urls), next(self._turn) % len(self.urls)
        return min(range(n), key=lambda i: (self.busy[i], (i - start) % n))


def router_app(title: str) -> tuple[FastAPI, httpx.AsyncClient]:
    """The router's app (ApiError answered as OpenAI-style JSON) and its client to the servers: one pool
    of up to 1024 connections, long reads (a decode may stream for minutes), quick connects."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None)
    answer_errors_in_openai_shape(app)

    @app.exception_handler(httpx.TransportError)  # a server behind the router is down or unreachable
    async def _upstream_gone(request: Request, err: httpx.TransportError):
        message = f"a server behind the router is unreachable ({type(err).__name__}: {str(err)[:200]})"
        return JSONResponse(ApiError(503, message).body(), status_code=503)

    return app, httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), limits=pool_limits(1024))


async def json_object(request: Request, routers_own: str) -> dict:
    """A client's request body: a JSON object of bounded size, without the field the router sets."""
    raw = await read_body(request)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:  # bad UTF-8, bad JSON, absurd nesting
        raise ApiError(400, f"request body is not valid JSON: {str(err)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if routers_own in body:
        raise ApiError(400, f"{routers_own} is set by the router, not by clients", param=routers_own)
    return body


async def pass_through(upstream: httpx.Response, stream: bool, done) -> Response:
    """The decode server's answer to the client, whole or streamed as it comes; `done` runs once it is read."""
    media = upstream.headers.get("content-type", "application/json")
    if not stream:
        try:
            content = await upstream.aread()
        finally:
            await done()
        return Response(content, status_code=upstream.status_code, media_type=media)
    return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, media_type=media,
                             background=BackgroundTask(done))


def prometheus_text(prefix: str, rows) -> str:
    """Prometheus text exposition of (name, kind, help, value) rows, each name under `prefix`_."""
    lines = []
    for name, kind, text, value in rows:
        lines += [f"# HELP {prefix}_{name} {text}", f"# TYPE {prefix}_{name} {kind}", f"{prefix}_{name} {value}"]
    return "\n".join(lines) + "\n"


SAMPLING_PATHS = ("/v1/completions", "/v1/chat/completions")


def add_sampling_routes(app: FastAPI, disaggregated) -> None:
    """POST /v1/completions and /v1/chat/completions, each answered by `disaggregated(request, path)`."""
    for path in SAMPLING_PATHS:
        app.add_api_route(path, _sampling_route(disaggregated, path), methods=["POST"])


def _sampling_route(disaggregated, path: str):
    async def route(request: Request):
        return await disaggregated(request, path)
    route.__name__ = path.strip("/").replace("/", "_")
    return route


def admin_route(router, path: str, admin_token: str | None):
    """A POST route for admin call `path`, fanned out by `router.admin` (both routers have one)."""
    async def route(request: Request):
        return await router.admin(request, path, admin_token)
    route.__name__ = "admin" + path.replace("/", "_")
    return route


def serve_router(config, create_router, log: logging.Logger) -> None:
    """Run a router app on the config's address; its admin token comes from the environment, never the config."""
    import uvicorn

    admin_token = os.environ.get(config.admin_token_env) or None
    if admin_token is None:
        log.warning("environment variable %s is not set: admin calls will be refused", config.admin_token_env)
    uvicorn.run(create_router(config, admin_token), host=config.host, port=config.port, log_level="info")
