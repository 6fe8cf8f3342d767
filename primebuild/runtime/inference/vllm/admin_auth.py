"""The run's admin token on a vLLM server's RL and dev endpoints (loaded by vLLM: ``--middleware``).

vLLM's own ``--api-key`` (or ``VLLM_API_KEY``) only guards paths under /v1, /v2, /inference and
/cohere: its RL endpoints (/pause, /resume, /update_weights, ...) and the dev endpoints
(/collective_rpc, /reset_prefix_cache, /sleep, ...) stay open to anyone who reaches the port. This
middleware closes them: every path that is not on the public list below needs
``Authorization: Bearer <token>``, the token being the value of ``PRIMEBUILD_ADMIN_TOKEN`` in the
server's environment; with no token set, those paths answer 401 — the same contract as our embedded
server (docs/inference.md). The token is compared by digest in constant time and never logged.

Runs inside vLLM's API server process: standard library only (plus starlette, which vLLM brings).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

from primebuild.runtime.inference.vllm.asgi_json import send_json

TOKEN_ENV = "PRIMEBUILD_ADMIN_TOKEN"

# Open like the embedded server: sampling and tokenising, and read-only status.
PUBLIC_PREFIXES = ("/v1/", "/inference/v1/")
PUBLIC_PATHS = frozenset({"/tokenize", "/detokenize"})
PUBLIC_READS = frozenset({"/health", "/ping", "/version", "/metrics", "/load", "/is_paused", "/weight_info"})
# Under /v1 but changing what the server serves (mounted with VLLM_ALLOW_RUNTIME_LORA_UPDATING): admin calls.
ADMIN_UNDER_V1 = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def is_public(method: str, path: str) -> bool:
    if path.rstrip("/") in ADMIN_UNDER_V1 or path.rstrip("/").removeprefix("/inference") in ADMIN_UNDER_V1:
        return False
    if path.startswith(PUBLIC_PREFIXES) or path in PUBLIC_PATHS:
        return True
    return method in ("GET", "HEAD") and path in PUBLIC_READS


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


class AdminTokenMiddleware:
    """Pure ASGI middleware (vLLM adds it with ``app.add_middleware(cls)``, no arguments)."""

    def __init__(self, app: Any, token_env: str = TOKEN_ENV) -> None:
        self.app = app
        token = os.environ.get(token_env)
        self._token_digest = _digest(token) if token else None

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        if self._token_digest is None:
            return False
        for name, value in headers:
            if name.lower() == b"authorization":
                scheme, _, presented = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(_digest(presented), self._token_digest)
        return False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if is_public(scope["method"], path) or self._authorized(scope.get("headers", [])):
            await self.app(scope, receive, send)
            return
        await send_json(send, 401, {"error": {"message": "admin endpoint: needs the run's admin token",
                                              "type": "authentication_error", "param": None, "code": "unauthorized"}})
