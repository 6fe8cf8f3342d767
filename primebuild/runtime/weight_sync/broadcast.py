"""Weights from trainer rank 0 to inference workers over a torch.distributed group of their own.

The trainer's ranks already form the default process group (torchrun), and a process has only one of
those; so this group is built directly from a TCPStore (hosted by the sender, rank 0 of this group) and a
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) object — the same "stateless group" approach
vLLM and prime-rl use for NCCL weight broadcast. Members: the sender (rank 0) and ``world_size - 1``
receivers (ranks 1..world_size-1); everyone passes the same ``init_method`` ``tcp://HOST:PORT``.

One update, in bounded memory at both ends:
  1. announce  header int64[2] (kind, metadata bytes; kind 0 = sender closed), then the metadata, JSON
               {"step", "tensors": [[name, dtype, shape], ...], "buckets": [tensors per bucket], "delta"}
               (buckets.py decides the cut). Receivers wait in this broadcast between updates.
  2. ready     each receiver sets ``ready/<update>/<rank>`` in the group's store once it can load, i.e.
               when its server is paused inside a weight update; the sender waits for all of them. A
               receiver holds no weights before that: it loads each bucket into the served model as it
               arrives, so the server must not be serving meanwhile.
  3. buckets   per bucket, the tensors' raw bytes at aligned offsets (any dtype, bf16 or fp8, travels the
               same way); with delta (delta.py) first int64[tensors, 3] (encoding, changed elements,
               bytes), then the encoded bytes. A receiver holds one bucket while it loads it and, with
               prefetch, the next one arriving: at most two buckets of staging, never the model.
The sender holds the layer group being streamed (stream.py), the bucket on the wire and the next one, which
it packs meanwhile.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from primebuild.contracts.trainer import DEFAULT_BUCKET_MB

from . import delta as delta_codec
from .buckets import aligned, bucket_counts, bucket_sizes, offsets
from .stream import StreamedWeights, TensorSpec, as_stream, in_layout_order

KIND_CLOSE, KIND_WEIGHTS = 0, 1
READY_POLL_S = 0.005  # how often the sender looks whether every receiver asked for the update
Bucket = list[tuple[str, torch.Tensor]]


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


def _broadcast(group, tensor: torch.Tensor, *, wait: bool = True):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    work = group.broadcast([tensor], opts)
    return work.wait() if wait else work


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight broadcast metadata")
    return dtype


def _ready_key(update: int, rank: int) -> str:
    return f"ready/{update}/{rank}"


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
_ALONE = 2  # the tensor's own reference and the one `untyped_storage()` makes to ask


def _unshared(t: torch.Tensor) -> bool:
    """No other tensor (a view a loader kept) uses `t`'s memory: refilling it would change nothing held.
    Without torch's use count (a private call) nothing counts as unshared: buffers are then never reused."""
    return _USE_COUNT is not None and _USE_COUNT(t.untyped_storage()._cdata) <= _ALONE


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class Announcement:
    """What a receiver knows of an update before any tensor arrives."""

    step: int
    specs: list[TensorSpec]
    buckets: list[int]  # tensors per bucket, in order
    delta: bool

    def bucket_specs(self) -> Iterator[list[TensorSpec]]:
        at = 0
        for count in self.buckets:
            yield self.specs[at : at + count]
            at += count


@dataclass
class SendStats:
    """One update as the sender saw it (what bench/weight_broadcast.py reports)."""

    step: int
    full_bytes: int  # every tensor's bytes
    wire_bytes: int  # what crossed the wire after the announcement (delta: the encoded bytes and headers)
    buckets: int
    ready_wait_s: float  # until every receiver asked for the tensors
    transfer_s: float  # from then to the last bucket sent
    encodings: dict[str, int] = field(default_factory=dict)  # delta: tensors per encoding


class BroadcastSender:
    """Rank 0 of the weight group; hosts its TCPStore. Blocks in ``__init__`` until every receiver
    joined (up to ``timeout_s``). ``timeout_s`` also bounds each wait for the receivers to be ready."""

    def __init__(
        self,
        init_method: str,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        device: str | torch.device = "cpu",
        delta: bool = False,
    ):
        if world_size < 2:
            raise ValueError("a weight broadcast group needs the sender and at least one receiver")
        self.device = torch.device(device)
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.timeout_s = timeout_s
        self.world_size = world_size
        self.delta = delta
        self._previous: dict[str, torch.Tensor] = {}  # delta: the last sent tensors, on the host
        self._in_flight = None  # the work of the bucket on the wire while the next one is packed
        self._buffers: list[torch.Tensor] = []  # the two payload buffers of an update, used in turn
        self._largest = 0  # the update's largest bucket: what each of them is sized for
        self._updates = 0
        self._abandoned = False
        self.last: SendStats | None = None
        self._group, self._store = _make_group(init_method, 0, world_size, backend, timeout_s)

    def send(self, weights: Mapping[str, torch.Tensor] | StreamedWeights, step: int,
             cancelled: Callable[[], bool] | None = None) -> SendStats | None:
        """One update; returns once every receiver has it. Streamed weights are sent as they come: the
        sender holds the group being read and two buckets, never the whole state (unless delta keeps
        the previous one). While the receivers have not asked for it, `cancelled()` (a run being
        stopped: nobody will update the servers) ends the wait: the stream is then read through without
        sending (its gathers are collectives of every trainer rank), None is returned, and this sender
        sends nothing more (the receivers wait for an update that never comes)."""
        if self._abandoned:
            raise RuntimeError("this weight sender abandoned an update: it cannot send again")
        weights = as_stream(weights)
        specs = list(weights.layout)
        counts = bucket_counts(specs, self.bucket_bytes)
        meta = {"step": int(step), "tensors": [[s.name, str(s.dtype), list(s.shape)] for s in specs],
                "buckets": counts, "delta": self.delta}
        blob = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8).to(self.device)
        _broadcast(self._group,
                   torch.tensor([KIND_WEIGHTS, blob.numel()], dtype=torch.int64, device=self.device))
        _broadcast(self._group, blob)
        self._updates += 1
        waited = time.perf_counter()
        if not self._wait_ready(step, cancelled):
            self._abandoned = True
            for _ in in_layout_order(weights):
                pass
            return None
        started = time.perf_counter()
        stats = SendStats(step=int(step), full_bytes=sum(s.nbytes for s in specs), wire_bytes=0,
                          buckets=len(counts), ready_wait_s=started - waited, transfer_s=0.0)
        tensors = in_layout_order(weights)
        self._in_flight = None
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._largest = max(bucket_sizes(specs, counts), default=0)
        for count in counts:
            bucket = [next(tensors) for _ in range(count)]
            stats.wire_bytes += self._send_delta(bucket, stats) if self.delta else self._send_full(bucket)
            bucket = None  # the tensors are in the bucket's payload now
        self._finish_in_flight()
        self._buffers = []  # the sender keeps no buffer between updates
        if next(tensors, None) is not None:
            raise RuntimeError("weight stream: more tensors than its layout")
        stats.transfer_s = time.perf_counter() - started
        self.last = stats
        return stats

    def _wait_ready(self, step: int, cancelled: Callable[[], bool] | None) -> bool:
        """Until every receiver asked for this update (True), or `cancelled()` says to give up (False)."""
        keys = [_ready_key(self._updates, r) for r in range(1, self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        while not self._store.check(keys):  # polled: a timed-out store wait logs a warning every time
            if cancelled is not None and cancelled():
                return False
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys, start=1) if not self._store.check([k])]
                raise TimeoutError(f"weight broadcast of step {step}: receiver ranks {missing} did not ask for it "
                                   f"within {self.timeout_s:g} s (servers not updating, or gone)")
            time.sleep(READY_POLL_S)
        for key in keys:
            self._store.delete_key(key)
        return True

    def _finish_in_flight(self) -> None:
        if self._in_flight is not None:
            self._in_flight.wait()
            self._in_flight = None  # (a finished work still holds its payload)

    def _send_full(self, bucket: list[tuple[TensorSpec, torch.Tensor]]) -> int:
        """Pack this bucket while the previous one is on the wire, then send it: two payload buffers,
        used in turn for the whole update (allocated and paged in once, not per bucket)."""
        where, size = offsets([spec for spec, _ in bucket])
        spare = self._buffers.pop(0)
        if spare.numel() < size:  # the first use: sized for the update's largest bucket
            spare = torch.empty(self._largest, dtype=torch.uint8, device=self.device)  # padding is never read
        payload = spare[:size]
        self._buffers.append(spare)
        for at, (spec, tensor) in zip(where, bucket, strict=True):
            payload[at : at + spec.nbytes].copy_(_raw(tensor))
        self._finish_in_flight()
        self._in_flight = _broadcast(self._group, payload, wait=False)
        return size

    def _send_delta(self, bucket: list[tuple[TensorSpec, torch.Tensor]], stats: SendStats) -> int:
        header = torch.zeros(len(bucket), 3, dtype=torch.int64)
        parts = []
        for i, (spec, tensor) in enumerate(bucket):
            tensor = tensor.detach().to("cpu")
            previous = self._previous.get(spec.name)
            if previous is None or previous.dtype != tensor.dtype or previous.shape != tensor.shape:
                code, changed, part = delta_codec.FULL, tensor.numel(), _raw(tensor)
                self._previous[spec.name] = tensor.clone().contiguous()
            else:
                code, changed, part = delta_codec.encode(previous, tensor)
                previous.copy_(tensor)
            header[i] = torch.tensor([code, changed, part.numel()])
            parts.append(part)
            name = ("same", "indices", "mask", "full")[code]
            stats.encodings[name] = stats.encodings.get(name, 0) + 1
        size = sum(aligned(p.numel()) for p in parts)
        payload = torch.zeros(size, dtype=torch.uint8)
        at = 0
        for part in parts:
            payload[at : at + part.numel()] = part
            at += aligned(part.numel())
        self._finish_in_flight()
        _broadcast(self._group, header.to(self.device))
        if size:
            self._in_flight = _broadcast(self._group, payload.to(self.device), wait=False)
        return size + header.numel() * 8

    def close(self) -> None:
        """Tell receivers there is nothing more (their ``announcement`` returns None), then leave. After
        an abandoned update they are not listening for one: nothing is sent."""
        if self._group is None or self._abandoned:
            return
        _broadcast(self._group, torch.tensor([KIND_CLOSE, 0], dtype=torch.int64, device=self.device))
        self._group = None


class BroadcastReceiver:
    """Rank ``rank`` (1..world_size-1) of the weight group. An update is ``announcement()`` (blocks until
    the sender starts one), then ``pull()`` (the tensors, a bucket at a time, into a loader)."""

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
        self.rank = rank
        self._updates = 0
        self._base: dict[str, torch.Tensor] = {}  # delta: the last synced tensors, on the host
        self._group, self._store = _make_group(init_method, rank, world_size, backend, timeout_s)

    def announcement(self) -> Announcement | None:
        """Block until the sender announces the next update (None once it closed)."""
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        _broadcast(self._group, header)
        kind, nbytes = (int(x) for x in header.tolist())
        if kind == KIND_CLOSE:
            self._group = None
            return None
        blob = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        _broadcast(self._group, blob)
        meta = json.loads(blob.cpu().numpy().tobytes().decode())
        self._updates += 1
        specs = [TensorSpec(name, _dtype(dtype), tuple(shape)) for name, dtype, shape in meta["tensors"]]
        return Announcement(meta["step"], specs, list(meta["buckets"]), bool(meta["delta"]))

    def pull(self, announced: Announcement, load: Callable[[Bucket], None], *, prefetch: bool = True) -> None:
        """Ask for the announced update's tensors and hand each bucket to ``load`` before the next one
        is taken. ``load`` must copy what it keeps: the bucket's tensors are views of a buffer that goes
        (delta: of the receiver's copy, which the next update changes). With ``prefetch`` the next bucket
        arrives while ``load`` runs (two buckets held); without, one bucket plus what ``load`` allocates.
        If ``load`` raises, the rest is still received (and dropped) so the group stays usable; the
        error is raised at the end."""
        self._store.set(_ready_key(self._updates, self.rank), b"1")
        failure: BaseException | None = None
        for bucket in (self._delta_buckets(announced) if announced.delta
                       else self._full_buckets(announced, prefetch)):
            if failure is None:
                try:
                    load(bucket)
                except BaseException as err:  # noqa: BLE001 (re-raised once the group is drained)
                    failure = err
            bucket = None
        if failure is not None:
            raise failure

    def _full_buckets(self, announced: Announcement, prefetch: bool) -> Iterator[Bucket]:
        layouts = [(specs, *offsets(specs)) for specs in announced.bucket_specs()]
        largest = max((size for _, _, size in layouts), default=0)  # every buffer fits any bucket: reusable
        free: list[torch.Tensor] = []  # buffers no loader holds a view of any more: refilled, not reallocated

        def post(i: int):
            size = layouts[i][2]
            spare = next((b for b in free if b.numel() >= size), None)
            if spare is None:
                spare = torch.empty(largest, dtype=torch.uint8, device=self.device)
            else:
                free.remove(spare)
            buffer = spare[:size]
            return spare, buffer, _broadcast(self._group, buffer, wait=False)

        arriving = post(0) if layouts else None
        for i, (specs, where, _) in enumerate(layouts):
            spare, buffer, work = arriving
            work.wait()
            arriving = work = None  # a finished work still holds its tensor: that would be a bucket more
            arriving = post(i + 1) if prefetch and i + 1 < len(layouts) else None
            yield [(s.name, buffer[at : at + s.nbytes].view(s.dtype).reshape(s.shape))
                   for s, at in zip(specs, where, strict=True)]
            buffer = None
            if _unshared(spare):  # (vLLM's layerwise reload may still hold views of it)
                free.append(spare)
            spare = None
            if arriving is None and i + 1 < len(layouts):
                arriving = post(i + 1)

    def _delta_buckets(self, announced: Announcement) -> Iterator[Bucket]:
        for specs in announced.bucket_specs():
            header = torch.zeros(len(specs), 3, dtype=torch.int64, device=self.device)
            _broadcast(self._group, header)
            header = header.cpu()
            size = sum(aligned(int(n)) for n in header[:, 2])
            payload = torch.empty(size, dtype=torch.uint8, device=self.device)
            if size:
                _broadcast(self._group, payload)
            payload, at, out = payload.cpu(), 0, []
            for spec, (code, changed, nbytes) in zip(specs, header.tolist(), strict=True):
                part = payload[at : at + nbytes]
                at += aligned(nbytes)
                base = self._base.get(spec.name)
                if base is None or base.dtype != spec.dtype or tuple(base.shape) != spec.shape:
                    if code != delta_codec.FULL:
                        raise RuntimeError(f"weight broadcast: a delta for {spec.name}, which this receiver "
                                           "never received in full")
                    base = self._base[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)
                delta_codec.apply(base, code, changed, part)
                out.append((spec.name, base))
            yield out

    def recv(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """One whole update as a state dict (every bucket kept: tests and tools, not servers), or None
        once the sender closed."""
        announced = self.announcement()
        if announced is None:
            return None
        state: dict[str, torch.Tensor] = {}
        self.pull(announced, lambda bucket: state.update((k, v.clone()) for k, v in bucket))
        return announced.step, state
