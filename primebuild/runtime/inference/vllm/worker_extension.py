"""Our vLLM worker extension (``--worker-extension-cls``): what we add to every vLLM worker.

Importing this module registers our broadcast weight-transfer engine with vLLM's factory under
``primebuild_broadcast``; vLLM imports the extension in each worker before it loads the model and
builds the engine named by ``--weight-transfer-config``, which is the one hook where a third-party
engine can be registered without installing a package (vLLM's plugin entry points would need one).
The extension's own method is a status read-out, called on every worker of every engine core through
``POST /primebuild/broadcast_status`` (broadcast_status.py); weight updates themselves go through
vLLM's own endpoints. Runs inside vLLM's worker process.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer import WeightTransferEngineFactory

BROADCAST_BACKEND = "primebuild_broadcast"

if BROADCAST_BACKEND not in WeightTransferEngineFactory._registry:  # a re-import must not fail
    WeightTransferEngineFactory.register_engine(
        BROADCAST_BACKEND, "primebuild.runtime.inference.vllm.broadcast_engine", "BroadcastWeightTransferEngine")


class PrimebuildWorkerExtension:
    """Mixed into vLLM's worker class; names carry our prefix so they cannot clash with vLLM's."""

    def primebuild_broadcast_status(self) -> dict[str, Any]:
        """{"joined", "rank", "received_version", "loaded_version", "error", "closed", "lost", "mixed"} of this
        worker's receiver (broadcast_engine.BroadcastWeightTransferEngine.status)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "status"):
            return {"joined": False, "rank": None, "received_version": 0, "loaded_version": None,
                    "error": "no primebuild_broadcast engine configured", "mixed": None}
        return engine.status()
