"""The vLLM P/D router's own answers, before any vLLM server is asked (tests/test_vllm_pd.py runs it in
front of real ones): admin calls need the run's token, clients cannot set the KV hand-off, and a
restarted router removes the KV files a former one left."""

from __future__ import annotations

import asyncio

import httpx

from primebuild.contracts.router import VllmPool, VllmRouterConfig
from primebuild.runtime.inference.vllm.pd_router import create_router

TOKEN = "router-test-token"


def config(storage=None) -> VllmRouterConfig:
    # nothing listens on port 9: a request that reached a server would fail with 503, not the codes below
    return VllmRouterConfig(served_model_name="tiny", port=8000, prefill=[VllmPool(url="http://127.0.0.1:9")],
                            decode=[VllmPool(url="http://127.0.0.1:9")], kv_storage_path=storage)


def ask(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.request(method, path, **kw)
    return asyncio.run(go())


def test_admin_calls_need_the_token_and_clients_cannot_set_the_hand_off():
    app = create_router(config(), TOKEN)
    for path in ("/pause", "/resume", "/collective_rpc", "/update_weight_version", "/init_weight_transfer_engine"):
        assert ask(app, "POST", path).status_code == 401, path
        assert ask(app, "POST", path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    assert app.state.fleet.running.is_set()  # a refused pause pauses nothing
    answer = ask(app, "POST", "/v1/completions", json={"prompt": [1, 2], "kv_transfer_params": {}})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "kv_transfer_params"
    assert ask(app, "GET", "/health").status_code == 200  # the router's own
    assert ask(app, "GET", "/weight_info").status_code == 503  # its servers do not answer
    no_token = create_router(config(), None)  # the run's token missing from its environment: no admin at all
    assert ask(no_token, "POST", "/pause", headers={"Authorization": "Bearer "}).status_code == 401


def test_a_restarted_router_removes_the_kv_files_a_former_one_left(tmp_path):
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "layer.safetensors").write_bytes(b"kv")
    create_router(config(str(tmp_path)), TOKEN)
    assert not any(tmp_path.iterdir())
