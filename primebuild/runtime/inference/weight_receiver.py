"""Broadcast weight sync, the inference side: join the trainer's group, hear each update announced, and
take its tensors only when the server loads them.

The trainer's rank 0 sends every step's weights over a torch.distributed group of its own (gloo on CPU,
NCCL on GPU; see primebuild/runtime/weight_sync/broadcast.py). A server joins that group as rank 1..N and
listens in a thread for announcements (a step's names, dtypes and shapes: bytes, not weights). The tensors
themselves are pulled by the update (`/update_weights` with `"source": "broadcast"`, inside the same pause
-> swap -> resume choreography as for a step folder), a bucket at a time straight into the served model:
a worker never stages the model, only a bucket or two. The trainer's send waits for every receiver's
update, so the trainer cannot run ahead of the slowest server by more than the step it is sending.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from primebuild.errors import UserError
from primebuild.runtime.weight_sync.broadcast import Announcement, BroadcastReceiver, Bucket

log = logging.getLogger("primebuild.inference")


class BroadcastStage:
    def __init__(self, init_method: str, rank: int, world_size: int, device: torch.device | str = "cpu",
                 timeout_s: float = 600.0):
        self.init_method, self.rank, self.world_size = init_method, rank, world_size
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        # The newest step announced, whose tensors a load takes (the name /health and the vLLM status
        # have always used: the step is here, ready to load, although its bytes cross only then).
        self.received_version = 0
        self.error: str | None = None
        self._receiver: BroadcastReceiver | None = None
        self._announced: Announcement | None = None
        self._taken = threading.Event()  # the announced update was pulled: listen for the next one
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._listen, name="weight-broadcast", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        try:
            self._receiver = BroadcastReceiver(self.init_method, self.world_size, self.rank, backend=backend,
                                               device=self.device, timeout_s=self.timeout_s)
            while (announced := self._receiver.announcement()) is not None:
                with self._lock:
                    self._announced = announced
                    self.received_version = announced.step
                log.info("weights of step %d announced by broadcast", announced.step)
                self._taken.wait()  # the sender sends nothing else before every receiver pulled this one
                self._taken.clear()
            log.info("the trainer closed the weight broadcast")
        except Exception as err:  # the group broke (trainer gone): say so on /health, keep serving
            self.error = f"{type(err).__name__}: {err}"
            log.error("weight broadcast stopped: %s", self.error)

    def announced(self, at_least: int) -> Announcement:
        """The announced update when it is step `at_least` or newer; a clear error otherwise."""
        with self._lock:
            announced = self._announced
        if announced is None or announced.step < at_least:
            have = "nothing" if announced is None else f"version {announced.step}"
            raise UserError(f"no broadcast weights of version {at_least} or newer are announced (have {have})",
                            hint="ask for received_version first")
        return announced

    def pull(self, announced: Announcement, load: Callable[[Bucket], None], *, prefetch: bool = True) -> int:
        """Take the announced update's tensors into `load`, a bucket at a time (BroadcastReceiver.pull);
        returns its step. Blocks until every receiver of the group pulls too."""
        with self._lock:
            if announced is not self._announced or self._receiver is None:
                raise UserError(f"the broadcast of step {announced.step} is no longer the announced one")
            self._announced = None
        load_failed = []

        def tracked(bucket: Bucket) -> None:
            try:
                load(bucket)
            except BaseException:
                load_failed.append(True)
                raise

        try:
            self._receiver.pull(announced, tracked, prefetch=prefetch)
        except Exception as err:
            if not load_failed:  # the group itself broke: nothing more will arrive
                self.error = f"{type(err).__name__}: {err}"
            raise
        finally:
            self._taken.set()
        log.info("loaded the weights of step %d from the broadcast", announced.step)
        return announced.step
