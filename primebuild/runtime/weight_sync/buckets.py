"""How one weight update is cut into broadcast buckets; the sender decides, the metadata carries the cut.

A bucket is what a receiving worker stages at once, so its size bounds the receiver's memory, not the
model's. Whole decoder layers stay together while they fit: a receiver can then finish a layer inside one
bucket (the embedded engine fuses q/k/v and folds norms per layer; vLLM's layerwise reload processes a
module once all its tensors arrived, holding the ones before). A layer bigger than a bucket is cut between
tensors, and a tensor bigger than a bucket is a bucket of its own: loaders take whole tensors only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .stream import TensorSpec

# A decoder layer's names, the trainer's publishing groups (primebuild/runtime/trainer/sharded_load.py
# LAYER is the same rule): `model.layers.7.mlp.down_proj.weight` -> `model.layers.7`.
LAYER = re.compile(r"^((?:.*\.)?layers\.\d+)\.")
# Every tensor starts at a multiple of this in its bucket, so a receiver views each tensor in the bucket's
# bytes (no copy) whatever its dtype; 64 is also a cache line.
ALIGN = 64
# A tensor of at least this many bytes crosses the wire as a message of its own, straight from the sender's
# memory (no packing copy); smaller neighbours are packed into one message (one round of per-message
# overhead for a layer's norms and biases, not one each).
DIRECT_BYTES = 1 << 20


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def group_of(name: str) -> str:
    m = LAYER.match(name)
    return m.group(1) if m else name


def bucket_counts(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[int]:
    """Tensors per bucket, in layout order (see the module's docstring for the rule)."""
    groups: list[list[int]] = []  # aligned sizes of each group's tensors
    last = None
    for spec in specs:
        key = group_of(spec.name)
        if key != last:
            groups.append([])
            last = key
        groups[-1].append(aligned(spec.nbytes))
    counts: list[int] = []
    count = filled = 0

    def close() -> None:
        nonlocal count, filled
        if count:
            counts.append(count)
        count = filled = 0

    for sizes in groups:
        if filled + sum(sizes) <= bucket_bytes:  # the whole group joins the open bucket
            count, filled = count + len(sizes), filled + sum(sizes)
            continue
        close()
        if sum(sizes) <= bucket_bytes:
            count, filled = len(sizes), sum(sizes)
            continue
        for size in sizes:  # a group bigger than a bucket: cut between its tensors
            if count and filled + size > bucket_bytes:
                close()
            count, filled = count + 1, filled + size
        close()
    close()
    return counts


def offsets(specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
    """Each tensor's byte offset in its bucket, and the bucket's size."""
    out, at = [], 0
    for spec in specs:
        out.append(at)
        at += aligned(spec.nbytes)
    return out, at


def bucket_sizes(specs: Sequence[TensorSpec], counts: Sequence[int]) -> list[int]:
    """The bytes of each bucket of a cut (`bucket_counts`)."""
    sizes, at = [], 0
    for count in counts:
        sizes.append(offsets(specs[at : at + count])[1])
        at += count
    return sizes


def messages(specs: Sequence[TensorSpec], direct_bytes: int = DIRECT_BYTES) -> list[tuple[int, int, int, int, bool]]:
    """How one bucket crosses the wire: (first tensor, end tensor, first byte, end byte, direct) per message,
    in order, over the bucket's layout (`offsets`). A tensor of `direct_bytes` or more is a message of its
    own (direct: sent from where it is, its padding not sent); a run of smaller ones is one message, packed
    by the sender. Both ends compute this from the announced specs, so it never travels."""
    where, size = offsets(specs)
    out: list[tuple[int, int, int, int, bool]] = []
    run = None  # the open run of small tensors: its first tensor
    for i, spec in enumerate(specs):
        if spec.nbytes >= direct_bytes:
            if run is not None:
                out.append((run, i, where[run], where[i], False))
                run = None
            out.append((i, i + 1, where[i], where[i] + spec.nbytes, True))
        elif run is None:
            run = i
    if run is not None:
        out.append((run, len(specs), where[run], size, False))
    return out
