"""Broadcast weight sync into a live server: a real sender (the trainer's BroadcastSender) pushes a new
policy over a gloo group; the server hears it announced and takes it, bucket by bucket, into the served
model when told, then answers with the new log-probs."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import httpx
import pytest
import torch
from conftest import free_port, reap
from inference_helpers import (
    ADMIN_TOKEN,
    Served,
    load_hf,
    running_server,
    save_model,
    teacher_forced_logprobs,
)
from safetensors.torch import load_file


@contextlib.contextmanager
def serve_with_stage(folder, init_method: str, rank: int = 1, world_size: int = 2):
    from primebuild.runtime.inference.engine import Engine
    from primebuild.runtime.inference.server import create_app
    from primebuild.runtime.inference.tokenizer import ServedTokenizer
    from primebuild.runtime.inference.weight_receiver import BroadcastStage

    tokenizer = ServedTokenizer(folder)
    engine = Engine(folder, device="cpu", max_num_seqs=8, max_model_len=256,
                    eos_token_ids=tokenizer.eos_token_ids, detokenize=tokenizer.decode)
    stage = BroadcastStage(init_method, rank=rank, world_size=world_size)
    app = create_app(engine, tokenizer, served_model_name="tiny", admin_token=ADMIN_TOKEN, weight_stage=stage)
    try:
        with running_server(app) as url:
            yield Served(url, engine)
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_broadcast_weights_are_announced_then_loaded_when_told(kind, tmp_path):
    from primebuild.runtime.weight_sync.broadcast import BroadcastSender

    v0, v1 = save_model(tmp_path / "v0", kind, seed=0), save_model(tmp_path / "v1", kind, seed=1)
    state = load_file(v1 / "model.safetensors")
    init = f"tcp://127.0.0.1:{free_port()}"
    senders = []
    # rank 0 hosts the group's store: build the sender in a thread while the server joins as rank 1
    # 50 kB buckets: a decoder layer (~145 kB) arrives cut over several, the server builds it when complete
    thread = threading.Thread(target=lambda: senders.append(BroadcastSender(init, 2, bucket_mb=0.05)), daemon=True)
    thread.start()
    with serve_with_stage(v0, init) as server:
        thread.join(timeout=60)
        (sender,) = senders
        body = {"model": "tiny", "prompt": [1, 11, 8, 15], "max_tokens": 12, "ignore_eos": True, "temperature": 1.0}

        early = server.admin("/update_weights", {"source": "broadcast", "version": 1})
        assert early.status_code == 400 and "no broadcast weights of version 1" in early.json()["error"]["message"]

        # the send returns only once the server took the tensors, inside its update
        sending = threading.Thread(target=sender.send, args=(state, 1), daemon=True)
        sending.start()
        health = httpx.get(server.url + "/health").json()
        for _ in range(200):
            if health["received_version"] == 1:
                break
            health = httpx.get(server.url + "/health").json()
        assert health["received_version"] == 1 and health["policy_version"] == 0  # announced, not yet served
        assert sending.is_alive()  # the sender waits for the server's update

        reply = server.admin("/update_weights", {"source": "broadcast", "version": 1})
        assert reply.status_code == 200, reply.text
        sending.join(timeout=30)
        assert not sending.is_alive() and sender.last.step == 1 and sender.last.buckets > 3
        choice = httpx.post(server.v1 + "/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["policy_version"] == 1
        want = teacher_forced_logprobs(load_hf(v1), choice["prompt_token_ids"], choice["token_ids"])
        assert max(abs(a - b) for a, b in zip(choice["token_logprobs"], want, strict=True)) < 1e-5
        sender.close()


def test_update_without_a_path_or_a_stage_is_a_clean_400(tmp_path):
    from inference_helpers import serve_folder

    with serve_folder(save_model(tmp_path / "v0", "dense", seed=0)) as server:
        no_path = server.admin("/update_weights", {"version": 1})
        assert no_path.status_code == 400 and "path" in no_path.json()["error"]["message"]
        no_stage = server.admin("/update_weights", {"source": "broadcast", "version": 1})
        assert no_stage.status_code == 400 and "without a weight broadcast" in no_stage.json()["error"]["message"]
        assert "received_version" not in httpx.get(server.url + "/health").json()


@pytest.mark.timeout(180)
def test_a_server_restarted_after_the_last_update_never_serves_the_base_weights(tmp_path):
    """Membership under broadcast, the run's tail: two servers took step 1, the trainer closed the broadcast
    (its last update), then one server restarted on the base weights. Nothing will ever send it step 1, so
    the orchestrator keeps it out of sampling (it never becomes active), also when every server was set
    aside at once; the survivor keeps serving step 1."""
    import asyncio
    import types

    from primebuild.contracts.run_dir import RunDir
    from primebuild.runtime.orchestrator.client import InferenceClient
    from primebuild.runtime.orchestrator.main import Orchestrator
    from primebuild.runtime.orchestrator.servers import Server, ServerSet
    from primebuild.runtime.orchestrator.weights import BroadcastWeights
    from primebuild.runtime.weight_sync.broadcast import BroadcastSender

    v0, v1 = save_model(tmp_path / "v0", seed=0), save_model(tmp_path / "v1", seed=1)
    init = f"tcp://127.0.0.1:{free_port()}"
    senders = []
    thread = threading.Thread(target=lambda: senders.append(BroadcastSender(init, 3)), daemon=True)
    thread.start()

    def client(url: str) -> InferenceClient:
        return InferenceClient(url + "/v1", "tiny", admin_token=ADMIN_TOKEN, retry_seconds=2)

    async def scenario(a, b_url) -> Orchestrator:
        orchestrator = Orchestrator.__new__(Orchestrator)  # the sync's state only: no tokenizer or trainer
        orchestrator.cfg = types.SimpleNamespace(weight_broadcast=[])  # embedded servers join on their own
        orchestrator.run_dir = RunDir(tmp_path / "run")
        orchestrator.servers = ServerSet([client(a.url), client(b_url)], orchestrator.run_dir, client, retry_seconds=2)
        orchestrator.weights, orchestrator.sync_lock, orchestrator.server_version = BroadcastWeights(), asyncio.Lock(), 0
        orchestrator.clients = orchestrator.servers.all_clients()
        while await orchestrator.newest_on_active_servers() < 1:  # step 1 announced to both
            await asyncio.sleep(0.05)
        await orchestrator.sync_servers()  # both load it (the sender waits for both)
        assert orchestrator.server_version == 1
        return orchestrator

    with serve_with_stage(v0, init, rank=1, world_size=3) as a:
        with serve_with_stage(v0, init, rank=2, world_size=3) as b:
            thread.join(timeout=60)
            (sender,) = senders
            sending = threading.Thread(target=sender.send, args=(load_file(v1 / "model.safetensors"), 1), daemon=True)
            sending.start()
            loop = asyncio.new_event_loop()
            orchestrator = loop.run_until_complete(scenario(a, b.url))
            sending.join(timeout=30)
            assert sender.last.step == 1
            b_url = b.url
        sender.close()  # the trainer's end: nothing more is announced
        with serve_with_stage(v0, init, rank=2, world_size=3) as restarted:  # the supervisor's restart of b
            assert httpx.get(restarted.url + "/health").json()["policy_version"] == 0

            async def tail():
                servers = orchestrator.servers
                gone = servers.servers.pop(b_url + "/v1")
                await gone.client.close()
                servers.servers[restarted.v1] = Server(restarted.v1, client(restarted.url), state="down")
                servers.servers[restarted.v1].client.fail_fast = True
                for _ in range(3):  # the tending loop's turns: revive, then the sync
                    await servers.revive(orchestrator.server_version, orchestrator.revive_load)
                    await orchestrator.sync_servers()
                assert servers.servers[restarted.v1].state == "down"
                assert {(await servers.pick()).url for _ in range(4)} == {a.v1}
                servers.servers[a.v1].state = "down"  # every server set aside at once (a transient error)
                await orchestrator.sync_servers()
                assert orchestrator.server_version == 1  # not the restarted server's 0
                await servers.revive(orchestrator.server_version, orchestrator.revive_load)
                assert {u: s.state for u, s in servers.servers.items()} == {a.v1: "active", restarted.v1: "down"}
                for c in servers.all_clients():
                    await c.close()

            loop.run_until_complete(tail())
            loop.close()
            body = {"model": "tiny", "prompt": [1, 11, 8], "max_tokens": 4, "temperature": 1.0}
            assert httpx.post(a.v1 + "/completions", json=body, timeout=60).json()["choices"][0]["policy_version"] == 1


async def _the_orchestrator_sets_a_mixed_server_aside(server, tmp_path) -> None:
    """What the orchestrator makes of a server with mixed weights, at policy version 0 (the update to step 1
    was the one cut off): a rollout sent there is passed on (ServerGone), the server has no whole policy,
    and reviving it does not make it active: only the trainer's next whole update does (main.py's admit)."""
    from primebuild.contracts.completion import NO_WHOLE_POLICY
    from primebuild.contracts.run_dir import RunDir
    from primebuild.runtime.orchestrator.client import InferenceClient, ServerGone
    from primebuild.runtime.orchestrator.servers import ServerSet

    client = InferenceClient(server.v1, "tiny", admin_token=ADMIN_TOKEN, retry_seconds=2)
    servers = ServerSet([client], RunDir(tmp_path / "run"), None, retry_seconds=2)
    try:
        with pytest.raises(ServerGone, match="weights_mixed"):
            await client.complete([1, 11, 8], n=1, temperature=1.0, top_p=1.0, max_tokens=4)
        assert await client.version() == NO_WHOLE_POLICY
        (entry,) = servers.servers.values()
        entry.state = "down"  # as sample() leaves it after the ServerGone

        async def broadcast_revive_load(client, version):  # main.py's, for an embedded server under broadcast
            raise ServerGone("waits for the trainer's next update")

        await servers.revive(0, broadcast_revive_load)
        assert entry.state == "down"  # not active on version 0's label: its weights are not version 0's
    finally:
        await client.close()


def sender_process(init_method: str, state_file: str, step: int, stall_file: str | None) -> None:
    """The trainer's rank 0 as its own process (it hosts the group's store: killing it takes that down too),
    sending one step; with `stall_file` it stalls half-way through its buckets (broadcast.STALL_ENV)."""
    import os

    from primebuild.runtime.weight_sync.broadcast import STALL_ENV, BroadcastSender

    torch.set_num_threads(1)
    if stall_file is not None:
        os.environ[STALL_ENV] = stall_file
    sender = BroadcastSender(init_method, 2, timeout_s=60, bucket_mb=0.05)  # a layer cut over several buckets
    sender.send(load_file(state_file), step)
    sender.close()


@pytest.mark.timeout(180)
def test_a_sender_killed_inside_a_load_leaves_the_server_up_and_serving_nothing_until_a_whole_update(tmp_path):
    """The trainer's sender dies -9 after half of step 1's buckets were installed in place: the served model
    is a mix of step 0 and step 1 with no copy to go back to. The server stays up (engine alive, /health 200
    saying weights_mixed), answers the request it held and every new one with 503 weights_mixed, and a
    restarted sender's whole update (step 2) makes it serve again, with step 2's exact log-probs: every
    piece was replaced."""
    import multiprocessing as mp
    import os
    import signal
    import time

    v0, v1, v2 = (save_model(tmp_path / f"v{i}", seed=i) for i in range(3))
    init = f"tcp://127.0.0.1:{free_port()}"
    stall = tmp_path / "stall"
    stall.touch()
    ctx = mp.get_context("spawn")
    first = ctx.Process(target=sender_process, args=(init, str(v1 / "model.safetensors"), 1, str(stall)))
    first.start()
    second = None
    body = {"model": "tiny", "prompt": [1, 11, 8, 15], "max_tokens": 12, "ignore_eos": True, "temperature": 1.0}
    try:
        with serve_with_stage(v0, init) as server:
            deadline = time.monotonic() + 60
            while httpx.get(server.url + "/health").json()["received_version"] < 1:
                assert time.monotonic() < deadline, "step 1 not announced"
                time.sleep(0.05)
            answers = {}
            updating = threading.Thread(target=lambda: answers.setdefault(
                "update", server.admin("/update_weights", {"source": "broadcast", "version": 1})), daemon=True)
            updating.start()
            while stall.exists():  # the sender removes it as it stalls, once half the buckets crossed
                assert time.monotonic() < deadline and first.is_alive(), "the send did not stall"
                time.sleep(0.05)
            # a request that comes while the engine is parked in the update: held, then answered when it ends
            held = threading.Thread(target=lambda: answers.setdefault(
                "held", httpx.post(server.v1 + "/completions", json=body, timeout=60)), daemon=True)
            held.start()
            time.sleep(1.0)  # the crossed buckets are installed (milliseconds on a quiet machine)
            os.kill(first.pid, signal.SIGKILL)
            updating.join(60)
            held.join(60)

            update, refused = answers["update"], answers["held"]
            assert update.status_code == 409 and update.json()["error"]["code"] == "weight_update_lost", update.text
            assert "mix of two policies" in update.json()["error"]["message"], update.text
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "weights_mixed", refused.text
            health = httpx.get(server.url + "/health")
            assert health.status_code == 200, health.text  # up: the supervisor restarts nothing
            state = health.json()
            assert state["status"] == "weights_mixed" and state["policy_version"] == 0, state
            installed = int(state["weights_mixed"].split("stopped after ")[1].split()[0])
            assert 1 <= installed < 4, state  # some of the 4 pieces (2 layers, embedding, head): a real mix
            new = httpx.post(server.v1 + "/completions", json=body, timeout=60)
            assert new.status_code == 503 and new.json()["error"]["code"] == "weights_mixed", new.text
            assert server.engine.dead is None
            asyncio.run(_the_orchestrator_sets_a_mixed_server_aside(server, tmp_path))

            second = ctx.Process(target=sender_process, args=(init, str(v2 / "model.safetensors"), 2, None))
            second.start()  # the restarted trainer's sender, on the same port: its first send is whole
            deadline = time.monotonic() + 60
            while httpx.get(server.url + "/health").json()["received_version"] < 2:
                assert time.monotonic() < deadline, "step 2 not announced by the restarted sender"
                time.sleep(0.05)
            reply = server.admin("/update_weights", {"source": "broadcast", "version": 2})
            assert reply.status_code == 200, reply.text
            state = httpx.get(server.url + "/health").json()
            assert state["status"] == "ok" and state["policy_version"] == 2 and "weights_mixed" not in state, state
            choice = httpx.post(server.v1 + "/completions", json=body, timeout=60).json()["choices"][0]
            assert choice["policy_version"] == 2
            want = teacher_forced_logprobs(load_hf(v2), choice["prompt_token_ids"], choice["token_ids"])
            assert max(abs(a - b) for a, b in zip(choice["token_logprobs"], want, strict=True)) < 1e-5
    finally:
        reap(p for p in (first, second) if p is not None)
