"""``POST /primebuild/broadcast_status``: the broadcast receiver of every worker of a vLLM server.

vLLM's own ``/collective_rpc`` reaches every worker of every engine core, but a data-parallel server
(several engine cores behind one API server) answers with the first core's workers only: its
client's ``call_utility_async`` keeps ``results[0]`` (vllm/v1/engine/core_client.py,
DPLBAsyncMPClient, vLLM 0.32). A weight update must see every worker (one that lags or failed must
stop the server from claiming the new version), so this route asks each engine core and answers
``{"results": [status, ...]}``, one status per worker (worker_extension.primebuild_broadcast_status).

Loaded by vLLM as an ASGI middleware (``--middleware``), listed *before* admin_auth's: vLLM adds
middlewares in order and the last added runs first, so the admin token is checked before this runs.
Runs inside vLLM's API server process.
"""

from __future__ import annotations

from typing import Any

from primebuild.runtime.inference.vllm.asgi_json import send_json

STATUS_PATH = "/primebuild/broadcast_status"
STATUS_METHOD = "primebuild_broadcast_status"  # worker_extension.PrimebuildWorkerExtension


async def worker_statuses(app: Any) -> list[dict]:
    """The receiver status of every worker of every engine core of the vLLM server `app`."""
    engine_core = app.state.engine_client.engine_core
    per_core = await engine_core.call_utility_all_async("collective_rpc", STATUS_METHOD, None, (), None)
    return [status for workers in per_core for status in workers]


class BroadcastStatusRoute:
    """Pure ASGI middleware that answers one path itself and passes every other request on."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or path != STATUS_PATH or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        await send_json(send, 200, {"results": await worker_statuses(scope["app"])})
