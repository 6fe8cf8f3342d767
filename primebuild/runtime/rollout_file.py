"""The rollout batch's file: the hand-off from the orchestrator (writes) to the trainer (reads).

The records inside are primebuild/contracts/rollout.py; this module is their on-disk form, kept apart
from both sides so that neither imports the other.

- Steps are 1-based. ``rollouts/step_{k:06d}.pt`` is the batch that the trainer's k-th optimizer step
  trains on; after it the trainer publishes ``weights/step_{k:06d}/`` (the policy after k optimizer steps,
  so the base model is policy version 0).
- The orchestrator writes the file with :func:`save_batch` (temp file + ``os.replace``), so a reader never
  sees a partial file. The payload is plain Python data (dicts, lists, numbers, strings) and loads with
  ``torch.load(weights_only=True)``: no pickled classes cross the process boundary.
- Advantages are computed by the orchestrator (primebuild/runtime/orchestrator/advantages.py); the trainer only
  consumes them.
- With router replay, a sample carries ``routed_experts``: one uint8 (uint16 above 256 experts) tensor
  [fed positions, moe_layers, top_k] -- the experts inference routed each position fed through the
  model to, prompt + completion - 1 positions (primebuild/kernels/routing.py). How the trainer packs them into
  micro-batches: primebuild/runtime/trainer/batch.py.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from primebuild.contracts.base import parse_contract
from primebuild.contracts.rollout import RolloutBatch, Sample
from primebuild.errors import UserError

BATCH_FORMAT_VERSION = 1


def save_batch(path: str | os.PathLike, batch: RolloutBatch) -> None:
    """Write atomically: a reader sees either no file or the whole file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": BATCH_FORMAT_VERSION,
        "step": int(batch.step),
        "metadata": batch.model_dump(include=set(_METADATA)),
        "samples": [s.model_dump() for s in batch.samples],
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def unfinished_writes(folder: str | os.PathLike) -> list[Path]:
    """Temporary files of ``save_batch`` calls that a kill cut short (never read: the batch is written
    again). Only meaningful while no orchestrator runs."""
    folder = Path(folder)
    return sorted(folder.glob(".step_*.pt.*.tmp")) if folder.is_dir() else []


# RolloutBatch fields kept under "metadata" in the file; keys of older writers that nothing reads
# (max_completion_tokens, groups) are skipped, so their files still load.
_METADATA = ("temperature", "next_group")


def load_batch(path: str | os.PathLike) -> RolloutBatch:
    payload = torch.load(path, weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != BATCH_FORMAT_VERSION:
        raise UserError(
            f"{path}: not a primebuild rollout batch of format {BATCH_FORMAT_VERSION}",
            hint="write batches with primebuild.runtime.rollout_file.save_batch",
        )
    metadata = {k: v for k, v in payload["metadata"].items() if k in _METADATA}
    batch = parse_contract(RolloutBatch, {"step": payload["step"], "samples": payload["samples"], **metadata},
                           where=str(path))
    for i, s in enumerate(batch.samples):
        s.validate_shapes(f"{path}: samples[{i}]")
    return batch


def routing_bytes(samples: list[Sample]) -> dict[str, float]:
    """Bytes of routing data the batch carries per token (router replay), {} without any."""
    carried = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not carried:
        return {}
    tokens = sum(s.num_tokens for s in samples)
    return {"routing_bytes_per_token": sum(r.numel() * r.element_size() for r in carried) / tokens}
