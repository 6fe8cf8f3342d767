"""P/D inside the engine: a prompt prefilled on one server and continued on another (disaggregation.py).

`Prefilled` is what crosses between the two engines (kv_transfer.py sends it over ZMQ): the prompt's
K and V, the logits of its last position and the policy version that computed them. A prefill engine
copies them out of the prompt's cache slot (`export_slot`); a decode engine copies them into a slot of
its own (`install_slot`) and samples the first token from the shipped logits, as its own prefill would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCache


@dataclass
class Prefilled:
    """A prompt prefilled elsewhere (P/D): what a decode server needs to continue it."""

    prompt_ids: list[int]
    k: torch.Tensor  # [layers, kv_heads, T, head_dim]
    v: torch.Tensor
    logits: torch.Tensor  # [vocab] fp32, at the prompt's last position
    version: int  # policy version of the weights that computed k, v and logits
    routed: torch.Tensor | None = None  # [T, moe_layer, top_k] the prompt's experts, when asked for


def export_slot(cache: KVCache, slot: int, length: int, logits: torch.Tensor, prompt_ids: list[int], version: int,
                with_routes: bool) -> Prefilled:
    """The first `length` positions of `slot` (copied: the slot is released next), with the prompt's last
    logits; its routes too when the request asked for routed experts and the cache records them."""
    k = torch.stack([layer[slot, :, :length] for layer in cache.k])
    v = torch.stack([layer[slot, :, :length] for layer in cache.v])
    routes = None  # [T, moe_layer, top_k]: the slot's rows, as the decode server stores them
    if with_routes and cache.routes is not None:
        routes = cache.routes[slot, :length].clone()
    return Prefilled(list(prompt_ids), k, v, logits.float().clone(), version, routes)


def install_slot(cache: KVCache, slot: int, shipped: Prefilled, device: torch.device, dtype: torch.dtype) -> None:
    """Write a shipped prompt's K, V (and routes) into the first positions of `slot`."""
    length = len(shipped.prompt_ids)
    for layer in range(len(cache.k)):
        cache.k[layer][slot, :, :length] = shipped.k[layer].to(device, dtype)
        cache.v[layer][slot, :, :length] = shipped.v[layer].to(device, dtype)
    if shipped.routed is not None and cache.routes is not None:
        cache.routes[slot, :length] = shipped.routed.to(device, cache.routes.dtype)
