"""ModelFacts: parameter and KV counts checked against hand-computed tiny configs, against the real
transformers modules built from the same configs, and against published totals."""

from __future__ import annotations

import json

import pytest

from primebuild.builders.model_facts import (
    KNOWN_MODELS_DIR,
    facts_from_hf_config,
    known_model_facts,
    load_model_facts,
)
from primebuild.errors import UserError

# hidden 8, 2 layers, 2 heads of 4, 1 KV head, MLP 16, vocab 10, untied, Qwen3 q/k norms.
TINY_QWEN3 = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 8, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16,
    "vocab_size": 10, "tie_word_embeddings": False, "max_position_embeddings": 64,
}
# hidden 8, 3 layers (layer 0 dense via mlp_only_layers), 4 experts of width 2, top-2.
TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 8,
    "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 4,
    "intermediate_size": 16, "moe_intermediate_size": 2, "num_experts": 4, "num_experts_per_tok": 2,
    "decoder_sparse_step": 1, "mlp_only_layers": [0], "vocab_size": 10, "tie_word_embeddings": False,
}
# hidden 16, 2 layers (first dense), MLA with q_lora 8 / kv_lora 4 / rope 2 / nope 4 / v 4,
# 4 routed experts of width 2 (top-2) + 1 shared, DSA indexer of 2 heads × 4.
TINY_GLM_DSA = {
    "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "hidden_size": 16,
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "head_dim": 2, "q_lora_rank": 8, "kv_lora_rank": 4, "qk_rope_head_dim": 2, "qk_nope_head_dim": 4,
    "v_head_dim": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 2, "intermediate_size": 32, "vocab_size": 10, "index_n_heads": 2,
    "index_head_dim": 4, "index_topk": 8, "tie_word_embeddings": False, "n_group": 1, "topk_group": 1,
}


def test_dense_gqa_counts_by_hand():
    f = facts_from_hf_config(TINY_QWEN3, "tiny.json")
    # attention/layer: q 8·8 + k 8·4 + v 8·4 + o 8·8 = 192, q/k norms 2·4 = 8
    assert f.attention_params_per_layer() == 200
    # embed 80 + lm_head 80 + 2·200 + MLP 2·(3·8·16 = 384) + norms 2·16 + 8
    assert f.total_params() == 1368
    assert f.active_params() == f.total_params() == f.dense_params()
    assert f.expert_params() == 0
    assert f.matmul_params_per_token() == 1368 - 80  # embedding lookup is not a matmul
    # K and V of 1 head × 4 dims, 2 layers, 2 bytes
    assert f.kv_bytes_per_token(2) == 2 * 2 * 1 * 4 * 2 == 32
    assert f.kv_bytes_per_token(2, tp=2) == 32  # one KV head: replicated, not split
    assert (f.head_dim, f.num_dense_layers, f.max_position_embeddings) == (4, 2, 64)


def test_qwen3_moe_counts_by_hand():
    f = facts_from_hf_config(TINY_QWEN3_MOE, "tiny-moe.json")
    assert (f.num_dense_layers, f.num_moe_layers, f.expert_size) == (1, 2, 3 * 8 * 2)
    c = f.param_counts()
    assert c.attention == 3 * (4 * 64 + 8)  # q, k, v, o of 8×8 each, q/k norms
    assert c.dense_mlp == 384
    assert c.routed_experts == 2 * 4 * 48 == f.expert_params()
    assert c.router == 2 * 4 * 8
    assert f.total_params() == 160 + 792 + 384 + 384 + 64 + 56 == 1840
    assert f.dense_params() == 1840 - 384
    assert f.active_params() == 1840 - 384 + 2 * 2 * 48  # two of four experts per MoE layer


def test_mla_dsa_counts_by_hand():
    f = facts_from_hf_config(TINY_GLM_DSA, "tiny-glm.json")
    assert f.is_mla and f.head_dim == 6  # nope + rope, not the config's "head_dim"
    # q: 16·8 + norm 8 + 8·2·6 = 232; kv_a: 16·6 + norm 4 = 100; kv_b: 4·2·8 = 64; o: 2·4·16 = 128
    # indexer: wq_b 8·2·4 = 64, wk 16·4 = 64, k_norm 2·4 = 8, weights 16·2 = 32
    assert f.attention_params_per_layer() == 524 + 168
    assert (f.num_dense_layers, f.num_moe_layers) == (1, 1)
    c = f.param_counts()
    assert (c.routed_experts, c.shared_experts, c.router, c.norms) == (384, 96, 64, 80)
    assert f.total_params() == 320 + 1384 + 1536 + 384 + 96 + 64 + 80 == 3864
    assert f.active_params() == 3864 - 384 + 2 * 96
    # latent 4 + rope 2 + indexer key 4 per layer, 2 layers; MLA latent is not split by TP
    assert f.kv_bytes_per_token(2) == 2 * 10 * 2 == 40
    assert f.kv_bytes_per_token(1, tp=2) == 20


@pytest.mark.parametrize("config", [TINY_QWEN3, TINY_QWEN3_MOE, TINY_GLM_DSA], ids=lambda c: c["model_type"])
def test_counts_match_transformers_modules(config):
    """The formulas must agree with the real implementations of the same configs."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    real = sum(p.numel() for p in model.parameters())
    facts = facts_from_hf_config(config, "inline")
    assert real == facts.total_params()


def test_mlp_layer_types_and_moe_layer_freq():
    base = {k: v for k, v in TINY_GLM_DSA.items() if k != "first_k_dense_replace"}
    layered = facts_from_hf_config({**base, "num_hidden_layers": 4,
                                    "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}, "x.json")
    assert layered.num_dense_layers == 2
    freq = facts_from_hf_config({**base, "num_hidden_layers": 6, "first_k_dense_replace": 1,
                                 "moe_layer_freq": 2}, "x.json")
    assert freq.num_moe_layers == 2  # layers 2 and 4


def test_missing_key_names_file_and_key():
    cfg = {k: v for k, v in TINY_QWEN3_MOE.items() if k != "moe_intermediate_size"}
    with pytest.raises(UserError) as err:
        facts_from_hf_config(cfg, "models/foo/config.json")
    text = str(err.value)
    assert "models/foo/config.json" in text and "moe_intermediate_size" in text
    with pytest.raises(UserError, match="hidden_size"):
        facts_from_hf_config({"num_hidden_layers": 2}, "bar.json")
    with pytest.raises(UserError, match="non-negative integer"):
        facts_from_hf_config({**TINY_QWEN3, "num_hidden_layers": "2"}, "bar.json")


def test_class_names_from_a_config_are_names_only():
    """A config.json comes from a hub or a model folder: its architecture is quoted in plans and in the
    comment lines of rendered scripts, where a newline would end the comment and run the rest."""
    hostile = {**TINY_QWEN3, "architectures": ["Qwen3ForCausalLM\ntouch /tmp/PWNED #"]}
    with pytest.raises(UserError, match="architectures.*not a model class name"):
        facts_from_hf_config(hostile, "config.json")
    with pytest.raises(UserError, match="model_type"):
        facts_from_hf_config({**TINY_QWEN3, "model_type": "qwen3; rm -rf x"}, "config.json")


def test_load_errors_are_user_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="config.json:1"):
        load_model_facts(bad)
    with pytest.raises(UserError, match="not found"):
        load_model_facts(tmp_path / "missing.json")
    with pytest.raises(UserError, match="glm-5"):
        known_model_facts("no-such-model")


def test_known_model_files_are_plain_hf_configs():
    for path in KNOWN_MODELS_DIR.glob("*.json"):
        cfg = json.loads(path.read_text())
        assert "_primebuild_source" in cfg, path
        load_model_facts(path)


def test_glm5_matches_published_size():
    f = known_model_facts("glm-5")
    assert f.is_mla and f.is_moe and f.index_topk == 2048
    assert (f.num_layers, f.num_dense_layers, f.num_experts, f.experts_per_token) == (78, 3, 256, 8)
    assert f.total_params() == pytest.approx(744e9, rel=0.01)
    assert f.active_params() == pytest.approx(40e9, rel=0.05)  # 41.8B: the card rounds to "40B"
    # MLA latent 512 + rope 64 + indexer key 128, 78 layers
    assert f.kv_bytes_per_token(2) == 78 * (512 + 64 + 128) * 2


def test_qwen3_30b_a3b_matches_published_size():
    f = known_model_facts("qwen3-30b-a3b")
    assert f.total_params() == pytest.approx(30.5e9, rel=0.01)
    assert f.active_params() == pytest.approx(3.3e9, rel=0.03)
    assert f.kv_bytes_per_token(2) == 48 * 2 * 4 * 128 * 2


def test_reverse_text_tiny():
    f = known_model_facts("reverse-text-tiny")
    assert f.tie_word_embeddings and f.vocab_size == 32
    # embed 32·128 + 2·(attention 49152 + q/k norms 64 + MLP 196608 + norms 256) + final norm 128
    assert f.total_params() == 4096 + 2 * (49152 + 64 + 196608 + 256) + 128 == 496_384


@pytest.mark.slow
@pytest.mark.parametrize("name", ["glm-5", "qwen3-30b-a3b"])
def test_known_models_match_transformers_exactly(name):
    """Build the full model on the meta device (no memory) and count its parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    cfg = json.loads((KNOWN_MODELS_DIR / f"{name}.json").read_text())
    cfg.pop("_primebuild_source")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    assert sum(p.numel() for p in model.parameters()) == known_model_facts(name).total_params()
