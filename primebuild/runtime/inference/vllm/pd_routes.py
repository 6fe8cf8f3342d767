"""Routed experts across vLLM's prefill/decode halves: what the P/D router asks each half for, and how it
puts their rows together (router replay through P/D; the vLLM side is r3_plugin.py).

A unified server returns, per choice, one row per position fed through the model: the prompt's, then the
completion's but its last token. Through P/D:
- the prefill server (max_tokens 1, n 1) computed the whole prompt: its choice's rows are the prompt's
  (from the client's `routed_experts_prompt_start`, 0 by default);
- the decode server loaded the prompt's KV instead of computing it, so it is asked for rows from
  `routed_experts_prompt_start` = the prompt's length: the completion's, but its last token.
The prompt's rows followed by the completion's, re-encoded as vLLM encodes them (primebuild/kernels/routing.py),
are the bytes a unified server returns for the same greedy prompt.
"""

from __future__ import annotations

import numpy as np

from primebuild.kernels.routing import decode_routes, encode_routes
from primebuild.runtime.inference.protocol import ApiError


def prompt_rows(prefilled: dict) -> list[np.ndarray] | None:
    """Per prompt (the prefill's choice index), its rows; None when the servers return no routes."""
    choices = sorted(prefilled.get("choices", []), key=lambda c: c.get("index", 0))
    if not any(c.get("routed_experts") is not None for c in choices):
        return None
    if any(c.get("routed_experts") is None for c in choices):
        raise ApiError(502, "the prefill server returned routed experts for some prompts only")
    return [decode_routes(c["routed_experts"]) for c in choices]


def decode_start(prefilled: dict, prompts: list[list[int]]) -> int:
    """The decode half's `routed_experts_prompt_start`: the prompt's length. One value per request, so
    the prompts of one request must be equally long."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ApiError(400, "router replay through P/D takes prompts of one length per request (the decode "
                       f"server skips one prompt length of rows); got lengths {sorted(lengths)}: send one "
                       "prompt per request", param="prompt")
    return lengths.pop()


def merge(decoded: dict, rows: list[np.ndarray], n: int) -> dict:
    """The decode server's answer with each choice's routes preceded by its prompt's rows."""
    out = dict(decoded)
    out["choices"] = []
    for choice in decoded.get("choices", []):
        prompt = rows[choice.get("index", 0) // n]
        encoded = choice.get("routed_experts")
        completion = decode_routes(encoded) if encoded is not None else prompt[:0]  # one token: no row
        if completion.shape[1:] != prompt.shape[1:] or completion.dtype != prompt.dtype:
            raise ApiError(502, f"prefill and decode servers' routed experts differ in layout: "
                           f"{prompt.dtype}{list(prompt.shape[1:])} vs {completion.dtype}{list(completion.shape[1:])}")
        out["choices"].append({**choice, "routed_experts": encode_routes(np.concatenate([prompt, completion]))})
    return out
