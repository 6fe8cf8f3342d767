"""The P/D routers' configs: the orchestrator's only inference endpoint in a disaggregated run, which
picks a prefill and a decode server for each request.

RouterConfig: the embedded engine's (primebuild/runtime/inference/router.py), speaking its OpenAI contract and
admin calls. VllmRouterConfig: vLLM's (primebuild/runtime/inference/vllm/pd_router.py), speaking vLLM's.
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


class VllmPool(Contract):
    url: str  # http://HOST:PORT of one vLLM server (no /v1)
    ranks: int = Field(1, ge=1)  # its workers (tp*dp): the ranks it takes in the trainer's weight group


class VllmRouterConfig(Contract):
    """The P/D router in front of vLLM servers (read by primebuild/runtime/inference/vllm/pd_router.py)."""

    kind: Literal["vllm_router"] = "vllm_router"
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    prefill: list[VllmPool] = Field(min_length=1)
    decode: list[VllmPool] = Field(min_length=1)
    # ExampleConnector only: the servers' shared_storage_path, whose KV files the router deletes once no
    # request needs them (vLLM never does); and the servers' --block-size, which names those files.
    kv_storage_path: str | None = None
    kv_block_size: int = Field(32, ge=1)
    admin_token_env: str = ADMIN_TOKEN_ENV
