"""Weights from trainer rank 0 to inference workers over a torch.distributed group of their own.

The trainer's ranks already form the default process group (torchrun), and a process has only one of
those; so this group is built directly from a TCPStore (hosted by the sender, rank 0 of this group) and a
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) object — the same "stateless group" approach
vLLM and prime-rl use for NCCL weight broadcast. Members: the sender (rank 0) and ``world_size - 1``
receivers (ranks 1..world_size-1); everyone passes the same ``init_method`` ``tcp://HOST:PORT``.

Wire protocol for one update, all as broadcasts from rank 0:
  1. header   int64[2]: (kind, metadata bytes); kind 1 = weights follow, kind 0 = sender closed;
  2. metadata uint8[n]: JSON {"step", "bucket_bytes", "tensors": [[name, dtype, shape, nbytes], ...]};
  3. payload  the tensors' raw bytes, concatenated in metadata order and cut into buckets of about
              ``bucket_bytes`` (a tensor is never split; a bigger tensor is a bucket of its own). Both
              sides derive the bucket layout from the metadata, so no sizes travel twice. Raw bytes make
              every dtype (bf16, fp8) travel the same way. The sender needs only the layout up front and
              then one bucket at a time (stream.py), so a sharded trainer streams its layers.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from .stream import StreamedWeights, as_stream, in_layout_order

KIND_CLOSE, KIND_WEIGHTS = 0, 1


def _parse_init_method(init_method: str) -> tuple[str, int]:
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must look like tcp://HOST:PORT, got {init_method!r}")
    return url.hostname, url.port


def _make_group(init_method: str, rank: int, world_size: int, backend: str, timeout_s: float):
    host, port = _parse_init_method(init_method)
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        # A TCPStore server listens on every interface unless handed its socket: listen on the
        # init_method's address only (the sender's node, loopback on one host), as the trainer's
        # rendezvous does (primebuild/runtime/trainer/launch.py). detach(): the socket is the store's from here on.
        listener = socket.create_server((host, port), backlog=1024)
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                              master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    store = dist.PrefixStore("primebuild/weight-broadcast", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout), store
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts), store
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()


def _buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of tensors per bucket, in order; a bucket closes before it would exceed bucket_bytes."""
    out: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, n in enumerate(sizes):
        if current and filled + n > bucket_bytes:
            out.append(current)
            current, filled = [], 0
        current.append(i)
        filled += n
    if current:
        out.append(current)
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight broadcast metadata")
    return dtype


class BroadcastSender:
    """Rank 0 of the weight group; hosts its TCPStore. Blocks in ``__init__`` until every receiver
    joined (up to ``timeout_s``)."""

    def __init__(
        self,
        init_method: str,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
        bucket_mb: float = 64.0,
        device: str | torch.device = "cpu",
    ):
        if world_size < 2:
            raise ValueError("a weight broadcast group needs the sender and at least one receiver")
        self.device = torch.device(device)
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self._group, self._store = _make_group(init_method, 0, world_size, backend, timeout_s)

    def send(self, weights: Mapping[str, torch.Tensor] | StreamedWeights, step: int) -> None:
        """One update. Streamed weights are sent as they come: the sender holds the group being read and
        one bucket, never the whole state (metadata first: the layout is known up front)."""
        weights = as_stream(weights)
        sizes = [spec.nbytes for spec in weights.layout]
        meta = {
            "step": int(step),
            "bucket_bytes": self.bucket_bytes,
            "tensors": [[s.name, str(s.dtype), list(s.shape), n] for s, n in zip(weights.layout, sizes, strict=True)],
        }
        blob = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8).to(self.device)
        _broadcast(
            self._group, torch.tensor([KIND_WEIGHTS, blob.numel()], dtype=torch.int64, device=self.device)
        )
        _broadcast(self._group, blob)
        last_of_bucket = {bucket[-1] for bucket in _buckets(sizes, self.bucket_bytes)}
        pending: list[torch.Tensor] = []
        for i, (_, tensor) in enumerate(in_layout_order(weights)):
            pending.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
            if i in last_of_bucket:
                _broadcast(self._group, torch.cat([r.to(self.device) for r in pending]))
                pending = []

    def close(self) -> None:
        """Tell receivers there is nothing more (their ``recv`` returns None), then leave the group."""
        if self._group is None:
            return
        _broadcast(self._group, torch.tensor([KIND_CLOSE, 0], dtype=torch.int64, device=self.device))
        self._group = None


class BroadcastReceiver:
    """Rank ``rank`` (1..world_size-1) of the weight group."""

    def __init__(
        self,
        init_method: str,
        world_size: int,
        rank: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
        device: str | torch.device = "cpu",
    ):
        if not 1 <= rank < world_size:
            raise ValueError(f"receiver rank must be in 1..{world_size - 1}, got {rank}")
        self.device = torch.device(device)
        self._group, self._store = _make_group(init_method, rank, world_size, backend, timeout_s)

    def recv(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Block until the next update; returns (step, state dict) or None once the sender closed."""
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        _broadcast(self._group, header)
        kind, nbytes = (int(x) for x in header.tolist())
        if kind == KIND_CLOSE:
            self._group = None
            return None
        blob = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        _broadcast(self._group, blob)
        meta = json.loads(blob.cpu().numpy().tobytes().decode())
        entries = meta["tensors"]
        out: dict[str, torch.Tensor] = {}
        for bucket in _buckets([e[3] for e in entries], meta["bucket_bytes"]):
            payload = torch.empty(sum(entries[i][3] for i in bucket), dtype=torch.uint8, device=self.device)
            _broadcast(self._group, payload)
            offset = 0
            for i in bucket:
                name, dtype, shape, n = entries[i]
                # clone first: a byte slice at an odd offset cannot be viewed as a wider dtype
                out[name] = payload[offset : offset + n].clone().view(_dtype(dtype)).reshape(shape)
                offset += n
        return meta["step"], out
