"""Fuzzed request bodies: the server answers every one with a 2xx or a 4xx carrying an OpenAI-shaped
JSON error, and is still healthy afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inference_helpers import save_model, serve_folder

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/update_weights", "/pause"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
numbers = st.one_of(st.integers(-5, 70), st.integers(), st.floats(), st.none(), st.text(max_size=3))
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "robot", 3]),
            "content": st.one_of(st.text(max_size=20), st.none(), json_values),
        }
    ),
    max_size=3,
)
plausible = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "tiny", "other", 7])},
    optional={
        "prompt": st.one_of(
            st.text(max_size=30),
            st.lists(st.integers(-3, 40), max_size=10),
            st.lists(st.text(max_size=5), max_size=3),
            json_values,
        ),
        "messages": messages,
        "max_tokens": numbers,
        "max_completion_tokens": numbers,
        "temperature": numbers,
        "top_p": numbers,
        "top_k": numbers,
        "n": st.one_of(st.integers(-1, 10), numbers),
        "seed": numbers,
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5), json_values),
        "logprobs": st.one_of(st.booleans(), numbers),
        "top_logprobs": numbers,
        "stream": st.booleans(),
        "ignore_eos": st.booleans(),
        "echo": st.booleans(),
        "stop_token_ids": st.lists(st.integers(-2, 40), max_size=3),
        "return_routed_experts": st.booleans(),
        "path": st.text(max_size=10),
        "version": numbers,
    },
)
bodies = st.one_of(
    plausible.map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_model(tmp_path_factory.mktemp("fuzz"), "moe", seed=0)
    # A short context bounds every generation the fuzzer can ask for.
    with serve_folder(folder, max_num_seqs=8, max_model_len=48) as served:
        yield served


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(endpoint=st.sampled_from(ENDPOINTS), body=bodies)
def test_fuzzed_bodies_get_2xx_or_json_4xx(server, endpoint, body):
    reply = httpx.post(
        server.url + endpoint, content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert 200 <= reply.status_code < 500, (reply.status_code, reply.text[:300])
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert set(error) >= {"message", "type", "param", "code"}
    elif reply.headers["content-type"].startswith("text/event-stream"):
        assert reply.text.rstrip().endswith("data: [DONE]")
    else:
        assert reply.json()["choices"]


def test_server_survives_fuzzing(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert server.engine.stats()["running"] == 0
