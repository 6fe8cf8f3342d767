"""A vLLM server whose weights are a mix of two steps serves nothing until a whole update (``--middleware``).

Broadcast weight sync: when the trainer's sender dies inside a load after some buckets were installed (the
trainer restarts alone), the worker finishes the reload without raising and marks its weights ``mixed``
(broadcast_engine.py); the server process, its model and its KV cache stay. This middleware, in the API
server process, makes the rest of the server honour that, as our embedded engine does (engine.py):

- after every ``POST /finish_weight_update`` it reads every worker's status (broadcast_status.py) before
  the answer leaves, so the admin's next call already sees the verdict; a whole load clears it;
- while any worker is mixed: completions (every POST under /v1 but the LoRA admin calls) answer 503
  ``weights_mixed``; ``POST /resume`` answers 409 ``weights_mixed``, so the server stays paused and the
  requests the update froze stay frozen (the next whole update drops their KV and resumes them on whole
  weights: nothing is sampled from the mix); ``GET /health`` answers 200 (up: no restart wanted) with
  ``{"status": "weights_mixed", ...}`` and ``GET /weight_info`` adds ``"status": "weights_mixed"``, which
  the orchestrator's client reads as NO_WHOLE_POLICY (admin.py).

Listed before admin_auth's middleware (vLLM runs the last-listed first): the token is checked first.
Runs inside vLLM's API server process.
"""

from __future__ import annotations

import logging
from typing import Any

from primebuild.contracts.completion import WEIGHTS_MIXED
from primebuild.runtime.inference.vllm.admin_auth import ADMIN_UNDER_V1, PUBLIC_PREFIXES
from primebuild.runtime.inference.vllm.asgi_json import send_json
from primebuild.runtime.inference.vllm.broadcast_status import worker_statuses

log = logging.getLogger("vllm.primebuild.weights_mixed")  # under vLLM's logger: its handler prints it


def _error(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": WEIGHTS_MIXED}}


class WeightsMixedGuard:
    """Pure ASGI middleware (vLLM adds it with ``app.add_middleware(cls)``, no arguments)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.mixed: str | None = None  # why the served weights are a mix, while they are

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method"), scope["path"].removeprefix(scope.get("root_path", ""))
        if method == "POST" and path == "/finish_weight_update":
            await self._finish(scope, receive, send)
        elif self.mixed is None:
            await self.app(scope, receive, send)
        elif method == "POST" and path.startswith(PUBLIC_PREFIXES) and \
                path.rstrip("/").removeprefix("/inference") not in ADMIN_UNDER_V1:
            await send_json(send, 503, _error(f"the served weights are a mix of two policies, served by nothing until "
                                            f"a whole update: {self.mixed}", "service_unavailable"))
        elif method == "POST" and path == "/resume":
            await send_json(send, 409, _error(f"not resumed: the weights are a mix of two policies ({self.mixed}); "
                                            "the next whole update resumes the server", "conflict"))
        elif method == "GET" and path in ("/health", "/weight_info"):
            held = await self._held(scope, receive)  # vLLM's own answer first: a dead engine still fails /health
            if held[0]["status"] != 200:
                for message in held:
                    await send(message)
                return
            version = await scope["app"].state.engine_client.get_weight_version()
            await send_json(send, 200, {"status": WEIGHTS_MIXED, "weight_version": version, WEIGHTS_MIXED: self.mixed})
        else:
            await self.app(scope, receive, send)

    async def _held(self, scope: dict, receive: Any) -> list[dict]:
        """vLLM's answer to the request, held back (its messages, the start first)."""
        held: list[dict] = []

        async def hold(message: dict) -> None:
            held.append(message)

        await self.app(scope, receive, hold)
        return held

    async def _finish(self, scope: dict, receive: Any, send: Any) -> None:
        """Finish the update, then read the workers' verdict before the answer goes out."""
        held = await self._held(scope, receive)
        mixed = [s["mixed"] for s in await worker_statuses(scope["app"]) if s.get("mixed")]
        if mixed and self.mixed is None:
            log.warning("the served weights are a mix of two policies (%s): completions answer 503 %s and the "
                        "server stays paused until a whole update", mixed[0], WEIGHTS_MIXED)
        elif not mixed and self.mixed is not None:
            log.warning("the weights are whole again: serving")
        self.mixed = mixed[0] if mixed else None
        for message in held:
            await send(message)
