"""FP8 on the wire (primebuild/runtime/weight_sync/fp8_wire.py): the trainer quantises the matmul weights
into the serving format before a broadcast, and the FP8 server loads those blocks as they are. What it
serves must be bit for bit what it would have served had it quantised the bf16 weights itself."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import free_port
from inference_helpers import save_model
from safetensors.torch import load_file

from primebuild.errors import UserError
from primebuild.kernels.fp8 import FP8_DTYPE, BlockFp8Weight
from primebuild.runtime.inference.model_config import ModelConfig
from primebuild.runtime.inference.weights import load_weights
from primebuild.runtime.inference.weights_in_place import WeightsInPlace
from primebuild.runtime.weight_sync.broadcast import BroadcastReceiver, BroadcastSender
from primebuild.runtime.weight_sync.fp8_wire import Fp8Wire, quantise, scale_name
from primebuild.runtime.weight_sync.stream import InMemoryWeights


def fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same MoE in transformers-5's layout (what the trainer publishes): per layer, experts.gate_up_proj
    [E, 2I, H] (gate rows, then up rows) and experts.down_proj [E, H, I]."""
    out, experts = {}, {}
    for name, tensor in state.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            e, kind = rest.split(".")[:2]
            experts.setdefault(prefix, {}).setdefault(int(e), {})[kind] = tensor
        else:
            out[name] = tensor
    for prefix, per in experts.items():
        order = sorted(per)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in order])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([per[e]["down_proj"] for e in order])
    return out


def over_the_wire(state: dict[str, torch.Tensor], served: torch.dtype) -> tuple[dict[str, torch.Tensor], object]:
    """`state` through a real broadcast (gloo, this process: sender in a thread) in FP8 form."""
    init, stats = f"tcp://127.0.0.1:{free_port()}", []

    def send():
        sender = BroadcastSender(init, 2, timeout_s=60, bucket_mb=0.05)  # ~50 kB: layers cut over buckets
        stats.append(sender.send(Fp8Wire(InMemoryWeights(state), served), 1))
        sender.close()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    receiver = BroadcastReceiver(init, 2, 1, timeout_s=60)
    step, received = receiver.recv()
    assert receiver.recv() is None  # the sender closed
    thread.join(30)
    assert step == 1 and stats
    return received, stats[0]


def same_fp8(a: BlockFp8Weight, b: BlockFp8Weight) -> bool:
    return (torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8)) and torch.equal(a.dequantised, b.dequantised)
            and (a.scales is None) == (b.scales is None) and (a.scales is None or torch.equal(a.scales, b.scales)))


def assert_served_alike(got, want) -> None:
    assert torch.equal(got.embed, want.embed) and torch.equal(got.lm_head.weight, want.lm_head.weight)
    for i, (x, y) in enumerate(zip(got.layers, want.layers, strict=True)):
        for a, b in zip(x.dense(), y.dense(), strict=True):
            assert hasattr(a, "fp8") and same_fp8(a.fp8, b.fp8), f"layer {i}"
            assert torch.equal(a.weight, b.weight)
        for name in ("qk_norm", "router", "input_scale", "post_scale"):
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None and v is None) or torch.equal(u, v), f"layer {i} {name}"
        assert (x.experts_fp8 is None) == (y.experts_fp8 is None)
        if x.experts_fp8 is not None:
            for got_list, want_list in zip(x.experts_fp8, y.experts_fp8, strict=True):
                assert all(same_fp8(a, b) for a, b in zip(got_list, want_list, strict=True)), f"layer {i} experts"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["dense", "moe", "moe-fused"])
def test_fp8_sent_weights_load_bit_equal_to_quantising_on_the_server(kind, tmp_path):
    folder = save_model(tmp_path / "m", "dense" if kind == "dense" else "moe", seed=3, with_tokenizer=False)
    state = {k: v.to(torch.bfloat16) for k, v in load_file(folder / "model.safetensors").items()}  # as published
    if kind == "moe-fused":
        state = fused_experts(state)
    config = ModelConfig.from_folder(folder)
    served = torch.float32  # the embedded FP8 engine's dtype on a CPU
    received, stats = over_the_wire(state, served)

    # what crossed: every matmul weight as e4m3 bytes and its block scales, the rest as published
    quantised = [n for n in state if n.endswith("_proj.weight") or n.endswith("_proj")]
    assert quantised and all(received[n].dtype == FP8_DTYPE for n in quantised)
    assert all(received[scale_name(n)].dtype == torch.float32 for n in quantised)
    assert all(torch.equal(received[n], state[n]) for n in state if n not in quantised)
    fp8_bytes = sum(received[n].nbytes + received[scale_name(n)].nbytes for n in quantised)
    bf16_bytes = sum(state[n].nbytes for n in quantised)
    assert fp8_bytes < 0.6 * bf16_bytes  # 1 byte an element + a 4-byte scale per (up to) 128 x 128 block
    assert stats.full_bytes == sum(t.nbytes for t in received.values()) < sum(t.nbytes for t in state.values())

    want = load_weights(state, config, served, fp8=True)  # the server quantises the bf16 weights itself
    assert_served_alike(load_weights(received, config, served, fp8=True), want)

    # the embedded engine's update in place, a bucket at a time, takes the blocks as they are too
    weights = load_weights(state, config, served, fp8=True)
    installer = WeightsInPlace(weights, config, list(received), served, torch.device("cpu"), True)
    names = list(received)
    for at in range(0, len(names), 5):
        installer.add([(n, received[n].clone()) for n in names[at : at + 5]])
    installer.finish()
    assert_served_alike(weights, want)

    with pytest.raises(UserError, match="arrived in FP8"):  # a server not serving FP8 refuses the blocks
        load_weights(received, config, served, fp8=False)


def test_quantise_matches_the_engines_blocks_on_full_and_partial_blocks():
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(2, 2 * 200, 300, generator=g) * 0.05).to(torch.bfloat16)  # 2 experts, 200-row halves
    q, scales = quantise("model.layers.0.mlp.experts.gate_up_proj", gate_up)
    assert q.dtype == FP8_DTYPE and scales.shape == (2, 2 * 2, 3)
    for e in range(2):
        engine = BlockFp8Weight(gate_up[e].float(), (200, 200))  # weights.py's quantisation of one expert
        assert torch.equal(q[e].view(torch.uint8), engine.q.view(torch.uint8))
        assert engine.scales is None  # 200 rows: not block-aligned, so the engine keeps per-part scales only
        assert torch.equal(scales[e], torch.cat([quantise("x.weight", h)[1] for h in gate_up[e].split(200)]))


@pytest.mark.parametrize(("manifest", "sets", "want"), [
    ("reverse-text.yaml", ["weight_sync.mode=broadcast", "inference.precision=fp8"], "float32"),  # embedded, CPU
    ("reverse-text.yaml", ["weight_sync.mode=broadcast"], None),  # fp32 servers: the weights cross as published
    ("glm5.yaml", [], None),  # vLLM's fp8_per_block quantises at reload from bf16: bf16 crosses (docs/vllm.md)
])
def test_the_plan_asks_the_trainer_for_fp8_on_the_wire_only_for_servers_that_load_it(manifest, sets, want):
    from conftest import MANIFESTS, plan_json

    plan = plan_json(MANIFESTS / manifest, sets)
    trainers = [p for p in plan["processes"] if p["role"] == "trainer"]
    assert trainers and all(p["config"]["weight_sync"]["fp8_served_dtype"] == want for p in trainers)
