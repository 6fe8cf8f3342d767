"""Slot-based KV cache: one preallocated row per running sequence, kept packed at slots 0..n-1.

Why slots and not pages: on CPU there is no paged-attention kernel, and gathering pages into a
contiguous block every decode step costs as much as the attention itself. With packed slots the decode
step attends over a plain view `k[:n, :, :max_len]`. When a sequence leaves, the last one moves into its
slot (one copy of its prefix), so the running batch stays contiguous.

The time axis grows by doubling up to `max_model_len`, so a server configured for long contexts holds
memory in proportion to the longest sequence actually seen, not to the worst case.

An MoE model's cache also keeps, per slot and position, the experts each MoE layer routed that position
to (`routes`, [slots, positions, moe_layers, top_k], uint8 up to 256 experts): written by the forward
pass with one indexed store per step, moved with the K/V rows, read once when a sequence finishes
(primebuild/kernels/routing.py has the layout). Routes are no per-token Python objects.
"""

from __future__ import annotations

import torch

from .model_config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        max_seqs: int,
        max_len: int,
        dtype: torch.dtype,
        device,
        initial_len: int = 256,
    ):
        self.max_seqs = max_seqs
        self.max_len = max_len
        self._shape = (max_seqs, config.num_kv_heads, 0, config.head_dim)
        self._layers = config.num_layers
        self._dtype = dtype
        self._device = device
        moe_layers = sum(config.sparse_layers) if config.is_moe else 0
        self._routes_shape = (max_seqs, 0, moe_layers, config.num_experts_per_tok) if moe_layers else None
        # uint8 up to 256 experts; int32 above (torch's uint16 lacks the indexed stores used here)
        self._routes_dtype = torch.uint8 if config.num_experts <= 256 else torch.int32
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.routes: torch.Tensor | None = None
        self.ensure(min(initial_len, max_len))

    def _alloc(self, length: int) -> list[torch.Tensor]:
        seqs, heads, _, dim = self._shape
        # Zeros, not empty: masked attention multiplies unused V entries by 0, and 0 * NaN is NaN.
        return [
            torch.zeros(seqs, heads, length, dim, dtype=self._dtype, device=self._device)
            for _ in range(self._layers)
        ]

    def ensure(self, length: int) -> None:
        """Make room for `length` positions per slot (copying what is cached when growing)."""
        if length <= self.capacity:
            return
        new_capacity = min(self.max_len, max(length, 2 * self.capacity))
        new_k, new_v = self._alloc(new_capacity), self._alloc(new_capacity)
        for old, new in zip(self.k + self.v, new_k + new_v, strict=False):  # nothing to copy at first
            new[:, :, : self.capacity] = old
        if self._routes_shape is not None:
            seqs, _, layers, top_k = self._routes_shape
            routes = torch.zeros(seqs, new_capacity, layers, top_k, dtype=self._routes_dtype, device=self._device)
            if self.routes is not None:
                routes[:, : self.capacity] = self.routes
            self.routes = routes
        self.k, self.v, self.capacity = new_k, new_v, new_capacity
        # The decode step writes each new K/V row through a flat [slots * heads * capacity, D] view
        # and one precomputed index (one index tensor is cheaper to apply than (slot, :, position)).
        seqs, heads, _, dim = self._shape
        self.k_rows = [t.view(-1, dim) for t in self.k]
        self.v_rows = [t.view(-1, dim) for t in self.v]
        self.head_base = torch.arange(seqs * heads, device=self._device).view(seqs, heads) * new_capacity

    def row_index(self, batch: int, positions: torch.Tensor) -> torch.Tensor:
        """[batch, heads] indices into `k_rows`/`v_rows` of slot b's heads at positions[b]."""
        return torch.add(self.head_base[:batch], positions.view(batch, 1))

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` to slot `dst` (fork n>1, or repack)."""
        for layer in self.k + self.v:
            layer[dst, :, :length] = layer[src, :, :length]
        if self.routes is not None:
            self.routes[dst, :length] = self.routes[src, :length]

    def write_routes(self, slots: torch.Tensor, positions: torch.Tensor | slice, routed: list[torch.Tensor]) -> None:
        """Store the forward's top-k experts ([rows..., top_k] per MoE layer) at (slots, positions)."""
        self.routes[slots, positions] = torch.stack(routed, dim=-2).to(self._routes_dtype)

    def nbytes(self) -> int:
        routes = [] if self.routes is None else [self.routes]
        return sum(t.numel() * t.element_size() for t in self.k + self.v + routes)
