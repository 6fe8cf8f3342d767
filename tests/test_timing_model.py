"""Throughput model: each formula against numbers computed by hand on a toy GPU and tiny configs."""

from __future__ import annotations

import pytest

from primebuild.builders.hardware import GpuSpec
from primebuild.builders.model_facts import ModelFacts, known_model_facts
from primebuild.builders.timing import (
    _attended_pairs,
    attention_forward_flops,
    distinct_experts,
    kv_read_bytes,
    step_time_estimate,
    suggest_split,
    weight_sync_estimate,
)
from primebuild.errors import UserError

# Same tiny dense model as test_memory_model: 1352 params, 2704 bf16 bytes; matmul params per token
# 1352 − embedding 80 − lm_head 80 + vocab·hidden 80 = 1272.
DENSE = ModelFacts(architecture="tiny", hidden_size=8, num_layers=2, num_attention_heads=2, num_kv_heads=1,
                   head_dim=4, vocab_size=10, intermediate_size=16, num_dense_layers=2)
MOE = ModelFacts(architecture="tiny-moe", hidden_size=8, num_layers=3, num_attention_heads=2, num_kv_heads=2,
                 head_dim=4, vocab_size=10, intermediate_size=0, num_dense_layers=0, num_experts=4,
                 experts_per_token=2, moe_intermediate_size=2)
# MLA latent 4 + rope 2, DSA indexer key 4, top-8 keys, 2 layers.
DSA = ModelFacts(architecture="tiny-dsa", hidden_size=16, num_layers=2, num_attention_heads=2, num_kv_heads=2,
                 head_dim=6, vocab_size=10, intermediate_size=32, num_dense_layers=2, q_lora_rank=8,
                 kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=4, v_head_dim=4, index_n_heads=2,
                 index_head_dim=4, index_topk=8)


def toy_gpu(hbm: float = 1000.0) -> GpuSpec:
    return GpuSpec(name="toy", memory_bytes=10**6, bf16_flops=1000.0, fp8_flops=2000.0, hbm_bytes_per_s=hbm,
                   nvlink_bytes_per_s=1.0, network_bytes_per_s=1.0, gpus_per_node=2)


def step(**kw):
    args = dict(rollouts_per_step=4, group_size=2, prompt_tokens=4, completion_tokens=2, inference_gpus=1,
                inference_replicas=1, trainer_gpus=1, gpu=toy_gpu(), trainer_mfu=0.5, prefill_mfu=0.5,
                decode_bandwidth_efficiency=0.5)
    return step_time_estimate(DENSE, **{**args, **kw})


def test_weight_sync_by_hand():
    fs = weight_sync_estimate(DENSE, dtype="bf16", bandwidth_bytes_per_s=1000, mode="filesystem",
                              trainer_gpus=4, inference_gpus=2, inference_replicas=2)
    assert fs.bytes == 2704
    assert (fs.write_seconds, fs.read_seconds) == pytest.approx((2.704, 2 * 2.704))
    assert fs.seconds == pytest.approx(8.112)
    bc = weight_sync_estimate(DENSE, dtype="bf16", bandwidth_bytes_per_s=1000, mode="broadcast",
                              trainer_gpus=4, inference_gpus=2)
    assert bc.seconds == pytest.approx(2704 * 3 / 4 / 1000 + 2.704)
    fp8 = weight_sync_estimate(DENSE, dtype="fp8", bandwidth_bytes_per_s=1000, mode="broadcast",
                               trainer_gpus=1, inference_gpus=1)
    assert fp8.bytes == 1556 and fp8.write_seconds == 0  # 1152 fp8 matmul bytes + scale 4 + 200 bf16 params
    with pytest.raises(UserError, match="weight_sync.mode"):
        weight_sync_estimate(DENSE, dtype="bf16", bandwidth_bytes_per_s=1, mode="rsync", trainer_gpus=1,
                             inference_gpus=1)


def test_attention_and_routing_helpers_by_hand():
    assert _attended_pairs(4, 0) == 10
    assert _attended_pairs(4, 2) == 3 + 2 * 2  # queries 3 and 4 see only 2 keys
    # layers 2 · 2 · pairs 10 · heads 2 · (d_qk 4 + d_v 4)
    assert attention_forward_flops(DENSE, 4) == 2 * 2 * 10 * 2 * 8 == 640
    # DSA: attention pairs capped at top-8; the indexer (2 heads × 4) scores all 55 pairs of 10 tokens
    assert attention_forward_flops(DSA, 10) == 2 * (2 * (36 + 2 * 8) * 2 * (6 + 4) + 2 * 55 * 2 * 4)
    assert distinct_experts(MOE, 1) == pytest.approx(2)
    assert distinct_experts(MOE, 2) == pytest.approx(4 * (1 - 0.5**2))
    assert distinct_experts(DENSE, 8) == 0
    # per layer: min(context, 8) latents of 6 + all context indexer keys of 4, 1 byte
    assert kv_read_bytes(DSA, 20, 1) == 2 * (8 * 6 + 20 * 4)
    assert kv_read_bytes(DENSE, 5, 2) == 2 * 5 * 2 * 4 * 2


def test_step_time_compute_bound_by_hand():
    t = step()
    # prefill: 2 prompts · (2·1272·4 + 640 attention flops) at 1000 FLOP/s · 0.5
    assert t.prefill_seconds == pytest.approx(2 * (2 * 1272 * 4 + 640) / 500)
    # decode step, batch 4 at average context 5: compute 4·(2·1272 + 2·2·2·8·5) = 11456 flops > memory
    # (2704 − 160 embedding + 4·160 KV bytes) / 500 B/s
    assert t.decode_batch_per_replica == 4 and t.decode_waves == 1
    assert t.decode_step_seconds == pytest.approx(11456 / 500)
    assert t.decode_seconds == pytest.approx(2 * 11456 / 500)
    assert t.rollout_seconds == pytest.approx(t.prefill_seconds + t.decode_seconds)
    # training: 6·1272·24 tokens + 3·4 sequences·1344 attention flops of 6 tokens
    assert t.tokens_per_step == 24
    assert t.train_seconds == pytest.approx((6 * 1272 * 24 + 3 * 4 * 1344) / 500)
    assert t.idle_side == "inference" and t.step_seconds == t.train_seconds
    assert t.idle_fraction == pytest.approx(1 - t.rollout_seconds / t.train_seconds)


def test_step_time_memory_bound_and_batching():
    slow_memory = toy_gpu(hbm=100.0)
    t = step(gpu=slow_memory)
    assert t.decode_step_seconds == pytest.approx((2544 + 4 * 160) / 50)
    one_at_a_time = step(gpu=slow_memory, max_concurrent_seqs_per_replica=1)
    assert one_at_a_time.decode_waves == 4
    assert one_at_a_time.decode_seconds == pytest.approx(4 * 2 * (2544 + 160) / 50)
    assert one_at_a_time.decode_seconds > 3 * t.decode_seconds  # batching amortises the weight reads


def test_prefill_decode_split_overlaps_the_two():
    t = step(inference_gpus=2, prefill_gpus=1)
    colocated = step()
    assert t.prefill_seconds == pytest.approx(colocated.prefill_seconds)
    assert t.rollout_seconds == pytest.approx(max(t.prefill_seconds, t.decode_seconds))
    with pytest.raises(UserError, match="decode GPUs"):
        step(inference_gpus=1, prefill_gpus=1)
    with pytest.raises(UserError, match="KV cache"):
        step(max_concurrent_seqs_per_replica=0)


def test_suggest_split_is_the_best_whole_node_split():
    f = known_model_facts("glm-5")
    kw = dict(rollouts_per_step=256, group_size=8, prompt_tokens=4096, completion_tokens=4096,
              precision="fp8", kv_cache_dtype="fp8", max_concurrent_seqs_per_replica=64)
    best = suggest_split(f, total_nodes=28, gpus_per_inference_replica=16, gpu="h200",
                         min_trainer_nodes=8, **kw)
    assert best.inference_nodes + best.trainer_nodes == 28 and best.trainer_nodes >= 8
    for inference_nodes in range(2, 21):  # a 16-GPU replica needs 2 nodes; ≥ 8 trainer nodes
        replicas = inference_nodes // 2  # an odd node's spare GPUs serve no replica
        other = step_time_estimate(f, inference_gpus=replicas * 16, inference_replicas=replicas,
                                   trainer_gpus=(28 - inference_nodes) * 8, gpu="h200", **kw)
        assert best.times.step_seconds <= other.step_seconds * (1 + 1e-9)
    # a memory check that only admits ≥ 16 trainer nodes moves the answer there
    constrained = suggest_split(f, total_nodes=28, gpus_per_inference_replica=16, gpu="h200",
                                trainer_fits=lambda gpus: gpus >= 16 * 8, **kw)
    assert constrained.trainer_nodes >= 16
    with pytest.raises(UserError, match="no inference:trainer split"):
        suggest_split(f, total_nodes=2, gpus_per_inference_replica=16, gpu="h200", **kw)
