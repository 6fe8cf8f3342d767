"""OpenAI-compatible HTTP server over the embedded engine (FastAPI + uvicorn).

    python -m primebuild.runtime.inference.server --config server.json   # an InferenceServerConfig

The app is assembled here from its parts: routes_openai.py (completions, chat, models; answers shaped in
responses.py, requests checked in validation.py, bodies typed in protocol.py) and routes_admin.py
(health, metrics, pause / resume / update_weights behind the run's token). Errors of every kind leave
as OpenAI-shaped JSON bodies. See docs/inference.md for the contract.

Entry points: `serve(config)` (blocking; what the worker runs), `create_app(engine, ...)` (tests), and
`run_http(app, engine, host, port)`, which serves until the engine dies (then the server leaves, exit 1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from primebuild.contracts.completion import WEIGHTS_MIXED
from primebuild.contracts.dtypes import PRECISION_DTYPES
from primebuild.contracts.inference import InferenceServerConfig
from primebuild.errors import UserError
from primebuild.runtime.config_main import config_main

from .body_parser import BodyParser, PromptBounds
from .disaggregation import Disaggregation
from .engine import Engine, WeightsMixed
from .protocol import ApiError, answer_errors_in_openai_shape
from .routes_admin import admin_router
from .routes_openai import openai_router
from .tokenizer import ServedTokenizer
from .weight_receiver import BroadcastStage

log = logging.getLogger(__name__)

ENGINE_WATCH_SECONDS = 1.0


def create_app(
    engine: Engine,
    tokenizer: ServedTokenizer | None = None,
    *,
    served_model_name: str = "model",
    admin_token: str | None = None,
    shutdown_engine_on_exit: bool = False,
    weight_stage: BroadcastStage | None = None,
    pd: Disaggregation | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app over an already-running engine. `admin_token=None` refuses every admin call."""
    tokenizer = tokenizer or ServedTokenizer(engine.model_path)
    if engine.detokenize is None:
        engine.detokenize = tokenizer.decode
    if not engine.eos_token_ids:
        engine.eos_token_ids = set(tokenizer.eos_token_ids)

    body_parser = BodyParser(PromptBounds(engine.max_model_len, tokenizer.max_chars_per_token))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        body_parser.close()
        if shutdown_engine_on_exit:
            engine.shutdown()

    app = FastAPI(title="primebuild inference", lifespan=lifespan, docs_url=None, redoc_url=None)
    answer_errors_in_openai_shape(app)

    @app.exception_handler(WeightsMixed)
    async def _weights_mixed(request: Request, err: WeightsMixed):
        # the server is up and will serve again after a whole update: 503, so a client goes elsewhere
        return JSONResponse(ApiError(503, str(err), code=WEIGHTS_MIXED).body(), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        return JSONResponse(ApiError(400, str(err)[:500]).body(), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, err: ClientDisconnect):
        # the client hung up before its request was read (the orchestrator dropped a rollout group or
        # stopped): nobody waits for an answer, and nothing went wrong here
        log.info("%s %s: the client disconnected before its request was read", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, err: Exception):
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, f"internal error: {type(err).__name__}").body(), status_code=500)

    app.include_router(openai_router(engine, tokenizer, served_model_name, body_parser, pd, tool_call_parser,
                                    admin_token))
    app.include_router(admin_router(engine, served_model_name, admin_token, weight_stage, pd))
    return app


def serve(config: InferenceServerConfig) -> None:
    """Load the model and serve it until interrupted (blocking)."""
    import torch

    if config.precision not in PRECISION_DTYPES and config.precision != "fp8":
        raise UserError(f"precision {config.precision}: the embedded engine computes in fp32, bf16 or fp8")
    # fp8: FP8 matmul weights; everything else in bf16 on a GPU, fp32 on a CPU (whose bf16 matmuls are
    # no faster and whose FP8 is the reference function, computed in fp32: primebuild/kernels/fp8.py)
    fp8 = config.precision == "fp8"
    dtype = ("bfloat16" if torch.cuda.is_available() else "float32") if fp8 else PRECISION_DTYPES[config.precision]
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    admin_token = os.environ.get(config.admin_token_env) or None
    if admin_token is None:
        log.warning("environment variable %s is not set: admin calls will be refused", config.admin_token_env)
    tokenizer = ServedTokenizer(config.model_path)
    weight_stage = None
    if config.weight_broadcast is not None:
        join = config.weight_broadcast
        device = "cuda" if torch.cuda.is_available() else "cpu"
        weight_stage = BroadcastStage(join.init_method, join.rank, join.world_size, device=device)
    engine = Engine(config.model_path, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                    dtype=dtype, fp8=fp8, seed=config.seed, policy_version=config.policy_version,
                    eos_token_ids=tokenizer.eos_token_ids, detokenize=tokenizer.decode,
                    batch_invariant=config.batch_invariant)
    pd = None
    if config.disaggregation is not None:  # P/D: this server is a prefill or a decode server
        role = config.disaggregation.role
        pd = Disaggregation(role, f"tcp://{config.host}:{config.disaggregation.kv_port}" if role == "decode" else None)
    app = create_app(engine, tokenizer, served_model_name=config.served_model_name, admin_token=admin_token,
                     shutdown_engine_on_exit=True, weight_stage=weight_stage, pd=pd,
                     tool_call_parser=config.tool_call_parser)
    served = run_http(app, engine, config.host, config.port)
    if weight_stage is not None:
        weight_stage.leave()  # stopped (retired by `scale`, restarted, or the run's end): out of the group now
    if not served:
        raise SystemExit(1)  # the supervisor restarts a server that failed


def run_http(app: FastAPI, engine: Engine, host: str, port: int) -> bool:
    """Serve until interrupted (True) or until the engine died (False): a server over a dead engine
    leaves, within ENGINE_WATCH_SECONDS, rather than answer every request with an error."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=5))

    def watch() -> None:
        while not server.should_exit:
            if engine.dead is not None:
                log.critical("the engine died (%s): the server leaves", engine.dead)
                server.should_exit = True
            time.sleep(ENGINE_WATCH_SECONDS)

    threading.Thread(target=watch, name="engine-watch", daemon=True).start()
    server.run()
    return engine.dead is None


def main(argv: list[str] | None = None) -> int:
    return config_main(argv, prog="python -m primebuild.runtime.inference.server", config_class=InferenceServerConfig,
                       run=serve, description="Serve an HF Qwen3 / Qwen3-MoE folder over an OpenAI-compatible API.")


if __name__ == "__main__":
    from primebuild.runtime.stacks import dump_on_signal

    dump_on_signal()  # a hung run asks for this process's stacks
    sys.exit(main())
