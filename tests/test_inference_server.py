"""The OpenAI-compatible server, driven by the official `openai` client against a real uvicorn.

References are the HF models themselves: greedy tokens must equal `generate`'s, and every returned
log-prob must equal a teacher-forced HF forward pass (1e-5, fp32).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
import openai
import pytest
from inference_helpers import (
    EOS_ID,
    hf_greedy,
    load_hf,
    save_model,
    serve_folder,
    teacher_forced_logprobs,
)

from primebuild.kernels.routing import decode_routes

TOL = 1e-5


@pytest.fixture(scope="module", params=["dense", "moe"])
def served(request, tmp_path_factory):
    folder = save_model(tmp_path_factory.mktemp(request.param), request.param, seed=0)
    with serve_folder(folder) as server:
        server.folder = folder
        server.hf = load_hf(folder)
        yield server




def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL


def test_completion_greedy_matches_generate_and_logprobs_match_hf(served):
    client = served.openai()
    prompt = [1, 11, 8, 15, 15, 18]
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}, logprobs=0
    )
    choice = reply.choices[0]
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == prompt
    assert extra["token_ids"] == hf_greedy(served.hf, prompt, 24)
    assert choice.finish_reason == "length"
    assert_close(extra["token_logprobs"], teacher_forced_logprobs(served.hf, prompt, extra["token_ids"]))
    assert choice.logprobs.token_logprobs == extra["token_logprobs"]  # OpenAI's field carries the same values
    assert extra["policy_version"] == 0 and set(extra["policy_versions"]) == {0}
    assert extra["resumed_from_version"] is None
    assert reply.usage.completion_tokens == 24 and reply.usage.prompt_tokens == len(prompt)


def test_sampled_logprobs_match_hf_with_temperature(served):
    client = served.openai()
    reply = client.completions.create(
        model="tiny",
        prompt="hello world",
        max_tokens=20,
        temperature=0.7,
        n=3,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        extra = choice.model_extra
        want = teacher_forced_logprobs(
            served.hf, extra["prompt_token_ids"], extra["token_ids"], temperature=0.7
        )
        assert_close(extra["token_logprobs"], want)
    # n > 1 samples independently, and the seed makes the whole reply reproducible.
    assert len({tuple(c.model_extra["token_ids"]) for c in reply.choices}) > 1
    again = client.completions.create(
        model="tiny",
        prompt="hello world",
        max_tokens=20,
        temperature=0.7,
        n=3,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert [c.model_extra["token_ids"] for c in again.choices] == [
        c.model_extra["token_ids"] for c in reply.choices
    ]


def test_chat_uses_template_and_logprobs_match_hf(served):
    from transformers import AutoTokenizer

    client = served.openai()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse abc"}]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, logprobs=True, top_logprobs=3
    )
    choice = reply.choices[0]
    extra = choice.model_extra
    template = AutoTokenizer.from_pretrained(served.folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert extra["prompt_token_ids"] == list(template)
    want = teacher_forced_logprobs(served.hf, extra["prompt_token_ids"], extra["token_ids"])
    assert_close(extra["token_logprobs"], want)
    assert [t.logprob for t in choice.logprobs.content] == extra["token_logprobs"]
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    if choice.finish_reason == "stop":  # ended by <|im_end|>, which is not part of the text
        assert extra["token_ids"][-1] == EOS_ID
    assert choice.message.role == "assistant" and "<|" not in choice.message.content


def test_streaming_equals_non_streaming(served):
    client = served.openai()
    kwargs = dict(model="tiny", prompt="abc", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0]
    text, ids, logprobs, final = "", [], [], None
    for chunk in client.completions.create(stream=True, **kwargs):
        piece = chunk.choices[0]
        text += piece.text
        ids += piece.model_extra["token_ids"]
        logprobs += piece.model_extra["token_logprobs"]
        if piece.finish_reason:
            final = piece
    assert text == full.text and ids == full.model_extra["token_ids"]
    assert logprobs == full.model_extra["token_logprobs"]
    assert (
        final.finish_reason == "length"
        and final.model_extra["prompt_token_ids"] == full.model_extra["prompt_token_ids"]
    )

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_stop_strings_and_token_id_prompts(served):
    client = served.openai()
    base = client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    assert len(base.text) >= 4
    stop = base.text[2:4]
    cut = client.completions.create(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[: base.text.find(stop)]
    assert cut.model_extra["token_ids"] == base.model_extra["token_ids"][: len(cut.model_extra["token_ids"])]


def test_sixty_four_concurrent_requests_are_batched(served):
    async def main():
        client = openai.AsyncOpenAI(base_url=served.v1, api_key="unused", max_retries=0)
        replies = await asyncio.gather(
            *(
                client.completions.create(
                    model="tiny",
                    prompt=[1, 4 + i % 26],
                    max_tokens=24,
                    temperature=1.0,
                    extra_body={"ignore_eos": True},
                )
                for i in range(64)
            )
        )
        await client.close()
        return replies

    before = _decode_histogram(served.url)
    replies = asyncio.run(main())
    assert len(replies) == 64
    assert all(
        r.choices[0].finish_reason == "length" and len(r.choices[0].model_extra["token_ids"]) == 24
        for r in replies
    )
    after = _decode_histogram(served.url)
    steps = after["count"] - before["count"]
    tokens_in_steps = after["sum"] - before["sum"]
    assert steps > 0 and tokens_in_steps / steps > 8  # many sequences per decode step
    assert after["le=16"] - before["le=16"] < steps  # some steps ran more than 16 sequences at once
    metrics = httpx.get(served.url + "/metrics").text
    assert re.search(r'primebuild_inference_requests_running\{model="tiny"\} 0', metrics)
    assert "primebuild_inference_generation_tokens_total" in metrics
    assert "primebuild_inference_kv_cache_usage_ratio" in metrics


def _decode_histogram(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("primebuild_inference_decode_batch_size"):
            name, value = line.rsplit(" ", 1)
            if "_bucket" in name:
                out["le=" + re.search(r'le="([^"]+)"', name).group(1)] = float(value)
            elif "_sum" in name:
                out["sum"] = float(value)
            elif "_count" in name:
                out["count"] = float(value)
    return out


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "prompt": "a"}, 404, "model"),
        ({"model": "tiny", "prompt": "a", "max_tokens": 100000}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "a" * 600}, 400, "prompt"),
        ({"model": "tiny", "prompt": "a", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": "a", "top_p": 0}, 400, "top_p"),
        ({"model": "tiny", "prompt": [99]}, 400, "prompt"),
        ({"model": "tiny", "prompt": ""}, 400, "prompt"),
        ({"model": "tiny", "prompt": "a", "n": 1000}, 400, "n"),
        ({"model": "tiny"}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(served, body, status, param):
    reply = httpx.post(served.v1 + "/completions", json=body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_and_client_errors(served):
    for raw in (b"{", b"[1, 2]", b"\xff\xfe", b'{"model": "tiny", "messages": []}'):
        reply = httpx.post(served.v1 + "/chat/completions", content=raw)
        assert reply.status_code == 400 and "message" in reply.json()["error"]
    with pytest.raises(openai.NotFoundError):
        served.openai().completions.create(model="other", prompt="a")
    with pytest.raises(openai.BadRequestError):
        served.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=100000
        )
    assert httpx.get(served.url + "/nowhere").json()["error"]["message"]
    assert httpx.get(served.url + "/health").json()["status"] == "ok"


def test_a_client_that_hangs_up_mid_request_is_no_server_error(served, caplog):
    """A dropped rollout group cancels its requests: one cut while the server reads its body is logged as
    what it is, not as an unhandled error with a traceback on the run's terminal."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(served.url)
    caplog.set_level(logging.INFO)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny\", \"prompt\": ")  # then hangs up
    deadline = time.monotonic() + 10
    while "disconnected before its request was read" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "disconnected before its request was read" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert httpx.get(served.url + "/health").json()["status"] == "ok"


def test_admin_calls_need_the_token(served):
    for path in ("/pause", "/resume", "/update_weights"):
        for token in (None, "wrong"):
            reply = served.admin(path, {"path": str(served.folder), "version": 9}, token=token)
            assert reply.status_code == 401, path
            assert reply.json()["error"]["type"] == "authentication_error"
    assert served.engine.version == 0 and not served.engine.paused


def test_pause_holds_generation_until_resume(served):
    client = served.openai()
    assert served.admin("/pause").json()["status"] == "paused"
    try:
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=0.5).completions.create(model="tiny", prompt="ab", max_tokens=4)
    finally:
        assert served.admin("/resume").status_code == 200
    reply = client.completions.create(
        model="tiny", prompt="ab", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert len(reply.choices[0].model_extra["token_ids"]) == 4


def test_routed_experts_on_request(served):
    reply = httpx.post(
        served.v1 + "/completions",
        json={
            "model": "tiny",
            "prompt": [1, 5, 6],
            "max_tokens": 4,
            "ignore_eos": True,
            "return_routed_experts": True,
        },
    )
    choice = reply.json()["choices"][0]
    config = served.engine.config
    if not config.is_moe:
        assert "routed_experts" not in choice
        return
    routed = decode_routes(choice["routed_experts"])  # vLLM's wire form: base64 .npy, every decoder layer
    assert routed.shape == (3 + 4 - 1, config.num_layers, config.num_experts_per_tok)  # every position fed
    assert routed.max() < config.num_experts
