"""Router replay (primebuild/runtime/trainer/router_replay.py) against the real embedded engine.

The model is a tiny Qwen3-MoE whose experts 0, 1 and 2 have router rows equal up to ~1e-9: the engine and
the HF modules of the trainer (both fp32) compute their logits in other orders (the engine folds the
norm into the router), so on some tokens the two pick other experts -- the routing mismatch of a real
deployment, made frequent. With the engine's routes replayed the trainer's log-probs equal the engine's;
without, they differ exactly downstream of the positions whose routing differs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from trainer_fixtures import make_tiny_model

from primebuild.contracts.rollout import Sample
from primebuild.kernels.routing import sample_routes
from primebuild.runtime.inference.engine import Engine
from primebuild.runtime.inference.sampling import SamplingParams
from primebuild.runtime.trainer.batch import pack
from primebuild.runtime.trainer.model import Policy
from primebuild.runtime.trainer.router_replay import RouterReplay

TIGHT = 2e-5  # fp32 on both sides, same routes: rounding only


def near_tied_moe(folder) -> str:
    path = make_tiny_model(folder, moe=True, seed=0)
    state = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for key in [k for k in state if k.endswith("mlp.gate.weight")]:
        w = state[key]
        w[1] = w[0] + torch.randn(w.shape[1], generator=g) * 5e-10
        w[2] = w[0] + torch.randn(w.shape[1], generator=g) * 5e-10
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """Samples drawn by the engine with their routes, as the orchestrator carries them."""
    from transformers import AutoModelForCausalLM

    path = near_tied_moe(tmp_path_factory.mktemp("moe"))
    engine = Engine(path, max_num_seqs=32, max_model_len=64, device="cpu")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 96, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
               for _ in range(16)]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=0, return_routed_experts=True)
    samples = []
    try:
        for prompt, (choice,) in zip(prompts, engine.generate(prompts, params), strict=True):
            routes = sample_routes(choice.routed_experts, [0, 1], len(prompt), len(choice.token_ids))
            samples.append(Sample(prompt_ids=prompt, completion_ids=choice.token_ids,
                                  inference_logprobs=choice.logprobs, advantage=1.0, reward=1.0,
                                  policy_version=0, routed_experts=torch.from_numpy(routes)))
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return samples, hf


def score(policy: Policy, mb, replay: bool) -> torch.Tensor:
    with policy.replay.replaying(mb.routed_experts if replay else None):
        lp, _ = policy(mb.input_ids, mb.position_ids, 1.0)
    return lp


def own_routes(hf, mb) -> torch.Tensor:
    """[B, T, moe_layers, top_k] the trainer's router picks by itself."""
    with torch.no_grad():
        out = hf(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, output_router_logits=True)
    k = hf.config.num_experts_per_tok
    return torch.stack([r.softmax(-1).topk(k, -1).indices for r in out.router_logits], dim=1).view(
        *mb.input_ids.shape, len(out.router_logits), k)


def test_replayed_routes_give_the_engines_logprobs_and_only_replay_does(rollout):
    samples, hf = rollout
    policy = Policy(hf, chunk_tokens=16, router_replay=True)
    (mbs,) = pack(samples, micro_batch_tokens=1 << 12, world_size=1)
    differing_tokens = agreeing_tokens = 0
    for mb in mbs:
        with torch.no_grad():
            replayed, free = score(policy, mb, True), score(policy, mb, False)
        mask = mb.loss_mask
        want = mb.inference_logprobs
        assert (replayed - want)[mask].abs().max().item() < TIGHT
        # a token's log-prob (predicted at t-1) depends on the routes of positions <= t-1
        recorded = mb.routed_experts.sort(-1).values
        own = own_routes(hf, mb).sort(-1).values
        differs = ((recorded != own).any(-1).any(-1) & (mb.routed_experts[..., 0, 0] >= 0)).long()
        upstream = torch.zeros_like(mask)  # within its own document (packed rows)
        for doc in range(len(mb.sample_indices)):
            span = mb.document_ids[0] == doc
            upstream[0, span] = torch.cat([differs.new_zeros(1), differs[0, span].cumsum(0)[:-1]]) > 0
        gap = (free - want).abs()
        assert gap[mask & ~upstream].max().item() < TIGHT  # same routes so far: same log-prob
        differing_tokens += int((mask & upstream & (gap > 1e-3)).sum())
        agreeing_tokens += int((mask & ~upstream).sum())
    assert differing_tokens > 5 and agreeing_tokens > 5  # the model really does flip, and not always


def test_router_gets_gradient_under_replay(rollout):
    samples, hf = rollout
    policy = Policy(hf, chunk_tokens=16, router_replay=True)
    (mbs,) = pack(samples, micro_batch_tokens=1 << 12, world_size=1)
    hf.zero_grad()
    for mb in mbs:
        with policy.replay.replaying(mb.routed_experts):
            lp, _ = policy(mb.input_ids, mb.position_ids, 1.0)
            (lp * mb.loss_mask).sum().backward()
    for router in policy.replay.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum().item() > 0
    agreed, total = policy.replay.take_agreement()
    assert 0 < agreed < total  # the near ties made the trainer's router disagree somewhere
    hf.zero_grad()


def test_replaying_the_trainers_own_routes_changes_nothing(rollout):
    _, hf = rollout
    policy = Policy(hf, chunk_tokens=16, router_replay=True)
    ids = torch.randint(1, 96, (3, 9), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    mb = type("MB", (), {"input_ids": ids, "position_ids": positions})
    with torch.no_grad():
        plain, _ = policy(ids, positions, 1.0)
        with policy.replay.replaying(own_routes(hf, mb)):
            replayed, _ = policy(ids, positions, 1.0)
    assert torch.equal(plain, replayed)


def test_routes_of_another_shape_are_refused(rollout):
    from primebuild.errors import UserError

    _, hf = rollout
    replay = RouterReplay(hf)
    with pytest.raises(UserError, match="MoE layers"), replay.replaying(torch.zeros(1, 4, 3, 2, dtype=torch.long)):
        pass
    replay.remove()


def test_glm5_router_is_replayed_with_its_sigmoid_gate():
    """GLM-MoE-DSA (GLM-5's architecture, tiny): replaying its own routes is exact, other routes get the
    sigmoid-renormalised-scaled weights of the replayed experts, and the router gets a gradient."""
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

    config = GlmMoeDsaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8,
                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
                             kv_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_n_heads=2,
                             index_head_dim=8, index_topk=4, n_group=1, topk_group=1, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).float()
    hf.model.layers[1].mlp.gate.weight.data.normal_(0, 0.5)  # HF initialises it to zeros
    replay = RouterReplay(hf)
    (router,) = replay.routers
    seen = []  # what the router returns, after the replay hook (registered first) had its say
    router.register_forward_hook(lambda _m, _i, out: seen.append(out))
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = hf(ids).logits
    logits, _, own = seen.pop()
    assert own.shape == (12, 2)
    with torch.no_grad(), replay.replaying(own.view(2, 6, 1, 2)):
        assert torch.equal(hf(ids).logits, plain)
    seen.clear()
    other = (own + 1) % 8
    with replay.replaying(other.view(2, 6, 1, 2)):
        hf(ids).logits.sum().backward()
    logits, weights, indices = seen.pop()
    assert torch.equal(indices, other)
    want = logits.sigmoid().gather(-1, other)
    want = want / (want.sum(-1, keepdim=True) + 1e-20) * config.routed_scaling_factor
    assert torch.allclose(weights, want)
    assert router.weight.grad.abs().sum().item() > 0


def test_routes_travel_from_http_through_the_orchestrator_unchanged(tmp_path):
    """Server -> HTTP (base64 .npy) -> orchestrator -> rollout file -> trainer batch: the MoE layers'
    routes arrive as sent, and a dense layer's (zero) rows are left behind."""
    import asyncio

    import httpx
    from inference_helpers import save_model, serve_folder

    from primebuild.contracts.orchestrator import OrchestratorConfig
    from primebuild.kernels.routing import decode_routes
    from primebuild.runtime.orchestrator.main import Orchestrator
    from primebuild.runtime.orchestrator.pool import Group
    from primebuild.runtime.rollout_file import load_batch, save_batch

    folder = save_model(tmp_path / "moe", "moe", seed=0)  # layer 0 sparse, layer 1 dense
    with serve_folder(folder) as served:
        config = OrchestratorConfig(
            run_dir=str(tmp_path / "run"), model_path=str(folder), served_model_name="tiny", endpoints=[served.v1],
            environments=[{"id": "reverse-text"}], rollouts_per_step=6, group_size=3, max_off_policy_steps=0,
            max_completion_tokens=6, seq_len=64, max_steps=1, temperature=1.0, eval_prompts=1, max_failed_groups_in_a_row=1, router_replay=True,
            moe_layers=[0])
        orchestrator = Orchestrator(config)
        env, task = orchestrator.mix.envs[0], orchestrator.mix.draw(0, 0, config.seed)
        seed = 12_345

        async def group_and_close():
            try:
                return await orchestrator.runner.group(orchestrator.sample, env, task, n=3, temperature=1.0,
                                                       seed=seed)
            finally:
                for client in orchestrator.clients:
                    await client.close()

        group = Group(seq=0, env=env, task=task, started_version=0, rollouts=asyncio.run(group_and_close()))
        batch = orchestrator.make_batch(1, [group], next_group=1)
        save_batch(tmp_path / "step.safetensors", batch)
        loaded = load_batch(tmp_path / "step.safetensors")
        first = loaded.samples[0]
        # the group's first request again, as the rollout runner sent it (token in)
        reply = httpx.post(served.v1 + "/completions", json={
            "model": "tiny", "prompt": first.prompt_ids, "n": 3, "temperature": 1.0, "max_tokens": 6,
            "logprobs": 0, "seed": seed, "return_routed_experts": True}).json()
    sent = decode_routes(reply["choices"][0]["routed_experts"])
    assert reply["choices"][0]["token_ids"] == first.completion_ids  # the same seeded sample
    assert sent.shape[1] == 2 and not sent[:, 1].any()  # every decoder layer on the wire, the dense one zero
    assert first.routed_experts.dtype == np.uint8
    assert np.array_equal(first.routed_experts, sent[:, [0]])
    for s in loaded.samples:
        assert s.routed_experts.shape == (s.num_tokens - 1, 1, 2)
    (mbs,) = pack(loaded.samples, micro_batch_tokens=1 << 12, world_size=1)
    span = (mbs[0].document_ids[0] == mbs[0].sample_indices.index(0)).nonzero().flatten()
    n = first.num_tokens - 1
    assert torch.equal(mbs[0].routed_experts[0, span[:n]], torch.from_numpy(first.routed_experts).long())
    assert (mbs[0].routed_experts[0, span[n:]] == -1).all()  # the document's last token: not recorded
