"""Broadcast weight sync, the inference side: receive each new policy in the background, stage it.

The trainer's rank 0 sends every step's weights over a torch.distributed group of its own (gloo on CPU,
NCCL on GPU; see primebuild/runtime/weight_sync/broadcast.py). A server joins that group as rank 1..N and keeps
listening in a thread, so the trainer never waits for it; the newest received state dict is staged,
and swapped in only when the orchestrator says so (`/update_weights` with `"source": "broadcast"`), with
the same pause -> swap -> resume choreography as for a step folder.
"""

from __future__ import annotations

import logging
import threading

import torch

from primebuild.errors import UserError

log = logging.getLogger("primebuild.inference")


class BroadcastStage:
    def __init__(self, init_method: str, rank: int, world_size: int, device: torch.device | str = "cpu"):
        self.init_method, self.rank, self.world_size = init_method, rank, world_size
        self.device = torch.device(device)
        self.received_version = 0
        self.error: str | None = None
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._receive, name="weight-broadcast", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        from primebuild.runtime.weight_sync.broadcast import BroadcastReceiver

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        try:
            receiver = BroadcastReceiver(self.init_method, self.world_size, self.rank, backend=backend,
                                         device=self.device)
            while (got := receiver.recv()) is not None:
                step, state = got
                with self._lock:
                    self._staged = (step, state)  # an unswapped older version is simply replaced
                    self.received_version = step
                log.info("received weights of step %d by broadcast", step)
            log.info("the trainer closed the weight broadcast")
        except Exception as err:  # the group broke (trainer gone): say so on /health, keep serving
            self.error = f"{type(err).__name__}: {err}"
            log.error("weight broadcast stopped: %s", self.error)

    def take(self, version: int) -> dict[str, torch.Tensor]:
        """The staged weights of `version` (the newest received); a clear error for any other version."""
        with self._lock:
            if self._staged is None or self._staged[0] != version:
                have = "nothing" if self._staged is None else f"version {self._staged[0]}"
                raise UserError(f"no broadcast weights of version {version} are staged (have {have})",
                                hint="ask /health for received_version first")
            return self._staged[1]

    def take_newest(self, at_least: int) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest staged (version, weights) when it is `at_least` that version: a newer step may
        have arrived since a caller read `received_version`, and loading it is never a step back."""
        with self._lock:
            if self._staged is None or self._staged[0] < at_least:
                have = "nothing" if self._staged is None else f"version {self._staged[0]}"
                raise UserError(f"no broadcast weights of version {at_least} or newer are staged (have {have})",
                                hint="ask for received_version first")
            return self._staged
