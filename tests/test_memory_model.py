"""Memory model: each formula against numbers computed by hand for tiny made-up configs."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from primebuild.builders.hardware import GIB, gpu_spec, known_gpus
from primebuild.builders.memory import (
    CUDA_CONTEXT_BYTES,
    CUDA_GRAPH_BYTES,
    HF_EAGER_ACTIVATION_FACTOR,
    NCCL_BUFFER_BYTES,
    broadcast_staging_bytes,
    delta_copy_bytes,
    inference_memory_per_gpu,
    layer_activation_bytes,
    trainer_memory_per_gpu,
    weight_bytes,
)
from primebuild.builders.model_facts import ModelFacts, known_model_facts
from primebuild.errors import UserError

# hidden 8, 2 layers, 2 heads × 4, 1 KV head, MLP 16, vocab 10, untied.
# attention/layer 8·8 + 8·4 + 8·4 + 8·8 = 192, MLP/layer 3·8·16 = 384, norms 2·16 + 8,
# embedding 80 + lm_head 80  →  total 1352.
DENSE = ModelFacts(architecture="tiny", hidden_size=8, num_layers=2, num_attention_heads=2, num_kv_heads=1,
                   head_dim=4, vocab_size=10, intermediate_size=16, num_dense_layers=2)
# hidden 8, 3 layers all MoE, 2 heads × 4, 2 KV heads, 4 experts of width 2 (top-2), vocab 10.
# attention/layer 4·64 = 256, expert 3·8·2 = 48, routed 3·4·48 = 576, router 3·4·8 = 96,
# norms 3·16 + 8 = 56, embeddings 160  →  total 768 + 576 + 96 + 56 + 160 = 1656.
MOE = ModelFacts(architecture="tiny-moe", hidden_size=8, num_layers=3, num_attention_heads=2, num_kv_heads=2,
                 head_dim=4, vocab_size=10, intermediate_size=0, num_dense_layers=0, num_experts=4,
                 experts_per_token=2, moe_intermediate_size=2)


def trainer(facts=DENSE, **kw):
    args = dict(dp_shard=2, micro_batch_tokens=4, seq_len=4, gpu_memory_bytes=10**9, overhead_bytes=0,
                activation_factor=1.0)
    return trainer_memory_per_gpu(facts, **{**args, **kw})


def test_tiny_totals():
    assert DENSE.total_params() == 1352
    assert MOE.total_params() == 1656 and MOE.expert_params() == 576


def test_trainer_by_hand():
    m = trainer()
    # 1352 params over dp_shard 2 = 676 per GPU: bf16 params, fp32 grads, fp32 master, 2 fp32 Adam states
    assert (m.params, m.grads, m.master_weights, m.optimizer_state) == (1352, 2704, 2704, 5408)
    # largest gathered layer: attention 192 + norms 16 + MLP 384 = 592 params × (2·2 bf16 + 4 fp32 grad)
    assert m.fsdp_buffers == 592 * 8
    # per layer and token (bf16): 2·(2h + q 8 + k 4 + v 4 + out 8 + 2h + 3·16) = 2·104 = 208 bytes;
    # checkpointing keeps 2 layers × h × 2 bytes plus one live layer: 4 tokens × (32 + 208)
    assert layer_activation_bytes(DENSE, moe_layer=False, act_bytes=2) == 208
    assert m.activations == 4 * (32 + 208) == 960
    assert m.logits == 4 * 10 * 12  # measured cross-entropy peak: 12 bytes per logit
    allocated = 1352 + 2704 + 2704 + 5408 + 4736 + 960 + 480
    assert m.overhead == math.ceil(0.05 * allocated)
    assert m.total == allocated + m.overhead == 19262
    assert m.tokens_per_gpu == 4 and m.host_bytes == 0


def test_trainer_fits_is_an_exact_boundary():
    assert trainer(gpu_memory_bytes=19262).fits and trainer(gpu_memory_bytes=19262).free == 0
    tight = trainer(gpu_memory_bytes=19261)
    assert not tight.fits and tight.free == -1


def test_trainer_without_checkpointing_keeps_every_layer():
    assert trainer(activation_checkpointing=False).activations == 4 * 2 * 208


def test_activation_factor_scales_layer_activations_not_checkpointed_inputs():
    # default: measured eager-transformers factor on the live layer; the kept layer inputs are exact
    assert trainer(activation_factor=HF_EAGER_ACTIVATION_FACTOR).activations == math.ceil(
        4 * (32 + HF_EAGER_ACTIVATION_FACTOR * 208))
    assert trainer(activation_checkpointing=False, activation_factor=2.0).activations == 4 * 2 * 2 * 208


def test_trainer_cpu_offload_moves_every_shard_to_host():
    # FSDP2's CPUOffloadPolicy: params, grads, master weights and optimizer state of the shard on the host
    m = trainer(optimizer_cpu_offload=True)
    assert (m.params, m.grads, m.master_weights, m.optimizer_state) == (0, 0, 0, 0)
    assert m.host_bytes == 1352 + 2704 + 2704 + 5408
    allocated = 4736 + 960 + 480  # the gathered layers, activations and logits stay on the device
    assert m.total == allocated + math.ceil(0.05 * allocated)


def test_trainer_cp_and_tp_split_tokens_params_and_vocab():
    cp = trainer(cp=2, micro_batch_tokens=4)
    assert cp.tokens_per_gpu == 2 and cp.params == 2 * 338  # FSDP over dp_shard·cp = 4
    # + one layer's CP visibility mask (2 local queries x 4 keys, bool + bf16 additive copy)
    assert cp.activations == 2 * 240 + 2 * 4 * (1 + 2)
    no_ac = dict(activation_checkpointing=False)  # every layer keeps its mask for backward
    assert trainer(cp=2, **no_ac).activations == (trainer(micro_batch_tokens=2, seq_len=2, **no_ac).activations
                                                  + 2 * 4 * (1 + 2) * DENSE.num_layers)
    tp = trainer(tp=2)
    assert tp.params == 2 * 338
    assert tp.activations == 4 * 240 // 2  # sequence parallel splits the activations
    # the torchtitan engine gathers the vocab-split head: whole-vocab logits, plus the head (bf16 + fp32 grad)
    assert tp.logits == 4 * DENSE.vocab_size * 12 + DENSE.vocab_size * DENSE.hidden_size * (2 + 4)
    assert tp.fsdp_buffers == math.ceil(592 / 2) * 8


def test_trainer_replication_divides_nothing():
    # HSDP: a replica holds the whole model split dp_shard ways; replicas add ranks, not savings
    assert trainer(dp_shard=2, dp_replicate=2) == trainer(dp_shard=2)
    hsdp, fsdp = trainer(dp_shard=1, dp_replicate=4), trainer(dp_shard=4)
    assert (hsdp.params, hsdp.grads, hsdp.optimizer_state) == (2 * 1352, 4 * 1352, 2 * 4 * 1352)
    assert hsdp.params == 4 * fsdp.params
    # pure replication still runs under fully_shard, which gathers layer by layer like FSDP does
    assert hsdp.fsdp_buffers == 592 * 8 and trainer(dp_shard=1).fsdp_buffers == 0


def test_trainer_dtype_and_optimizer_choices():
    fp32 = trainer(param_dtype="fp32", master_dtype=None)
    assert (fp32.params, fp32.master_weights, fp32.optimizer_state) == (2704, 0, 5408)
    sgd = trainer(optimizer="sgd")
    assert sgd.optimizer_state == 0
    chunked = trainer(logits_chunk_tokens=1)
    assert chunked.logits == 1 * 10 * 12
    assert trainer(overhead_bytes=None).overhead >= CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES


def test_trainer_expert_parallel_shrinks_the_gathered_layer():
    # MoE layer: (attention 256 + norms 16 + router 32)/tp + 4 experts·48/ep
    one = trainer(MOE, dp_shard=4, ep=1)
    two = trainer(MOE, dp_shard=4, ep=2)
    assert one.fsdp_buffers == (304 + 192) * 8
    assert two.fsdp_buffers == (304 + 96) * 8
    assert one.params == two.params == 2 * 414  # 1656 / 4: EP ranks come out of the FSDP ranks
    # MoE layer activations: 2·(2h + q 8 + k 8 + v 8 + out 8 + 2h + k·(h + 3·2) = 28) + fp32 router 4·4
    assert layer_activation_bytes(MOE, moe_layer=True, act_bytes=2) == 2 * (16 + 32 + 16 + 28) + 16


def test_expert_parallel_on_the_tensor_parallel_ranks_counts_whole_experts_per_rank():
    """torchtitan's expert mesh is cut from dp_shard·cp·tp, ep innermost: tp 2 x ep 2 on 2 ranks puts 2 of
    the 4 experts, whole, on each rank (TP splits attention, embeddings and router rows, not them)."""
    borrowed = trainer(MOE, dp_shard=1, tp=2, ep=2)
    assert borrowed.params == 2 * 828  # 1656 / (dp_shard·cp·tp = 2): 2 experts of 48 per rank among them
    assert borrowed.fsdp_buffers == 0  # no FSDP rank: TP and EP shard the model, nothing is gathered
    # with FSDP beside them a gathered MoE layer holds (304 / tp) + 4/ep experts · 48
    assert trainer(MOE, dp_shard=2, tp=2, ep=2).fsdp_buffers == (152 + 2 * 48) * 8
    assert trainer(MOE, dp_shard=2, tp=2, ep=4).fsdp_buffers == (152 + 1 * 48) * 8  # ep spans dp_shard x tp
    assert trainer(MOE, dp_shard=2, tp=2, ep=4).params == 2 * 414


def test_expert_parallel_keeps_the_received_tokens_of_each_moe_layer():
    # per token per MoE layer: k·h·a = 2·8·2 bytes for the routed copies the local experts received
    one, two = trainer(MOE, dp_shard=4, ep=1), trainer(MOE, dp_shard=4, ep=2)
    assert two.activations - one.activations == 4 * 32  # checkpointed: one live layer, 4 tokens
    one, two = (trainer(MOE, dp_shard=4, ep=ep, activation_checkpointing=False) for ep in (1, 2))
    assert two.activations - one.activations == 4 * 3 * 32  # every MoE layer kept


@pytest.mark.parametrize("kw, message", [
    (dict(ep=3, dp_shard=6), "divide the number of experts"),
    (dict(ep=4, dp_shard=2), "dp_shard·cp·tp"),
    (dict(ep=4, dp_shard=1, tp=2), "dp_shard·cp·tp"),
    (dict(micro_batch_tokens=2, seq_len=4), "smaller than seq_len"),
    (dict(optimizer="lion"), "unknown optimizer"),
    (dict(param_dtype="int4"), "unknown dtype"),
    (dict(dp_shard=0), "positive integer"),
])
def test_trainer_rejects_impossible_layouts(kw, message):
    with pytest.raises(UserError, match=message):
        trainer(MOE, **kw)


def test_weight_bytes_bf16_and_fp8():
    assert weight_bytes(DENSE, "bf16") == (2704, 0)
    # fp8: matmuls (2·192 + 2·384 = 1152) at 1 byte + one 4-byte scale per 128×128 block;
    # embeddings and norms (200) stay bf16
    assert weight_bytes(DENSE, "fp8") == (1152 + 4 + 400, 0)
    assert weight_bytes(MOE, "bf16") == (2 * 1080, 2 * 576)


def inference(facts=DENSE, **kw):
    args = dict(gpu_memory_bytes=100_000, gpu_memory_utilization=0.5, max_num_seqs=2, seq_len=100,
                max_num_batched_tokens=16, overhead_bytes=0)
    return inference_memory_per_gpu(facts, **{**args, **kw})


def test_inference_by_hand():
    m = inference()
    assert m.weights == 2704
    # 16 tokens · 2 bytes · (4h + 3·I) + 2 seqs · vocab · 4 bytes of sampler logits
    assert m.activations == 16 * 2 * (32 + 48) + 2 * 10 * 4 == 2640
    assert m.budget == 50_000
    assert m.kv_cache_bytes == 50_000 - 2704 - 2640
    assert m.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2  # auto = bf16
    assert m.kv_tokens_capacity == 44656 // 32 == 1395
    assert m.max_concurrent_seqs == 2 and m.fits  # 13 would fit, max_num_seqs caps
    assert inference(max_num_seqs=64).max_concurrent_seqs == 13
    assert inference(kv_cache_dtype="fp8").kv_bytes_per_token == 16
    assert inference(overhead_bytes=None).overhead == CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES + CUDA_GRAPH_BYTES


def test_inference_fits_needs_one_full_sequence():
    # budget 5500 leaves 5500 − 2704 − 2640 = 156 bytes: 4 tokens, not one 100-token sequence
    m = inference(gpu_memory_bytes=11_000)
    assert m.kv_tokens_capacity == 4 and m.max_concurrent_seqs == 0 and not m.fits
    assert not inference(gpu_memory_bytes=1_000).fits


def test_inference_sharding_of_dense_and_expert_weights():
    # MoE bf16: 2160 non-expert bytes, 1152 expert bytes
    assert inference(MOE, tp=2).weights == 1080 + 576  # experts TP-sharded without EP
    assert inference(MOE, tp=1, dp=4, ep=4).weights == 2160 + 288  # attention replicated per dp rank
    dp = inference(MOE, tp=2, dp=2, ep=4)
    assert dp.weights == 1080 + 288 and dp.max_concurrent_seqs_total == 2 * dp.max_concurrent_seqs
    # GQA heads split by TP: 2 KV heads over tp 2
    assert inference(MOE, tp=2).kv_bytes_per_token == 3 * 2 * 1 * 4 * 2


def test_broadcast_staging_is_two_buckets_a_tensor_bigger_than_one_or_the_model():
    # DENSE in bf16: 2704 bytes, the embedding 10 · 8 · 2 = 160
    assert broadcast_staging_bytes(DENSE, "bfloat16", 100) == 2 * 160  # the embedding is a bucket of its own
    assert broadcast_staging_bytes(DENSE, "bfloat16", 1000) == 2000
    assert broadcast_staging_bytes(DENSE, "bfloat16", 10**6) == 2704  # a model smaller than a bucket
    assert broadcast_staging_bytes(DENSE, "float32", 10**6) == 2 * 2704
    assert delta_copy_bytes(DENSE, "bfloat16") == 2704


def test_glm5_plan_counts_the_staging_buckets_of_a_broadcast():
    """Every vLLM worker stages two buckets of an update: GLM-5's embedding (154,880 x 6,144 bf16, 1.8 GiB)
    is a bucket of its own beside the default 1 GiB ones; bigger buckets than vLLM's budget leaves out are
    refused at weight_sync.bucket_mb."""
    from conftest import MANIFESTS

    from primebuild.builders.plan import compile_plan
    from primebuild.manifest.load import load_manifest

    plan = compile_plan(load_manifest(MANIFESTS / "glm5.yaml")).to_json()
    embedding = 154880 * 6144 * 2
    for group in ("prefill", "decode"):
        memory = plan["memory"][group]
        assert memory["breakdown"]["weight_staging"] == 2 * embedding
        assert memory["used_bytes"] == sum(memory["breakdown"].values()) and memory["fits"]
    with pytest.raises(UserError) as err:
        compile_plan(load_manifest(MANIFESTS / "glm5.yaml", ["weight_sync.bucket_mb=8192"]))
    assert "weight_sync.bucket_mb" in [p.field for p in err.value.problems]


def test_inference_rejects_impossible_layouts():
    with pytest.raises(UserError, match="tp·dp"):
        inference(MOE, tp=1, dp=1, ep=2)
    with pytest.raises(UserError, match="dense"):
        inference(DENSE, dp=2, ep=2)
    with pytest.raises(UserError, match="num_attention_heads"):
        inference(DENSE, tp=4)
    with pytest.raises(UserError, match="kv_cache_dtype"):
        inference(kv_cache_dtype="int8")


def test_glm5_layouts_on_h200():
    """Sanity of the worked example in docs/planning.md (FP8 weights and KV, 128k sequences)."""
    f, h200 = known_model_facts("glm-5"), gpu_spec("h200")
    decode = inference_memory_per_gpu(f, precision="fp8", kv_cache_dtype="fp8", tp=1, dp=16, ep=16,
                                      gpu_memory_bytes=h200.memory_bytes, max_num_seqs=64, seq_len=131072)
    assert decode.fits and 55 * GIB < decode.weights < 70 * GIB
    assert decode.kv_bytes_per_token == 78 * (512 + 64 + 128)
    assert decode.max_concurrent_seqs >= 4
    bf16_one_node = inference_memory_per_gpu(f, precision="bf16", tp=8, gpu_memory_bytes=h200.memory_bytes,
                                             max_num_seqs=64, seq_len=131072)
    assert not bf16_one_node.fits  # 1.49 TB of bf16 weights cannot sit on 8 × 141 GB
    train = trainer_memory_per_gpu(f, dp_shard=16, cp=8, ep=64, micro_batch_tokens=131072, seq_len=131072,
                                   gpu_memory_bytes=h200.memory_bytes, optimizer_cpu_offload=True,
                                   logits_chunk_tokens=4096)
    assert train.fits and train.tokens_per_gpu == 16384
    assert not trainer_memory_per_gpu(f, dp_shard=16, cp=8, ep=64, micro_batch_tokens=131072,
                                      seq_len=131072, gpu_memory_bytes=h200.memory_bytes).fits


def test_gpu_table():
    assert gpu_spec("H200").memory_bytes == 150_109_880_320  # CUDA's total, measured on an H200
    assert gpu_spec("h100").hbm_bytes_per_s < gpu_spec("h200").hbm_bytes_per_s < gpu_spec("b200").hbm_bytes_per_s
    assert gpu_spec("cpu", host_memory_bytes=16 * GIB).memory_bytes == 16 * GIB
    with pytest.raises(UserError, match="host memory"):
        gpu_spec("cpu")
    with pytest.raises(UserError, match="h100, h200"):
        gpu_spec("a100")
    assert known_gpus() == ["b200", "cpu", "h100", "h200"]


def test_planner_modules_import_without_torch():
    """The planner's modules import neither torch nor numpy (their speed is bench/plan.py's to measure: a
    timed assertion here failed whenever the 2 shared cores were busy)."""
    code = ("import sys; import primebuild.builders.memory, primebuild.builders.timing, primebuild.builders.hardware; "
            "assert not {'torch', 'numpy'} & set(sys.modules), sorted({'torch', 'numpy'} & set(sys.modules))")
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "primebuild.builders.memory" in imported and "torch" not in imported and "numpy" not in imported


def test_sparse_index_term_for_dsa_models_only():
    """GLM-5's indexer: one query chunk of fp32 scores plus the key-selection masks, by hand; none for Qwen3."""
    from primebuild.builders.memory import INDEX_SCORE_CHUNK_BYTES, index_query_chunk

    glm5, qwen3 = known_model_facts("glm-5"), known_model_facts("qwen3-30b-a3b")
    seq, cp, h200 = 131072, 4, gpu_spec("h200").memory_bytes
    mem = trainer_memory_per_gpu(glm5, dp_shard=32, cp=cp, ep=64, micro_batch_tokens=seq, seq_len=seq,
                                 gpu_memory_bytes=h200)
    chunk = index_query_chunk(1, 32, seq)
    assert chunk == 64 and chunk * 32 * seq * 4 == INDEX_SCORE_CHUNK_BYTES  # 512 GiB unchunked
    assert mem.sparse_index == chunk * 32 * seq * 4 + (seq // cp) * seq * (2 + 2)  # 17 GiB
    one_rank = trainer_memory_per_gpu(glm5, dp_shard=64, ep=64, micro_batch_tokens=1024, seq_len=1024,
                                      gpu_memory_bytes=h200)
    assert one_rank.sparse_index == 1024 * 32 * 1024 * 4 + 1024 * 1024 * (3 + 2)  # all queries in one chunk
    dense = trainer_memory_per_gpu(qwen3, dp_shard=8, micro_batch_tokens=seq, seq_len=seq, cp=cp,
                                   gpu_memory_bytes=h200)
    assert dense.sparse_index == 0
    assert mem.total > trainer_memory_per_gpu(glm5, dp_shard=32, cp=cp, ep=64, micro_batch_tokens=seq,
                                              seq_len=seq // 2, gpu_memory_bytes=h200).total
