"""Routed experts of an MoE forward: the one layout inference, orchestrator and trainer share.

Layout: an integer array ``[positions, layers, top_k]`` of expert ids, for every position fed through the
model (the prompt, then the completion without its last token, which no forward ever sees), dtype
``uint8`` while expert ids fit (<= 256 experts) and ``uint16`` above. That is what vLLM's
``--enable-return-routed-experts`` records, and both engines put it on the wire the way vLLM does: the
bytes of a ``.npy`` file, base64-encoded, in a choice's ``routed_experts`` field, with the layer axis
holding *every* decoder layer (a dense layer's rows are zeros). The orchestrator keeps the MoE layers
only (``select_moe_layers``) and carries ``[positions, moe_layers, top_k]`` in the rollout batch as a
tensor: one byte per expert choice for up to 256 experts (the tiny MoE: 2 layers x top-2 = 4 bytes per
token; GLM-5: 75 MoE layers x top-8 = 600 bytes per token).

No torch here: the orchestrator decodes with numpy alone.
"""

from __future__ import annotations

import base64
import io

import numpy as np

UINT8_MAX_EXPERTS = 256


def routes_dtype(num_experts: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every expert id (vLLM's choice as well)."""
    if num_experts <= UINT8_MAX_EXPERTS:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    raise ValueError(f"{num_experts} experts do not fit the uint16 routing layout")


def encode_routes(routes: np.ndarray) -> str:
    """[positions, layers, top_k] -> base64 of its .npy bytes (the wire form of ``routed_experts``)."""
    if routes.ndim != 3:
        raise ValueError(f"routed experts: expected [positions, layers, top_k], got shape {routes.shape}")
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(routes), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_routes(encoded: str) -> np.ndarray:
    """Inverse of ``encode_routes``; refuses anything but a 3-D unsigned-integer array."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (ValueError, OSError) as err:
        raise ValueError(f"routed_experts is not a base64 .npy array: {err}") from None
    if array.ndim != 3 or array.dtype.kind != "u":
        raise ValueError(f"routed_experts: expected a [positions, layers, top_k] unsigned array, got "
                         f"{array.dtype} of shape {array.shape}")
    return array


def select_moe_layers(routes: np.ndarray, moe_layers: list[int]) -> np.ndarray:
    """Keep the MoE layers' columns of a [positions, decoder_layers, top_k] array (contiguous)."""
    if moe_layers and max(moe_layers) >= routes.shape[1]:
        raise ValueError(f"routed_experts has {routes.shape[1]} layers; MoE layer {max(moe_layers)} is not among them")
    return np.ascontiguousarray(routes[:, moe_layers, :])


def sample_routes(encoded: str | None, moe_layers: list[int], prompt_len: int, completion_len: int) -> np.ndarray:
    """One choice's ``routed_experts`` as the rollout batch carries it: [fed positions, moe_layers, top_k],
    checked to cover every position fed through the model (prompt + completion - 1)."""
    if encoded is None:
        raise ValueError("the server returned no routed_experts (router replay needs them: embedded engine, or "
                         "vLLM started with --enable-return-routed-experts)")
    routes = select_moe_layers(decode_routes(encoded), moe_layers)
    fed = prompt_len + completion_len - 1
    if routes.shape[0] != fed:
        raise ValueError(f"routed_experts has {routes.shape[0]} positions for {fed} fed tokens "
                         f"({prompt_len} prompt + {completion_len} completion - 1)")
    return routes
