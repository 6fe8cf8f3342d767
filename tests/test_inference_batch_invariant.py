"""Batch invariance of the embedded engine (`inference.batch_invariant`): a prompt's greedy tokens, log-probs
and routed experts are the same bits whether it runs alone or among others, in any order, whatever arrives
beside it; and they still follow the HF reference."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch
from inference_helpers import load_hf, save_model, serve_folder, teacher_forced_logprobs

from primebuild.runtime.inference.batch_invariant import ROW_BLOCK, in_row_blocks
from primebuild.runtime.inference.engine import Engine
from primebuild.runtime.inference.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["dense", "moe"])
def folder(request, tmp_path_factory):
    return save_model(tmp_path_factory.mktemp(request.param), request.param, seed=0)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 20) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


def _bits(choice) -> tuple:
    return choice.token_ids, choice.logprobs, choice.routed_experts


def test_row_blocks_give_every_row_the_same_bits_whatever_its_neighbours():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g)
    row = torch.randn(64, generator=g)
    seen = set()
    for rows in (1, 3, ROW_BLOCK, ROW_BLOCK + 5, 3 * ROW_BLOCK):
        x = torch.randn(rows, 64, generator=g)
        x[rows // 2] = row
        out = in_row_blocks(lambda block: block @ weight.T, x)
        assert out.shape == (rows, 96)
        seen.add(out[rows // 2].numpy().tobytes())
    assert len(seen) == 1


def test_a_prompt_gives_the_same_bits_alone_and_in_any_batch(folder):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                            return_routed_experts=folder.name.startswith("moe"))
    prompts = _prompts(24)
    engine = Engine(folder, device="cpu", max_num_seqs=32, max_model_len=64, batch_invariant=True)
    try:
        alone = [_bits(engine.generate([p], params)[0][0]) for p in prompts[:6]]
        among_all = [_bits(c[0]) for c in engine.generate(prompts, params)[:6]]
        reversed_few = [_bits(c[0]) for c in engine.generate(prompts[:6][::-1], params)][::-1]
    finally:
        engine.shutdown()
    assert alone == among_all == reversed_few
    if params.return_routed_experts:
        assert all(routes is not None for _, _, routes in alone)


def test_batch_invariant_decoding_follows_the_hf_reference(folder):
    prompts = _prompts(8, seed=1)
    engine = Engine(folder, device="cpu", max_num_seqs=8, max_model_len=64, batch_invariant=True)
    try:
        results = engine.generate(prompts, GREEDY)
    finally:
        engine.shutdown()
    hf = load_hf(folder)
    for prompt, (choice,) in zip(prompts, results, strict=True):
        reference = teacher_forced_logprobs(hf, prompt, choice.token_ids)
        assert max(abs(a - b) for a, b in zip(choice.logprobs, reference, strict=True)) < 1e-5


def test_requests_arriving_together_over_http_score_as_each_alone(tmp_path):
    """The case that made evals move: concurrent requests join the running batch at arbitrary steps."""
    folder = save_model(tmp_path / "dense", "dense", seed=0)
    prompts = _prompts(16, seed=2)

    async def complete(client: httpx.AsyncClient, prompt: list[int]) -> tuple:
        reply = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 10,
                                                           "temperature": 0, "logprobs": 1, "ignore_eos": True})
        reply.raise_for_status()
        logprobs = reply.json()["choices"][0]["logprobs"]
        return tuple(logprobs["tokens"]), tuple(logprobs["token_logprobs"])

    async def together(url: str) -> list[tuple]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return list(await asyncio.gather(*(complete(client, p) for p in prompts)))

    async def one_by_one(url: str) -> list[tuple]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return [await complete(client, p) for p in prompts]

    with serve_folder(folder, batch_invariant=True, max_num_seqs=32, max_model_len=64) as served:
        assert asyncio.run(together(served.url)) == asyncio.run(one_by_one(served.url))
