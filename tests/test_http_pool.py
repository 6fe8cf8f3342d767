"""primebuild's HTTP clients drop an idle connection before uvicorn (under every server here) closes it: a
request sent on a connection as the server closes it fails with a ReadError, which the orchestrator reads
as a server gone (primebuild/runtime/http_pool.py). Against a real uvicorn server with its defaults."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import uvicorn
from conftest import free_port
from fastapi import FastAPI, Request

from primebuild.runtime.http_pool import KEEPALIVE_EXPIRY_S, pool_limits


def test_an_idle_connection_is_dropped_before_the_server_would_close_it():
    server_keep_alive = uvicorn.Config(app=FastAPI()).timeout_keep_alive
    assert KEEPALIVE_EXPIRY_S < server_keep_alive - 2  # room for a loaded machine's scheduling delays

    app = FastAPI()

    @app.get("/port")
    async def port(request: Request) -> int:
        return request.client.port  # the client's side of the connection the request came on

    port_number = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port_number, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)

        async def ports() -> list[int]:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port_number}", limits=pool_limits(4)) as client:
                seen = [(await client.get("/port")).json()]
                await asyncio.sleep(0.2)
                seen.append((await client.get("/port")).json())  # reused while fresh
                await asyncio.sleep(KEEPALIVE_EXPIRY_S + 0.5)
                seen.append((await client.get("/port")).json())  # idle too long: a new connection
                return seen

        first, again, after_idle = asyncio.run(ports())
        assert first == again and after_idle != first
    finally:
        server.should_exit = True
        thread.join(10)
