"""The decode hot path's building blocks, and whole batches through both matmul backends vs HF."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from inference_helpers import load_hf, save_model, teacher_forced_logprobs

from primebuild.runtime.inference import linear as linear_module
from primebuild.runtime.inference.engine import Engine
from primebuild.runtime.inference.linear import Linear, onednn_packing_available
from primebuild.runtime.inference.model import _unit
from primebuild.runtime.inference.sampling import SamplingParams, sample, sample_greedy
from primebuild.runtime.inference.sequences import ChoiceResult

ONEDNN = onednn_packing_available("cpu", torch.float32)


@pytest.mark.parametrize("shape", [(1, 128), (5, 8, 32), (3, 64)])
def test_unit_norm_times_sqrt_n_is_rms_norm(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    x[0] *= 1e-4  # a row small enough for eps to matter
    n = shape[-1]
    want = F.rms_norm(x, (n,), None, 1e-6)
    torch.testing.assert_close(_unit(x, 1e-6) * n**0.5, want, rtol=1e-6, atol=1e-6)
    half = _unit(x.bfloat16(), 1e-6)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float() * n**0.5, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_backends_agree(bias):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 48, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    linear = Linear(weight, b)
    if ONEDNN:
        linear.pack()
        linear.packed_from_rows = 4  # force both paths within one test
    for rows in (1, 3, 4, 37):
        x = torch.randn(rows, 48, generator=g)
        residual = torch.randn(rows, 96, generator=g)
        want = F.linear(x, weight, b)
        torch.testing.assert_close(linear(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear.add_to(residual, x), residual + want, rtol=1e-5, atol=1e-5)


def test_only_calls_with_enough_work_take_the_packed_path():
    if not ONEDNN:
        pytest.skip("oneDNN packing needs an x86 CPU build of torch with mkldnn")
    linear = Linear(torch.randn(1024, 128))
    linear.pack()
    # 2^21 multiply-adds / (1024 * 128) weights = 16 rows; one row never pays oneDNN's call overhead.
    assert linear.packed_from_rows == 16
    small = Linear(torch.randn(8, 8))
    small.pack()
    assert small.packed_from_rows == linear_module.ONEDNN_MIN_MACS // 64


def test_greedy_fast_path_matches_general_sampler():
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(2))
    fast = sample_greedy(logits)
    general = sample(logits, [SamplingParams(temperature=0.0)] * 6, [None] * 6, torch.Generator())
    assert fast.tokens == general.tokens == logits.argmax(-1).tolist()
    assert fast.logprobs == pytest.approx(general.logprobs, abs=1e-7)
    assert fast.top is None


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("dense"), "dense", seed=3)


@pytest.mark.parametrize("packed", [False, True])
def test_ragged_batch_decodes_like_hf_on_both_backends(dense_folder, monkeypatch, packed):
    """Prompts of different lengths (masked attention) decoded together; with `packed`, every matmul of
    two or more rows goes through oneDNN. Tokens equal HF's greedy ones, log-probs HF's teacher-forced."""
    if packed and not ONEDNN:
        pytest.skip("oneDNN packing needs an x86 CPU build of torch with mkldnn")
    monkeypatch.setattr(linear_module, "ONEDNN_MIN_MACS", 1 if packed else 1 << 62)
    engine = Engine(dense_folder, max_num_seqs=12, max_model_len=64, device="cpu")
    try:
        layer = engine.forward.weights.layers[0]
        assert (layer.gate_up.packed_from_rows == 2) == packed
        prompts = [[1, 5 + i, 9, 12, 3 + i][: 1 + i % 5] for i in range(12)]
        params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
        results = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    hf = load_hf(dense_folder)
    for prompt, (choice,) in zip(prompts, results, strict=True):
        ids = torch.tensor([prompt])
        want = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=9,
            min_new_tokens=9,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert choice.token_ids == want
        reference = teacher_forced_logprobs(hf, prompt, choice.token_ids)
        assert max(abs(a - b) for a, b in zip(choice.logprobs, reference, strict=True)) < 1e-5


def test_abort_of_a_running_request_frees_its_slot(dense_folder):
    engine = Engine(dense_folder, max_num_seqs=4, max_model_len=256, device="cpu")
    try:
        result = ChoiceResult(0, [1, 2])
        finished = threading.Event()
        started = threading.Event()

        def sink(updates):
            for update in updates:
                result.apply(update)
                if update.finish_reason:
                    finished.set()
            started.set()

        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        request = engine.submit([1, 2], params, sink)
        assert started.wait(30)
        request.abort()
        # The engine drops it between steps: no finish update arrives, and the slot comes back.
        for _ in range(200):
            if engine.stats()["running"] == 0:
                break
            threading.Event().wait(0.01)
        assert engine.stats()["running"] == 0
        assert not finished.is_set()
        assert len(result.token_ids) < 200
        # The engine still serves new work afterwards.
        again = engine.generate([[1, 2]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(again[0][0].token_ids) == 3
    finally:
        engine.shutdown()


def test_flat_kv_row_index_tracks_cache_growth():
    """The decode step writes new K/V rows through flat views and `row_index`; after the time axis
    grows (and the tensors are replaced) the index must still address (slot, head, position)."""
    from primebuild.runtime.inference.kv_cache import KVCache
    from primebuild.runtime.inference.model_config import ModelConfig

    config = ModelConfig(
        model_type="qwen3", vocab_size=8, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=2,
        head_dim=4, intermediate_size=8, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False,
    )
    cache = KVCache(config, max_seqs=3, max_len=64, dtype=torch.float32, device="cpu", initial_len=4)
    for length in (4, 40):
        cache.ensure(length)
        positions = torch.tensor([length - 1, 0])
        rows = cache.row_index(2, positions)
        new = torch.randn(2, 2, 4)
        cache.k_rows[1].index_put_((rows,), new)
        assert torch.equal(cache.k[1][[0, 1], :, positions], new)
        assert cache.k_rows[1].data_ptr() == cache.k[1].data_ptr()
