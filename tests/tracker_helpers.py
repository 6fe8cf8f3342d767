"""Read experiment-tracker files back with the trackers' own formats, for comparison with metrics.jsonl.

wandb (0.31) no longer ships a Python reader for its offline `.wandb` files: the format is a
`:W&B` header (4 bytes), a 2-byte magic and a version byte, then LevelDB's log format (32 KiB blocks,
records of crc32 (4) + length (2, little-endian) + type (1: full, 2: first, 3: middle, 4: last)), each
payload one `wandb.proto.wandb_internal_pb2.Record`. History rows are `Record.history`.
"""

from __future__ import annotations

import json
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the rest of a block too short for a record header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0:
            break
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(path: Path) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of a wandb run file's history rows."""
    rows: dict[int, dict[str, float]] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    rows.setdefault(step, {})[key] = json.loads(item.value_json)
    return rows


def tensorboard_scalars(folder: Path) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} from every event file in `folder`, read by TensorBoard's own loader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    rows: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["tensors"]:
        for event in events.Tensors(tag):
            rows.setdefault(event.step, {})[tag] = float(tensor_util.make_ndarray(event.tensor_proto))
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            rows.setdefault(event.step, {})[tag] = event.value
    return rows


def jsonl_metrics(path: Path, role: str) -> dict[int, dict[str, float]]:
    """{step: {name: value}} of one role in metrics.jsonl, finite values only (the sinks skip the rest)."""
    rows: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["role"] == role and record["value"] is not None:
            rows.setdefault(record["step"], {})[record["name"]] = record["value"]
    return rows
