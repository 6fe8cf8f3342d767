"""The P/D router: the one inference endpoint of a disaggregated run (FastAPI + httpx).

    python -m primebuild.runtime.inference.router --config router.json   # a RouterConfig

For each /v1/completions or /v1/chat/completions request it picks the least-busy prefill server and
the least-busy decode server, then
  1. posts the body to the prefill server with `kv_transfer: {id, to: <decode's KV inbox>}`: the
     prompts are prefilled there and their KV caches pushed to the decode server (disaggregation.py);
  2. posts the same body to the decode server with `kv_transfer: {id}`, which continues from the
     shipped KV and answers with the full OpenAI contract; that answer (streamed or whole) is passed
     through unchanged.
Admin calls (`/pause`, `/resume`, `/update_weights`, with the run's token) go to every prefill and
decode server at once, so the orchestrator's pause -> update -> resume reaches both pools. `/health`
reports the lowest policy version any server holds (and the lowest received one): a fleet that is
partly updated looks stale to the orchestrator, which then updates it again.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from primebuild.contracts.completion import WEIGHTS_MIXED
from primebuild.contracts.router import RouterConfig
from primebuild.runtime.config_main import config_main

from .protocol import ApiError, authorize, read_body
from .router_base import (
    Pool,
    add_sampling_routes,
    admin_route,
    json_object,
    pass_through,
    prometheus_text,
    router_app,
    serve_router,
)

log = logging.getLogger(__name__)
PREFIX = "primebuild_router"


class Counters:
    def __init__(self):
        self.requests = self.failed = self.prompts = self.kv_bytes = self.kv_tokens = 0
        self.prefill_seconds = self.decode_seconds = 0.0

    def metrics_text(self) -> str:
        """The Prometheus text of the counters."""
        return prometheus_text(PREFIX, (
            ("requests_total", "counter", "Requests routed through prefill then decode.", self.requests),
            ("requests_failed_total", "counter", "Requests a prefill or decode server failed.", self.failed),
            ("prompts_total", "counter", "Prompts prefilled and shipped.", self.prompts),
            ("kv_transfer_bytes_total", "counter", "Bytes of K and V shipped from prefill to decode.",
             self.kv_bytes),
            ("kv_transfer_tokens_total", "counter", "Prompt tokens whose K and V were shipped.", self.kv_tokens),
            ("prefill_seconds_total", "counter", "Seconds in prefill requests (prefill + KV send).",
             self.prefill_seconds),
            ("decode_seconds_total", "counter", "Seconds in decode requests.", self.decode_seconds)))


class PdRouter:
    """The router's state (pools, counters, the httpx client) and its three jobs: route one request through
    prefill then decode, fan admin calls out to every server, and report the fleet's health."""

    def __init__(self, config: RouterConfig, http: httpx.AsyncClient, admin_token: str | None):
        self.config, self.http = config, http
        # the servers take a body with kv_transfer only with the run's token: no client may point a prefill
        # server's KV at an address of its choosing, nor hold a decode server waiting for KV that never comes
        self.auth = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.prefill = Pool([u.rstrip("/") for u in config.prefill])
        self.decode = Pool([d.url.rstrip("/") for d in config.decode])
        self.inbox = {d.url.rstrip("/"): d.kv_address for d in config.decode}
        self.every = self.prefill.urls + self.decode.urls
        self.counters = Counters()

    async def disaggregated(self, request: Request, path: str) -> Response:
        body = await json_object(request, "kv_transfer")
        transfer = uuid.uuid4().hex
        self.counters.requests += 1
        d = self.decode.pick()
        failed = await self._prefill(path, body, transfer, self.decode.urls[d])
        if failed is not None:
            return failed
        return await self._decode(path, {**body, "kv_transfer": {"id": transfer}}, d, bool(body.get("stream")))

    async def _prefill(self, path: str, body: dict, transfer: str, decode_url: str) -> Response | None:
        """The first half: the prompts prefilled and their KV pushed to the decode server's inbox; returns
        the prefill server's own answer when it is an error, to pass on."""
        counters, p = self.counters, self.prefill.pick()
        prefill_url = self.prefill.urls[p]
        self.prefill.busy[p] += 1
        started = time.monotonic()
        try:
            answer = await self.http.post(prefill_url + path, headers=self.auth, json={
                **body, "stream": False, "kv_transfer": {"id": transfer, "to": self.inbox[decode_url]}})
        except httpx.TransportError as err:
            counters.failed += 1
            raise ApiError(503, f"prefill server {prefill_url} unreachable: {err}") from None
        finally:
            self.prefill.busy[p] -= 1
        counters.prefill_seconds += time.monotonic() - started
        if answer.status_code != 200:  # the prefill server's own answer (a 400 for a bad request ...)
            counters.failed += 1
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        sent = answer.json().get("kv_transfer", {})
        counters.prompts += int(sent.get("prompts", 0))
        counters.kv_bytes += int(sent.get("kv_bytes", 0))
        counters.kv_tokens += int(sent.get("tokens", 0))
        return None

    async def _decode(self, path: str, body: dict, d: int, stream: bool) -> Response:
        """The second half: the decode server continues from the shipped KV; its answer passes through."""
        decode_url = self.decode.urls[d]
        self.decode.busy[d] += 1
        started = time.monotonic()
        try:
            upstream = await self.http.send(self.http.build_request("POST", decode_url + path, json=body,
                                                                    headers=self.auth), stream=True)
        except httpx.TransportError as err:
            self.decode.busy[d] -= 1
            self.counters.failed += 1
            raise ApiError(503, f"decode server {decode_url} unreachable: {err}") from None

        async def done() -> None:
            await upstream.aclose()
            self.decode.busy[d] -= 1
            self.counters.decode_seconds += time.monotonic() - started

        return await pass_through(upstream, stream, done)

    async def _fan_out(self, method: str, path: str, headers: dict, body: bytes | None = None) -> list[httpx.Response]:
        return await asyncio.gather(*(self.http.request(method, url + path, headers=headers, content=body)
                                      for url in self.every))

    async def health(self):
        try:
            answers = await self._fan_out("GET", "/health", {})
        except httpx.TransportError as err:
            return JSONResponse({"status": "unavailable", "error": str(err)}, status_code=503)
        if any(a.status_code != 200 for a in answers):
            return JSONResponse({"status": "unavailable", "servers": [a.status_code for a in answers]},
                                status_code=503)
        states = [a.json() for a in answers]
        versions = [s["policy_version"] for s in states]
        # one server's mixed weights (a broadcast cut off inside its update) make the fleet's: it serves nothing whole
        mixed = any(s.get("status") == WEIGHTS_MIXED for s in states)
        return {"status": WEIGHTS_MIXED if mixed else "ok", "model": self.config.served_model_name,
                "policy_version": min(versions),
                "policy_versions": dict(zip(self.every, versions, strict=True)),
                "received_version": min(s.get("received_version", s["policy_version"]) for s in states),
                "paused": any(s.get("paused") for s in states)}

    async def admin(self, request: Request, path: str, admin_token: str | None):
        header = authorize(request, admin_token)
        body = await read_body(request)
        try:
            answers = await self._fan_out("POST", path, {"authorization": header, "content-type": "application/json"},
                                          body or b"{}")
        except httpx.TransportError as err:
            raise ApiError(503, f"{path}: a server is unreachable: {err}") from None
        failed = [(url, a) for url, a in zip(self.every, answers, strict=True) if a.status_code != 200]
        if failed:
            url, worst = failed[0]
            message = f"{path} failed on {len(failed)} of {len(self.every)} servers; {url}: {worst.text[:300]}"
            raise ApiError(worst.status_code, message)
        versions = {a.json().get("policy_version") for a in answers}
        return {"status": "ok", "servers": len(self.every), "policy_version": min(v for v in versions if v is not None)}


def create_router(config: RouterConfig, admin_token: str | None) -> FastAPI:
    app, http = router_app("primebuild P/D router")
    router = PdRouter(config, http, admin_token)

    add_sampling_routes(app, router.disaggregated)

    @app.get("/v1/models")
    async def models():
        answer = await http.get(router.decode.urls[0] + "/v1/models")
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        return await router.health()

    for path in ("/pause", "/resume", "/update_weights"):
        app.add_api_route(path, admin_route(router, path, admin_token), methods=["POST"])

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(router.counters.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def serve(config: RouterConfig) -> None:
    serve_router(config, create_router, log)


def main(argv: list[str] | None = None) -> int:
    return config_main(argv, prog="python -m primebuild.runtime.inference.router", config_class=RouterConfig, run=serve,
                       description="Route OpenAI requests through prefill then decode servers.")


if __name__ == "__main__":
    from primebuild.runtime.stacks import dump_on_signal

    dump_on_signal()  # a hung run asks for this process's stacks
    sys.exit(main())
