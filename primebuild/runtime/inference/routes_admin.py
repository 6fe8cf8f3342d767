"""Operations: /health and /metrics (open), and the admin calls /pause, /resume, /update_weights, which
need `Authorization: Bearer <the run's token>` (compared in constant time, never logged)."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from primebuild.contracts.completion import WEIGHTS_MIXED
from primebuild.errors import UserError

from . import metrics as prometheus
from .disaggregation import Disaggregation
from .engine import Engine, EngineDead
from .protocol import ApiError, UpdateWeightsRequest, authorize, parse_body, read_body
from .weight_receiver import BroadcastInterrupted, BroadcastStage

log = logging.getLogger(__name__)


def admin_router(engine: Engine, served_model_name: str, admin_token: str | None,
                 weight_stage: BroadcastStage | None, pd: Disaggregation | None = None) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        if engine.dead is not None:  # a live server over a dead engine is a dead server (the supervisor restarts it)
            return JSONResponse({"status": "dead", "error": engine.dead}, status_code=503)
        state = {"status": "ok", "model": served_model_name, "policy_version": engine.version,
                 "paused": engine.paused}
        if engine.mixed is not None:  # up (no restart wanted), serving nothing: policy_version is the last whole one
            state["status"], state["weights_mixed"] = WEIGHTS_MIXED, engine.mixed
        if pd is not None and pd.role is not None:
            state["role"] = pd.role
        if weight_stage is not None:
            state["received_version"] = weight_stage.received_version
            state["broadcast_error"] = weight_stage.error
        return state

    @router.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus.render(engine, served_model_name, pd),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.post("/pause")
    async def pause(request: Request):
        authorize(request, admin_token)
        engine.pause()
        return {"status": "paused", "policy_version": engine.version}

    @router.post("/resume")
    async def resume(request: Request):
        authorize(request, admin_token)
        engine.resume()
        return {"status": "running", "policy_version": engine.version}

    @router.post("/update_weights")
    async def update_weights(request: Request):
        authorize(request, admin_token)
        body: UpdateWeightsRequest = parse_body(await read_body(request), UpdateWeightsRequest)
        started = time.monotonic()
        try:
            if body.source == "broadcast":
                if weight_stage is None:
                    raise ApiError(400, "this server was started without a weight broadcast", param="source")
                announced = weight_stage.announced(body.version)
                # one bucket at a time straight into the served model: no staged copy (weight_receiver.py);
                # without prefetch the bucket and the layer built from it are all an update adds. A sender
                # that dies half-way leaves the weights mixed, not the engine dead: the restarted trainer's
                # next send is whole (broadcast.py) and mends every piece.
                await asyncio.to_thread(
                    engine.update_weights_in_place, [s.name for s in announced.specs],
                    lambda add: weight_stage.pull(announced, add, prefetch=False), body.in_flight,
                    resumable=(BroadcastInterrupted,))
            else:
                await asyncio.to_thread(engine.update_weights, body.path, body.version, body.in_flight)
        except UserError as err:
            raise ApiError(400, str(err), param="source" if body.source == "broadcast" else "path") from None
        except BroadcastInterrupted as err:  # the trainer restarts alone: the orchestrator counts no update
            mixed = "" if engine.mixed is None else (f"; the served weights are a mix of two policies, "
                                                     f"served by nothing until a whole update: {engine.mixed}")
            raise ApiError(409, f"{err}{mixed}", code="weight_update_lost") from None
        except TimeoutError as err:
            raise ApiError(409, str(err)) from None
        except EngineDead as err:
            raise ApiError(503, str(err), code="engine_dead") from None
        log.info("weights updated to version %s from %s", body.version, body.path or "the broadcast")
        return {"status": "ok", "policy_version": engine.version, "seconds": round(time.monotonic() - started, 3)}

    return router
