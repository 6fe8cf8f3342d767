"""A dead embedded engine behind a live HTTP server is a dead server: /health answers 503 with the cause,
requests are refused (503, not a hang), and `run_http` leaves so that the supervisor restarts the server.

The fault is real torch failing in the engine thread: the served embedding loses a column (a broken
model), so every forward raises a shape error; after MAX_FAILED_STEPS failed steps in a row the engine
is dead, while one failed batch alone is only that batch's error."""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import pytest
from conftest import free_port
from inference_helpers import save_model, serve_folder

from primebuild.runtime.inference.engine import MAX_FAILED_STEPS

PROMPT = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("dead-engine"), "dense", seed=0)


def _break(engine) -> None:
    weights = engine.forward.weights
    engine.forward.weights = dataclasses.replace(weights, embed=weights.embed[:, :-1].contiguous())


def test_one_failed_batch_is_an_error_a_broken_engine_is_dead(folder):
    with serve_folder(folder, max_num_seqs=4, max_model_len=64) as served:
        url = served.url
        assert httpx.post(url + "/v1/completions", json=PROMPT, timeout=60).status_code == 200
        good = served.engine.forward.weights
        _break(served.engine)
        first = httpx.post(url + "/v1/completions", json=PROMPT, timeout=60)
        assert first.status_code == 500 and "internal engine error" in first.text
        # one failed step: the engine serves on once the model is sound again
        served.engine.forward.weights = good
        assert httpx.post(url + "/v1/completions", json=PROMPT, timeout=60).status_code == 200
        assert httpx.get(url + "/health", timeout=10).status_code == 200

        _break(served.engine)
        for _ in range(MAX_FAILED_STEPS):
            assert httpx.post(url + "/v1/completions", json=PROMPT, timeout=60).status_code >= 500
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "dead" and "shapes cannot be multiplied" in health.json()["error"]
        refused = httpx.post(url + "/v1/completions", json=PROMPT, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


def test_the_server_leaves_when_its_engine_dies(folder):
    from primebuild.runtime.inference.engine import Engine
    from primebuild.runtime.inference.server import create_app, run_http
    from primebuild.runtime.inference.tokenizer import ServedTokenizer

    tokenizer = ServedTokenizer(folder)
    engine = Engine(folder, device="cpu", max_num_seqs=4, max_model_len=64, eos_token_ids=tokenizer.eos_token_ids)
    app = create_app(engine, tokenizer, served_model_name="tiny")
    port = free_port()
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("ok", run_http(app, engine, "127.0.0.1", port)),
                              daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
    try:
        _break(engine)
        for _ in range(MAX_FAILED_STEPS):
            httpx.post(url + "/v1/completions", json=PROMPT, timeout=60)
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server still runs over a dead engine"
        assert result["ok"] is False  # serve() exits 1 on it: a failure the supervisor restarts
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        engine.shutdown()
