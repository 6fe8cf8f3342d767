"""The engine in process: continuous batching, sampling semantics, n > 1, routed experts."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from inference_helpers import hf_greedy, load_hf, save_model, teacher_forced_logprobs

from primebuild.kernels.routing import decode_routes
from primebuild.runtime.inference.engine import Engine
from primebuild.runtime.inference.sampling import SamplingParams
from primebuild.runtime.inference.sequences import ChoiceResult


@pytest.fixture(scope="module", params=["dense", "moe"])
def setup(request, tmp_path_factory):
    folder = save_model(tmp_path_factory.mktemp(request.param), request.param, seed=0)
    engine = Engine(folder, max_num_seqs=8, max_model_len=256, device="cpu")
    yield engine, load_hf(folder)
    engine.shutdown()


def test_requests_join_and_leave_between_decode_steps(setup):
    """Requests arrive while others decode; each still gets exactly its greedy continuation."""
    engine, hf = setup
    prompts = [[1, 5 + i, 9, 12 + i][: 2 + i % 3] for i in range(12)]  # more than max_num_seqs
    lengths = [5 + 7 * (i % 4) for i in range(12)]
    results = [ChoiceResult(0, p) for p in prompts]
    done = threading.Event()
    left = [len(prompts)]

    def sink_for(result):
        def sink(updates):
            for update in updates:
                result.apply(update)
                if update.finish_reason:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
            # Submit the next prompt from inside the engine loop: it must join mid-flight.
            if len(result.token_ids) == 2 and pending:
                prompt, length, res = pending.pop(0)
                engine.submit(
                    prompt, SamplingParams(max_tokens=length, temperature=0, ignore_eos=True), sink_for(res)
                )

        return sink

    pending = list(zip(prompts[1:], lengths[1:], results[1:], strict=True))
    steps_before = engine.metrics.decode_steps
    engine.submit(
        prompts[0],
        SamplingParams(max_tokens=lengths[0], temperature=0, ignore_eos=True),
        sink_for(results[0]),
    )
    assert done.wait(60)
    for prompt, length, result in zip(prompts, lengths, results, strict=True):
        assert result.token_ids == hf_greedy(hf, prompt, length)
        assert result.finish_reason == "length"
    assert engine.metrics.decode_steps > steps_before
    assert engine.stats()["running"] == 0


def test_logprobs_come_from_the_processed_distribution(setup):
    engine, hf = setup
    prompt = [1, 7, 8, 9]
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=5, top_p=0.9, seed=11, ignore_eos=True)
    result = engine.generate([prompt], params)[0][0]
    ids = torch.tensor([prompt + result.token_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].float() / 0.8
    # Reference top-k then top-p filter, written out plainly.
    for row, token, got in zip(logits, result.token_ids, result.logprobs, strict=True):
        order = row.argsort(descending=True)
        keep = order[:5]
        probs = torch.softmax(row[keep], dim=-1)
        before = probs.cumsum(0) - probs
        keep = keep[before < 0.9]
        filtered = torch.full_like(row, float("-inf"))
        filtered[keep] = row[keep]
        assert token in keep.tolist()
        assert abs(torch.log_softmax(filtered, dim=-1)[token].item() - got) < 1e-5


def test_n_shares_one_prefill_and_seeds_reproduce(setup):
    engine, hf = setup
    prompt = [1, 20, 21, 22, 23, 24]
    params = SamplingParams(max_tokens=10, temperature=1.0, n=4, seed=7, ignore_eos=True)
    prefill_tokens = engine.metrics.prompt_tokens
    choices = engine.generate([prompt], params)[0]
    assert engine.metrics.prompt_tokens - prefill_tokens == len(prompt)  # one prefill for four samples
    assert len({tuple(c.token_ids) for c in choices}) > 1
    for choice in choices:
        want = teacher_forced_logprobs(hf, prompt, choice.token_ids)
        assert max(abs(a - b) for a, b in zip(choice.logprobs, want, strict=True)) < 1e-5
    # Same seed, different company in the batch: same samples.
    noise = SamplingParams(max_tokens=10, temperature=1.0, n=2, ignore_eos=True)
    again = engine.generate([prompt], params)[0]
    mixed = engine.generate([prompt, [1, 2, 3]], noise)
    assert [c.token_ids for c in again] == [c.token_ids for c in choices]
    assert all(len(c.token_ids) == 10 for group in mixed for c in group)


def test_stop_token_ids_and_eos(setup):
    engine, _ = setup
    free = engine.generate([[1, 5, 6]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0][0]
    stop_at = free.token_ids[3]
    cut = engine.generate(
        [[1, 5, 6]], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_at])
    )[0][0]
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]


def test_routed_experts_match_hf_router(setup):
    engine, hf = setup
    if not engine.config.is_moe:
        pytest.skip("dense model has no experts")
    prompt = [1, 9, 10, 11]
    result = engine.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_routed_experts=True)
    )[0][0]
    fed = prompt + result.token_ids[:-1]  # the last sampled token is never fed through the model
    routes = decode_routes(result.routed_experts)  # vLLM's layout: every decoder layer, dense ones zero
    k = engine.config.num_experts_per_tok
    assert routes.shape == (len(fed), engine.config.num_layers, k) and routes.dtype == np.uint8
    with torch.no_grad():
        out = hf(torch.tensor([fed]), output_router_logits=True)
    sparse = [i for i, s in enumerate(engine.config.sparse_layers) if s]
    assert len(out.router_logits) == len(sparse) and sparse != list(range(engine.config.num_layers))
    for layer, router_logits in zip(sparse, out.router_logits, strict=True):
        want = router_logits.float().softmax(-1).topk(k, dim=-1).indices
        got = torch.from_numpy(routes[:, layer].astype(np.int64))
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    dense = [i for i in range(engine.config.num_layers) if i not in sparse]
    assert not routes[:, dense].any()


def test_routed_experts_survive_batching_forks_and_repacking(setup):
    """Routes live in the cache slots: n > 1 forks and slot moves (short sequences finishing while long
    ones decode) must keep every sequence's own routes, equal to those of the sequence decoded alone."""
    engine, _ = setup
    if not engine.config.is_moe:
        pytest.skip("dense model has no experts")
    prompts = [[1, 9, 10, 11], [1, 4, 5]]
    params = SamplingParams(max_tokens=9, temperature=1.0, seed=3, n=3, return_routed_experts=True, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, return_routed_experts=True)
    shorts = []
    side = threading.Thread(target=lambda: shorts.extend(engine.generate([[1, 2], [1, 3, 3]], short)))
    side.start()
    together = engine.generate(prompts, params)
    side.join()
    assert engine.metrics.preemptions == 0  # moves inside the cache, not re-prefills
    for prompt, choices in zip(prompts, together, strict=True):
        for i, choice in enumerate(choices):
            alone = engine.generate([prompt], SamplingParams(**{**params.__dict__, "n": 1, "seed": 3 + i}))[0][0]
            assert alone.token_ids == choice.token_ids
            np.testing.assert_array_equal(decode_routes(alone.routed_experts), decode_routes(choice.routed_experts))
    for prompt, (choice,) in zip([[1, 2], [1, 3, 3]], shorts, strict=True):
        assert decode_routes(choice.routed_experts).shape[0] == len(prompt) + 1
