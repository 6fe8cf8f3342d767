"""vLLM serves what `primebuild export` makes: the session's vLLM server reloads the export of a real run's
checkpoint and samples with transformers' log-probs on it.

Apart from tests/test_export.py so that only this test joins the serial `vllm` group (tests/parallel_groups.py);
the run is the one that module exports (conftest `broadcast_checkpoint_run`), built once for both. The export
goes into a store of this test's own: that module checks that its store is left as it was.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from conftest import run_cli

from primebuild.runtime.rollout_file import load_batch
from primebuild.runtime.weight_sync.filesystem import step_folder

# the setup may wait for the shared run (another worker building it) and for the shared server's start
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_vllm_serves_the_export(broadcast_checkpoint_run: Path, vllm_tiny, tmp_path: Path):
    """The session's vLLM server (conftest `vllm_tiny`: the same architecture, seed-0 weights) reloads
    the exported folder and samples with transformers' log-probs on it; it is left on the seed-0 weights
    at version "default", as tests/test_vllm_oracle.py and tests/test_vllm_server.py expect to find it."""
    from inference_helpers import load_hf, teacher_forced_logprobs
    from transformers import AutoModelForCausalLM
    from vllm_helpers import VLLM_ADMIN_TOKEN

    from primebuild.builders.store import ENTRY_FILE
    from primebuild.runtime.inference.vllm.admin import VllmAdmin
    from primebuild.runtime.inference.vllm.completions import adapt_response, completion_request
    from primebuild.runtime.trainer.model import Policy, full_state_dict
    from primebuild.runtime.weight_sync.filesystem import publish_dir, publish_hf_weights

    run_dir = broadcast_checkpoint_run
    made = run_cli("export", run_dir, "--step", "2", "--store", tmp_path / "store", timeout=200)
    assert made.code == 0, made.text[-3000:]
    exported = Path(made.out.strip().splitlines()[-1])
    assert exported.parent == tmp_path / "store" and exported.name.endswith("-step2")
    # a server's weight update reads a published step folder (STABLE-marked): the export's files, as they are
    weights = tmp_path / "weights"
    publish_dir(step_folder(weights, 1), lambda d: [shutil.copy(p, d / p.name) for p in exported.iterdir()
                                                    if p.name != ENTRY_FILE], 1)
    seed_zero = load_hf(vllm_tiny.model_path)
    publish_hf_weights(weights, 2, full_state_dict(Policy(seed_zero, chunk_tokens=64), torch.float32),
                       seed_zero.config, tokenizer_src=vllm_tiny.model_path)

    async def load(step: int, version: int) -> None:
        async with VllmAdmin(vllm_tiny.url, admin_token=VLLM_ADMIN_TOKEN) as admin:
            await admin.update_weights(version=version, path=step_folder(weights, step))

    async def as_started() -> None:  # the seed-0 weights under vLLM's own first version name, "default"
        await load(2, version=0)
        async with VllmAdmin(vllm_tiny.url, admin_token=VLLM_ADMIN_TOKEN) as admin:
            await admin._call("POST", "/update_weight_version", json={"new_version": "default"})

    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    prompts = [s.prompt_ids for s in load_batch(run_dir / "rollouts" / "step_000002.safetensors").samples[::8][:4]]
    asyncio.run(load(1, version=41))
    try:
        body = completion_request(vllm_tiny.model_name, prompts, max_tokens=8, temperature=1.0, seed=3)
        choices = adapt_response(vllm_tiny.complete(body), policy_version=41)
        assert len(choices) == len(prompts)
        for choice in choices:
            expected = teacher_forced_logprobs(hf, choice["prompt_token_ids"], choice["token_ids"])
            assert choice["token_logprobs"] == pytest.approx(expected, abs=2e-4)
        # and not the seed-0 weights' log-probs: the server really serves the export
        theirs = teacher_forced_logprobs(seed_zero, choices[0]["prompt_token_ids"], choices[0]["token_ids"])
        assert choices[0]["token_logprobs"] != pytest.approx(theirs, abs=1e-2)
    finally:
        asyncio.run(as_started())
    assert httpx.get(vllm_tiny.url + "/weight_info", timeout=10).json() == {"weight_version": "default"}
