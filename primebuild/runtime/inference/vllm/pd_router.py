"""The P/D router for vLLM: one endpoint in front of vLLM prefill and decode servers that speaks vLLM's own
API, so the orchestrator's VllmClient talks to it exactly as to one vLLM server.

    python -m primebuild.runtime.inference.vllm.pd_router --config router.json   # a VllmRouterConfig

A sampling request (/v1/completions, /v1/chat/completions) runs in two halves:
  1. prefill: the client's body with max_tokens 1, n 1, unstreamed, and `kv_transfer_params:
     {"do_remote_decode": true}` to the least-busy prefill server. Its KV connector keeps the prompt's
     KV (NIXL pins the blocks; ExampleConnector writes files into the shared storage) and the answer's
     `kv_transfer_params` say where (NIXL: remote engine, request, blocks, host, port; ExampleConnector:
     none, its files are found by the prompt's tokens).
  2. decode: the client's body plus those `kv_transfer_params` to the least-busy decode server, which
     loads the KV instead of computing it and answers with vLLM's whole contract, passed through.
     With routed experts (servers started with --enable-return-routed-experts and r3_plugin.py), the
     prefill's rows are the prompt's, the decode is asked for the completion's only
     (`routed_experts_prompt_start`), and each choice gets both, in order (pd_routes.py).

Policy versions. Every admin call that can change the weights (all but pause, resume, joins and status
reads) starts a new epoch. A hand-off whose prefill started in an earlier epoch is prefilled again
before it is decoded, and no half starts while the servers are paused: KV computed by an older policy
is never continued by a newer one. ExampleConnector's files are named by the prompt's tokens alone and
a file that exists is never rewritten, so the resume that ends an update first deletes every file (the
servers are still paused): a decode that vLLM preempted during the update, and re-prefills on resume,
then computes its prompt on the new weights instead of loading the old KV.

Admin calls (the run's token) go to every server of both pools, prefill first, in the order of the
config: /pause, /resume, /collective_rpc (the results of all servers, concatenated),
/reset_prefix_cache, /update_weight_version, /start_weight_update, /update_weights,
/finish_weight_update, and /init_weight_transfer_engine, where server i joins the trainer's group at
the given rank offset plus the ranks of the servers before it. Reads: /health (the router's own),
/weight_info (the lowest version any server holds, 503 until all answer: a fleet partly updated looks
stale, and is updated again), /is_paused (any), /version and /v1/models (one server's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from primebuild.contracts.router import VllmRouterConfig
from primebuild.runtime.config_main import config_main
from primebuild.runtime.inference.protocol import ApiError, authorize, read_body
from primebuild.runtime.inference.router_base import (
    Pool,
    add_sampling_routes,
    admin_route,
    json_object,
    pass_through,
    prometheus_text,
    router_app,
    serve_router,
)
from primebuild.runtime.inference.vllm.admin import parse_policy_version
from primebuild.runtime.inference.vllm.kv_files import KvFiles
from primebuild.runtime.inference.vllm.pd_routes import decode_start, merge, prompt_rows

log = logging.getLogger(__name__)
PREFIX = "primebuild_vllm_router"
MAX_PREFILLS = 8  # a hand-off overtaken by this many weight updates in a row gives up (503: the client retries)
FAN_OUT = ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
           "/start_weight_update", "/update_weights", "/finish_weight_update", "/init_weight_transfer_engine")
# Admin calls that leave the weights as they are; every other one starts a new epoch.
KEEPS_WEIGHTS = ("/pause", "/resume", "/init_weight_transfer_engine")
READ_ONLY_RPCS = ("primebuild_broadcast_status",)
# What a prefill must not inherit from the client's body: it samples one token, once, unstreamed.
NOT_FOR_PREFILL = ("stream", "stream_options", "min_tokens", "n", "best_of", "max_tokens", "max_completion_tokens")


class Fleet:
    """What the router knows of the servers' weights: an epoch per weight change, and whether paused."""

    def __init__(self):
        self.epoch = 0
        self.running = asyncio.Event()
        self.running.set()
        self.changed_while_paused = False

    def pause(self) -> None:
        self.running.clear()
        self.changed_while_paused = False

    def weights_changed(self) -> None:
        self.epoch += 1
        self.changed_while_paused = True


@dataclass
class Handoff:
    epoch: int  # the router's epoch when the prefill started
    result: dict | Response  # the prefill's answer, or the server's error to pass on
    names: set[str]  # ExampleConnector folders held until the decode is done


class Counters:
    def __init__(self):
        self.requests = self.failed = self.stale = 0
        self.prefill_seconds = self.decode_seconds = 0.0

    def metrics_text(self, fleet: Fleet, files: KvFiles | None) -> str:
        """The Prometheus text of the counters, the epoch and the KV folders."""
        return prometheus_text(PREFIX, (
            ("requests_total", "counter", "Requests routed through prefill then decode.", self.requests),
            ("requests_failed_total", "counter", "Requests a prefill or decode server failed.", self.failed),
            ("stale_prefills_total", "counter", "Prefills redone because the weights changed before decode.",
             self.stale),
            ("epoch", "gauge", "Weight changes the router has forwarded.", fleet.epoch),
            ("kv_folders", "gauge", "ExampleConnector KV folders in the shared storage.",
             files.folders() if files else 0),
            ("kv_folders_deleted_total", "counter", "ExampleConnector KV folders deleted.",
             files.deleted if files else 0),
            ("prefill_seconds_total", "counter", "Seconds in prefill requests.", self.prefill_seconds),
            ("decode_seconds_total", "counter", "Seconds in decode requests.", self.decode_seconds)))


def _changes_weights(path: str, body: bytes) -> bool:
    if path in KEEPS_WEIGHTS:
        return False
    if path == "/collective_rpc":
        try:
            return json.loads(body or b"{}").get("method") not in READ_ONLY_RPCS
        except (ValueError, AttributeError, RecursionError):
            return True
    return True


def _prompts(answer: dict) -> list[list[int]]:
    """The prompt ids a prefill answer reports (return_token_ids): per choice, or once for a chat."""
    prompts = [c["prompt_token_ids"] for c in answer.get("choices", []) if c.get("prompt_token_ids")]
    if not prompts and answer.get("prompt_token_ids"):
        prompts = [answer["prompt_token_ids"]]
    return prompts


class VllmPdRouter:
    """The router's state (pools, fleet, counters, KV files, the httpx client) and its jobs: route one
    request through prefill then decode (in one policy epoch), fan admin calls out to every server, and
    answer the reads from all of them."""

    def __init__(self, config: VllmRouterConfig, http: httpx.AsyncClient):
        self.http = http
        self.prefill = Pool([s.url.rstrip("/") for s in config.prefill])
        self.decode = Pool([s.url.rstrip("/") for s in config.decode])
        self.every = config.prefill + config.decode
        self.urls = [s.url.rstrip("/") for s in self.every]
        self.files = KvFiles(config.kv_storage_path, config.kv_block_size) if config.kv_storage_path else None
        if self.files is not None:
            self.files.wipe()  # a restarted router: what a former one left is held by no request
        self.fleet, self.counters = Fleet(), Counters()

    # -- sampling: prefill, then decode ------------------------------------------------------------------

    async def disaggregated(self, request: Request, path: str) -> Response:
        body = await json_object(request, "kv_transfer_params")
        self.counters.requests += 1
        try:
            first = await self.handoff(path, body)
        except ApiError:
            self.counters.failed += 1
            raise
        return await self.finish(path, body, first)

    async def handoff(self, path: str, body: dict) -> Handoff:
        """The first half, in the epoch it starts in."""
        await self.fleet.running.wait()
        epoch = self.fleet.epoch
        result, names = await self._prefill(path, body)
        return Handoff(epoch, result, names)

    async def finish(self, path: str, body: dict, h: Handoff) -> Response:
        """The second half, after prefilling again while the weights changed since the first."""
        for _ in range(MAX_PREFILLS):
            if isinstance(h.result, Response):
                self.counters.failed += 1
                return h.result
            await self.fleet.running.wait()
            if self.fleet.epoch == h.epoch:
                break
            self.counters.stale += 1  # its KV is an older policy's
            self._release(h.names)
            h = await self.handoff(path, body)
        else:
            self._release(h.names)
            self.counters.failed += 1
            raise ApiError(503, f"{MAX_PREFILLS} prefills in a row were overtaken by weight updates")
        return await self._decode(path, body, h.result, h.names)

    async def _prefill(self, path: str, body: dict) -> tuple[dict | Response, set[str]]:
        """The first half; returns the prefill's answer (or the server's error, passed on) and the KV
        folders the request now holds (ExampleConnector)."""
        one_token = {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL}
        one_token.update(max_tokens=1, n=1, stream=False, return_token_ids=True,
                         kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        if path.endswith("/chat/completions"):
            one_token["max_completion_tokens"] = 1
        files, prefill = self.files, self.prefill
        p = prefill.pick()
        prefill.busy[p] += 1
        if files is not None:
            files.begin_write()
        started = time.monotonic()
        names: set[str] = set()
        try:
            answer = await self.http.post(prefill.urls[p] + path, json=one_token)
            if answer.status_code != 200:  # the server's own answer (a 400 for a bad request ...)
                return Response(answer.content, status_code=answer.status_code, media_type="application/json"), names
            result = answer.json()
            if files is not None:
                names = files.names(_prompts(result))
                files.hold(names)  # before end_write: a folder released meanwhile must not go under it
            return result, names
        except httpx.TransportError as err:
            raise ApiError(503, f"prefill server {prefill.urls[p]} unreachable: {err}") from None
        finally:
            prefill.busy[p] -= 1
            if files is not None:
                files.end_write()
            self.counters.prefill_seconds += time.monotonic() - started

    async def _decode(self, path: str, body: dict, prefilled: dict, names: set[str]) -> Response:
        """The second half: the client's body plus where the prefill left the KV; the answer passed through,
        or with routed experts, each choice's routes preceded by its prompt's (pd_routes.py)."""
        params = prefilled.get("kv_transfer_params")
        decode_body = {**body, "kv_transfer_params": params} if params else dict(body)
        try:
            rows = prompt_rows(prefilled)
            if rows is not None:
                if body.get("stream"):
                    raise ApiError(400, "router replay through P/D answers unstreamed requests only (the routes "
                                   "of both halves are merged into the final answer): drop stream",
                                   param="stream")
                decode_body["routed_experts_prompt_start"] = decode_start(prefilled, _prompts(prefilled))
        except ApiError:
            self._release(names)
            self.counters.failed += 1
            raise
        decode = self.decode
        d = decode.pick()
        decode.busy[d] += 1
        started = time.monotonic()
        try:
            upstream = await self.http.send(
                self.http.build_request("POST", decode.urls[d] + path, json=decode_body), stream=True)
        except httpx.TransportError as err:
            decode.busy[d] -= 1
            self._release(names)
            self.counters.failed += 1
            raise ApiError(503, f"decode server {decode.urls[d]} unreachable: {err}") from None

        async def done() -> None:
            await upstream.aclose()
            decode.busy[d] -= 1
            self._release(names)
            self.counters.decode_seconds += time.monotonic() - started

        if rows is None:
            return await pass_through(upstream, bool(body.get("stream")), done)
        try:
            content = await upstream.aread()
        finally:
            await done()
        if upstream.status_code != 200:
            return Response(content, status_code=upstream.status_code, media_type="application/json")
        return JSONResponse(merge(json.loads(content), rows, int(body.get("n") or 1)))

    def _release(self, names: set[str]) -> None:
        if self.files is not None and names:
            self.files.release(names)

    # -- reads -------------------------------------------------------------------------------------------

    async def weight_info(self):
        infos = [a.json() for a in await self._read_all("/weight_info")]
        return min(infos, key=lambda i: parse_policy_version(i.get("weight_version")))

    async def is_paused(self):
        return {"is_paused": any(a.json().get("is_paused") for a in await self._read_all("/is_paused"))}

    async def _read_all(self, path: str) -> list[httpx.Response]:
        """Every server's answer to GET `path`; 503 unless all of them answer 200."""
        try:
            answers = await asyncio.gather(*(self.http.get(url + path) for url in self.urls))
        except httpx.TransportError as err:
            raise ApiError(503, f"{path}: a server is unreachable: {err}") from None
        if any(a.status_code != 200 for a in answers):
            raise ApiError(503, f"{path}: a server did not answer")
        return answers

    async def passthrough(self, url: str, path: str) -> Response:
        try:
            answer = await self.http.get(url + path)
        except httpx.TransportError as err:
            raise ApiError(503, f"{url}{path} unreachable: {err}") from None
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    # -- admin -------------------------------------------------------------------------------------------

    async def admin(self, request: Request, path: str, admin_token: str | None):
        header = authorize(request, admin_token)
        raw = await read_body(request) or b"{}"
        self._note_admin(path, raw)
        headers = {"authorization": header, "content-type": "application/json"}
        query = request.url.query
        try:
            answers = await asyncio.gather(*(
                self.http.post(url + path + (f"?{query}" if query else ""), headers=headers, content=body)
                for url, body in zip(self.urls, self._bodies_for(path, raw), strict=True)))
        except httpx.TransportError as err:
            raise ApiError(503, f"{path}: a server is unreachable: {err}") from None
        if path == "/resume" and all(a.status_code == 200 for a in answers):
            self.fleet.running.set()
        failed = [(url, a) for url, a in zip(self.urls, answers, strict=True) if a.status_code != 200]
        if failed:
            url, worst = failed[0]
            raise ApiError(worst.status_code, f"{path} failed on {len(failed)} of {len(self.urls)} servers; "
                           f"{url}: {worst.text[:300]}")
        if path == "/collective_rpc":
            return {"results": [r for a in answers for r in a.json()["results"]]}
        return Response(answers[0].content, status_code=200, media_type="application/json")

    def _note_admin(self, path: str, raw: bytes) -> None:
        """What an admin call does to the fleet, before it reaches the servers."""
        if path == "/pause":
            self.fleet.pause()  # before the servers pause: no hand-off starts a half from now on
        elif _changes_weights(path, raw):
            self.fleet.weights_changed()
        elif path == "/resume" and self.files is not None and self.fleet.changed_while_paused:
            self.files.wipe()  # every server is still paused: no KV file is being read or written

    def _bodies_for(self, path: str, raw: bytes) -> list[bytes]:
        """The body each server gets: the same, except a join, where each server takes its own ranks."""
        if path != "/init_weight_transfer_engine":
            return [raw] * len(self.every)
        try:
            body = json.loads(raw)
            offset = int(body["init_info"]["rank_offset"])
        except (ValueError, KeyError, TypeError, RecursionError):
            raise ApiError(400, "init_info.rank_offset: an integer is required", param="init_info") from None
        out = []
        for server in self.every:
            out.append(json.dumps({**body, "init_info": {**body["init_info"], "rank_offset": offset}}).encode())
            offset += server.ranks
        return out


def create_router(config: VllmRouterConfig, admin_token: str | None) -> FastAPI:
    app, http = router_app("primebuild vLLM P/D router")
    router = VllmPdRouter(config, http)

    add_sampling_routes(app, router.disaggregated)

    @app.get("/health")
    async def health():
        # The router itself: on Kubernetes it is a container of prefill-0's pod, whose readiness gates the
        # decode group's start (JobSet InOrder), so it cannot wait for the decode servers. Whether the
        # servers answer is what /weight_info tells (503 until all do), which the orchestrator retries.
        return Response(status_code=200)

    @app.get("/weight_info")
    async def weight_info():
        return await router.weight_info()

    @app.get("/is_paused")
    async def is_paused():
        return await router.is_paused()

    @app.get("/version")
    async def version():
        return await router.passthrough(router.urls[0], "/version")

    @app.get("/v1/models")
    async def models():
        return await router.passthrough(router.decode.urls[0], "/v1/models")

    for path in FAN_OUT:
        app.add_api_route(path, admin_route(router, path, admin_token), methods=["POST"])

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(router.counters.metrics_text(router.fleet, router.files),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    app.state.fleet, app.state.counters, app.state.kv_files = router.fleet, router.counters, router.files
    app.state.handoff, app.state.finish, app.state.close = router.handoff, router.finish, http.aclose  # for tests
    return app


def serve(config: VllmRouterConfig) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per upstream request: two per sample
    serve_router(config, create_router, log)


def main(argv: list[str] | None = None) -> int:
    return config_main(argv, prog="python -m primebuild.runtime.inference.vllm.pd_router",
                       config_class=VllmRouterConfig, run=serve,
                       description="Route vLLM requests through prefill then decode servers.")


if __name__ == "__main__":
    sys.exit(main())
