"""The KV files of vLLM's ExampleConnector, which the P/D router deletes once no request needs them.

ExampleConnector (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py, vLLM 0.32) keeps a
prompt's KV as one safetensors file per layer in a folder of the servers' shared storage, named by the
md5 of the prompt's token ids (int64 bytes) cut to whole blocks. Facts read from its source:
- a server stores a prompt it computes under `ids[:align(len)]` and looks one up under
  `ids[:align(len - 1)]`, with align(n) = (n - 1) // block * block: a prompt moves its whole blocks
  except the last token's (44 tokens and blocks of 32: 32 move), and names can differ by one block;
- every server role stores and looks up (a consumer stores what it had to compute; a producer loads a
  file that exists), a file is written only when its folder is missing, and nothing is ever deleted.

So the folders are refcounted by the requests in flight that may read them. A folder nobody holds is
deleted only when no prefill is in flight either: a prefill server may be writing any folder, and a
folder removed under it would fail its write (and a failed worker call ends a vLLM server).
"""

from __future__ import annotations

import hashlib
import shutil
import struct
from collections import Counter
from pathlib import Path


def _align(n: int, block: int) -> int:
    return (n - 1) // block * block


def _folder(ids: list[int]) -> str:
    return hashlib.md5(struct.pack(f"<{len(ids)}q", *ids), usedforsecurity=False).hexdigest()


def folder_names(prompt_token_ids: list[int], block_size: int) -> set[str]:
    """The folders a prompt's KV is stored under and looked up in."""
    n = len(prompt_token_ids)
    return {_folder(prompt_token_ids[:_align(n, block_size)]), _folder(prompt_token_ids[:_align(n - 1, block_size)])}


class KvFiles:
    """One shared storage folder; single-threaded (the router's event loop)."""

    def __init__(self, root: str | Path, block_size: int):
        self.root = Path(root)
        self.block_size = block_size
        self.holders: Counter[str] = Counter()
        self.unheld: set[str] = set()
        self.writers = 0  # prefills in flight
        self.deleted = 0  # folders removed (a metric)

    def names(self, prompts: list[list[int]]) -> set[str]:
        return set().union(*(folder_names(p, self.block_size) for p in prompts)) if prompts else set()

    def hold(self, names: set[str]) -> None:
        self.holders.update(names)

    def release(self, names: set[str]) -> None:
        self.holders.subtract(names)
        self.unheld |= {n for n in names if self.holders[n] <= 0}
        self.flush()

    def begin_write(self) -> None:
        self.writers += 1

    def end_write(self) -> None:
        self.writers -= 1
        self.flush()

    def flush(self) -> None:
        if self.writers:
            return
        for name in self.unheld:
            if self.holders[name] <= 0:
                del self.holders[name]
                self._remove(self.root / name)
        self.unheld.clear()

    def wipe(self) -> None:
        """Every folder, held or not: KV of weights that are no longer served (call while the servers
        are paused, so that none is reading or writing)."""
        if self.root.is_dir():
            for folder in self.root.iterdir():
                self._remove(folder)

    def folders(self) -> int:
        return sum(1 for _ in self.root.iterdir()) if self.root.is_dir() else 0

    def _remove(self, folder: Path) -> None:
        if folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            self.deleted += 1
