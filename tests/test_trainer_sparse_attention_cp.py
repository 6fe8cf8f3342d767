"""GLM-5's DeepSeek sparse attention under context parallelism (primebuild/runtime/trainer/sparse_attention.py).

A tiny random GLM-5 (manifests/models/glm-5.json's architecture at small sizes; index_topk 6 on 24-token
sequences, so each late query attends to a quarter of its keys) is scored by the trainer's Policy on one
process and on 2 CP ranks over gloo (load-balanced split, FSDP over both, activation checkpointing): the
log-probs, the loss and every gradient must agree to fp32 rounding. The same model with index_topk >= the
sequence (dense attention) must give clearly different log-probs, so a CP path that dropped the top-k
selection could not pass.
"""

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch
from conftest import free_port

from primebuild.contracts.trainer import ParallelDims
from primebuild.runtime.trainer.context_parallel import make_shard
from primebuild.runtime.trainer.model import DistEnv, init_distributed, load_model
from primebuild.runtime.trainer.parallel_dims import build_meshes

MANIFEST_MODEL = Path(__file__).resolve().parents[1] / "manifests" / "models" / "glm-5.json"
SEQ, TOPK, BATCH = 24, 6, 2
SMALL = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             first_k_dense_replace=1, indexer_types=["full", "shared", "full"], num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, head_dim=8, index_n_heads=8, index_head_dim=16, index_topk=TOPK, n_routed_experts=4,
             num_experts_per_tok=2, vocab_size=96, max_position_embeddings=256, pad_token_id=0,
             eos_token_id=1, dtype="float32")


def make_tiny_glm5(path: Path) -> Path:
    """GLM-5's published config with small sizes, random weights (seeded)."""
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

    published = {k: v for k, v in json.loads(MANIFEST_MODEL.read_text()).items() if not k.startswith("_")}
    config = GlmMoeDsaConfig(**{**published, **SMALL})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, SMALL["vocab_size"], (BATCH, SEQ), generator=g)
    weights = torch.randn(BATCH, SEQ, generator=g)  # a loss that reads every log-prob
    return ids, weights


def score(model, shard=None):
    ids, weights = inputs()
    lp, _ = model(ids, torch.arange(SEQ).expand(BATCH, -1), 1.0, shard)
    loss = (lp * weights).sum()
    loss.backward()
    return lp.detach(), loss.detach()


def one_rank(path: Path, index_topk: int = TOPK):
    model = load_model(str(path), DistEnv(0, 1, torch.device("cpu")), "float32", False, 16)
    for module in model.modules():
        if hasattr(module, "index_topk"):
            module.index_topk = index_topk
    lp, loss = score(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp, loss, grads


def cp_rank(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    env = init_distributed()
    meshes = build_meshes(ParallelDims(dp_shard=1, cp=2), 2, rank, "cpu")
    model = load_model(path, env, "float32", True, 16, meshes=meshes)
    lp, loss = score(model, make_shard(torch.zeros(SEQ, dtype=torch.long), 2, rank, meshes.cp_group, env.device))
    # every target is scored by exactly one CP rank; FSDP averages gradients over its 2 ranks
    dist.all_reduce(lp)
    dist.all_reduce(loss)
    grads = {n: 2 * p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    if rank == 0:
        torch.save({"lp": lp, "loss": loss, "grads": grads}, out)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sparse_attention_under_cp_equals_one_rank(tmp_path):
    torch.set_num_threads(2)
    path = make_tiny_glm5(tmp_path / "glm5")
    out = tmp_path / "cp2.pt"
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=cp_rank, args=(r, port, str(path), str(out))) for r in range(2)]
    for p in procs:
        p.start()
    lp, loss, grads = one_rank(path)
    dense_lp, _, _ = one_rank(path, index_topk=SEQ)
    for p in procs:
        p.join(240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    cp = torch.load(out)

    # not vacuous: top-k really changes the result (measured: log-probs differ by up to 0.11; CP = one rank
    # to 5e-7 in log-probs, 6e-7 relative in gradients; a CP run ignoring the indices equals the dense one)
    assert (lp - dense_lp).abs().max() > 1e-3
    assert (cp["lp"] - dense_lp).abs().max() > 1e-3
    torch.testing.assert_close(cp["lp"], lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cp["loss"], loss, rtol=1e-5, atol=1e-5)
    unwrapped = {name.replace("_checkpoint_wrapped_module.", ""): grad for name, grad in cp["grads"].items()}
    assert unwrapped.keys() == grads.keys(), sorted(unwrapped.keys() ^ grads.keys())
    for name, grad in unwrapped.items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_plan_lifts_the_cp_refusal_for_exactly_the_hooked_indexers():
    from primebuild.builders.capabilities import SPARSE_ATTENTION, SPARSE_ATTENTION_UNDER_CP
    from primebuild.runtime.trainer.sparse_attention import SPARSE_INDEXERS

    assert set(SPARSE_INDEXERS) == SPARSE_ATTENTION_UNDER_CP <= set(SPARSE_ATTENTION)
