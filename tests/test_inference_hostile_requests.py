"""Requests a server must survive without harm: a body too large to hold, calls abandoned mid-decode, weight
folders that do not read as weights, and the P/D router in front of servers that are gone. Each gets a 4xx/5xx
in OpenAI's error shape and the server stays usable (found by an audit of the embedded server's HTTP surface)."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from conftest import free_port
from inference_helpers import ADMIN_TOKEN, running_server, save_model, serve_folder
from safetensors.torch import load_file, save_file

from primebuild.runtime.inference.protocol import MAX_BODY_BYTES
from primebuild.runtime.inference.responses import DISCONNECT_POLL_S

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("hostile"), "dense", seed=0)


@pytest.fixture(scope="module")
def server(folder):
    with serve_folder(folder, max_num_seqs=8, max_model_len=512) as served:
        yield served


def assert_still_serves(server) -> None:
    reply = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 2},
                       timeout=60)
    assert reply.status_code == 200, reply.text


def test_a_body_declared_too_large_is_refused_before_it_is_read(server):
    """The old check came after reading the whole body: a client could make the server hold gigabytes. Here
    the body never comes at all, so only a refusal on the declared length answers."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {2 * MAX_BODY_BYTES}\r\n\r\n".encode())
        answer = b""
        while b"request body larger than" not in answer and (chunk := conn.recv(4096)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"request body larger than" in answer, answer[:300]
    assert_still_serves(server)


def test_a_streamed_body_is_cut_off_at_the_limit(server):
    def chunks():
        block = b" " * (1 << 20)
        for _ in range(MAX_BODY_BYTES // len(block) + 2):  # chunked: no length declared
            yield block

    reply = httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["message"].startswith("request body larger than")
    assert_still_serves(server)


def test_a_whole_answer_nobody_waits_for_stops_decoding(server):
    """uvicorn does not cancel a handler whose client left: abandoned non-streamed calls used to decode to the
    end, and the next client queued behind them. The server is paused while the calls come and go, so what
    decodes after it resumes does not depend on how fast this machine is."""
    calls, n, tokens = 8, 4, 480
    body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": tokens, "ignore_eos": True, "n": n}

    def abandon(_) -> str:
        try:
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
            return "answered"
        except httpx.TimeoutException:
            return "abandoned"

    assert httpx.post(server.url + "/pause", headers=ADMIN, timeout=30).status_code == 200
    try:
        with ThreadPoolExecutor(calls) as pool:
            outcomes = list(pool.map(abandon, range(calls)))
        time.sleep(4 * DISCONNECT_POLL_S)  # each handler looks at its client every DISCONNECT_POLL_S
    finally:
        before = server.engine.metrics.generation_tokens
        assert httpx.post(server.url + "/resume", headers=ADMIN, timeout=30).status_code == 200
    assert outcomes == ["abandoned"] * calls, outcomes
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = server.engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"abandoned calls still decoding: {server.engine.stats()}")
    decoded = server.engine.metrics.generation_tokens - before
    assert decoded < calls * n * tokens // 20, decoded  # (all of it, 15,360 tokens, before the fix)
    assert_still_serves(server)


def _step_folder(folder: Path, tmp: Path, name: str, change) -> Path:
    out = tmp / name
    out.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    change(out, tensors)
    return out


def test_weight_folders_that_do_not_read_as_weights_are_400s_naming_path(server, folder, tmp_path):
    def garbage(out, tensors):
        (out / "model.safetensors").write_bytes(b"\x00" * 100)

    def integers(out, tensors):
        save_file({k: v.to(torch.int32) for k, v in tensors.items()}, out / "model.safetensors")

    def config_list(out, tensors):
        save_file(tensors, out / "model.safetensors")
        (out / "config.json").write_text("[1, 2]")

    for change in (garbage, integers, config_list):
        path = _step_folder(folder, tmp_path, change.__name__, change)
        reply = httpx.post(server.url + "/update_weights", json={"path": str(path), "version": 1}, headers=ADMIN,
                           timeout=60)
        assert reply.status_code == 400, (change.__name__, reply.status_code, reply.text)
        assert reply.json()["error"]["param"] == "path", reply.text
        assert server.engine.version == 0
        assert_still_serves(server)


@pytest.mark.parametrize(("body", "param"), [({"version": 1}, "path"), ({"path": "x", "version": -1}, "version"),
                                             ({"path": "x", "version": 2**64 - 1}, "version")])
def test_an_update_request_names_the_field_it_gets_wrong(server, body, param):
    reply = httpx.post(server.url + "/update_weights", json=body, headers=ADMIN, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_the_router_answers_in_openai_shape_with_its_servers_gone():
    from primebuild.contracts.router import DecodeServer, RouterConfig
    from primebuild.runtime.inference.router import create_router

    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = RouterConfig(served_model_name="tiny", port=free_port(), prefill=[gone],
                          decode=[DecodeServer(url=gone, kv_address=f"tcp://127.0.0.1:{free_port()}")])
    with running_server(create_router(config, "t")) as url:
        nested = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        answers = {
            "nested JSON": httpx.post(url + "/v1/completions", content=nested, timeout=30),
            "unknown route": httpx.get(url + "/v2/nothing", timeout=30),
            "server gone": httpx.get(url + "/v1/models", timeout=30),
        }
        statuses = {k: a.status_code for k, a in answers.items()}
        assert statuses == {"nested JSON": 400, "unknown route": 404, "server gone": 503}, statuses
        for reply in answers.values():
            assert set(reply.json()["error"]) >= {"message", "type", "param", "code"}, reply.text
