"""A vLLM weight-transfer engine that joins *our* trainer's weight broadcast group.

Why not vLLM's own engines: its ``nccl`` engine (and the sparse/m2n variants) build a
``PyNcclCommunicator``, CUDA only, with the parameter list travelling in the HTTP body. Our trainer
broadcasts over gloo (CPU) or NCCL (GPU) with its own wire format (primebuild/runtime/weight_sync/broadcast.py):
it announces each step on its own schedule, and sends the tensors, a bucket at a time, once every
receiver asks for them inside its server's weight update (primebuild/runtime/inference/weight_receiver.py).
This engine speaks that protocol and keeps vLLM's own control plane:

  POST /init_weight_transfer_engine {"init_info": {"init_method": "tcp://H:P", "rank_offset": R,
                                                   "world_size": W}}
        join the group as rank R (+ this worker's index) in a background thread, which listens for
        announced steps; returns at once (the trainer may join later).
  POST /start_weight_update              layerwise-reload set-up (as vLLM's NCCL engine does)
  POST /update_weights {"update_info": {"version": v}}
        take the announced step (v or newer) bucket by bucket into the model; returns once every
        worker of every server has taken it; the status then reports it as ``loaded_version``
  POST /finish_weight_update
        finalise the reload. The caller (admin.py) sets the server's version only once every worker
        of every engine core reports the same ``loaded_version``.

An exception in a worker during these calls shuts the whole vLLM server down (vLLM treats a failed
worker RPC as fatal), so callers check ``received_version`` first (admin.py does) and nothing here
raises for a condition they can check. Nor for the one they cannot: the trainer's sender dying inside a
load (it restarts alone) after some buckets were installed. The worker then finishes the reload with what
it has and records that its weights are ``mixed`` (part of two steps, and a layer cut half-way holds
unset values: vLLM's layerwise reload materialises it empty); the status says so, the server serves
nothing until a whole update (weights_mixed_guard.py) and the restarted sender's first send, always
whole, replaces every piece and clears it.

vLLM finds it by name: worker_extension registers it as ``primebuild_broadcast``, and the server is
started with ``--weight-transfer-config '{"backend": "primebuild_broadcast"}'``.
Runs inside vLLM's worker process.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from primebuild.runtime.inference.vllm.expert_slice import keep_local, local_experts
from primebuild.runtime.inference.weight_receiver import BroadcastClosed, BroadcastInterrupted, BroadcastStage

log = logging.getLogger("primebuild.inference")


def _log_to_stderr() -> None:
    """vLLM configures logging for its own `vllm` logger only: without a handler of ours, the receiver's
    INFO lines (each step announced and loaded, the sender lost and rejoined) would never reach the
    server's log; only warnings would, through Python's last-resort handler."""
    ours = logging.getLogger("primebuild")
    if not ours.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s [primebuild weight receiver] %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False  # one line each, should vLLM or a plugin configure the root logger too


@dataclass
class BroadcastInitInfo(WeightTransferInitInfo):
    init_method: str  # tcp://HOST:PORT of the trainer's TCPStore (rank 0 hosts it)
    rank_offset: int  # this server's first rank in the group (1..world_size-1); its workers take the next ones
    world_size: int  # the trainer's sender + every receiving worker of every server


@dataclass
class BroadcastUpdateInfo(WeightTransferUpdateInfo):
    version: int  # the oldest trainer step acceptable; the announced one (this or newer) is loaded


class BroadcastWeightTransferEngine(WeightTransferEngine[BroadcastInitInfo, BroadcastUpdateInfo]):
    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _log_to_stderr()
        self.stage: BroadcastStage | None = None
        self.loaded_version: int | None = None  # the last step loaded in full (also while mixed)
        self.mixed: str | None = None  # why the weights are a mix of two steps, while they are

    def worker_rank(self) -> int:
        """This worker's index among all workers of the server (data parallel x tensor/pipeline)."""
        parallel = self.parallel_config
        return parallel.data_parallel_index * parallel.world_size + parallel.rank

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        if self.stage is not None:
            raise RuntimeError("this server already joined a weight broadcast group; a group is joined once")
        self.stage = BroadcastStage(init_info.init_method, init_info.rank_offset + self.worker_rank(),
                                    init_info.world_size, device=self.device)

    def status(self) -> dict[str, Any]:
        if self.stage is None:
            return {"joined": False, "rank": None, "received_version": 0, "loaded_version": None, "error": None,
                    "closed": False, "lost": False, "mixed": None}
        # lost: the trainer's sender died with an update announced here and not loaded (weight_receiver.py)
        return {"joined": True, "rank": self.stage.rank, "received_version": self.stage.received_version,
                "loaded_version": self.loaded_version, "error": self.stage.error, "closed": self.stage.closed,
                "lost": self.stage.lost, "mixed": self.mixed}

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
        if self.stage is None:
            raise RuntimeError("no weight broadcast group joined: call /init_weight_transfer_engine first")
        # a bucket at a time, in checkpoint (HF) names and layouts as the trainer sends them: the model's
        # loaders fuse qkv/gate_up and keep this worker's TP shard, other EP ranks' experts are dropped
        # first (expert_slice.py); layerwise reload (start_weight_update) processes each module once all
        # its tensors arrived. The next bucket arrives meanwhile (prefetch).
        local = local_experts(self.model)
        installed = 0

        def load(bucket) -> None:
            nonlocal installed
            self.model.load_weights(keep_local(bucket, local))
            installed += 1

        try:
            announced = self.stage.announced(update_info.version)
            self.loaded_version = self.stage.pull(announced, load)
        except (BroadcastClosed, BroadcastInterrupted) as err:
            # The run is stopping, or the trainer's sender died (it restarts alone) after admin.py checked
            # the status: the update will never come. Raising here would kill the engine (a failed worker RPC
            # is fatal to vLLM) and the supervisor would restart the server: a full model load. With nothing
            # installed, finish_weight_update puts the old tensors back; with some, the weights are a mix
            # and stay marked so until a whole update. loaded_version, still the last whole step, with the
            # status's closed/lost/mixed, tells admin.py the load did not happen (409).
            if installed:
                why = "the run stops" if isinstance(err, BroadcastClosed) else "the trainer's weight sender went away"
                self.mixed = (f"the update to step {announced.step} stopped after {installed} bucket(s) were "
                              f"installed ({why}); the rest of the model is step {self.loaded_version}")
                log.warning("the served weights are a mix of two policies (%s); serving nothing until a whole "
                            "update", self.mixed)
            return
        if self.mixed is not None:  # a whole step: every piece of the mix was replaced
            log.warning("the weights of step %d are whole: serving again", self.loaded_version)
            self.mixed = None

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        torch.accelerator.synchronize()

    def shutdown(self) -> None:
        # The receiving thread is a daemon polling the group's store; it ends with the process. The sender
        # sees this worker's beat stop and leaves it out of the next group generation (membership.py).
        self.stage = None
