"""FP8 training (primebuild/runtime/trainer/fp8.py): block-scaled forward, straight-through backward, and the same
function as the embedded engine's FP8 inference."""

from __future__ import annotations

import torch
from trainer_fixtures import make_tiny_model, trainer_config, write_rollouts

from primebuild.contracts.rollout import Sample
from primebuild.kernels.fp8 import (
    dequantize_activation,
    dequantize_blockwise,
    fp8_block_matmul_reference,
    quantize_activation,
    quantize_blockwise,
)
from primebuild.kernels.routing import sample_routes
from primebuild.runtime.metrics import read_metrics
from primebuild.runtime.trainer.batch import pack
from primebuild.runtime.trainer.fp8 import Fp8Linear, apply_fp8_training, fp8_linear
from primebuild.runtime.trainer.main import run_trainer
from primebuild.runtime.trainer.model import Policy, decoder_layers
from primebuild.runtime.weight_sync.filesystem import step_folder


def test_forward_is_the_reference_and_backward_the_straight_through_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 256, generator=g, requires_grad=True)
    w = torch.randn(384, 256, generator=g, requires_grad=True)
    y = fp8_linear(x, w)
    q, s = quantize_blockwise(w.detach())
    assert torch.equal(y, fp8_block_matmul_reference(x.detach(), q, s).view(3, 5, 384))
    grad_y = torch.randn(3, 5, 384, generator=g)
    y.backward(grad_y)
    flat = grad_y.view(-1, 384)
    assert torch.allclose(x.grad.view(-1, 256), flat @ dequantize_blockwise(q, s), atol=1e-5)
    assert torch.allclose(w.grad, flat.T @ dequantize_activation(*quantize_activation(x.detach().view(-1, 256))),
                          atol=1e-4)


def test_a_fused_weight_quantises_each_part_on_its_own_blocks():
    """gate|up of 64 rows each: the same as two separate checkpoint weights, not one 128-row block."""
    g = torch.Generator().manual_seed(1)
    x, gate, up = torch.randn(4, 128, generator=g), torch.randn(64, 128, generator=g), torch.randn(64, 128, generator=g) * 30
    fused = fp8_linear(x, torch.cat([gate, up]), parts=(64, 64))
    assert torch.equal(fused, torch.cat([fp8_linear(x, gate), fp8_linear(x, up)], dim=-1))
    assert not torch.equal(fused, fp8_linear(x, torch.cat([gate, up])))


def test_the_fp8_trainer_scores_exactly_what_the_fp8_engine_samples(tmp_path):
    """Same precision on both sides (FP8 weights and activations, checkpoint weights on their own blocks):
    trainer and engine compute the same function, so the mismatch KL is ~1e4x below that of an fp32
    trainer scoring FP8 samples."""
    from transformers import AutoModelForCausalLM

    from primebuild.runtime.inference.engine import Engine
    from primebuild.runtime.inference.sampling import SamplingParams
    from primebuild.runtime.trainer.losses import kl_per_token

    path = make_tiny_model(tmp_path / "moe", moe=True, seed=3)
    engine = Engine(path, max_num_seqs=64, max_model_len=64, device="cpu", fp8=True)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 96, (6,), generator=g).tolist() for _ in range(8)]
    params = SamplingParams(max_tokens=12, temperature=1.0, n=4, seed=0, return_routed_experts=True, ignore_eos=True)
    try:
        results = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    samples = [Sample(prompt_ids=p, completion_ids=c.token_ids, inference_logprobs=c.logprobs, advantage=0.0,
                      reward=0.0, policy_version=0,
                      routed_experts=torch.from_numpy(sample_routes(c.routed_experts, [0, 1], 6, 12)))
               for p, choices in zip(prompts, results, strict=True) for c in choices]
    (mbs,) = pack(samples, micro_batch_tokens=1 << 12, world_size=1)
    kls = {}
    for precision in ("fp32", "fp8"):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if precision == "fp8":
            assert apply_fp8_training(hf, decoder_layers(hf)) == {"linear": 8, "experts": 2}
        policy = Policy(hf, 64, router_replay=True)
        deltas = []
        with torch.no_grad():
            for mb in mbs:
                with policy.replay.replaying(mb.routed_experts):
                    lp, _ = policy(mb.input_ids, mb.position_ids, 1.0)
                deltas.append((lp - mb.inference_logprobs)[mb.loss_mask])
        kls[precision] = kl_per_token(torch.cat(deltas)).mean().item()
    assert kls["fp8"] < 1e-5 and kls["fp32"] > 1e3 * kls["fp8"], kls


def test_an_fp8_training_step_keeps_names_and_trains(tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_tiny_model(tmp_path / "moe", moe=True)
    base = AutoModelForCausalLM.from_pretrained(model)
    run = tmp_path / "run"
    write_rollouts(run, model, range(1, 2), num_prompts=2)
    run_trainer(trainer_config(model_path=str(model), run_dir=str(run), max_steps=1, precision="fp8", loss="cispo"))
    metrics = read_metrics(run / "metrics.jsonl")[1]
    assert 1e-7 < metrics["mismatch_kl"] < 1e-2  # FP8 trainer vs the fp32 log-probs (fp32 trainer: ~1e-13)
    trained = AutoModelForCausalLM.from_pretrained(step_folder(run / "weights", 1))
    assert trained.state_dict().keys() == base.state_dict().keys()
    assert any(not torch.equal(v, base.state_dict()[k]) for k, v in trained.state_dict().items())
    assert not any(isinstance(m, Fp8Linear) for m in trained.modules())  # published weights are plain HF
