"""Who is in the weight broadcast group: generations of members, agreed on the sender's TCPStore.

A torch.distributed group has a size fixed when it is built, and a member that dies breaks it. So the
group is rebuilt, between updates, whenever its membership changes: generation n is the sender (rank 0)
and the receivers listed in ``gen/<n>/members``, and its gloo/NCCL group rendezvouses under
``gen/<n>/group``. The store itself (hosted by the sender for the whole run) is the control plane:

  member/<rank>   the incarnation (a random id) of the process that holds this receiver rank; a
                  restarted server writes a new one, a server that leaves for good (retired, stopped)
                  writes "" (LEFT).
  extra, extra/<i>
                  ranks beyond the plan's (`primebuild scale` added the server): a count, and the i-th
                  such rank, so the sender learns of ranks it was not planned with.
  beat/<rank>     a counter that a live receiver bumps every BEAT_S (its own store connection and thread,
                  so it beats while the receiver is busy). The sender counts a receiver dead once the
                  counter has not moved for DEAD_AFTER_S.
  gen             the current generation; ``gen/<n>/members`` its receivers as [[rank, incarnation], ...].
  gen/<n>/update/<i>, gen/<n>/ready/<i>/<rank>, gen/<n>/go/<i>
                  the i-th update of generation n: announced, asked for, then "send" (the buckets follow on
                  the group) or "again" (a member died or was replaced: it is announced again to the next
                  generation). Nothing crosses the group before "send", so no collective is ever left
                  half-way by a membership change.
  closed          the sender is done.
  sender          the sender's epoch (a random id). A trainer restarted alone hosts a new store on the same
                  port; a receiver whose store connection broke reconnects to it, registers again and
                  starts from generation 1 of the new epoch (BroadcastReceiver.rejoin).
  loaded/<rank>   the newest step this receiver's server loaded in full, written as it registers: a
                  restarted sender does not send again the steps it retrains that the servers already hold.

A receiver joins the generation that lists its own incarnation; one that is not (yet) listed waits, and
the sender admits it at its next update. Ranks 1..world_size-1 are the plan's (a restart reuses its rank);
a server added by `primebuild scale` takes the next rank after the plan's and lists it under ``extra``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

BEAT_S = 1.0  # how often a receiver says it is alive
DEAD_AFTER_S = 10.0  # a receiver whose beat has not moved for this long is gone (a loaded CPU host stalls seconds)
POLL_S = 0.01  # how often a receiver looks for a new generation or announcement
LIVENESS_POLL_S = 0.25  # how often the sender looks at the beats while it waits
LEFT = ""  # member/<rank> of a receiver that left for good


def _parse_init_method(init_method: str) -> tuple[str, int]:
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must look like tcp://HOST:PORT, got {init_method!r}")
    return url.hostname, url.port


def open_store(init_method: str, *, host: bool, timeout_s: float) -> dist.Store:
    """The group's TCPStore: hosted by the sender (for the whole run), a client anywhere else. Its size is
    not fixed: members come and go."""
    address, port = _parse_init_method(init_method)
    timeout = timedelta(seconds=timeout_s)
    if host:
        # A TCPStore server listens on every interface unless handed its socket: listen on the
        # init_method's address only (the sender's node, loopback on one host), as the trainer's
        # rendezvous does (primebuild/runtime/trainer/launch.py). detach(): the socket is the store's from here on.
        listener = socket.create_server((address, port), backlog=1024)
        store = dist.TCPStore(address, port, None, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(address, port, None, is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore("primebuild/weight-broadcast", store)


def make_group(store: dist.Store, generation: int, rank: int, size: int, backend: str, timeout_s: float):
    """Generation `generation`'s group; blocks until all `size` members build it (or `timeout_s`)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(f"gen/{generation}/group", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def read_int(store: dist.Store, key: str, default: int = 0) -> int:
    return int(store.get(key)) if store.check([key]) else default


class Heartbeat:
    """A receiver's registration and its beat, on a store connection of its own."""

    def __init__(self, store: dist.Store, rank: int, loaded: int = 0, incarnation: str | None = None, *,
                 extra: bool = False):
        """`extra`: a rank beyond the plan's, which the sender learns of from the ``extra`` list."""
        self.rank = rank
        self.incarnation = incarnation or uuid.uuid4().hex
        self._store = store.clone()
        self._stop = threading.Event()
        self._store.add(f"beat/{rank}", 1)
        store.set(f"loaded/{rank}", str(loaded))  # before member/: the sender reads it once all registered
        store.set(f"member/{rank}", self.incarnation)
        if extra:
            store.set(f"extra/{store.add('extra', 1)}", str(rank))  # a restart lists it again: read as a set
        self._thread = threading.Thread(target=self._beat, name="weight-group-beat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._store.add(f"beat/{self.rank}", 1)
            except Exception:  # noqa: BLE001 (the sender is gone: the receiver finds out on its own connection)
                return

    def stop(self) -> None:
        self._stop.set()

    def leave(self) -> None:
        """Leave for good: the sender forms its next generation without this rank at once, without
        waiting DEAD_AFTER_S for the beat to stop."""
        self.stop()
        try:
            self._store.set(f"member/{self.rank}", LEFT)
        except Exception:  # noqa: BLE001 (the sender is gone already: nothing to leave)
            pass


class Roster:
    """The sender's view of the receivers: who registered, with which incarnation, and who still beats."""

    def __init__(self, store: dist.Store, ranks: range):
        self.store = store
        self.ranks = list(ranks)  # the plan's, then the extra ones as they are listed
        self._extras_read = 0
        self._beats: dict[int, tuple[str, int, float]] = {}  # rank -> (incarnation, beat count, when it last moved)

    def _read_extras(self) -> None:
        listed = self.store.add("extra", 0)
        while self._extras_read < listed:
            key = f"extra/{self._extras_read + 1}"
            if not self.store.check([key]):  # counted, not yet written: read it next time
                return
            rank = int(self.store.get(key))
            if rank not in self.ranks:
                self.ranks.append(rank)
            self._extras_read += 1

    def registered(self) -> dict[int, str]:
        """Receivers that registered and have not left: rank -> incarnation."""
        self._read_extras()
        present = [r for r in self.ranks if self.store.check([f"member/{r}"])]
        members = {r: self.store.get(f"member/{r}").decode() for r in present}
        return {r: who for r, who in members.items() if who != LEFT}

    def live(self) -> dict[int, str]:
        """Registered receivers whose beat moved within DEAD_AFTER_S (a new incarnation counts as live)."""
        now = time.monotonic()
        out = {}
        for rank, incarnation in self.registered().items():
            count = self.store.add(f"beat/{rank}", 0)
            seen = self._beats.get(rank)
            if seen is None or seen[0] != incarnation or seen[1] != count:
                self._beats[rank] = seen = (incarnation, count, now)
            if now - seen[2] < DEAD_AFTER_S:
                out[rank] = incarnation
        return out


def wait_until_listening(init_method: str, timeout_s: float, poll_s: float = 0.2) -> None:
    """Until something accepts connections at `init_method` (a restarted sender's store comes up at an
    unknown moment). A plain connection, tried every `poll_s`: TCPStore's own connect retry backs off to many
    seconds between tries and logs each failed one."""
    address, port = _parse_init_method(init_method)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((address, port), timeout=poll_s).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight broadcast: nothing listens at {init_method} after {timeout_s:g} s "
                                   "(the trainer did not come back)") from None
            time.sleep(poll_s)


def held_version(store: dist.Store, ranks) -> int:
    """The newest step any registered receiver's server loaded in full (0: none, a fresh start). Every
    server is brought to the next step the sender sends, in full, so the newest one counts."""
    return max((read_int(store, f"loaded/{r}") for r in ranks), default=0)


def set_epoch(store: dist.Store) -> str:
    epoch = uuid.uuid4().hex
    store.set("sender", epoch)
    return epoch


def wait_for_key(store: dist.Store, key: str, timeout_s: float, *, also: str) -> str | None:
    """The value of `key` once it is set (None if `also` is set first); TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if store.check([also]):
            return None
        if time.monotonic() > deadline:
            raise TimeoutError(f"weight broadcast: {key} not set within {timeout_s:g} s (the sender is gone?)")
        time.sleep(POLL_S)
    return store.get(key).decode()


def members_key(generation: int) -> str:
    return f"gen/{generation}/members"


def publish_generation(store: dist.Store, generation: int, members: dict[int, str]) -> None:
    store.set(members_key(generation), json.dumps(sorted(members.items())))
    store.set("gen", str(generation))


def read_members(store: dist.Store, generation: int) -> list[tuple[int, str]]:
    return [(int(r), str(i)) for r, i in json.loads(store.get(members_key(generation)).decode())]
