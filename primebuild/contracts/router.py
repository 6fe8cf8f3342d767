"""RouterConfig: the P/D router in front of prefill and decode servers (read by runtime/inference/router.py).

The orchestrator's only inference endpoint in a disaggregated run. It speaks the embedded engine's
OpenAI contract and admin calls, and for each request picks a prefill and a decode server.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from primebuild.contracts.base import Contract
from primebuild.contracts.inference import ADMIN_TOKEN_ENV


class DecodeServer(Contract):
    url: str  # http://HOST:PORT (no /v1)
    kv_address: str  # tcp://HOST:PORT of its KV inbox, where prefill servers push


class RouterConfig(Contract):
    kind: Literal["router"] = "router"
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    prefill: list[str] = Field(min_length=1)  # http://HOST:PORT of each prefill server
    decode: list[DecodeServer] = Field(min_length=1)
    admin_token_env: str = ADMIN_TOKEN_ENV
