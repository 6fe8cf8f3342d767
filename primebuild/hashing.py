"""The one canonical JSON and the hashes built on it (plans, locks, manifests, store keys).

Canonical: sorted keys, no spaces, UTF-8 as is, NaN refused. Two values that are equal as JSON give
the same string, on any machine and in any Python process.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_READ_CHUNK = 1 << 20


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_json(value: object) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_bytes(value: object) -> bytes:
    """canonical_json as UTF-8 bytes (what files and blobs are written with)."""
    return canonical_json(value).encode()
