"""Moving a prompt's KV cache from a prefill server to a decode server, over ZMQ (PUSH -> PULL).

Why ZMQ: it is what the field's P/D stacks use between engines when there is no RDMA fabric (vLLM's
P2P connectors and NIXL handshakes, SGLang's disaggregation bootstrap all speak ZMQ); a multipart
message sends each tensor's memory as one frame without serialising it, PUSH sockets queue while a
decode server is busy, and one PULL socket takes transfers from every prefill server. It crosses
nodes as plain TCP; on GPUs the frames would be replaced by a NIXL/NCCL transfer, the protocol kept.

One transfer = one prompt: frames [header (JSON), K, V, logits(, routes)], K and V [layers, kv_heads,
T, head_dim] in the engine's dtype, logits [vocab] fp32 of the prompt's last position (the decode
server samples the first token from them, with the request's own sampling parameters and generators,
so the split engine samples exactly what the unified one does). Routes, when the request asked for
routed experts (router replay): [T, moe_layers, top_k] of the experts each prompt position went to,
uint8 (int32 above 256 experts), so the decode server answers the prompt's routes as the prefill
server computed them. The header carries the transfer id and prompt index, the prompt's token ids
(checked against the decode server's own tokenisation), the policy version whose weights computed the
KV, the routes' shape, and the send time.

Counters (read by /metrics): bytes of K+V, tokens, transfers and seconds, separately from the logits'
bytes, so KV bytes / token can be compared with the model's 2 x layers x kv_heads x head_dim x dtype.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import zmq

from primebuild.kernels.dtypes import DTYPES

from .prefilled import Prefilled

log = logging.getLogger(__name__)

_DTYPES = {**DTYPES, "uint8": torch.uint8, "int32": torch.int32}  # KV caches, and the integer tables beside them
# numpy has no bf16: 16-bit floats cross as int16
_WIRE = {torch.float32: torch.float32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.uint8: torch.uint8, torch.int32: torch.int32}
INBOX_TTL_S = 300.0  # a transfer nobody claims (its router request died) is dropped after this


@dataclass
class TransferCounters:
    transfers: int = 0
    kv_bytes: int = 0
    tokens: int = 0
    logits_bytes: int = 0
    routes_bytes: int = 0  # routed experts of the prompts (router replay)
    seconds: float = 0.0  # sender: extract-to-sent; receiver: sent-to-received (same clock on one host)


def _frame(t: torch.Tensor):
    t = t.detach().contiguous().cpu()
    return t.view(_WIRE[t.dtype]).numpy()


def _tensor(frame: zmq.Frame, dtype: str, shape: list[int]) -> torch.Tensor:
    want = _DTYPES[dtype]
    flat = torch.frombuffer(frame.buffer, dtype=_WIRE[want]).clone()  # own the memory: frames are reused
    return flat.view(want).view(shape)


SEND_TIMEOUT_S = 30.0


class KvSender:
    """Prefill side: one thread owns the PUSH sockets (ZMQ sockets are not thread-safe)."""

    def __init__(self):
        self.context = zmq.Context.instance()
        self.counters = TransferCounters()
        self._queue: queue.Queue = queue.Queue()
        self._sockets: dict[str, zmq.Socket] = {}
        self._thread = threading.Thread(target=self._loop, name="primebuild-kv-sender", daemon=True)
        self._thread.start()

    def send(self, address: str, transfer_id: str, index: int, item: Prefilled, started: float) -> Future:
        """Queue one prompt's KV for `address`; the future resolves with the bytes sent."""
        done: Future = Future()
        self._queue.put((address, transfer_id, index, item, started, done))
        return done

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 5000)
            sock.setsockopt(zmq.SNDHWM, 64)  # at most this many transfers queued per decode server
            # a decode server that is gone (or not up yet) fails the send after SEND_TIMEOUT_S instead of
            # holding this thread, and every transfer behind it, for ever; nothing queues for a peer not there
            sock.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(address)
            self._sockets[address] = sock
        return sock

    def _loop(self) -> None:
        while True:
            address, transfer_id, index, item, started, done = self._queue.get()
            try:
                routes = item.routed
                routes_layout = None if routes is None else {
                    "dtype": str(routes.dtype).removeprefix("torch."), "shape": list(routes.shape)}
                header = {"id": transfer_id, "index": index, "prompt_ids": item.prompt_ids, "version": item.version,
                          "dtype": str(item.k.dtype).removeprefix("torch."), "shape": list(item.k.shape),
                          "vocab": int(item.logits.numel()), "routes": routes_layout, "sent_at": time.time()}
                frames = [json.dumps(header).encode(), _frame(item.k), _frame(item.v), _frame(item.logits.float())]
                if routes is not None:
                    frames.append(_frame(routes))
                self._socket(address).send_multipart(frames, copy=False)
                kv_bytes = item.k.numel() * item.k.element_size() * 2
                c = self.counters
                c.transfers += 1
                c.kv_bytes += kv_bytes
                c.tokens += item.k.shape[2]
                c.logits_bytes += item.logits.numel() * 4
                c.routes_bytes += 0 if routes is None else routes.numel() * routes.element_size()
                c.seconds += time.monotonic() - started
                done.set_result(kv_bytes)
            except Exception as err:  # a bad address must not kill the sender thread
                log.exception("KV transfer %s/%d to %s failed", transfer_id, index, address)
                done.set_exception(err)


class KvInbox:
    """Decode side: a PULL socket bound at `address`, transfers kept by (id, prompt index) until taken."""

    def __init__(self, address: str):
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.counters = TransferCounters()
        self._items: dict[tuple[str, int], tuple[float, Prefilled]] = {}
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="primebuild-kv-inbox", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                head, k, v, logits, *routes = self.socket.recv_multipart(copy=False)
                header = json.loads(head.bytes)
                shape, routes_layout = header["shape"], header.get("routes")
                item = Prefilled(prompt_ids=header["prompt_ids"], k=_tensor(k, header["dtype"], shape),
                                 v=_tensor(v, header["dtype"], shape),
                                 logits=_tensor(logits, "float32", [header["vocab"]]),
                                 version=int(header["version"]),
                                 routed=_tensor(routes[0], routes_layout["dtype"], routes_layout["shape"])
                                 if routes_layout else None)
            except Exception:
                log.exception("dropping a malformed KV transfer")
                continue
            now = time.time()
            c = self.counters
            c.transfers += 1
            c.kv_bytes += len(k.buffer) + len(v.buffer)
            c.tokens += shape[2]
            c.logits_bytes += len(logits.buffer)
            c.routes_bytes += len(routes[0].buffer) if routes else 0
            c.seconds += max(0.0, now - header["sent_at"])
            with self._cv:
                self._items[(header["id"], int(header["index"]))] = (time.monotonic(), item)
                cutoff = time.monotonic() - INBOX_TTL_S
                for key in [key for key, (t, _) in self._items.items() if t < cutoff]:
                    del self._items[key]
                self._cv.notify_all()

    def take(self, transfer_id: str, index: int, timeout: float) -> Prefilled | None:
        """The transfer, waiting up to `timeout` seconds for it; None if it did not come."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while (transfer_id, index) not in self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            return self._items.pop((transfer_id, index))[1]
