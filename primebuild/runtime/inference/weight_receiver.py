"""Broadcast weight sync, the inference side: join the trainer's group, hear each update announced, and
take its tensors only when the server loads them.

The trainer's rank 0 sends every step's weights over a torch.distributed group of its own (gloo on CPU,
NCCL on GPU; see primebuild/runtime/weight_sync/broadcast.py). A server joins that group as rank 1..N and
listens in a thread for announcements (a step's names, dtypes and shapes: bytes, not weights). The tensors
themselves are pulled by the update (`/update_weights` with `"source": "broadcast"`, inside the same pause
-> swap -> resume choreography as for a step folder), a bucket at a time straight into the served model:
a worker never stages the model, only a bucket or two. The trainer's send waits for every receiver's
update, so the trainer cannot run ahead of the slowest server by more than the step it is sending.

Membership changes (primebuild/runtime/weight_sync/membership.py): a server that restarts joins again with a
new incarnation and is admitted to the group at the trainer's next update; if a member dies while the
others wait for an update, the update is announced again to a new generation, and a load in progress
here waits for that announcement and takes it (`pull` loops) instead of failing.

The trainer restarted alone (primebuild/runtime/supervisor.py): the sender and its store die with the
trainer's rank 0. The listener reconnects to the store the restarted rank 0 hosts on the same port and
registers again with the step this server last loaded in full; the server keeps serving that step
meanwhile. An update announced but not yet loaded is dropped (`received_version` goes back to the loaded
step), and a load waiting for it ends at once with BroadcastInterrupted (409), so the orchestrator does not
count it. A load the sender died inside, after some buckets were installed, leaves a mix of two versions
(no staged copy to go back to: that would be a second model's memory): the load ends the same way, the
engine marks its weights mixed and serves nothing, the server process stays (engine.py; vLLM:
vllm/broadcast_engine.py and vllm/weights_mixed_guard.py). The listener
registers with the restarted sender with the step last loaded in full, as ever: the restarted sender's first
send is whole whatever it is told (a new group, delta restarting) and is a step after that one, so it
replaces every piece. (Registering with 0 instead would make it send again the retrained steps up to the
one the orchestrator already counted, which no load would ever ask for.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from primebuild.errors import UserError
from primebuild.runtime.weight_sync.broadcast import Announcement, BroadcastReceiver, Bucket, SenderLost

log = logging.getLogger("primebuild.inference")
SUPERSEDED_POLL_S = 0.1  # how often an announcement no load has asked for is checked for being re-announced


class BroadcastClosed(TimeoutError):
    """An update the trainer will never send (it closed the broadcast: the run is stopping). A TimeoutError,
    so /update_weights answers 409 at once, as for an update that did not come in time."""


class BroadcastInterrupted(TimeoutError):
    """An announced update whose sender died before this server loaded it (the trainer restarts alone):
    the server keeps the step it holds. /update_weights answers 409 with code "weight_update_lost"."""


class BroadcastStage:
    def __init__(self, init_method: str, rank: int, world_size: int, device: torch.device | str = "cpu",
                 timeout_s: float = 600.0):
        self.init_method, self.rank, self.world_size = init_method, rank, world_size
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        # The newest step announced, whose tensors a load takes (the name /health and the vLLM status
        # have always used: the step is here, ready to load, although its bytes cross only then).
        self.received_version = 0
        self.loaded_version = 0  # the newest step a load took in full (what a restarted sender is told)
        self.lost = False  # the sender died with an announced update not loaded here; cleared by the next one
        self.error: str | None = None
        self.closed = False  # the trainer closed the broadcast (the run ends): nothing more is announced
        self._receiver: BroadcastReceiver | None = None
        self._last: Announcement | None = None  # the newest announcement heard
        self._announced: Announcement | None = None  # the one a load may take now (None while none is)
        self._pulling = False  # a load is taking it: the listener leaves the store to it meanwhile
        self._taken = threading.Event()  # the announced update was pulled: listen for the next one
        self._lock = threading.Condition()  # guards the three above; notified when an announcement arrives
        self._thread = threading.Thread(target=self._listen, name="weight-broadcast", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        try:
            self._receiver = receiver = BroadcastReceiver(self.init_method, self.world_size, self.rank,
                                                          backend=backend, device=self.device,
                                                          timeout_s=self.timeout_s)
            while True:
                try:
                    if (announced := receiver.announcement()) is None:
                        break
                    with self._lock:
                        self._announced = self._last = announced
                        self._taken.clear()  # (a load that failed with the sender set it for nothing)
                        self.received_version = announced.step
                        self.lost = False
                        self._lock.notify_all()
                    log.info("weights of step %d announced by broadcast (group generation %d)", announced.step,
                             announced.generation)
                    self._wait_taken(announced)
                except SenderLost as err:
                    self._sender_lost(err)
                    log.warning("%s: serving step %d, waiting for the restarted trainer's sender", err,
                                self.loaded_version)
                    receiver.rejoin(self.loaded_version)
            log.info("the trainer closed the weight broadcast")
            self.closed = True
        except Exception as err:  # the group broke (trainer gone): say so on /health, keep serving
            self.error = f"{type(err).__name__}: {err}"
            log.error("weight broadcast stopped: %s", self.error)
        with self._lock:
            self._lock.notify_all()

    def _sender_lost(self, err: SenderLost) -> None:
        """Nothing announced so far will come: forget it (the served step stays) and wake a waiting load."""
        with self._lock:
            if self._last is not None and self._last.step > self.loaded_version:
                log.info("the announced step %d is dropped: its sender is gone before this server loaded it",
                         self._last.step)
            self.lost = True
            self._announced = self._last = None
            self.received_version = self.loaded_version
            self._lock.notify_all()

    def _wait_taken(self, announced: Announcement) -> None:
        """Until a load took `announced`, or the sender announced it again to a new generation before
        any load here asked for it (then this server must follow: the new group waits for it)."""
        while not self._taken.wait(SUPERSEDED_POLL_S):
            with self._lock:
                if not self._pulling and self._announced is announced and self._receiver.superseded(announced):
                    self._announced = None
                    return
        self._taken.clear()

    def announced(self, at_least: int) -> Announcement:
        """The announced update when it is step `at_least` or newer; a clear error otherwise."""
        with self._lock:
            announced, lost = self._last, self.lost
        if lost and (announced is None or announced.step < at_least):
            raise BroadcastInterrupted(f"the trainer's weight sender went away before step {at_least} was sent; "
                                       f"this server keeps step {self.loaded_version}")
        if announced is None or announced.step < at_least:
            have = "nothing" if announced is None else f"version {announced.step}"
            raise UserError(f"no broadcast weights of version {at_least} or newer are announced (have {have})",
                            hint="ask for received_version first")
        return announced

    def pull(self, announced: Announcement, load: Callable[[Bucket], None], *, prefetch: bool = True) -> int:
        """Take the announced update (`announced`'s step or newer) into `load`, a bucket at a time
        (BroadcastReceiver.pull); returns its step. Blocks until every receiver of the group pulls too.
        When the sender announces the step again to a new generation (a member left), that announcement
        is waited for and taken instead."""
        load_failed = []

        def tracked(bucket: Bucket) -> None:
            try:
                load(bucket)
            except BaseException:
                load_failed.append(True)
                raise

        step = announced.step

        def takeable() -> bool:
            return (self.error is not None or self.closed or self.lost
                    or (self._announced is not None and self._announced.step >= step))

        while True:
            with self._lock:
                if not self._lock.wait_for(takeable, timeout=self.timeout_s):
                    raise TimeoutError(f"step {step} was not announced again within {self.timeout_s:g} s")
                if self.error is not None:
                    raise RuntimeError(f"weight broadcast stopped: {self.error}")
                if self.closed and (self._announced is None or self._announced.step < step):
                    # a stop while the update was announced again: the trainer will not send it, and
                    # the load waiting for it would hold the orchestrator's stop for timeout_s
                    raise BroadcastClosed(f"the trainer closed the weight broadcast before step {step} was sent")
                if self.lost and (self._announced is None or self._announced.step < step):
                    raise BroadcastInterrupted(f"the trainer's weight sender went away before step {step} was "
                                               f"sent; this server keeps step {self.loaded_version}")
                announced, self._announced, self._pulling = self._announced, None, True
            try:
                done = self._receiver.pull(announced, tracked, prefetch=prefetch)
            except SenderLost as err:
                self._sender_lost(err)
                raise BroadcastInterrupted(f"the trainer's weight sender went away during the update to step "
                                           f"{announced.step} ({err})") from err
            except Exception as err:
                if not load_failed:  # the group itself broke: nothing more will arrive
                    self.error = f"{type(err).__name__}: {err}"
                raise
            finally:
                with self._lock:
                    self._pulling = False
                self._taken.set()
            if done:
                self.loaded_version = announced.step
                log.info("loaded the weights of step %d from the broadcast", announced.step)
                return announced.step
            log.info("step %d is announced again to a new weight group generation: waiting for it", announced.step)

    def leave(self) -> None:
        """The server stops (retired, or the run ends): the trainer forms its next weight group without it
        at once instead of waiting for its beat to stop (membership.py)."""
        if self._receiver is not None:
            self._receiver.leave()
