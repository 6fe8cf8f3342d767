"""Weights from trainer rank 0 to inference workers over a torch.distributed group of their own.

The trainer's ranks already form the default process group (torchrun), and a process has only one of
those; so this group is built directly from a TCPStore (hosted by the sender, rank 0 of this group) and a
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) object — the same "stateless group" approach
vLLM and prime-rl use for NCCL weight broadcast. Members: the sender (rank 0) and ``world_size - 1``
receivers (ranks 1..world_size-1, the plan's; a server `primebuild scale` adds takes a rank after them);
everyone passes the same ``init_method`` ``tcp://HOST:PORT``.

Membership is a generation (membership.py): the sender and the receivers alive when it was formed. A
receiver that dies (or a restarted one that registers again) makes the sender form a new generation
before its next update, so a server restart costs the run that server's share, never the run.

One update, in bounded memory at both ends:
  1. announce  the metadata, JSON {"step", "tensors": [[name, dtype, shape], ...], "buckets": [tensors per
               bucket], "delta"} (buckets.py decides the cut), as the store key ``gen/<n>/update/<i>``.
               Receivers poll for it between updates (never inside a collective).
  2. ready     each receiver sets ``gen/<n>/ready/<i>/<rank>`` once it can load, i.e. when its server is
               paused inside a weight update; the sender waits for all of them, watching their beats:
               one that died or was replaced meanwhile turns ``go`` to "again", and the update is
               announced again to a new generation. A receiver holds no weights before that: it loads
               each bucket into the served model as it arrives, so the server must not be serving meanwhile.
  3. buckets   after ``go`` = "send", per bucket over the generation's group, the tensors' raw bytes at
               aligned offsets (any dtype, bf16 or fp8, travels the same way; fp8_wire.py sends FP8 servers
               their serving format): one message per big tensor, straight from the sender's memory, and one
               per run of small ones, packed (buckets.messages), all posted at once, so the wire never waits
               for a packing copy or a round trip between them; the receiver posts the same messages into
               views of its bucket buffer. With delta (delta.py) first int64[tensors, 3] (encoding, changed
               elements, bytes), then the encoded bytes. A receiver
               holds one bucket while it loads it and, with prefetch, the next one arriving: at most two
               buckets of staging, never the model. A generation with a newcomer gets full tensors (delta
               restarts from them), so a joining server receives the whole current weights.
The sender holds the layer group being streamed (stream.py) and the tensors of at most two buckets in flight
(the one the receivers are taking and the next), plus the packed copies of their small tensors.

The sender's restart (a trainer-only restart, primebuild/runtime/supervisor.py): the store dies with the
trainer's rank 0, and the restarted rank 0 hosts a new one on the same port, under a new epoch. A receiver
finds its store connection broken (SenderLost, whatever it was doing: waiting for an announcement, for "go",
or inside a bucket), reconnects and registers again with the step its server last loaded in full
(``rejoin``). The new sender starts at generation 1 with full tensors (delta restarts), and leaves out
the steps it retrains that the servers already hold (``servers_hold``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from primebuild.contracts.trainer import DEFAULT_BUCKET_MB

from . import delta as delta_codec
from .buckets import aligned, bucket_counts, messages, offsets
from .membership import (
    LIVENESS_POLL_S,
    POLL_S,
    Heartbeat,
    Roster,
    held_version,
    make_group,
    open_store,
    publish_generation,
    read_int,
    read_members,
    set_epoch,
    wait_for_key,
    wait_until_listening,
)
from .stream import StreamedWeights, TensorSpec, as_stream, in_layout_order

log = logging.getLogger("primebuild.weight_sync")
READY_POLL_S = 0.005  # how often the sender looks whether every receiver asked for the update
CLOSE_WAIT_S = 10.0  # how long a closing sender waits for its members to have seen it close
Bucket = list[tuple[str, torch.Tensor]]
# Test-only fault injection, read by nothing but BroadcastSender: while the file this variable names exists,
# a send stalls half-way through its buckets, once those sent so far have crossed, and removes the file (so
# the restarted sender, started with the same environment, sends whole). A test kills the sender then, with
# part of an update installed in the servers (tests/test_trainer_restart.py). A run never sets it.
STALL_ENV = "PRIMEBUILD_TEST_STALL_SEND"
STALL_S = 600.0


class SenderLost(ConnectionError):
    """The sender (the trainer's rank 0) and the store it hosted are gone: nothing of the update in hand
    will come. A restarted trainer hosts a new store on the same port (BroadcastReceiver.rejoin)."""


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
    generation: int = 0  # the group it was announced to
    index: int = 0  # its number within that generation

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
    registered (up to ``timeout_s``). ``timeout_s`` also bounds each wait for the receivers to be ready.
    Between updates it re-forms the group when its membership changed (membership.py)."""

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
        self.backend = backend
        self.delta = delta
        self._previous: dict[str, torch.Tensor] = {}  # delta: the last sent tensors, on the host
        self._in_flight: list = []  # the works of the bucket on the wire while the next one is posted
        self._abandoned = False
        self._stall_file = os.environ.get(STALL_ENV)  # (tests only: see STALL_ENV)
        self.last: SendStats | None = None
        self.generation = 0
        self.members: dict[int, str] = {}  # receiver rank -> incarnation, in the current generation
        self._announced = 0  # updates announced to the current generation
        self._group = None
        self._store = open_store(init_method, host=True, timeout_s=timeout_s)
        self.epoch = set_epoch(self._store)  # receivers of a sender that died tell this store from its by it
        self._roster = Roster(self._store, range(1, world_size))
        deadline = time.monotonic() + timeout_s
        while len(registered := self._roster.registered()) < world_size - 1:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, world_size)) - set(registered))
                raise TimeoutError(f"weight broadcast: receiver ranks {missing} did not join within {timeout_s:g} s")
            time.sleep(LIVENESS_POLL_S)
        # after a trainer-only restart: the step the servers hold (0 on a fresh start); the trainer sends
        # none of the steps it retrains up to it (the same bytes), and the next one in full
        self.servers_hold = held_version(self._store, registered)
        self._form(registered)

    def _form(self, members: dict[int, str]) -> None:
        """A new generation of these receivers; blocks until each of them built its group."""
        newcomers = set(members.values()) - set(self.members.values())
        self._group = None  # the previous generation's group goes (nothing is in flight on it)
        self.generation += 1
        self.members = dict(sorted(members.items()))
        self._announced = 0
        if newcomers:
            self._previous.clear()  # delta: a newcomer has no base, so the next update is sent in full
        publish_generation(self._store, self.generation, self.members)
        log.info("weight group generation %d: receiver ranks %s", self.generation, sorted(self.members))
        self._group = make_group(self._store, self.generation, 0, len(self.members) + 1, self.backend,
                                 self.timeout_s)

    def _refresh(self, cancelled: Callable[[], bool] | None, survivors_only: bool = False) -> bool:
        """Before an update: a new generation if the live receivers are not the current members (False:
        cancelled while none was live). `survivors_only`: an update announced again keeps to the members
        that are still there; a receiver that registered since waits for the next update, because the
        servers' loads of this one are already under way without it (taking it in would leave every
        load waiting on a server nobody asked to load)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            live = self._roster.live()
            if survivors_only:
                live = {r: who for r, who in live.items() if self.members.get(r) == who} or live
            if live and live == self.members and self._group is not None:
                return True
            if live:
                try:
                    self._form(live)
                    return True
                except (RuntimeError, dist.DistError) as err:  # a member went while the group was built
                    log.warning("weight group generation %d not formed (%s): again", self.generation, err)
                    self._group = None
                    continue
            if cancelled is not None and cancelled():
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight broadcast: no receiver alive for {self.timeout_s:g} s")
            time.sleep(LIVENESS_POLL_S)

    def send(self, weights: Mapping[str, torch.Tensor] | StreamedWeights, step: int,
             cancelled: Callable[[], bool] | None = None) -> SendStats | None:
        """One update; returns once every member of the group has it. Streamed weights are sent as they
        come: the sender holds the group being read and two buckets, never the whole state (unless delta
        keeps the previous one). A member that dies before the buckets go is left out: the update is
        announced again to the members left (a restarted one is admitted at the next update).
        While the receivers have not asked for it, `cancelled()` (a run being stopped: nobody will update
        the servers) ends the wait: the stream is then read through without sending (its gathers are
        collectives of every trainer rank), None is returned, and this sender sends nothing more."""
        if self._abandoned:
            raise RuntimeError("this weight sender abandoned an update: it cannot send again")
        weights = as_stream(weights)
        specs = list(weights.layout)
        counts = bucket_counts(specs, self.bucket_bytes)
        waited = time.perf_counter()
        outcome = None
        while True:
            if not self._refresh(cancelled, survivors_only=outcome == "again"):
                outcome = "cancelled"
                break
            meta = {"step": int(step), "tensors": [[s.name, str(s.dtype), list(s.shape)] for s in specs],
                    "buckets": counts, "delta": self.delta}
            self._announced += 1
            self._store.set(f"gen/{self.generation}/update/{self._announced}", json.dumps(meta))
            outcome = self._wait_ready(step, cancelled)
            if outcome != "again":
                break
        if outcome == "cancelled":
            self._abandoned = True
            for _ in in_layout_order(weights):
                pass
            return None
        started = time.perf_counter()
        stats = SendStats(step=int(step), full_bytes=sum(s.nbytes for s in specs), wire_bytes=0,
                          buckets=len(counts), ready_wait_s=started - waited, transfer_s=0.0)
        tensors = in_layout_order(weights)
        self._in_flight = []
        for i, count in enumerate(counts):
            bucket = [next(tensors) for _ in range(count)]
            stats.wire_bytes += self._send_delta(bucket, stats) if self.delta else self._send_full(bucket)
            bucket = None  # the posted messages hold what they still need
            if self._stall_file and i + 1 == len(counts) // 2:
                self._stall_if_asked(step, i + 1, len(counts))
        self._finish_in_flight()
        if next(tensors, None) is not None:
            raise RuntimeError("weight stream: more tensors than its layout")
        stats.transfer_s = time.perf_counter() - started
        self.last = stats
        return stats

    def _stall_if_asked(self, step: int, sent: int, buckets: int) -> None:
        """STALL_ENV (tests only): stall here if its file exists, once the buckets so far have crossed."""
        try:
            os.remove(self._stall_file)
        except FileNotFoundError:
            return
        self._finish_in_flight()
        log.warning("%s: the send of step %d stalls after %d of %d buckets (a test's fault injection)", STALL_ENV,
                    step, sent, buckets)
        time.sleep(STALL_S)

    def _wait_ready(self, step: int, cancelled: Callable[[], bool] | None) -> str:
        """Until every member asked for the announced update ("send"), one of them died or was replaced
        ("again"), or `cancelled()` says to give up ("cancelled")."""
        prefix = f"gen/{self.generation}"
        keys = [f"{prefix}/ready/{self._announced}/{r}" for r in self.members]
        go = f"{prefix}/go/{self._announced}"
        deadline = time.monotonic() + self.timeout_s
        looked = time.monotonic()
        while not self._store.check(keys):  # polled: a timed-out store wait logs a warning every time
            if cancelled is not None and cancelled():
                return "cancelled"
            now = time.monotonic()
            if now - looked > LIVENESS_POLL_S:
                looked = now
                live = self._roster.live()
                gone = [r for r, incarnation in self.members.items() if live.get(r) != incarnation]
                if gone:
                    log.warning("weight broadcast of step %d: receiver ranks %s left the group; announcing it "
                                "again to the others", step, gone)
                    self._store.set(go, "again")
                    return "again"
            if now > deadline:
                missing = [r for r, k in zip(self.members, keys, strict=True) if not self._store.check([k])]
                raise TimeoutError(f"weight broadcast of step {step}: receiver ranks {missing} did not ask for it "
                                   f"within {self.timeout_s:g} s (servers not updating, or gone)")
            time.sleep(READY_POLL_S)
        self._store.set(go, "send")
        return "send"

    def _finish_in_flight(self) -> None:
        for work in self._in_flight:
            work.wait()
        self._in_flight = []  # (a finished work still holds its payload)

    def _send_full(self, bucket: list[tuple[TensorSpec, torch.Tensor]]) -> int:
        """Post this bucket's messages (buckets.messages): a big tensor straight from its own memory, a run
        of small ones packed; then wait for the previous bucket's, so that at most two buckets are held
        while the receivers take one and the wire carries the next."""
        specs = [spec for spec, _ in bucket]
        where, size = offsets(specs)
        posted = []
        for first, end, start, stop, direct in messages(specs):
            if direct:
                data = _raw(bucket[first][1].to(self.device))
            else:  # padding between the packed tensors is never read
                data = torch.empty(stop - start, dtype=torch.uint8, device=self.device)
                for at, (spec, tensor) in zip(where[first:end], bucket[first:end], strict=True):
                    data[at - start : at - start + spec.nbytes].copy_(_raw(tensor))
            posted.append(_broadcast(self._group, data, wait=False))
            data = None
        self._finish_in_flight()
        self._in_flight = posted
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
            self._in_flight = [_broadcast(self._group, payload.to(self.device), wait=False)]
        return size + header.numel() * 8

    def close(self) -> None:
        """Tell receivers there is nothing more (their ``announcement`` returns None), then leave."""
        self._store.set("closed", "1")
        self._group = None
        # the store goes with this process: give the members a moment to read "closed" from it first
        keys = [f"closed/{r}" for r in self.members]
        deadline = time.monotonic() + CLOSE_WAIT_S
        while not self._store.check(keys) and time.monotonic() < deadline:
            time.sleep(READY_POLL_S)


class BroadcastReceiver:
    """Receiver rank ``rank`` (1..world_size-1, or beyond for an added server) of the weight group, in
    whichever generation lists it.
    An update is ``announcement()`` (blocks until the sender starts one), then ``pull()`` (the tensors, a
    bucket at a time, into a loader)."""

    def __init__(
        self,
        init_method: str,
        world_size: int,
        rank: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
        device: str | torch.device = "cpu",
        loaded: int = 0,
    ):
        if rank < 1:  # beyond world_size - 1: a server `primebuild scale` added (membership.py)
            raise ValueError(f"receiver rank must be 1 or more, got {rank}")
        self.device = torch.device(device)
        self.rank = rank
        self.backend = backend
        self.timeout_s = timeout_s
        self.init_method = init_method
        self._base: dict[str, torch.Tensor] = {}  # delta: the last synced tensors, on the host
        self.incarnation: str | None = None
        self._extra = rank >= world_size  # a server `primebuild scale` added: listed under ``extra``
        self._connect(loaded)

    def _connect(self, loaded: int) -> None:
        """Connect to the sender's store (waiting up to timeout_s for it to listen), learn its epoch and
        register, saying which step this server holds."""
        self._store = open_store(self.init_method, host=False, timeout_s=self.timeout_s)
        self.epoch = self._store.get("sender").decode()  # (a get waits for the sender to have set it)
        self._beat = Heartbeat(self._store, self.rank, loaded, self.incarnation, extra=self._extra)
        self.incarnation = self._beat.incarnation
        self._group = None
        self.generation = 0  # the generation whose group this receiver is in (0: none)
        self._seen = 0  # the newest generation looked at
        self._next = 1  # the next announcement's number within the generation

    def rejoin(self, loaded: int) -> None:
        """After SenderLost: register with the restarted sender's store once it listens (up to timeout_s).
        `loaded`: the step this server last loaded in full. Delta restarts from the next full update."""
        self._beat.stop()
        self._base.clear()
        wait_until_listening(self.init_method, self.timeout_s)  # (at once, not after TCPStore's back-off)
        self._connect(loaded)
        log.info("rank %d rejoined the weight sender of epoch %s holding step %d", self.rank, self.epoch[:8], loaded)

    def _sender_alive(self) -> bool:
        try:
            return self._store.get("sender").decode() == self.epoch
        except (RuntimeError, dist.DistError):
            return False

    @contextmanager
    def _sender_watched(self):
        """A store or group failure whose cause is the sender gone becomes SenderLost."""
        try:
            yield
        except (RuntimeError, dist.DistError) as err:
            if self._sender_alive():
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise SenderLost(f"the weight sender of epoch {self.epoch[:8]} is gone ({first})") from err

    def _follow(self) -> None:
        """Join the newest generation if it lists this incarnation; leave the old group either way."""
        newest = read_int(self._store, "gen")
        if newest == self._seen:
            return
        self._seen = newest
        self._group, self.generation = None, 0
        members = read_members(self._store, newest)
        if (self.rank, self.incarnation) not in members:
            return  # not admitted (yet): the sender admits a live receiver at its next update
        try:
            self._group = make_group(self._store, newest, members.index((self.rank, self.incarnation)) + 1,
                                     len(members) + 1, self.backend, self.timeout_s)
        except (RuntimeError, dist.DistError) as err:  # a member went while it was built: the sender forms another
            log.warning("weight group generation %d not joined: %s", newest, err)
            return
        self.generation, self._next = newest, 1
        log.info("joined weight group generation %d as rank %d", newest, members.index((self.rank, self.incarnation)) + 1)

    def announcement(self) -> Announcement | None:
        """Block until the sender announces the next update to a generation this receiver is in (None
        once it closed). SenderLost when the sender died."""
        with self._sender_watched():
            return self._announcement()

    def _announcement(self) -> Announcement | None:
        while True:
            if self._store.check(["closed"]):
                self._group = None
                self._beat.stop()
                self._store.set(f"closed/{self.rank}", self.incarnation)
                return None
            self._follow()
            key = f"gen/{self.generation}/update/{self._next}"
            if self._group is not None and self._store.check([key]):
                meta = json.loads(self._store.get(key).decode())
                specs = [TensorSpec(name, _dtype(dtype), tuple(shape)) for name, dtype, shape in meta["tensors"]]
                announced = Announcement(meta["step"], specs, list(meta["buckets"]), bool(meta["delta"]),
                                         generation=self.generation, index=self._next)
                self._next += 1
                return announced
            time.sleep(POLL_S)

    def pull(self, announced: Announcement, load: Callable[[Bucket], None], *, prefetch: bool = True) -> bool:
        """Ask for the announced update's tensors and hand each bucket to ``load`` before the next one
        is taken; True once done. False when the sender announces it again to a new generation instead
        (a member left): nothing was loaded, and the next ``announcement()`` is that one. ``load`` must
        copy what it keeps: the bucket's tensors are views of a buffer that goes (delta: of the
        receiver's copy, which the next update changes). With ``prefetch`` the next bucket arrives while
        ``load`` runs (two buckets held); without, one bucket plus what ``load`` allocates. If ``load``
        raises, the rest is still received (and dropped) so the group stays usable; the error is raised
        at the end. SenderLost when the sender died meanwhile: a bucket may have been loaded (the caller
        must not serve that mix)."""
        with self._sender_watched():
            return self._pull(announced, load, prefetch)

    def _pull(self, announced: Announcement, load: Callable[[Bucket], None], prefetch: bool) -> bool:
        if announced.generation != self.generation or self._group is None:
            return False
        prefix = f"gen/{announced.generation}"
        self._store.set(f"{prefix}/ready/{announced.index}/{self.rank}", self.incarnation)
        go = wait_for_key(self._store, f"{prefix}/go/{announced.index}", self.timeout_s, also="closed")
        if go != "send":
            return False
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
        return True

    def _full_buckets(self, announced: Announcement, prefetch: bool) -> Iterator[Bucket]:
        layouts = [(specs, *offsets(specs)) for specs in announced.bucket_specs()]
        largest = max((size for _, _, size in layouts), default=0)  # every buffer fits any bucket: reusable
        free: list[torch.Tensor] = []  # buffers no loader holds a view of any more: refilled, not reallocated

        def post(i: int):
            specs, _, size = layouts[i]
            spare = next((b for b in free if b.numel() >= size), None)
            if spare is None:
                spare = torch.empty(largest, dtype=torch.uint8, device=self.device)
            else:
                free.remove(spare)
            buffer = spare[:size]
            works = [_broadcast(self._group, buffer[start:stop], wait=False)
                     for _, _, start, stop, _ in messages(specs)]
            return spare, buffer, works

        arriving = post(0) if layouts else None
        for i, (specs, where, _) in enumerate(layouts):
            spare, buffer, works = arriving
            for work in works:
                work.wait()
            arriving = works = None  # a finished work still holds its tensor: that would be a bucket more
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

    def superseded(self, announced: Announcement) -> bool:
        """The sender gave up on `announced` (it announces it again to a newer generation) or closed."""
        go = f"gen/{announced.generation}/go/{announced.index}"
        with self._sender_watched():
            return (self._store.check(["closed"]) or read_int(self._store, "gen") != announced.generation
                    or (self._store.check([go]) and self._store.get(go) == b"again"))

    def recv(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """One whole update as a state dict (every bucket kept: tests and tools, not servers), or None
        once the sender closed."""
        while (announced := self.announcement()) is not None:
            state: dict[str, torch.Tensor] = {}
            if self.pull(announced, lambda bucket, into=state: into.update((k, v.clone()) for k, v in bucket)):
                return announced.step, state
        return None

    def close(self) -> None:
        """Stop beating: the sender leaves this receiver out of its next generation."""
        self._beat.stop()
        self._group = None

    def leave(self) -> None:
        """Leave for good (the server stops): the sender's next generation is formed without it at once."""
        self._beat.leave()
        self._group = None
