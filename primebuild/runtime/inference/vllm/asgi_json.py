"""A JSON answer sent by one of primebuild's pure ASGI middlewares inside vLLM's API server (admin_auth.py,
broadcast_status.py, weights_mixed_guard.py), without passing the request on."""

from __future__ import annotations

import json
from typing import Any


async def send_json(send: Any, status: int, content: dict) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
