"""Prefill/decode disaggregation, the servers' side (the router is router.py).

A request reaches a prefill server and then a decode server with the same OpenAI body plus
`kv_transfer` (protocol.KvTransfer), so both tokenise, template and check it identically:

- prefill server (`kv_transfer.to` set): each prompt is prefilled once (n is the decode side's
  business), its KV and last logits copied out of the cache (Engine `export`) and pushed to the decode
  server's inbox over ZMQ (kv_transfer.py); the answer says what was sent.
- decode server (`kv_transfer.id` only): takes each prompt's transfer from its inbox, checks that it is
  the same prompt, and continues it (Engine `prefilled`), answering the request with the whole OpenAI
  contract (n, log-probs, streaming, stop strings, policy versions).

Policy versions: a transfer carries the version of the weights that computed it. The decode engine
continues it only on that same version; otherwise (a weight update landed between the two halves) it
prefills the prompt itself on its own weights and counts it (`kv_transfer_stale_total`): the KV of an
old policy is never continued by a new one. A transfer that does not arrive in time is prefilled
locally too (`kv_transfer_missing_total`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from .engine import Engine
from .kv_transfer import KvInbox, KvSender
from .prefilled import Prefilled
from .protocol import ApiError, KvTransfer
from .sampling import SamplingParams

log = logging.getLogger(__name__)

KV_WAIT_S = 30.0  # the router calls decode only after prefill answered "sent": arrival is near-immediate


class PrefillSide:
    def __init__(self):
        self.sender = KvSender()

    async def export(self, engine: Engine, prompts: list[list[int]], params: SamplingParams,
                     transfer: KvTransfer) -> dict:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in prompts]

        def sink_for(future: asyncio.Future):
            def sink(result):  # Prefilled, or a list of updates when the engine aborted the request
                loop.call_soon_threadsafe(_settle, future, result)
            return sink

        requests = [engine.submit(p, params, sink_for(f), export=True) for p, f in zip(prompts, futures, strict=True)]
        try:
            shipped = await asyncio.gather(*futures)
        finally:
            for request in requests:
                request.abort()  # no-op once exported; frees the slot if the router went away
        bad = [s for s in shipped if not isinstance(s, Prefilled)]
        if bad:
            raise ApiError(500, next((u.error for u in bad[0] if u.error), "prefill aborted"))
        started = time.monotonic()
        sends = [asyncio.wrap_future(self.sender.send(transfer.to, transfer.id, i, item, started))
                 for i, item in enumerate(shipped)]
        try:
            sent = await asyncio.gather(*sends)
        except Exception as err:
            raise ApiError(502, f"KV transfer to {transfer.to} failed: {err}") from None
        return {"kv_transfer": {"id": transfer.id, "prompts": len(shipped), "kv_bytes": sum(sent),
                                "tokens": sum(len(p) for p in prompts), "policy_version": shipped[0].version,
                                "seconds": round(time.monotonic() - started, 6)}}


def _settle(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


class DecodeSide:
    def __init__(self, address: str):
        self.inbox = KvInbox(address)
        self.missing = 0

    async def collect(self, transfer: KvTransfer, prompts: list[list[int]]) -> list[Prefilled | None]:
        """The shipped KV of each prompt, None where it did not come (that prompt is prefilled here)."""
        taken = await asyncio.gather(*(asyncio.to_thread(self.inbox.take, transfer.id, i, KV_WAIT_S)
                                       for i in range(len(prompts))))
        out: list[Prefilled | None] = []
        for i, (prompt, item) in enumerate(zip(prompts, taken, strict=True)):
            if item is None:
                self.missing += 1
                log.warning("KV transfer %s/%d did not arrive in %.0f s: prefilling here", transfer.id, i, KV_WAIT_S)
            elif list(item.prompt_ids) != list(prompt):
                raise ApiError(400, f"KV transfer {transfer.id}/{i} holds another prompt than this request's",
                               param="kv_transfer")
            out.append(item)
        return out


class Disaggregation:
    """What a server does with `kv_transfer` bodies, by its role (None: it refuses them)."""

    def __init__(self, role: str | None, inbox_address: str | None = None):
        self.role = role
        self.prefill = PrefillSide() if role == "prefill" else None
        self.decode = DecodeSide(inbox_address) if role == "decode" else None

    async def handle(self, engine: Engine, transfer: KvTransfer | None, prompts: list[list[int]],
                     params: SamplingParams) -> tuple[dict | None, list[Prefilled | None] | None]:
        """(an answer to return as is, or None) and (the prompts' shipped KV, or None)."""
        if transfer is None:
            return None, None
        if transfer.to is not None:
            if self.prefill is None:
                raise ApiError(400, "kv_transfer.to: this server is not a prefill server", param="kv_transfer")
            return await self.prefill.export(engine, prompts, params, transfer), None
        if self.decode is None:
            raise ApiError(400, "kv_transfer: this server is not a decode server", param="kv_transfer")
        return None, await self.decode.collect(transfer, prompts)
