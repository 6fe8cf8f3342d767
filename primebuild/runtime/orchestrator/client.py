"""The orchestrator's view of an inference server: sampling, evaluation and the weight-update calls.

It speaks the OpenAI-compatible contract of docs/inference.md (the embedded engine and vLLM alike), and
rides out a server restart: a failed request is retried until `retry_seconds` pass, so a restarted
replica costs a delay, never a lost or duplicated sample. A server that answers but only with errors
(5xx: its engine died behind a live HTTP server) is a failing server too: the supervisor restarts it
within seconds (primebuild/runtime/liveness.py), and if it keeps answering errors for ERROR_RUN_SECONDS with no
restart in between, the request fails, naming the server and its answer. Either way, once a call has
failed for QUIET_SECONDS, a WARNING says so on the terminal (at most every WARN_SECONDS per server), so a run
never waits in silence. With several servers (primebuild/runtime/orchestrator/servers.py) a client fails fast
instead: a server that does not answer raises ServerGone at once, and its request goes to another one.
A server whose weights are a mix of two policies (503 "weights_mixed": a broadcast whose sender died inside
its update, engine.py) is treated as one that restarts: it is up, but serves again only after a whole
update; its `version()` is NO_WHOLE_POLICY meanwhile, so it is brought to the current weights first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import httpx
from pydantic import ValidationError

from primebuild.contracts.completion import NO_WHOLE_POLICY, WEIGHTS_MIXED, CompletionResult, ServerHealth
from primebuild.contracts.inference import ADMIN_TOKEN_ENV
from primebuild.runtime.http_pool import pool_limits

log = logging.getLogger("primebuild.orchestrator")
LANE_CONNECTIONS = 16  # connections per httpx pool of sampling requests (see InferenceClient.__init__)
ERROR_RUN_SECONDS = 60.0  # only error answers for this long, and no restart seen: the server is broken
QUIET_SECONDS = 5.0  # a shorter outage is not worth a warning (a keep-alive connection the server just closed)
WARN_SECONDS = 30.0


class InferenceUnavailable(RuntimeError):
    pass


class WeightUpdateLost(RuntimeError):
    """Broadcast: the trainer's sender died before this update crossed (the trainer restarts alone); the
    server keeps the weights it had. The update does not count."""


class ServerGone(ConnectionError):
    """A fail-fast client's server did not answer (killed, restarting, stopped)."""


class Outage:
    """One call's view of a server that fails it: until when to retry, and whether to give up now."""

    def __init__(self, client: InferenceClient, url: str):
        self.client = client
        self.url = url
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + client.retry_seconds
        self.first_failure: float | None = None
        self.errors_since: float | None = None  # start of the current run of error answers

    def _warn(self, message: str) -> None:
        now = self.loop.time()
        self.first_failure = now if self.first_failure is None else self.first_failure
        if now - self.first_failure >= QUIET_SECONDS:
            self.client.warn(message)

    def gone(self, err: Exception) -> None:
        """The server did not answer (it died, or is restarting): retry until `retry_seconds` pass."""
        self.client.transport_errors += 1
        if self.client.fail_fast:
            raise ServerGone(f"{self.url}: {type(err).__name__}: {err}") from err
        self.errors_since = None  # a restart ends a run of error answers
        self._warn(f"{self.url}: {type(err).__name__}: {err}; waiting for the server to come back")
        if self.loop.time() > self.deadline:
            raise InferenceUnavailable(f"{self.url}: no answer for {self.client.retry_seconds:.0f} s: {err}") from err

    def failing(self, status: int, text: str) -> None:
        """The server answered an error (5xx): its engine may be dead behind a live HTTP server."""
        self.client.transport_errors += 1  # the answer to come may be a restarted server's
        now = self.loop.time()
        self.errors_since = now if self.errors_since is None else self.errors_since
        self._warn(f"{self.url} answered {status}: {text[:200]}; retrying (a dead engine is restarted)")
        if now - self.errors_since > ERROR_RUN_SECONDS or now > self.deadline:
            raise InferenceUnavailable(f"{self.url} answered only {status} for {now - self.errors_since:.0f} s "
                                       f"and was not restarted: {text[:300]}")


def _error_code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


class InferenceClient:
    def __init__(self, base_url: str, model: str, *, admin_token: str | None = None, retry_seconds: float = 120.0,
                 max_requests: int = 256):
        self.base_url = base_url.rstrip("/")  # ends in /v1
        self.root = self.base_url.removesuffix("/v1")
        self.model = model
        self.retry_seconds = retry_seconds
        self.transport_errors = 0  # calls that found the server gone or failing (it died, or is restarting)
        self.fail_fast = False  # True: a server that does not answer raises ServerGone instead of being waited for
        self._warned_at = -WARN_SECONDS
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        timeout = httpx.Timeout(600.0, connect=5.0)
        # Health, pause, update and resume have their own connections: they never wait behind sampling.
        self.http = httpx.AsyncClient(timeout=timeout, headers=headers,
                                      limits=pool_limits(4))
        # Sampling requests go through lanes of LANE_CONNECTIONS connections each, at most max_requests at
        # once (more would only wait in the server's queue). One pool for all of them is what httpx would
        # do, but httpcore scans every connection of a pool (a socket call each) whenever a request starts
        # or ends: with 128-512 rollouts in flight that took 60-75% of the orchestrator's CPU and made it
        # the bottleneck (long-tail bench, m = 32: bench/RESULTS.md).
        lanes = [httpx.AsyncClient(timeout=timeout, headers=headers, limits=pool_limits(LANE_CONNECTIONS))
            for _ in range(-(-max_requests // LANE_CONNECTIONS))]
        self.lanes = lanes
        self.free_lanes: asyncio.Queue[httpx.AsyncClient] = asyncio.Queue()
        for i in range(max_requests):  # one entry per request slot, spread over the lanes
            self.free_lanes.put_nowait(lanes[i % len(lanes)])

    @classmethod
    def from_env(cls, base_url: str, model: str, **kw) -> InferenceClient:
        return cls(base_url, model, admin_token=os.environ.get(ADMIN_TOKEN_ENV), **kw)

    async def close(self) -> None:
        for http in (self.http, *self.lanes):
            await http.aclose()

    def warn(self, message: str) -> None:
        """A WARNING (the supervisor shows those on the terminal), at most every WARN_SECONDS."""
        now = time.monotonic()
        if now - self._warned_at >= WARN_SECONDS:
            self._warned_at = now
            log.warning("%s", message)

    async def _post(self, path: str, body: dict, *, root: bool = False, http: httpx.AsyncClient | None = None) -> dict:
        url = (self.root if root else self.base_url) + path
        http = http or self.http
        outage = Outage(self, url)
        delay = 0.2
        while True:
            try:
                response = await http.post(url, json=body)
            except (httpx.TransportError, httpx.RemoteProtocolError) as err:
                outage.gone(err)
            else:
                if response.status_code < 400:
                    return response.json()
                if response.status_code == 409 and "weight_update_lost" in response.text:
                    raise WeightUpdateLost(f"{url}: {response.text[:500]}")
                if response.status_code == 503 and _error_code(response) == WEIGHTS_MIXED:
                    # up, serving again after a whole update: gone meanwhile (re-routed, or waited for)
                    outage.gone(RuntimeError(f"503 {WEIGHTS_MIXED}: its weights are a mix of two policies"))
                elif response.status_code < 500:
                    raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:500]}")
                else:
                    outage.failing(response.status_code, response.text)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _sample(self, body: dict) -> dict:
        lane = await self.free_lanes.get()
        try:
            return await self._post("/completions", body, http=lane)
        finally:
            self.free_lanes.put_nowait(lane)

    async def complete(self, prompt: str | list[int], *, n: int, temperature: float, top_p: float,
                       max_tokens: int, seed: int | None = None, routed_experts: bool = False) -> CompletionResult:
        """`prompt` as text or, token in / token out, as the exact ids to continue (a multi-turn rollout's
        transcript so far): the answer's `prompt_token_ids` then equal them and nothing is re-tokenised.
        With `routed_experts`, each choice carries its routes (router replay)."""
        body = {"model": self.model, "prompt": prompt, "n": n, "temperature": temperature, "top_p": top_p,
                "max_tokens": max_tokens, "logprobs": 0}
        if seed is not None:
            body["seed"] = seed
        if routed_experts:
            body["return_routed_experts"] = True
        answer = await self._sample(body)
        try:
            return CompletionResult.model_validate(answer)
        except ValidationError as err:
            raise RuntimeError(f"{self.base_url}/completions answered outside the rollout contract: {err}") from None

    async def prompt_logprobs(self, prompts: list[list[int]]) -> list[list[dict | None]]:
        """vLLM's `prompt_logprobs` of each token-id prompt (None first, then {token id: {"logprob": x}} per
        token), one request for all of them, one token generated beside each: how a distillation teacher
        scores sampled tokens (orchestrator/teacher.py)."""
        answer = await self._sample({"model": self.model, "prompt": prompts, "max_tokens": 1, "temperature": 0.0,
                                     "prompt_logprobs": 0})
        by_index = {c["index"]: c["prompt_logprobs"] for c in answer["choices"]}
        return [by_index[i] for i in range(len(prompts))]

    async def engine(self) -> dict:
        """Which engine answers, for the run's summary."""
        from primebuild import __version__

        return {"name": "embedded", "version": __version__}

    async def version(self) -> int:
        """The server's policy version (NO_WHOLE_POLICY while its weights are mixed: it needs an update);
        waits for a restarting server to come back."""
        health = await self.health()
        return NO_WHOLE_POLICY if health.status == WEIGHTS_MIXED else health.policy_version

    async def received_version(self) -> int:
        """Broadcast weight sync: the newest version the server has received and staged."""
        return (await self.health()).received_version

    async def health(self) -> ServerHealth:
        outage = Outage(self, self.root + "/health")
        while True:
            try:
                response = await self.http.get(outage.url)
            except httpx.TransportError as err:
                outage.gone(err)
            else:
                if response.status_code == 200:
                    return ServerHealth.model_validate(response.json())
                outage.failing(response.status_code, response.text)
            await asyncio.sleep(0.25)

    async def update_weights(self, body: dict) -> None:
        """Pause -> swap in the weights named by `body` (a step folder or staged broadcast) -> resume.
        In-flight requests resume on the new weights."""
        await self._post("/pause", {}, root=True)
        try:
            await self._post("/update_weights", {**body, "in_flight": "resume"}, root=True)
        finally:
            await self._post("/resume", {}, root=True)
