"""The trainer's query-chunked DSA indexer (primebuild/runtime/trainer/sparse_attention.py) picks exactly the keys
transformers' GlmMoeDsaIndexer picks, for chunk sizes that do and do not divide the sequence."""

import pytest
import torch
from test_trainer_sparse_attention_cp import SMALL, make_tiny_glm5

from primebuild.runtime.trainer.sparse_attention import chunked_index_topk


@pytest.fixture(scope="module")
def indexer_and_inputs(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(make_tiny_glm5(tmp_path_factory.mktemp("glm5")))
    layer = hf.model.layers[0].self_attn
    batch, seq = 2, 37
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(batch, seq, SMALL["hidden_size"], generator=g)
    q_resid = torch.randn(batch, seq, SMALL["q_lora_rank"], generator=g)
    positions = torch.arange(seq)[None].expand(batch, -1)
    rope = hf.model.rotary_emb(hidden, positions)
    causal = (positions[:, :, None] >= torch.arange(seq)[None, None, :])  # [B, S, T]
    causal[1, :, :5] = False  # left padding in the second row
    return layer.indexer, (hidden, q_resid, rope, causal, positions)


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 100])
def test_chunked_indices_equal_transformers(indexer_and_inputs, chunk):
    indexer, args = indexer_and_inputs
    expected = indexer(*args)  # the library's forward: all queries at once
    got = chunked_index_topk(indexer, *args, query_chunk=chunk)
    assert got.dtype == torch.int32 and got.shape == expected.shape == (2, 37, SMALL["index_topk"])
    assert torch.equal(got, expected)


def test_additive_mask_matches_too(indexer_and_inputs):
    indexer, (hidden, q_resid, rope, causal, positions) = indexer_and_inputs
    additive = torch.zeros(causal.shape).masked_fill(~causal, float("-inf"))
    args = (hidden, q_resid, rope, additive, positions)
    assert torch.equal(chunked_index_topk(indexer, *args, query_chunk=8), indexer(*args))
