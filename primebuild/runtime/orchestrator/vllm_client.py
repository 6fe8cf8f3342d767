"""The orchestrator's view of a vLLM server: the same calls as the embedded engine's InferenceClient,
on vLLM's own API (primebuild/runtime/inference/vllm/: the completions adapter and the RL admin client).

What differs underneath, and is absorbed here so the orchestrator cannot tell (docs/vllm.md):
- a completion choice carries no policy version: the version is read from the server before the request
  and when the answer has arrived (`GET /weight_info`); updates re-prefill in-flight requests on the new
  weights, so the later version produced the last token and the earlier one (when they differ) the first
  (`resumed_from_version`). A restarted server answers with version 0 and is re-synced.
- `/health` has no body: the policy version comes from the admin API, retried while a server restarts.
- a weight update is a sequence of vLLM calls (pause, reload, drop stale KV, set version, resume), and a
  load that fails inside vLLM takes the server down: the step folder is verified (its STABLE listing:
  exactly the bytes the trainer published, and the trainer publishes no non-finite weights,
  runtime/trainer/finite.py) before the server is touched. The orchestrator never reads the tensors
  themselves: it would hold a whole model in its memory, which the plan's model does not give it.
- broadcast, a trainer's sender that died inside a load (some buckets installed): the server stays up with
  its weights mixed (weights_mixed_guard.py): completions answer 503 "weights_mixed" (re-routed or waited for,
  as for the embedded engine), `version()` is NO_WHOLE_POLICY, and the load raises WeightUpdateLost; the
  requests the update froze stay frozen until the restarted trainer's whole update resumes them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx
from pydantic import ValidationError

from primebuild.builders.vllm_command import LORA_ADAPTER_NAME
from primebuild.contracts.completion import NO_WHOLE_POLICY, CompletionResult
from primebuild.contracts.orchestrator import ServerJoin
from primebuild.runtime.inference.lora import is_adapter_folder
from primebuild.runtime.inference.vllm.admin import VllmAdmin, VllmAdminError, VllmUpdateLost
from primebuild.runtime.inference.vllm.broadcast_status import STATUS_PATH as BROADCAST_STATUS_PATH
from primebuild.runtime.inference.vllm.completions import adapt_response
from primebuild.runtime.orchestrator.client import InferenceClient, Outage, WeightUpdateLost
from primebuild.runtime.weight_sync.filesystem import verify


class VllmClient(InferenceClient):
    def __init__(self, base_url: str, model: str, *, admin_token: str | None = None, members: Sequence[str] = (),
                 **kw):
        """`members`: the servers this endpoint's requests reach (default: the endpoint itself; a P/D
        router's prefill and decode servers), whose workers' broadcast status gates an update."""
        super().__init__(base_url, model, admin_token=admin_token, **kw)
        self.admin = VllmAdmin(self.root, admin_token=admin_token, members=members)
        self.admin_token = admin_token
        self.adapter_model: str | None = None  # LoRA: the adapter's name once the server has loaded one

    async def close(self) -> None:
        await self.admin.close()
        await super().close()

    async def complete(self, prompt: str | list[int], *, n: int, temperature: float, top_p: float,
                       max_tokens: int, seed: int | None = None, routed_experts: bool = False) -> CompletionResult:
        """As the embedded client's; vLLM returns routes when started with --enable-return-routed-experts
        (the plan adds it with router_replay), not per request."""
        errors = self.transport_errors
        before = await self.version()  # an update during the request re-prefills it on the new weights
        # LoRA: version 0 is the base model (also after a restart, before the adapter is loaded again)
        model = self.adapter_model if self.adapter_model and before > 0 else self.model
        body = {"model": model, "prompt": prompt, "n": n, "temperature": temperature, "top_p": top_p,
                "max_tokens": max_tokens, "logprobs": 0, "return_token_ids": True}
        if seed is not None:
            body["seed"] = seed
        answer = await self._sample(body)
        version = await self.version()
        # (before is NO_WHOLE_POLICY when the server was mixed: the answer came after a whole update mended it)
        resumed = before if before not in (version, NO_WHOLE_POLICY) else None
        if self.transport_errors != errors:
            # The server died around this request: the answer may come from its restart, on the weights it
            # started with, and a re-sync may have happened since. Label it as the base policy, so the
            # orchestrator re-syncs the server and asks again unless nothing was trained yet.
            version, resumed = 0, None
        try:
            choices = adapt_response(answer, policy_version=version)
            return CompletionResult.model_validate(
                {"choices": [{"index": i, **c, "resumed_from_version": resumed} for i, c in enumerate(choices)]})
        except (ValueError, ValidationError) as err:
            raise RuntimeError(f"{self.base_url}/completions answered outside the rollout contract: {err}") from None

    async def version(self) -> int:
        """The server's policy version; waits for a restarting server to come back (a dead engine behind
        a live server answers errors: Outage gives up on it after a while)."""
        return await self._until_answered("/weight_info", self.admin.policy_version)

    async def engine(self) -> dict:
        response = await self.http.get(self.root + "/version")
        return {"name": "vllm", "version": response.json().get("version") if response.status_code == 200 else None}

    async def received_version(self) -> int:
        return await self._until_answered(BROADCAST_STATUS_PATH, self.admin.received_version)

    async def _until_answered(self, path: str, ask) -> int:
        """`ask()` of the admin API, retried while the server is away or answers errors (Outage decides
        when to give up)."""
        outage = Outage(self, self.root + path)
        while True:
            try:
                return await ask()
            except httpx.TransportError as err:
                outage.gone(err)
            except VllmAdminError as err:
                outage.failing(err.status, str(err))
            await asyncio.sleep(0.5)

    async def join_weight_broadcast(self, join: ServerJoin) -> None:
        """Ask the server `join.url` (this endpoint, or one behind its router) to join the trainer's
        weight group, its workers from `join.rank` on (they join in the background; the trainer's sender
        waits for every member). A server whose workers all joined already is left as it is."""
        await self.version()  # up and answering
        async with VllmAdmin(join.url, admin_token=self.admin_token) as server:
            if not all(s["joined"] for s in await server.broadcast_status()):
                await server.init_broadcast(join.init_method, join.rank, join.world_size)

    async def update_weights(self, body: dict) -> None:
        if body.get("source", "folder") == "folder":
            verify(body["path"])  # a damaged folder is named here, not by a dead server
        outage = Outage(self, self.root + " (weight update)")
        while True:
            try:
                await self.admin.update_weights(version=int(body["version"]), path=body.get("path"),
                                                source=body.get("source", "folder"), in_flight="resume")
                if body.get("path") and is_adapter_folder(body["path"]):
                    self.adapter_model = LORA_ADAPTER_NAME
                return
            # The server died during the update (or its engine did: 5xx); its restart comes back on the
            # base weights, so the whole update is done again once it answers.
            except httpx.TransportError as err:
                outage.gone(err)
            except VllmUpdateLost as err:
                raise WeightUpdateLost(str(err)) from None
            except VllmAdminError as err:
                if err.status < 500:
                    raise
                outage.failing(err.status, str(err))
            await self.version()

