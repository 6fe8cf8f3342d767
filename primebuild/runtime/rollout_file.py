"""The rollout batch's file: the hand-off from the orchestrator (writes) to the trainer (reads).

The records inside are primebuild/contracts/rollout.py; this module is their on-disk form, kept apart
from both sides so that neither imports the other.

- Steps are 1-based. ``rollouts/step_{k:06d}.safetensors`` is the batch that the trainer's k-th optimizer
  step trains on; after it the trainer publishes ``weights/step_{k:06d}/`` (the policy after k optimizer
  steps, so the base model is policy version 0).
- The orchestrator writes the file with :func:`save_batch` (temp file + ``os.replace``), so a reader never
  sees a partial file. It is a safetensors file written with numpy: each sample's token ids, log-probs,
  loss mask and routes are arrays (``samples.{i}.{field}``), its scalars and the batch's fields JSON in
  the header. No pickle crosses the process boundary, and the orchestrator needs no torch to write it.
- Advantages are computed by the orchestrator (primebuild/runtime/orchestrator/advantages.py); the trainer only
  consumes them.
- With router replay, a sample carries ``routed_experts``: one uint8 (uint16 above 256 experts) array
  [fed positions, moe_layers, top_k] -- the experts inference routed each position fed through the
  model to, prompt + completion - 1 positions (primebuild/kernels/routing.py). How the trainer packs them into
  micro-batches: primebuild/runtime/trainer/batch.py.
- With on-policy distillation, a sample carries ``teacher_logprobs`` (float64, one per completion token,
  like ``inference_logprobs``): the teacher's log-probs of the sampled tokens (trainer/distill.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from primebuild.contracts.base import parse_contract
from primebuild.contracts.rollout import RolloutBatch, Sample
from primebuild.errors import UserError

BATCH_FORMAT_VERSION = 2
SUFFIX = ".safetensors"
LEGACY_SUFFIX = ".pt"  # format 1, still read
_HEADER_KEY = "primebuild_rollout_batch"
# Sample fields stored as arrays (the rest go to the JSON header), with their on-disk dtype.
_ARRAYS = {"prompt_ids": np.int64, "completion_ids": np.int64, "inference_logprobs": np.float64,
           "completion_mask": np.uint8, "teacher_logprobs": np.float64,
           "routed_experts": None}  # routes keep their own integer dtype


def save_batch(path: str | os.PathLike, batch: RolloutBatch) -> None:
    """Write atomically: a reader sees either no file or the whole file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays, samples = {}, []
    for i, sample in enumerate(batch.samples):
        fields = sample.model_dump(exclude=set(_ARRAYS))
        for name, dtype in _ARRAYS.items():
            value = getattr(sample, name)
            if value is not None:
                arrays[f"samples.{i}.{name}"] = np.ascontiguousarray(np.asarray(value, dtype=dtype))
        samples.append(fields)
    header = {"format": BATCH_FORMAT_VERSION, "step": int(batch.step),
              "metadata": batch.model_dump(include=set(_METADATA)), "samples": samples}
    payload = save(arrays, metadata={_HEADER_KEY: json.dumps(header)})
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
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
    return sorted(folder.glob(f".step_*{SUFFIX}.*.tmp")) if folder.is_dir() else []


# RolloutBatch fields kept under "metadata" in the file.
_METADATA = ("temperature", "next_group")


def load_batch(path: str | os.PathLike) -> RolloutBatch:
    if Path(path).suffix == LEGACY_SUFFIX:
        return _parse(path, _load_format_1(path))
    not_a_batch = UserError(f"{path}: not a primebuild rollout batch of format {BATCH_FORMAT_VERSION}",
                            hint="write batches with primebuild.runtime.rollout_file.save_batch")
    try:
        with safe_open(str(path), framework="numpy") as f:
            header = json.loads((f.metadata() or {}).get(_HEADER_KEY, "null"))
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, json.JSONDecodeError):
        raise not_a_batch from None
    if not isinstance(header, dict) or header.get("format") != BATCH_FORMAT_VERSION:
        raise not_a_batch
    samples = []
    for i, fields in enumerate(header["samples"]):
        for name in _ARRAYS:
            array = arrays.get(f"samples.{i}.{name}")
            if array is not None:  # ids, log-probs and masks as the contract's lists; routes stay an array
                fields[name] = array if name == "routed_experts" else array.tolist()
        samples.append(fields)
    return _parse(path, {**header, "samples": samples})


def _load_format_1(path: str | os.PathLike) -> dict:
    """A batch written before format 2: torch.save of plain data (run folders started by older code)."""
    import torch

    payload = torch.load(path, weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != 1:
        raise UserError(f"{path}: not a primebuild rollout batch", hint="write batches with save_batch")
    for sample in payload["samples"]:
        if sample.get("routed_experts") is not None:
            sample["routed_experts"] = sample["routed_experts"].numpy()
    return payload


def _parse(path: str | os.PathLike, payload: dict) -> RolloutBatch:
    # metadata keys of older writers that nothing reads (max_completion_tokens, groups) are skipped
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
    return {"routing_bytes_per_token": sum(np.asarray(r).nbytes for r in carried) / tokens}
