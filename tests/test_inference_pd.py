"""Prefill/decode disaggregation of the embedded engine: a prefill server, a decode server and the router
(primebuild/runtime/inference/router.py) on real uvicorn servers, KV caches shipped over ZMQ on loopback, against
a unified server over the same weights.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import torch
from conftest import free_port
from inference_helpers import ADMIN_TOKEN, VOCAB, running_server, save_model

from primebuild.contracts.router import DecodeServer, RouterConfig
from primebuild.runtime.inference.disaggregation import Disaggregation
from primebuild.runtime.inference.engine import Engine
from primebuild.runtime.inference.router import create_router
from primebuild.runtime.inference.server import create_app
from primebuild.runtime.inference.tokenizer import ServedTokenizer

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _server(folder, role=None, inbox=None):
    tokenizer = ServedTokenizer(folder)
    engine = Engine(folder, device="cpu", max_num_seqs=64, max_model_len=256, eos_token_ids=tokenizer.eos_token_ids,
                    detokenize=tokenizer.decode)
    pd = Disaggregation(role, inbox) if role else None
    return engine, create_app(engine, tokenizer, served_model_name="tiny", admin_token=ADMIN_TOKEN, pd=pd)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    folder = save_model(tmp_path_factory.mktemp("pd"), "dense", seed=0)
    inbox = f"tcp://127.0.0.1:{free_port()}"
    unified, unified_app = _server(folder)
    prefill, prefill_app = _server(folder, "prefill")
    decode, decode_app = _server(folder, "decode", inbox)
    engines = (unified, prefill, decode)
    try:
        with running_server(unified_app) as unified_url, running_server(prefill_app) as prefill_url, \
                running_server(decode_app) as decode_url:
            config = RouterConfig(served_model_name="tiny", port=1, prefill=[prefill_url],
                                  decode=[DecodeServer(url=decode_url, kv_address=inbox)])
            with running_server(create_router(config, ADMIN_TOKEN)) as router_url:
                yield {"unified": unified_url, "prefill": prefill_url, "decode": decode_url, "router": router_url,
                       "folder": folder, "engines": engines}
    finally:
        for engine in engines:
            engine.shutdown()


def prompts(count: int) -> list[str]:
    g = torch.Generator().manual_seed(7)
    letters = VOCAB[4:30]
    return ["".join(letters[i] for i in torch.randint(0, len(letters), (int(n),), generator=g))
            for n in torch.randint(3, 40, (count,), generator=g)]


async def _complete_all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(timeout=120) as client:
        answers = await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200][:1]
    return [a.json() for a in answers]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def test_greedy_and_seeded_outputs_equal_the_unified_engine(fleet):
    greedy = [{"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0, "logprobs": 0} for p in prompts(50)]
    seeded = [{"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 11 + i,
               "logprobs": 0} for i, p in enumerate(prompts(6))]
    bytes_before = metric(fleet["decode"], "primebuild_inference_kv_transfer_received_bytes_total")
    tokens_before = metric(fleet["decode"], "primebuild_inference_kv_transfer_received_tokens_total")
    split = asyncio.run(_complete_all(fleet["router"], greedy + seeded))
    whole = asyncio.run(_complete_all(fleet["unified"], greedy + seeded))
    for got, want in zip(split, whole, strict=True):
        assert len(got["choices"]) == len(want["choices"])
        for a, b in zip(got["choices"], want["choices"], strict=True):
            assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
            assert a["prompt_token_ids"] == b["prompt_token_ids"] and a["policy_versions"] == b["policy_versions"]
            assert max(abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"], strict=True)) < 1e-5
    # every prompt's KV crossed, and the bytes per token are the model's KV size: 2 x layers x kv_heads x
    # head_dim x 4 bytes (fp32) = 2 x 2 x 2 x 16 x 4
    kv_bytes = metric(fleet["decode"], "primebuild_inference_kv_transfer_received_bytes_total") - bytes_before
    tokens = metric(fleet["decode"], "primebuild_inference_kv_transfer_received_tokens_total") - tokens_before
    assert tokens == sum(len(s["choices"][0]["prompt_token_ids"]) for s in split)
    assert kv_bytes / tokens == 2 * 2 * 2 * 16 * 4
    assert metric(fleet["router"], "primebuild_router_kv_transfer_bytes_total") >= kv_bytes
    assert metric(fleet["decode"], "primebuild_inference_kv_transfer_installed_total") >= len(greedy) + len(seeded)
    assert metric(fleet["decode"], "primebuild_inference_prefill_steps_total") == 0  # decode never prefilled
    assert metric(fleet["prefill"], "primebuild_inference_generation_tokens_total") == 0  # prefill never sampled


def test_streaming_and_chat_pass_through_the_router(fleet):
    body = {"model": "tiny", "prompt": "stream me", "max_tokens": 10, "temperature": 0}
    whole = httpx.post(fleet["unified"] + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    ids = []
    with httpx.stream("POST", fleet["router"] + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
    assert ids == whole["token_ids"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    a = httpx.post(fleet["router"] + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    b = httpx.post(fleet["unified"] + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    assert a["token_ids"] == b["token_ids"]
    bad = httpx.post(fleet["router"] + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # the prefill server's answer


def test_weight_updates_reach_both_pools_and_stale_kv_is_never_continued(fleet, tmp_path):
    other = save_model(tmp_path / "v1", "dense", seed=1)
    router = fleet["router"]
    assert httpx.post(router + "/pause", json={}).status_code == 401  # admin calls need the run's token
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 8, "temperature": 0}
    before = httpx.post(router + "/v1/completions", json=body, timeout=60).json()["choices"][0]

    # Only the prefill server moves to version 1: its KV must not be continued by the decode server's v0.
    assert httpx.post(fleet["prefill"] + "/update_weights", json={"path": str(other), "version": 1},
                      headers=AUTH, timeout=60).status_code == 200
    assert httpx.get(router + "/health").json()["policy_version"] == 0  # the lowest of the fleet
    stale = metric(fleet["decode"], "primebuild_inference_kv_transfer_stale_total")
    mixed = httpx.post(router + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert metric(fleet["decode"], "primebuild_inference_kv_transfer_stale_total") == stale + 1
    assert mixed["token_ids"] == before["token_ids"] and mixed["policy_version"] == 0  # prefilled on v0 instead

    # The orchestrator's choreography through the router reaches every server.
    for path, payload in (("/pause", {}), ("/update_weights", {"path": str(other), "version": 1}), ("/resume", {})):
        answer = httpx.post(router + path, json=payload, headers=AUTH, timeout=60)
        assert answer.status_code == 200, answer.text
    health = httpx.get(router + "/health").json()
    assert health["policy_version"] == 1 and set(health["policy_versions"].values()) == {1}
    after = httpx.post(router + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert after["policy_version"] == 1 and after["token_ids"] != before["token_ids"]
    assert metric(fleet["decode"], "primebuild_inference_kv_transfer_stale_total") == stale + 1
    # back to the first weights for the other tests of the module
    for path, payload in (("/update_weights", {"path": str(fleet["folder"]), "version": 2}),):
        assert httpx.post(router + path, json=payload, headers=AUTH, timeout=60).status_code == 200


def test_routed_experts_travel_with_the_kv_cache():
    """An MoE prompt prefilled on one server and decoded on another answers with the same routes (prompt
    positions recorded by prefill, shipped with its KV; completion positions recorded by decode) as one
    unified server: greedy, and seeded with n=3 (the shipped routes copied to every sample's slot)."""
    import tempfile
    from pathlib import Path

    from primebuild.kernels.routing import decode_routes

    greedy = [{"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0, "return_routed_experts": True}
              for p in prompts(12)]
    seeded = [{"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 5 + i,
               "return_routed_experts": True} for i, p in enumerate(prompts(16)[12:])]
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_model(Path(tmp), "moe", seed=3)
        inbox = f"tcp://127.0.0.1:{free_port()}"
        servers = [_server(folder), _server(folder, "prefill"), _server(folder, "decode", inbox)]
        try:
            with running_server(servers[0][1]) as unified_url, running_server(servers[1][1]) as prefill_url, \
                    running_server(servers[2][1]) as decode_url:
                config = RouterConfig(served_model_name="tiny", port=1, prefill=[prefill_url],
                                      decode=[DecodeServer(url=decode_url, kv_address=inbox)])
                with running_server(create_router(config, ADMIN_TOKEN)) as router_url:
                    unified = asyncio.run(_complete_all(unified_url, greedy + seeded))
                    split = asyncio.run(_complete_all(router_url, greedy + seeded))
                    # the decode server never ran a prompt through its model: the prompt rows came by ZMQ
                    assert metric(decode_url, "primebuild_inference_prefill_steps_total") == 0
                    assert metric(decode_url, "primebuild_inference_kv_transfer_installed_total") == 16
                    # 1 MoE layer x top-2 x 1 byte per prompt token, beside the KV
                    received = "primebuild_inference_kv_transfer_received"
                    tokens = metric(decode_url, f"{received}_tokens_total")
                    assert metric(decode_url, f"{received}_routes_bytes_total") == 2 * tokens
        finally:
            for engine, _ in servers:
                engine.shutdown()
    for u, s in zip(unified, split, strict=True):
        assert len(s["choices"]) == len(u["choices"])
        for cu, cs in zip(u["choices"], s["choices"], strict=True):
            assert cs["token_ids"] == cu["token_ids"]
            assert cu["routed_experts"] and cs["routed_experts"] == cu["routed_experts"]
            routes = decode_routes(cs["routed_experts"])  # [position, decoder layer, k]
            fed = len(cs["prompt_token_ids"]) + len(cs["token_ids"]) - 1
            assert routes.shape == (fed, 2, 2) and not routes[:, 1].any()  # layer 1 is dense: zeros
            assert len({tuple(r) for r in routes[:, 0].tolist()}) > 1  # the sparse layer really routed


def test_only_the_router_may_send_kv_transfer(fleet, monkeypatch):
    """A client's `kv_transfer.to` made the prefill server push KV to any address (one to a dead address
    held its sender thread, and every transfer behind it, for good), and a client's `kv_transfer.id` held a
    decode server waiting 30 s for KV that never came. Both now need the run's token, which the router sends."""
    import time

    from primebuild.runtime.inference import kv_transfer

    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4}
    nowhere = {"id": "x1", "to": "tcp://127.0.0.1:9"}
    for server, transfer in (("prefill", nowhere), ("decode", {"id": "x2"})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            started = time.monotonic()
            answer = httpx.post(fleet[server] + "/v1/completions", json={**body, "kv_transfer": transfer},
                                headers=headers, timeout=60)
            assert answer.status_code == 401 and time.monotonic() - started < 5, (server, answer.text)
    sent = metric(fleet["prefill"], "primebuild_inference_kv_transfer_sent_total")
    # with the token (the router's), an address nobody listens at fails in bounded time and blocks nothing
    monkeypatch.setattr(kv_transfer, "SEND_TIMEOUT_S", 1.0)
    answer = httpx.post(fleet["prefill"] + "/v1/completions", json={**body, "kv_transfer": nowhere}, headers=AUTH,
                        timeout=60)
    assert answer.status_code == 502 and "KV transfer to tcp://127.0.0.1:9 failed" in answer.text, answer.text
    assert metric(fleet["prefill"], "primebuild_inference_kv_transfer_sent_total") == sent
    routed = httpx.post(fleet["router"] + "/v1/completions", json=body, timeout=60)  # the sender still sends
    assert routed.status_code == 200, routed.text
    assert metric(fleet["prefill"], "primebuild_inference_kv_transfer_sent_total") == sent + 1
