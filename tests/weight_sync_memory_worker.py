"""One rank of a bucketed weight broadcast: how much host memory a receiver adds while it takes an update
(peak RSS above the RSS before, the kernel's high-water mark reset just before; as sharded_load_worker.py).

    python tests/weight_sync_memory_worker.py MODEL INIT_METHOD WORLD RANK MODE BUCKET_MB OUT_DIR

Rank 0 sends MODEL's safetensors (fp32) twice, as steps 1 and 2 (step 2: every weight + 1/64, exact in
fp32), then closes. A receiver (MODE):
  copy    copies each bucket into a served copy of the model allocated up front (a loader that keeps its
          TP slice does no more), with prefetch: the next bucket arrives while one is copied;
  engine  the embedded engine's update in place (Engine.update_weights_in_place), without prefetch.
Each receiver checks that it ends with step 2's weights and writes OUT_DIR/rank{r}.json with the peaks of
both updates (the first warms gloo's buffers up: the second is the steady state).
"""

from __future__ import annotations

import gc
import json
import re
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def _status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"(VmRSS|VmHWM):\s+(\d+) kB", text)}


def peak_above_now(action):
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status()["VmRSS"]
    result = action()
    return result, _status()["VmHWM"] - before


def steps(model: Path) -> list[dict[str, torch.Tensor]]:
    first = load_file(model / "model.safetensors")
    return [first, {k: v + 1 / 64 for k, v in first.items()}]


def send(model: Path, init: str, world: int, bucket_mb: float) -> dict:
    from primebuild.runtime.weight_sync.broadcast import BroadcastSender

    sender = BroadcastSender(init, world, timeout_s=120, bucket_mb=bucket_mb)
    stats = [sender.send(state, step) for step, state in enumerate(steps(model), start=1)]
    sender.close()
    return {"buckets": stats[-1].buckets, "transfer_s": [s.transfer_s for s in stats]}


def receive_copy(model: Path, init: str, world: int, rank: int) -> dict:
    from primebuild.runtime.weight_sync.broadcast import BroadcastReceiver
    from primebuild.runtime.weight_sync.buckets import offsets

    served = {k: v.clone() for k, v in load_file(model / "model.safetensors").items()}
    receiver = BroadcastReceiver(init, world, rank, timeout_s=120)

    def load(bucket):
        for name, tensor in bucket:
            served[name].copy_(tensor)

    peaks, largest = [], 0
    while (announced := receiver.announcement()) is not None:
        largest = max(offsets(specs)[1] for specs in announced.bucket_specs())
        peaks.append(peak_above_now(lambda a=announced: receiver.pull(a, load, prefetch=True))[1])
    want = steps(model)[-1]
    same = all(torch.equal(served[k], v) for k, v in want.items())
    return {"peaks": peaks, "largest_bucket": largest, "weights_equal": same}


def receive_engine(model: Path, init: str, world: int, rank: int) -> dict:
    from primebuild.runtime.inference.engine import Engine
    from primebuild.runtime.inference.weight_receiver import BroadcastStage
    from primebuild.runtime.inference.weights import load_weights
    from primebuild.runtime.weight_sync.buckets import offsets

    engine = Engine(model, device="cpu", max_num_seqs=1, max_model_len=64)
    stage = BroadcastStage(init, rank, world, timeout_s=120)
    peaks, largest = [], 0
    for version in (1, 2):
        while stage.received_version < version:
            time.sleep(0.01)
        announced = stage.announced(version)
        largest = max(offsets(specs)[1] for specs in announced.bucket_specs())
        _, peak = peak_above_now(lambda a=announced: engine.update_weights_in_place(
            [s.name for s in a.specs], lambda add: stage.pull(a, add, prefetch=False)))
        peaks.append(peak)
    want = load_weights(steps(model)[-1], engine.config, engine.dtype, "cpu")
    got = engine.forward.weights
    same = engine.version == 2 and torch.equal(got.embed, want.embed) and torch.equal(
        got.lm_head.weight, want.lm_head.weight) and all(
        torch.equal(a.weight, b.weight) for x, y in zip(got.layers, want.layers, strict=True)
        for a, b in zip(x.dense(), y.dense(), strict=True))
    engine.shutdown()
    return {"peaks": peaks, "largest_bucket": largest, "weights_equal": same}


def main(model: str, init: str, world: str, rank: str, mode: str, bucket_mb: str, out: str) -> None:
    torch.set_num_threads(1)
    model_path, world_size, r = Path(model), int(world), int(rank)
    if r == 0:
        report = send(model_path, init, world_size, float(bucket_mb))
    elif mode == "copy":
        report = receive_copy(model_path, init, world_size, r)
    else:
        report = receive_engine(model_path, init, world_size, r)
    (Path(out) / f"rank{r}.json").write_text(json.dumps({"rank": r, "mode": mode, **report}))


if __name__ == "__main__":
    main(*sys.argv[1:8])
