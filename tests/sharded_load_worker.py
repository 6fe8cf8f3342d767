"""One trainer rank under torchrun: how much host memory loading the model and publishing its weights
(twice) add to the process (peak RSS above the RSS before, the kernel's high-water mark reset just before).

    torchrun --nproc_per_node=N tests/sharded_load_worker.py MODEL WARMUP_MODEL OUT_DIR [EP]

Writes OUT_DIR/rank{r}.json and publishes the loaded weights under OUT_DIR/weights (steps 1 and 2).
Used by tests/test_trainer_sharded_load.py (its numbers are in docs/planning.md, section 7).
A warm-up load of a tiny model first imports and initialises everything the measured load uses, so the
measured peaks are tensors, not code.
"""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

import torch

from primebuild.contracts.trainer import ParallelDims
from primebuild.runtime.trainer.model import init_distributed, load_model
from primebuild.runtime.trainer.parallel_dims import build_meshes
from primebuild.runtime.trainer.weight_stream import LAYER, PublishedWeights
from primebuild.runtime.weight_sync.filesystem import publish_hf_weights


def _status() -> dict[str, int]:
    return {k: int(v) * 1024 for k, v in re.findall(r"(VmRSS|VmHWM):\s+(\d+) kB", Path("/proc/self/status").read_text())}


def peak_above_now(action):
    """Run `action`; returns (its result, peak RSS it reached minus the RSS before it)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status()["VmRSS"]
    result = action()
    return result, _status()["VmHWM"] - before


def main(model_path: str, warmup_path: str, out_dir: str, ep: str = "1") -> None:
    torch.set_num_threads(1)
    env = init_distributed()
    meshes = build_meshes(ParallelDims(dp_shard=env.world_size, ep=int(ep)), env.world_size, env.rank, env.device.type)

    def load(path):
        return load_model(path, env, "float32", activation_checkpointing=False, logprob_chunk_tokens=64, meshes=meshes)

    def publish(model, root, step=1):
        weights = PublishedWeights(model.hf, torch.float32)
        if env.is_main:
            publish_hf_weights(root, step, weights, model.config)
        else:
            weights.drain()
        return weights

    warm = load(warmup_path)
    publish(warm, Path(out_dir) / "warmup")
    del warm

    model, load_peak = peak_above_now(lambda: load(model_path))
    weights, publish_peak = peak_above_now(lambda: publish(model, Path(out_dir) / "weights"))
    _, publish_again_peak = peak_above_now(lambda: publish(model, Path(out_dir) / "weights", step=2))
    groups: dict[str, int] = {}
    for spec in weights.layout:
        m = LAYER.match(spec.name)
        groups[m.group(1) if m else spec.name] = groups.get(m.group(1) if m else spec.name, 0) + spec.nbytes
    shards = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())
    report = {"rank": env.rank, "world_size": env.world_size, "load_peak": load_peak, "publish_peak": publish_peak,
              "publish_again_peak": publish_again_peak,
              "shard_bytes": shards, "largest_group_bytes": max(groups.values()),
              "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    (Path(out_dir) / f"rank{env.rank}.json").write_text(json.dumps(report))
    if env.distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
