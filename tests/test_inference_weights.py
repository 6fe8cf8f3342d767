"""Live weight updates: new versions are served with the new weights' log-probs, and a request that
was in flight either resumes on the new weights or finishes on the old ones, and says which."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from inference_helpers import load_hf, save_model, serve_folder, teacher_forced_logprobs

TOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    v0, v1 = save_model(root / "step0", "dense", seed=0), save_model(root / "step1", "dense", seed=1)
    return {"v0": v0, "v1": v1, "hf0": load_hf(v0), "hf1": load_hf(v1)}


def completion(server, **body):
    body = {"model": "tiny", "prompt": [1, 11, 8, 15], "max_tokens": 16, "ignore_eos": True, **body}
    reply = httpx.post(server.v1 + "/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_update_serves_new_version_with_new_logprobs(folders):
    with serve_folder(folders["v0"]) as server:
        before = completion(server)
        assert before["policy_version"] == 0
        reply = server.admin("/update_weights", {"path": str(folders["v1"]), "version": 1})
        assert reply.status_code == 200 and reply.json()["policy_version"] == 1
        after = completion(server, temperature=1.0)
        assert after["policy_version"] == 1 and set(after["policy_versions"]) == {1}
        want = teacher_forced_logprobs(folders["hf1"], after["prompt_token_ids"], after["token_ids"])
        assert max(abs(a - b) for a, b in zip(after["token_logprobs"], want, strict=True)) < TOL
        assert httpx.get(server.url + "/health").json()["policy_version"] == 1
        assert (
            'primebuild_inference_policy_version{model="tiny"} 1' in httpx.get(server.url + "/metrics").text
        )


def test_bad_update_keeps_serving_old_weights(folders, tmp_path):
    wide = save_model(tmp_path / "other", "moe", seed=0, with_tokenizer=False)
    with serve_folder(folders["v0"]) as server:
        for body in (
            {"path": str(tmp_path / "missing"), "version": 1},
            {"path": str(wide), "version": 1},
            {"version": 1},
            {"path": str(folders["v1"]), "version": "x"},
        ):
            reply = server.admin("/update_weights", body)
            assert reply.status_code == 400, body
            assert reply.json()["error"]["message"]
        assert completion(server)["policy_version"] == 0


def _stream_with_update(server, update_body: dict, max_tokens: int = 300) -> tuple[dict, list]:
    """Stream one long completion; after its first tokens, pause, start the update, resume."""
    body = {
        "model": "tiny",
        "prompt": [1, 11, 8, 15],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 3,
        "stream": True,
    }
    updates: list = []
    final: dict = {}
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    updater = None
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            ids += choice["token_ids"]
            logprobs += choice["token_logprobs"]
            versions += choice["policy_versions"]
            if updater is None:
                assert server.admin("/pause").status_code == 200
                updater = threading.Thread(
                    target=lambda: updates.append(server.admin("/update_weights", update_body))
                )
                updater.start()
                if update_body.get("in_flight") != "finish":
                    updater.join(timeout=30)  # a resume-mode swap happens even while paused
                assert server.admin("/resume").status_code == 200
            if choice["finish_reason"]:
                final = choice
    updater.join(timeout=30)
    final.update(token_ids=ids, token_logprobs=logprobs, policy_versions=versions)
    return final, updates


def test_in_flight_request_resumes_on_new_weights(folders):
    with serve_folder(folders["v0"]) as server:
        final, updates = _stream_with_update(server, {"path": str(folders["v1"]), "version": 1})
    assert updates[0].status_code == 200
    versions = final["policy_versions"]
    switch = versions.index(1)
    assert 0 < switch and set(versions[:switch]) == {0} and set(versions[switch:]) == {1}
    assert final["resumed_from_version"] == 0 and final["policy_version"] == 1
    assert len(final["token_ids"]) == 300
    # Tokens before the switch are what the old weights give, tokens after what the new ones give,
    # each conditioned on everything generated before it.
    prompt, ids, got = final["prompt_token_ids"], final["token_ids"], final["token_logprobs"]
    old = teacher_forced_logprobs(folders["hf0"], prompt, ids)
    new = teacher_forced_logprobs(folders["hf1"], prompt, ids)
    assert max(abs(got[i] - old[i]) for i in range(switch)) < TOL
    assert max(abs(got[i] - new[i]) for i in range(switch, len(ids))) < TOL


def test_in_flight_request_can_finish_on_old_weights(folders):
    with serve_folder(folders["v0"]) as server:
        final, updates = _stream_with_update(
            server, {"path": str(folders["v1"]), "version": 1, "in_flight": "finish"}, max_tokens=100
        )
        assert updates[0].status_code == 200
        assert set(final["policy_versions"]) == {0} and final["resumed_from_version"] is None
        assert len(final["token_ids"]) == 100
        old = teacher_forced_logprobs(folders["hf0"], final["prompt_token_ids"], final["token_ids"])
        assert max(abs(a - b) for a, b in zip(final["token_logprobs"], old, strict=True)) < TOL
        assert completion(server)["policy_version"] == 1
